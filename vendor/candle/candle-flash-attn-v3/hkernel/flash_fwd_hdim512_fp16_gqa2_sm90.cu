// Copyright (c) 2024, Jay Shah, Ganesh Bikshandi, Ying Zhang, Vijay Thakkar, Pradeep Ramani, Tri Dao.
// Splitting the different head dimensions to different files to speed up compilation.

#include "flash_fwd_launch_template.h"

template<>
void run_mha_fwd_gqa_<cutlass::half_t, 512, 2>(Flash_fwd_params &params, cudaStream_t stream) {
    run_mha_fwd_hdim512_gqa<cutlass::half_t, 2>(params, stream);
}
