#include "mmq_common.cuh"
#include "mmq_gguf.cuh"

// Force instantiation of all mmq_x variants for GGML_TYPE_Q4_1
template <int mmq_x>
static void instantiate_mmq_q4_1(float *tmp_fixup, const mmq_args &args,
                                 cudaStream_t stream, int cc, int nsm,
                                 size_t smpbo, int warp_size_host) {

  const int mmq_y = (GGML_CUDA_CC_IS_NVIDIA(cc) &&
                     ggml_cuda_highest_compiled_arch(cc) >= GGML_CUDA_CC_VOLTA)
                        ? 128
                        : 64;
  const int nwarps = 256 / warp_size_host;
  const int nbytes_shared = mmq_get_nbytes_shared<GGML_TYPE_Q4_1>(
      mmq_x, mmq_y, cc, warp_size_host, nwarps);
  const int nty = (args.nrows_x + mmq_y - 1) / mmq_y;
  const int ntx = (args.ncols_max + mmq_x - 1) / mmq_x;
  const int ntzw = args.nchannels_y * args.nsamples_y;
  const dim3 block_dims(warp_size_host, nwarps, 1);
  const int channel_ratio = args.nchannels_y / args.nchannels_x;
  const int sample_ratio = args.nsamples_y / args.nsamples_x;

  const uint3 blocks_per_ne00_fd = init_fastdiv_values(
      args.ncols_x / ggml_cuda_type_traits<GGML_TYPE_Q4_1>::qk);
  const uint3 ntx_fd = init_fastdiv_values(ntx);
  const uint3 nchannels_y_fd = init_fastdiv_values(args.nchannels_y);
  const uint3 nsamples_y_fd = init_fastdiv_values(args.nsamples_y);
  const uint3 channel_ratio_fd = init_fastdiv_values(channel_ratio);
  const uint3 sample_ratio_fd = init_fastdiv_values(sample_ratio);

  CUDA_SET_SHARED_MEMORY_LIMIT((mul_mat_q<GGML_TYPE_Q4_1, mmq_x, false>),
                               nbytes_shared);
  CUDA_SET_SHARED_MEMORY_LIMIT((mul_mat_q<GGML_TYPE_Q4_1, mmq_x, true>),
                               nbytes_shared);

  if (!args.use_stream_k) {
    const dim3 grid(nty, ntx, ntzw);
    if (args.nrows_x % mmq_y == 0) {
      mul_mat_q<GGML_TYPE_Q4_1, mmq_x, false>
          <<<grid, block_dims, nbytes_shared, stream>>>(
              args.x, args.y, args.ids_dst, args.expert_bounds, args.dst,
              nullptr, blocks_per_ne00_fd, args.nrows_x, args.ncols_dst,
              args.stride_row_x, args.ncols_y, args.nrows_dst, channel_ratio_fd,
              nchannels_y_fd, args.stride_channel_x, args.stride_channel_y,
              args.stride_channel_dst, sample_ratio_fd, nsamples_y_fd,
              args.stride_sample_x, args.stride_sample_y,
              args.stride_sample_dst, args.type_dst, ntx_fd);
    } else {
      mul_mat_q<GGML_TYPE_Q4_1, mmq_x, true>
          <<<grid, block_dims, nbytes_shared, stream>>>(
              args.x, args.y, args.ids_dst, args.expert_bounds, args.dst,
              nullptr, blocks_per_ne00_fd, args.nrows_x, args.ncols_dst,
              args.stride_row_x, args.ncols_y, args.nrows_dst, channel_ratio_fd,
              nchannels_y_fd, args.stride_channel_x, args.stride_channel_y,
              args.stride_channel_dst, sample_ratio_fd, nsamples_y_fd,
              args.stride_sample_x, args.stride_sample_y,
              args.stride_sample_dst, args.type_dst, ntx_fd);
    }
    return;
  }

  // Stream-k. When tiling efficiency is high, run one block per output tile
  // and avoid the stream-k fixup pass. This matches llama.cpp's launch policy.
  const int ntiles_dst = ntx * nty * ntzw;
  const int tiles_nwaves = (ntiles_dst + nsm - 1) / nsm;
  const int tiles_efficiency_percent = 100 * ntiles_dst / (nsm * tiles_nwaves);
  const dim3 grid_sk(
      GGML_CUDA_CC_IS_NVIDIA(cc) && tiles_efficiency_percent >= 90 ? ntiles_dst
                                                                   : nsm,
      1, 1);
  const bool fixup_needed = ntiles_dst % grid_sk.x != 0;
  GGML_ASSERT(ntiles_dst * blocks_per_ne00_fd.z < (1 << 30));
  const dim3 block_nums_fixup(grid_sk.x, mmq_y / warp_size_host, 1);
  const dim3 block_dims_fixup(block_dims.x, block_dims.y / 2, block_dims.z);

  if (args.nrows_x % mmq_y == 0) {
    mul_mat_q<GGML_TYPE_Q4_1, mmq_x, false>
        <<<grid_sk, block_dims, nbytes_shared, stream>>>(
            args.x, args.y, args.ids_dst, args.expert_bounds, args.dst,
            tmp_fixup, blocks_per_ne00_fd, args.nrows_x, args.ncols_dst,
            args.stride_row_x, args.ncols_y, args.nrows_dst, channel_ratio_fd,
            nchannels_y_fd, args.stride_channel_x, args.stride_channel_y,
            args.stride_channel_dst, sample_ratio_fd, nsamples_y_fd,
            args.stride_sample_x, args.stride_sample_y, args.stride_sample_dst, args.type_dst, ntx_fd);
    if (fixup_needed) {
      mul_mat_q_stream_k_fixup<GGML_TYPE_Q4_1, mmq_x, false>
          <<<block_nums_fixup, block_dims_fixup, 0, stream>>>(
              args.ids_dst, args.expert_bounds, args.dst, args.type_dst, tmp_fixup,
              blocks_per_ne00_fd, args.nrows_x, args.ncols_dst, args.nrows_dst,
              nchannels_y_fd, args.stride_channel_dst, nsamples_y_fd,
              args.stride_sample_dst, ntx_fd);
    }
  } else {
    mul_mat_q<GGML_TYPE_Q4_1, mmq_x, true>
        <<<grid_sk, block_dims, nbytes_shared, stream>>>(
            args.x, args.y, args.ids_dst, args.expert_bounds, args.dst,
            tmp_fixup, blocks_per_ne00_fd, args.nrows_x, args.ncols_dst,
            args.stride_row_x, args.ncols_y, args.nrows_dst, channel_ratio_fd,
            nchannels_y_fd, args.stride_channel_x, args.stride_channel_y,
            args.stride_channel_dst, sample_ratio_fd, nsamples_y_fd,
            args.stride_sample_x, args.stride_sample_y, args.stride_sample_dst, args.type_dst, ntx_fd);
    if (fixup_needed) {
      mul_mat_q_stream_k_fixup<GGML_TYPE_Q4_1, mmq_x, true>
          <<<block_nums_fixup, block_dims_fixup, 0, stream>>>(
              args.ids_dst, args.expert_bounds, args.dst, args.type_dst, tmp_fixup,
              blocks_per_ne00_fd, args.nrows_x, args.ncols_dst, args.nrows_dst,
              nchannels_y_fd, args.stride_channel_dst, nsamples_y_fd,
              args.stride_sample_dst, ntx_fd);
    }
  }
}

