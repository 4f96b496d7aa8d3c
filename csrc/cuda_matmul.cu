// Quantized matmul on the GPU for decode-sized batches: y[T, N] = x[T, K] . W[N, K]^T with W in
// Q8_0 or Q4_0 blocks, dequantized in registers (no copy of the weight in another format). One warp
// per row, one 32-element block per lane per step, fp32 accumulation; launched on torch's current
// stream with no host synchronisation, so CUDA graphs can capture it.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "quant_blocks.h"

namespace hs {
namespace {

constexpr int WARPS = 4;
constexpr int MAX_TOKENS = 8;

template <int64_t QT>
__device__ __forceinline__ void load_block(const uint8_t* blk, float* v) {
  const float d = __half2float(*reinterpret_cast<const __half*>(blk));
  if constexpr (QT == Q8_0) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
#pragma unroll
    for (int i = 0; i < QK; ++i) v[i] = d * static_cast<float>(qs[i]);
  } else {  // Q4_0
    const uint8_t* qs = blk + 2;
#pragma unroll
    for (int i = 0; i < QK / 2; ++i) {
      v[i] = d * static_cast<float>((qs[i] & 0xF) - 8);
      v[i + QK / 2] = d * static_cast<float>((qs[i] >> 4) - 8);
    }
  }
}

template <int64_t QT>
__global__ void qgemv_kernel(const uint8_t* __restrict__ w, int64_t row_bytes, const float* __restrict__ x,
                             float* __restrict__ y, int64_t N, int64_t K, int T) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * WARPS + threadIdx.x / 32;
  if (row >= N) return;
  const int bb = QT == Q8_0 ? sizeof(BlockQ8_0) : sizeof(BlockQ4_0);
  const int64_t nb = K / QK;
  const uint8_t* wr = w + row * row_bytes;
  float acc[MAX_TOKENS];
#pragma unroll
  for (int t = 0; t < MAX_TOKENS; ++t) acc[t] = 0.f;
  float v[QK];
  for (int64_t b = lane; b < nb; b += 32) {
    load_block<QT>(wr + b * bb, v);
    for (int t = 0; t < T; ++t) {
      const float4* xv = reinterpret_cast<const float4*>(x + t * K + b * QK);
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < QK / 4; ++i) {
        const float4 xx = xv[i];
        s += v[4 * i] * xx.x + v[4 * i + 1] * xx.y + v[4 * i + 2] * xx.z + v[4 * i + 3] * xx.w;
      }
      acc[t] += s;
    }
  }
  for (int t = 0; t < T; ++t) {
    float s = acc[t];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffff, s, off);
    if (lane == 0) y[t * N + row] = s;
  }
}

}  // namespace

// Launcher only: argument checks live in cuda_ops.cpp (host C++), because a c10::Error thrown from
// nvcc-compiled code crashed the process on the GPU machine instead of raising.
void launch_qgemv(int64_t qtype, const uint8_t* w, int64_t row_bytes, const float* x, float* y, int64_t N,
                  int64_t K, int T, cudaStream_t stream) {
  const dim3 grid((N + WARPS - 1) / WARPS), block(32 * WARPS);
  if (qtype == Q8_0)
    qgemv_kernel<Q8_0><<<grid, block, 0, stream>>>(w, row_bytes, x, y, N, K, T);
  else
    qgemv_kernel<Q4_0><<<grid, block, 0, stream>>>(w, row_bytes, x, y, N, K, T);
}

int qgemv_max_tokens() { return MAX_TOKENS; }

}  // namespace hs
