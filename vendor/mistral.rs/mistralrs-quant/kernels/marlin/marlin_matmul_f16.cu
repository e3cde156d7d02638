#include "marlin_kernel.cuh"

extern "C" int marlin_gptq_4bit_f16(const void *A, const void *B, void *scales,
                                    void *zeros, void *C, int prob_m,
                                    int prob_k, int prob_n, void *workspace,
                                    int groupsize, int64_t stream) {
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    return static_cast<int>(status);
  }
  try {
    marlin_matmul<half, ScalarTypeID::kU4B8, false, 4>(
        A, B, scales, zeros, C, prob_m, prob_k, prob_n, workspace, groupsize,
        stream);
    return static_cast<int>(cudaGetLastError());
  } catch (...) {
    return -1;
  }
}