static void launch_mmq_case_q4_1(float *tmp_fixup, const mmq_args &args,
                                 cudaStream_t stream, int cc, int nsm,
                                 size_t smpbo, int warp_size_host) {

  const int mmq_x_max =
      (turing_mma_available(cc)) ? 128
      : (GGML_CUDA_CC_IS_NVIDIA(cc) &&
         ggml_cuda_highest_compiled_arch(cc) >= GGML_CUDA_CC_VOLTA)
          ? 64
          : 64;
  const int mmq_y = (GGML_CUDA_CC_IS_NVIDIA(cc) &&
                     ggml_cuda_highest_compiled_arch(cc) >= GGML_CUDA_CC_VOLTA)
                        ? 128
                        : 64;
  const int nwarps = 256 / warp_size_host;

  int mmq_x_best = 0;
  int ntiles_x_best = INT_MAX;
  for (int mmq_x = 8; mmq_x <= mmq_x_max && ntiles_x_best > 1; mmq_x += 8) {
    const int granularity = (turing_mma_available(cc) && mmq_x >= 48) ? 16 : 8;
    if (mmq_x % granularity != 0)
      continue;
    const size_t nbs = mmq_get_nbytes_shared<GGML_TYPE_Q4_1>(
        mmq_x, mmq_y, cc, warp_size_host, nwarps);
    if (nbs > smpbo)
      continue;
    const int ntiles_x = (args.ncols_max + mmq_x - 1) / mmq_x;
    if (ntiles_x < ntiles_x_best) {
      mmq_x_best = mmq_x;
      ntiles_x_best = ntiles_x;
    }
  }

  switch (mmq_x_best) {
  case 8:
    instantiate_mmq_q4_1<8>(tmp_fixup, args, stream, cc, nsm, smpbo,
                            warp_size_host);
    break;
  case 16:
    instantiate_mmq_q4_1<16>(tmp_fixup, args, stream, cc, nsm, smpbo,
                             warp_size_host);
    break;
  case 24:
    instantiate_mmq_q4_1<24>(tmp_fixup, args, stream, cc, nsm, smpbo,
                             warp_size_host);
    break;
  case 32:
    instantiate_mmq_q4_1<32>(tmp_fixup, args, stream, cc, nsm, smpbo,
                             warp_size_host);
    break;
  case 40:
    instantiate_mmq_q4_1<40>(tmp_fixup, args, stream, cc, nsm, smpbo,
                             warp_size_host);
    break;
  case 48:
    instantiate_mmq_q4_1<48>(tmp_fixup, args, stream, cc, nsm, smpbo,
                             warp_size_host);
    break;
  case 56:
    instantiate_mmq_q4_1<56>(tmp_fixup, args, stream, cc, nsm, smpbo,
                             warp_size_host);
    break;
  case 64:
    instantiate_mmq_q4_1<64>(tmp_fixup, args, stream, cc, nsm, smpbo,
                             warp_size_host);
    break;
  case 72:
    instantiate_mmq_q4_1<72>(tmp_fixup, args, stream, cc, nsm, smpbo,
                             warp_size_host);
    break;
  case 80:
    instantiate_mmq_q4_1<80>(tmp_fixup, args, stream, cc, nsm, smpbo,
                             warp_size_host);
    break;
  case 88:
    instantiate_mmq_q4_1<88>(tmp_fixup, args, stream, cc, nsm, smpbo,
                             warp_size_host);
    break;
  case 96:
    instantiate_mmq_q4_1<96>(tmp_fixup, args, stream, cc, nsm, smpbo,
                             warp_size_host);
    break;
  case 104:
    instantiate_mmq_q4_1<104>(tmp_fixup, args, stream, cc, nsm, smpbo,
                              warp_size_host);
    break;
  case 112:
    instantiate_mmq_q4_1<112>(tmp_fixup, args, stream, cc, nsm, smpbo,
                              warp_size_host);
    break;
  case 120:
    instantiate_mmq_q4_1<120>(tmp_fixup, args, stream, cc, nsm, smpbo,
                              warp_size_host);
    break;
  case 128:
    instantiate_mmq_q4_1<128>(tmp_fixup, args, stream, cc, nsm, smpbo,
                              warp_size_host);
    break;
  default:
    break;
  }
}

