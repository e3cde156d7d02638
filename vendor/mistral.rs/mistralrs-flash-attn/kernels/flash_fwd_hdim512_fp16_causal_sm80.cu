// Copyright (c) 2024, Tri Dao.
// Splitting the different head dimensions to different files to speed up compilation.
// This file is auto-generated. See "generate_kernels.py"

// hd512 (Gemma 4) uses no alibi/softcap/local; disabling shrinks the template cross-product so ptxas does not take hours
#define FLASHATTENTION_DISABLE_ALIBI
#define FLASHATTENTION_DISABLE_SOFTCAP
#define FLASHATTENTION_DISABLE_LOCAL

#include "flash_fwd_launch_template.h"

template<>
void run_mha_fwd_<cutlass::half_t, 512, true>(Flash_fwd_params &params, cudaStream_t stream) {
    run_mha_fwd_hdim512<cutlass::half_t, true>(params, stream);
}
