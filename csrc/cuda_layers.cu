// The small per-layer steps of a decode step on the GPU, each one kernel instead of 5-20 torch ops
// (a decode step of a 7B model ran ~290 such small kernels, 2.6 ms of its 7 ms):
//   rope_      rotary embedding in place (NEOX halves or NORM adjacent pairs), strided x
//   kv_store   k/v of the new tokens into the cache at their positions (float16 or float32 cache)
//   attention  causal (+ sliding window) softmax attention of a few tokens over the cache, grouped-
//              query heads; one block per (token, query head, chunk of 32-64 cache positions), then
//              one that rescales and adds the chunks' sums (split-KV)
//   rms_norm   one block per row
//   layer_norm the same with the mean taken out and an optional bias (torch's kernel runs one token's
//              row of 8192 in ~15 us: Falcon-40B's 121 norms a step took 1.8 ms on the H200)
//   gated_act  act(gate) * up, or act(gate) * act(up)
// Positions are read on the device, so CUDA graphs replay these for any position. HS_CUDA_PDL=1: each
// may start while the kernel before it ends and waits for it first (csrc/cuda_launch.h).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_device.h"
#include "cuda_launch.h"

namespace hs {
namespace {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ void from_f(float v, float* p) { *p = v; }
__device__ __forceinline__ void from_f(float v, __half* p) { *p = __float2half(v); }
// v as the cache of type C holds it
template <typename C> __device__ __forceinline__ float cache_round(float v) {
  C c;
  from_f(v, &c);
  return to_f(c);
}

__global__ void rope_kernel(float* x, int64_t st, int64_t sh, int H, int half, const float* cos,
                            const float* sin, bool neox, int64_t total) {
  pdl_wait();
  pdl_launch_dependents();
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
  pdl_wait();
  pdl_launch_dependents();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t d = i % D, th = i / D, h = th % Hkv, t = th / Hkv;
  const int64_t slot = (h * n_ctx + pos[t]) * D + d;
  from_f(k[t * skt + h * skh + d], kc + slot);
  from_f(v[t * svt + h * svh + d], vc + slot);
}

constexpr int ATT_MAX_D = 256;
constexpr int ATT_MAX_KV = 8192;  // the graph buckets' largest cache length (runtime/layers.py)
constexpr int ATT_WARPS = 4;      // warps per attention block
constexpr int ATT_MAX_CHUNK = 64; // cache positions per block (split-KV, "flash decoding")
// Cache rows a warp loads before it reduces their dots (KU), and rows of V a thread loads before it
// adds them in (VU): with 8 and 16 a 32-position chunk's rows are one round of memory latency each.
// At a few hundred positions the kernel waits on latency, not bandwidth (a 7B layer's K and V at 256
// positions are 4 MiB, ~1.5 us of HBM time; it took ~13 us with 4 and 4, two and eight rounds).
// H100, session 19 (`hs-bench attention --device cuda`: the k/v store, attention and combine of one
// token, replayed in a CUDA graph, two alternating runs each): 7B heads 12 -> 11 us at 257 positions,
// 67 -> 64 us at 4001; Llama-3-8B 40 -> 38 us at 4001: mostly launch and latency floor either way.
// HS_CUDA_ATT_UNROLL=0: 4 and 4, for side-by-side runs (tests/gpu/device_session.sh stage att).
constexpr int ATT_UNROLL = 8;
constexpr int ATT_V_UNROLL = 16;

// this lane's share of q . k for one cache row: lanes over head_dim, so a warp reads a row with
// consecutive loads
__device__ __forceinline__ float lane_dot(const __half* kr, const float* qs, int D, int lane) {
  float acc = 0.f;
  if ((D & 1) == 0) {
    const __half2* k2 = reinterpret_cast<const __half2*>(kr);
    for (int d = lane; d < D / 2; d += 32) {
      const float2 f = __half22float2(k2[d]);
      acc += f.x * qs[2 * d] + f.y * qs[2 * d + 1];
    }
  } else {
    for (int d = lane; d < D; d += 32) acc += __half2float(kr[d]) * qs[d];
  }
  return acc;
}

__device__ __forceinline__ float lane_dot(const float* kr, const float* qs, int D, int lane) {
  float acc = 0.f;
  if ((D & 1) == 0) {
    const float2* k2 = reinterpret_cast<const float2*>(kr);
    for (int d = lane; d < D / 2; d += 32) {
      const float2 f = k2[d];
      acc += f.x * qs[2 * d] + f.y * qs[2 * d + 1];
    }
  } else {
    for (int d = lane; d < D; d += 32) acc += kr[d] * qs[d];
  }
  return acc;
}

// lane_dot of the new row k (float), rounded as the cache of type C holds it
template <typename C>
__device__ __forceinline__ float lane_dot_new(const float* kr, const float* qs, int D, int lane) {
  float acc = 0.f;
  for (int d = lane; d < D; d += 32) acc += cache_round<C>(kr[d]) * qs[d];
  return acc;
}

// The chunks of one (token, head) rescaled to their common maximum and added, threads over head_dim
// (the combine kernel's block, or the last attention block of the (token, head) to finish).
__device__ __forceinline__ void combine_chunks(const float* part_o, const float* part_ml, int n_chunks, int D,
                                               int64_t th, float* out) {
  const float* ml = part_ml + th * n_chunks * 2;
  float mx = -INFINITY;
  for (int s = 0; s < n_chunks; ++s) mx = fmaxf(mx, __ldcg(ml + 2 * s));
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f, total = 0.f;
    for (int s = 0; s < n_chunks; ++s) {
      const float m = __ldcg(ml + 2 * s), l = __ldcg(ml + 2 * s + 1);
      if (l == 0.f) continue;  // an empty chunk
      const float w = __expf(m - mx);
      total += w * l;
      o += w * __ldcg(part_o + (th * n_chunks + s) * D + d);
    }
    out[th * D + d] = total > 0.f ? o / total : 0.f;
  }
}

// Per (token, head): how many of its chunks' blocks have written their sums (the last one combines
// them and sets it back to 0). A decode step's attention launches follow one another on one stream.
constexpr int ATT_MAX_DONE = 4096;
__device__ unsigned int att_done[ATT_MAX_DONE];

// One token's new k/v rows (T = 1, HS_CUDA_ATT_FUSE not 0): the kv_store kernel folded in. Blocks read
// them from here as the cache would hold them, and the block of the first query head of each key/
// value head whose chunk holds the token's position writes them into the cache; no block reads that
// cache row in this launch.
struct NewKV {
  const float* k;  // [Hkv, D] with stride skh (null: the rows are in the cache already)
  const float* v;
  int64_t skh, svh;
};

// One block per (token, query head, chunk of cache positions): the chunk's scores (a warp per cache
// row), their softmax with the chunk's own maximum, the weighted sum of its V rows (threads over
// head_dim). With one chunk the block writes the output; with several it writes (sum, max, total),
// which the (token, head)'s last block to finish combines (combine_here, counting in att_done; else
// the combine kernel does). One block per head left most of the GPU idle: ~24 us per layer of a 7B decode step at a
// 256-position cache.
template <typename C, int KU, int VU>
__global__ void __launch_bounds__(32 * ATT_WARPS)
attention_kernel(const float* q, int64_t sqt, int64_t sqh, C* kc, C* vc, const int64_t* pos,
                 int Hq, int group, int64_t n_ctx, int D, int64_t kv_len, int64_t window, float scale, int chunk,
                 int n_chunks, float* out, float* part_o, float* part_ml, NewKV nkv, bool combine_here) {
  pdl_wait();
  pdl_launch_dependents();
  __shared__ float qs[ATT_MAX_D], scores[ATT_MAX_CHUNK];
  __shared__ bool last_block;
  const int th = blockIdx.x, s = blockIdx.y, t = th / Hq, h = th % Hq, hk = h / group;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t p = pos[t];
  const int64_t last = min(p, kv_len - 1);
  const int64_t first = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
  const int64_t c0 = max(first, static_cast<int64_t>(s) * chunk);
  const int64_t c1 = min(last, static_cast<int64_t>(s) * chunk + chunk - 1);
  const int n = c1 >= c0 ? static_cast<int>(c1 - c0 + 1) : 0;
  // the new row, where this chunk holds it, is its last (c1 = p)
  const bool has_new = nkv.k != nullptr && n > 0 && c1 == p;
  const float* kn = has_new ? nkv.k + hk * nkv.skh : nullptr;
  const float* vn = has_new ? nkv.v + hk * nkv.svh : nullptr;
  if (nkv.k != nullptr && h % group == 0 && p < n_ctx && p / chunk == s)  // the one block that stores them
    for (int d = tid; d < D; d += blockDim.x) {
      from_f(nkv.k[hk * nkv.skh + d], kc + (static_cast<int64_t>(hk) * n_ctx + p) * D + d);
      from_f(nkv.v[hk * nkv.svh + d], vc + (static_cast<int64_t>(hk) * n_ctx + p) * D + d);
    }
  if (n == 0) {  // a chunk outside the causal (or sliding) window
    if (n_chunks == 1) {
      for (int d = tid; d < D; d += blockDim.x) out[static_cast<int64_t>(th) * D + d] = 0.f;
      return;
    }
    for (int d = tid; d < D; d += blockDim.x) part_o[(static_cast<int64_t>(th) * n_chunks + s) * D + d] = 0.f;
    if (tid == 0) {
      part_ml[(static_cast<int64_t>(th) * n_chunks + s) * 2] = -INFINITY;
      part_ml[(static_cast<int64_t>(th) * n_chunks + s) * 2 + 1] = 0.f;
    }
  } else {
    for (int d = tid; d < D; d += blockDim.x) qs[d] = q[t * sqt + h * sqh + d] * scale;
    const C* kbase = kc + (static_cast<int64_t>(hk) * n_ctx + c0) * D;
    const C* vbase = vc + (static_cast<int64_t>(hk) * n_ctx + c0) * D;
    const int n_cached = has_new ? n - 1 : n;  // rows read from the cache
    __syncthreads();
    for (int i0 = warp; i0 < n; i0 += ATT_WARPS * KU) {
      float part[KU];
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const int i = i0 + u * ATT_WARPS;
        part[u] = i < n_cached ? lane_dot(kbase + static_cast<int64_t>(i) * D, qs, D, lane)
                               : (i < n ? lane_dot_new<C>(kn, qs, D, lane) : 0.f);
      }
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const float v = warp_sum(part[u]);
        const int i = i0 + u * ATT_WARPS;
        if (lane == 0 && i < n) scores[i] = v;
      }
    }
    __syncthreads();
    float mx = -INFINITY;  // every warp finds the chunk's maximum and total itself (n <= 64)
    for (int i = lane; i < n; i += 32) mx = fmaxf(mx, scores[i]);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, off));
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) scores[i] = __expf(scores[i] - mx);
    __syncthreads();
    float sum = 0.f;
    for (int i = lane; i < n; i += 32) sum += scores[i];
    sum = warp_sum(sum);
    for (int d = tid; d < D; d += blockDim.x) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      // VU rows' loads first, all in flight at once, a partial last round too (rows past the chunk's
      // end load its last row again and weigh 0: the chunk that ends at the token's position is rarely
      // a multiple of VU, and a tail loop of dependent rounds made it the slowest block); the new row,
      // where the chunk has it, comes from vn
      for (int i = 0; i < n_cached; i += VU) {
        float vv[VU];
#pragma unroll
        for (int j = 0; j < VU; ++j) vv[j] = to_f(vbase[static_cast<int64_t>(min(i + j, n_cached - 1)) * D + d]);
#pragma unroll
        for (int j = 0; j < VU; ++j) acc[j % 4] += (i + j < n_cached ? scores[i + j] : 0.f) * vv[j];
      }
      if (has_new) acc[0] += scores[n - 1] * cache_round<C>(vn[d]);
      const float o = (acc[0] + acc[1]) + (acc[2] + acc[3]);
      if (n_chunks == 1) out[static_cast<int64_t>(th) * D + d] = o / sum;
      else part_o[(static_cast<int64_t>(th) * n_chunks + s) * D + d] = o;
    }
    if (n_chunks == 1) return;
    if (tid == 0) {
      part_ml[(static_cast<int64_t>(th) * n_chunks + s) * 2] = mx;
      part_ml[(static_cast<int64_t>(th) * n_chunks + s) * 2 + 1] = sum;
    }
  }
  if (!combine_here) return;
  // the last of the (token, head)'s blocks to get here combines the chunks (threadFenceReduction)
  __threadfence();
  __syncthreads();
  if (tid == 0) last_block = atomicAdd(att_done + th, 1u) == static_cast<unsigned>(n_chunks - 1);
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  combine_chunks(part_o, part_ml, n_chunks, D, th, out);
  if (tid == 0) att_done[th] = 0;
}