extern "C" void launch_mmq_gguf_q4_1(void *tmp_fixup_ptr, const void *x,
                                     const void *y_q8_1_mmq, void *dst,
                                     int64_t ncols_x, int64_t nrows_x,
                                     int64_t ncols_y, int64_t stride_row_x,
                                     int64_t stride_col_dst, int cc, int nsm,
                                     int64_t smpbo, int warp_size_host,
                                     int type_dst, void *stream) {

  const bool use_stream_k =
      (GGML_CUDA_CC_IS_NVIDIA(cc) &&
       ggml_cuda_highest_compiled_arch(cc) >= GGML_CUDA_CC_VOLTA);

  const mmq_args args = {(const char *)x,
                         GGML_TYPE_Q4_1,
                         (const int *)y_q8_1_mmq,
                         nullptr,
                         nullptr,
                         dst,
                         (ggml_type) type_dst,
                         ncols_x,
                         nrows_x,
                         ncols_y,
                         stride_row_x,
                         ncols_y,
                         nrows_x,
                         1,
                         1,
                         0,
                         0,
                         0,
                         1,
                         1,
                         0,
                         0,
                         0,
                         use_stream_k,
                         ncols_y};

  launch_mmq_case_q4_1((float *)tmp_fixup_ptr, args, (cudaStream_t)stream, cc,
                       nsm, smpbo, warp_size_host);
}

DEFINE_MMQ_MOE_LAUNCHER(q4_1, GGML_TYPE_Q4_1, launch_mmq_case_q4_1)
