// The small per-layer steps of a decode step on the GPU, each one kernel instead of 5-20 torch ops
// (a decode step of a 7B model ran ~290 such small kernels, 2.6 ms of its 7 ms):
//   rope_      rotary embedding in place (NEOX halves or NORM adjacent pairs), strided x
//   kv_store   k/v of the new tokens into the cache at their positions (float16 or float32 cache)
//   attention  causal (+ sliding window) softmax attention of a few tokens over the cache, grouped-
//              query heads; one block per (token, query head), scores in shared memory
//   rms_norm   one block per row
//   gated_act  act(gate) * up, or act(gate) * act(up)
// Positions are read on the device, so CUDA graphs replay these for any position.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace hs {
namespace {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ void from_f(float v, float* p) { *p = v; }
__device__ __forceinline__ void from_f(float v, __half* p) { *p = __float2half(v); }

__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffff, s, off);
  return s;
}

__global__ void rope_kernel(float* x, int64_t st, int64_t sh, int H, int half, const float* cos,
                            const float* sin, bool neox, int64_t total) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t j = i % half, th = i / half, h = th % H, t = th / H;
  float* v = x + t * st + h * sh;
  float* a = neox ? v + j : v + 2 * j;
  float* b = neox ? v + j + half : v + 2 * j + 1;
  const float c = cos[t * half + j], s = sin[t * half + j], x0 = *a, x1 = *b;
  *a = x0 * c - x1 * s;
  *b = x0 * s + x1 * c;
}

template <typename C>
__global__ void kv_store_kernel(const float* k, const float* v, int64_t skt, int64_t skh, int64_t svt,
                                int64_t svh, C* kc, C* vc, const int64_t* pos, int Hkv, int64_t n_ctx, int D,
                                int64_t total) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t d = i % D, th = i / D, h = th % Hkv, t = th / Hkv;
  const int64_t slot = (h * n_ctx + pos[t]) * D + d;
  from_f(k[t * skt + h * skh + d], kc + slot);
  from_f(v[t * svt + h * svh + d], vc + slot);
}

constexpr int ATT_THREADS = 256;
constexpr int ATT_MAX_D = 256;
constexpr int ATT_MAX_KV = 8192;  // scores of one (token, head) in shared memory: 32 KiB

// q . k for one cache row: 16-byte loads, several in flight (a plain loop over head_dim was one
// dependent load at a time: 28 us per layer for a 7B decode step).
__device__ __forceinline__ float row_dot(const __half* kr, const float* qs, int D) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (D % 8 == 0) {
    const uint4* k4 = reinterpret_cast<const uint4*>(kr);
#pragma unroll 8
    for (int c = 0; c < D / 8; ++c) {
      const uint4 raw = __ldg(k4 + c);
      const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __half22float2(h[j]);
        acc[j] += f.x * qs[c * 8 + 2 * j] + f.y * qs[c * 8 + 2 * j + 1];
      }
    }
  } else {
    for (int d = 0; d < D; ++d) acc[d & 3] += qs[d] * __half2float(kr[d]);
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

__device__ __forceinline__ float row_dot(const float* kr, const float* qs, int D) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (D % 4 == 0) {
    const float4* k4 = reinterpret_cast<const float4*>(kr);
#pragma unroll 8
    for (int c = 0; c < D / 4; ++c) {
      const float4 v = __ldg(k4 + c);
      acc[0] += v.x * qs[4 * c];
      acc[1] += v.y * qs[4 * c + 1];
      acc[2] += v.z * qs[4 * c + 2];
      acc[3] += v.w * qs[4 * c + 3];
    }
  } else {
    for (int d = 0; d < D; ++d) acc[d & 3] += qs[d] * kr[d];
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

__device__ float block_reduce(float v, bool is_max, float* red) {
  for (int off = 16; off > 0; off /= 2) {
    const float o = __shfl_xor_sync(0xffffffff, v, off);
    v = is_max ? fmaxf(v, o) : v + o;
  }
  __syncthreads();  // red may still be read by a previous reduction
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < ATT_THREADS / 32; ++w) r = is_max ? fmaxf(r, red[w]) : r + red[w];
  return r;
}

// One block per (token, query head): every thread scores its own cache positions (one row of K each,
// q from shared memory), a block-wide softmax, then the threads split head_dim x positions for the
// weighted sum of V rows (coalesced across threads).
template <typename C>
__global__ void __launch_bounds__(ATT_THREADS)
attention_kernel(const float* q, int64_t sqt, int64_t sqh, const C* kc, const C* vc, const int64_t* pos,
                 int Hq, int group, int64_t n_ctx, int D, int64_t kv_len, int64_t window, float scale,
                 float* out) {
  extern __shared__ float scores[];
  __shared__ float qs[ATT_MAX_D], red[ATT_THREADS / 32], part[ATT_THREADS];
  const int t = blockIdx.x / Hq, h = blockIdx.x % Hq, hk = h / group, tid = threadIdx.x;
  for (int d = tid; d < D; d += ATT_THREADS) qs[d] = q[t * sqt + h * sqh + d] * scale;
  const int64_t p = pos[t];
  const int64_t last = min(p, kv_len - 1);
  const int64_t first = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
  const int n = last >= first ? static_cast<int>(last - first + 1) : 0;
  const C* kbase = kc + (static_cast<int64_t>(hk) * n_ctx + first) * D;
  const C* vbase = vc + (static_cast<int64_t>(hk) * n_ctx + first) * D;
  __syncthreads();
  float mx = -INFINITY;
  for (int i = tid; i < n; i += ATT_THREADS) {
    const C* kr = kbase + static_cast<int64_t>(i) * D;
    scores[i] = row_dot(kr, qs, D);
    mx = fmaxf(mx, scores[i]);
  }
  mx = block_reduce(mx, true, red);
  float sum = 0.f;
  for (int i = tid; i < n; i += ATT_THREADS) {
    const float e = __expf(scores[i] - mx);
    scores[i] = e;
    sum += e;
  }
  sum = block_reduce(sum, false, red);  // its barriers also publish scores[]
  const int parts = ATT_THREADS / D;    // threads per output feature, each over every parts-th position
  const int d = tid % D, j = tid / D;
  float acc = 0.f;
  if (j < parts) {
#pragma unroll 8
    for (int i = j; i < n; i += parts) acc += scores[i] * to_f(vbase[static_cast<int64_t>(i) * D + d]);
  }
  part[tid] = acc;
  __syncthreads();
  if (tid < D) {
    float o = 0.f;
    for (int k = 0; k < parts; ++k) o += part[k * D + tid];
    out[(static_cast<int64_t>(t) * Hq + h) * D + tid] = n ? o / sum : 0.f;
  }
}

__global__ void rms_norm_kernel(const float* x, const float* w, float* y, int64_t D, float eps) {
  const float* xr = x + blockIdx.x * D;
  float* yr = y + blockIdx.x * D;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) ss += xr[i] * xr[i];
  __shared__ float part[32];
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : 0.f;
    v = warp_sum(v);
    if (threadIdx.x == 0) part[0] = v;
  }
  __syncthreads();
  const float scale = rsqrtf(part[0] / static_cast<float>(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) yr[i] = xr[i] * scale * w[i];
}

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