// The chunks of one (token, head) combined: a block per (token, head), threads over head_dim.
__global__ void attention_combine_kernel(const float* part_o, const float* part_ml, int n_chunks, int D,
                                         float* out) {
  pdl_wait();
  pdl_launch_dependents();
  combine_chunks(part_o, part_ml, n_chunks, D, blockIdx.x, out);
}

// The sum of v over the block, in every thread (part: 32 floats of shared memory, free on entry)
__device__ __forceinline__ float block_sum(float v, float* part) {
  v = warp_sum(v);
  __syncthreads();  // the previous call's readers of part[0] are done
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float s = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : 0.f;
    s = warp_sum(s);
    if (threadIdx.x == 0) part[0] = s;
  }
  __syncthreads();
  return part[0];
}

__global__ void rms_norm_kernel(const float* x, const float* w, float* y, int64_t D, float eps) {
  pdl_wait();
  pdl_launch_dependents();
  const float* xr = x + blockIdx.x * D;
  float* yr = y + blockIdx.x * D;
  __shared__ float part[32];
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) ss += xr[i] * xr[i];
  const float scale = rsqrtf(block_sum(ss, part) / static_cast<float>(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) yr[i] = xr[i] * scale * w[i];
}

__global__ void layer_norm_kernel(const float* x, const float* w, const float* b, float* y, int64_t D, float eps) {
  pdl_wait();
  pdl_launch_dependents();
  const float* xr = x + blockIdx.x * D;
  float* yr = y + blockIdx.x * D;
  __shared__ float part[32];
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) s += xr[i];
  const float mean = block_sum(s, part) / static_cast<float>(D);
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float d = xr[i] - mean;
    ss += d * d;
  }
  const float rstd = rsqrtf(block_sum(ss, part) / static_cast<float>(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) yr[i] = (xr[i] - mean) * rstd * w[i] + (b ? b[i] : 0.f);
}

