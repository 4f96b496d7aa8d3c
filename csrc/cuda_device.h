// Device helpers the CUDA kernels share (csrc/cuda_sparse.cu, csrc/cuda_layers.cu).
#pragma once

#include <cuda_runtime.h>

namespace hs {
namespace {

__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffff, s, off);
  return s;
}

// The FFN activations by id (runtime/kernels.py ACTIVATION_IDS): 0 SiLU, 1 ReLU, 2 GELU (tanh form),
// 3 GELU (erf form)
__device__ __forceinline__ float act_f(float x, int act) {
  switch (act) {
    case 0: return x / (1.f + __expf(-x));
    case 1: return fmaxf(x, 0.f);
    case 2: {
      const float c = 0.7978845608028654f;  // sqrt(2 / pi)
      return 0.5f * x * (1.f + tanhf(c * (x + 0.044715f * x * x * x)));
    }
    default: return 0.5f * x * (1.f + erff(x * 0.7071067811865476f));
  }
}

}  // namespace
}  // namespace hs