__global__ void gated_act_kernel(const float* g, int64_t sg, const float* u, int64_t su, float* y, int64_t N,
                                 int64_t total, int act, bool act_on_up) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t t = i / N, n = i % N;
  const float up = u[t * su + n];
  y[i] = act_f(g[t * sg + n], act) * (act_on_up ? act_f(up, act) : up);
}

int blocks(int64_t total, int per) { return static_cast<int>((total + per - 1) / per); }

}  // namespace

void launch_rope(float* x, int64_t st, int64_t sh, int64_t T, int H, int half, const float* cos, const float* sin,
                 bool neox, cudaStream_t stream) {
  const int64_t total = T * H * half;
  if (total) rope_kernel<<<blocks(total, 256), 256, 0, stream>>>(x, st, sh, H, half, cos, sin, neox, total);
}

void launch_kv_store(const float* k, const float* v, int64_t skt, int64_t skh, int64_t svt, int64_t svh,
                     void* kc, void* vc, bool half_cache, const int64_t* pos, int64_t T, int Hkv, int64_t n_ctx,
                     int D, cudaStream_t stream) {
  const int64_t total = T * Hkv * D;
  if (!total) return;
  if (half_cache)
    kv_store_kernel<__half><<<blocks(total, 256), 256, 0, stream>>>(
        k, v, skt, skh, svt, svh, static_cast<__half*>(kc), static_cast<__half*>(vc), pos, Hkv, n_ctx, D, total);
  else
    kv_store_kernel<float><<<blocks(total, 256), 256, 0, stream>>>(
        k, v, skt, skh, svt, svh, static_cast<float*>(kc), static_cast<float*>(vc), pos, Hkv, n_ctx, D, total);
}

void launch_attention(const float* q, int64_t sqt, int64_t sqh, const void* kc, const void* vc, bool half_cache,
                      const int64_t* pos, int64_t T, int Hq, int Hkv, int64_t n_ctx, int D, int64_t kv_len,
                      int64_t window, float scale, float* out, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(T * Hq)), block(ATT_THREADS);
  const size_t smem = static_cast<size_t>(kv_len) * sizeof(float);
  if (half_cache)
    attention_kernel<__half><<<grid, block, smem, stream>>>(q, sqt, sqh, static_cast<const __half*>(kc),
                                                         static_cast<const __half*>(vc), pos, Hq, Hq / Hkv, n_ctx, D,
                                                         kv_len, window, scale, out);
  else
    attention_kernel<float><<<grid, block, smem, stream>>>(q, sqt, sqh, static_cast<const float*>(kc),
                                                        static_cast<const float*>(vc), pos, Hq, Hq / Hkv, n_ctx, D,
                                                        kv_len, window, scale, out);
}

int attention_max_head_dim() { return ATT_MAX_D; }
int attention_max_kv() { return ATT_MAX_KV; }

void launch_rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t D, float eps,
                     cudaStream_t stream) {
  const int threads = D >= 4096 ? 1024 : (D >= 1024 ? 512 : 256);
  if (rows) rms_norm_kernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(x, w, y, D, eps);
}

void launch_gated_act(const float* g, int64_t sg, const float* u, int64_t su, float* y, int64_t T, int64_t N,
                      int act, bool act_on_up, cudaStream_t stream) {
  const int64_t total = T * N;
  if (total) gated_act_kernel<<<blocks(total, 256), 256, 0, stream>>>(g, sg, u, su, y, N, total, act, act_on_up);
}

}  // namespace hs