__global__ void gated_act_kernel(const float* g, int64_t sg, const float* u, int64_t su, float* y, int64_t N,
                                 int64_t total, int act, bool act_on_up) {
  pdl_wait();
  pdl_launch_dependents();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t t = i / N, n = i % N;
  const float up = u[t * su + n];
  y[i] = act_f(g[t * sg + n], act) * (act_on_up ? act_f(up, act) : up);
}

int blocks(int64_t total, int per) { return static_cast<int>((total + per - 1) / per); }

// threads of a norm's block (one block per row)
int norm_threads(int64_t D) { return D >= 4096 ? 1024 : (D >= 1024 ? 512 : 256); }

}  // namespace

void launch_rope(float* x, int64_t st, int64_t sh, int64_t T, int H, int half, const float* cos, const float* sin,
                 bool neox, cudaStream_t stream) {
  const int64_t total = T * H * half;
  if (total) launch(rope_kernel, dim3(blocks(total, 256)), dim3(256), 0, stream, x, st, sh, H, half, cos, sin, neox, total);
}

void launch_kv_store(const float* k, const float* v, int64_t skt, int64_t skh, int64_t svt, int64_t svh,
                     void* kc, void* vc, bool half_cache, const int64_t* pos, int64_t T, int Hkv, int64_t n_ctx,
                     int D, cudaStream_t stream) {
  const int64_t total = T * Hkv * D;
  if (!total) return;
  if (half_cache)
    launch(kv_store_kernel<__half>, dim3(blocks(total, 256)), dim3(256), 0, stream, k, v, skt, skh, svt, svh,
           static_cast<__half*>(kc), static_cast<__half*>(vc), pos, Hkv, n_ctx, D, total);
  else
    launch(kv_store_kernel<float>, dim3(blocks(total, 256)), dim3(256), 0, stream, k, v, skt, skh, svt, svh,
           static_cast<float*>(kc), static_cast<float*>(vc), pos, Hkv, n_ctx, D, total);
}

// How many cache positions each attention block takes: 64, or 32 when 64 would leave fewer than two
// blocks per SM of an H100/H200.
int attention_chunk(int64_t T, int Hq, int64_t kv_len) {
  const int64_t blocks64 = T * Hq * ((kv_len + 63) / 64);
  return blocks64 >= 264 ? 64 : 32;
}

int attention_chunks(int64_t T, int Hq, int64_t kv_len) {
  const int chunk = attention_chunk(T, Hq, kv_len);
  return static_cast<int>((kv_len + chunk - 1) / chunk);
}

// k/v [T, Hkv, D] (strides skt, skh / svt, svh) stored into the cache at their positions, then the
// attention of q over it. HS_CUDA_ATT_FUSE=0 keeps the older three kernels (store, attend, combine) for
// side-by-side runs; otherwise one token's store and the combine happen inside the attention kernel.
void launch_attention(const float* q, int64_t sqt, int64_t sqh, const float* k, const float* v, int64_t skt,
                      int64_t skh, int64_t svt, int64_t svh, void* kc, void* vc, bool half_cache,
                      const int64_t* pos, int64_t T, int Hq, int Hkv, int64_t n_ctx, int D, int64_t kv_len,
                      int64_t window, float scale, float* out, float* part_o, float* part_ml, cudaStream_t stream) {
  const int chunk = attention_chunk(T, Hq, kv_len), n_chunks = attention_chunks(T, Hq, kv_len);
  const bool fuse = !env_off("HS_CUDA_ATT_FUSE");
  const NewKV nkv = fuse && T == 1 ? NewKV{k, v, skh, svh} : NewKV{nullptr, nullptr, 0, 0};
  if (nkv.k == nullptr) launch_kv_store(k, v, skt, skh, svt, svh, kc, vc, half_cache, pos, T, Hkv, n_ctx, D, stream);
  const bool combine_here = fuse && n_chunks > 1 && T * Hq <= ATT_MAX_DONE;
  const dim3 grid(static_cast<unsigned>(T * Hq), static_cast<unsigned>(n_chunks)), block(32 * ATT_WARPS);
  const bool unrolled = !env_off("HS_CUDA_ATT_UNROLL");
  if (half_cache)
    launch(unrolled ? attention_kernel<__half, ATT_UNROLL, ATT_V_UNROLL> : attention_kernel<__half, 4, 4>, grid, block,
           0, stream, q, sqt, sqh, static_cast<__half*>(kc), static_cast<__half*>(vc), pos, Hq, Hq / Hkv,
           n_ctx, D, kv_len, window, scale, chunk, n_chunks, out, part_o, part_ml, nkv, combine_here);
  else
    launch(unrolled ? attention_kernel<float, ATT_UNROLL, ATT_V_UNROLL> : attention_kernel<float, 4, 4>, grid, block,
           0, stream, q, sqt, sqh, static_cast<float*>(kc), static_cast<float*>(vc), pos, Hq, Hq / Hkv,
           n_ctx, D, kv_len, window, scale, chunk, n_chunks, out, part_o, part_ml, nkv, combine_here);
  if (n_chunks > 1 && !combine_here)
    launch(attention_combine_kernel, dim3(static_cast<unsigned>(T * Hq)), dim3(D <= 128 ? 128 : 256), 0, stream,
           part_o, part_ml, n_chunks, D, out);
}

int attention_max_head_dim() { return ATT_MAX_D; }
int attention_max_kv() { return ATT_MAX_KV; }

void launch_rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t D, float eps,
                     cudaStream_t stream) {
  if (rows) launch(rms_norm_kernel, dim3(static_cast<unsigned>(rows)), dim3(norm_threads(D)), 0, stream, x, w, y, D, eps);
}

void launch_layer_norm(const float* x, const float* w, const float* b, float* y, int64_t rows, int64_t D, float eps,
                       cudaStream_t stream) {
  if (rows)
    launch(layer_norm_kernel, dim3(static_cast<unsigned>(rows)), dim3(norm_threads(D)), 0, stream, x, w, b, y, D, eps);
}

void launch_gated_act(const float* g, int64_t sg, const float* u, int64_t su, float* y, int64_t T, int64_t N,
                      int act, bool act_on_up, cudaStream_t stream) {
  const int64_t total = T * N;
  if (total)
    launch(gated_act_kernel, dim3(blocks(total, 256)), dim3(256), 0, stream, g, sg, u, su, y, N, total, act, act_on_up);
}

}  // namespace hs
