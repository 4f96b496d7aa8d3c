// Neuron-aware sparse kernels on the GPU, which are also the dense GEMV for decode-sized batches
// (every row active). Weights stay in their stored format (F16, BF16, Q8_0, Q4_0) and are
// dequantized in registers; accumulation in fp32; at most 8 tokens per launch.
//
// The unit of work is a run of a row's weights (16 bytes of F16/BF16, a quarter of a Q8_0 block,
// half a Q4_0 block), so that consecutive lanes read consecutive bytes of a row and a warp's loads
// coalesce whatever the format:
//   row-dot  y[t, k] = W[row_k] . x[t]       1, 2 or 4 warps per row; row_k = idx[k] (or k); rows whose
//                                            mask entry is false are not read (y = 0)
//   axpy     y[t]   += sum_k h[t, k] W_t[row_k]   a block per (column tile, group of 64 rows);
//                                            rows whose h is zero for every token are not read;
//                                            the 8 warps' partial sums meet in shared memory and
//                                            one atomicAdd per column and block goes to y
// Everything runs on torch's current stream with no host synchronisation (CUDA-graph capturable);
// HS_CUDA_PDL=1 launches with programmatic dependent launch (csrc/cuda_launch.h): a row-dot over every
// row prefetches the start of its rows into L2 before it waits for the kernel before it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "cuda_device.h"
#include "cuda_launch.h"
#include "quant_blocks.h"

namespace hs {
namespace {

constexpr int DOT_WARPS = 8;     // warps per block of the row-dot
constexpr int AXPY_WARPS = 8;
constexpr int AXPY_ROWS = 64;    // rows per block of the axpy
constexpr int STAGED_CHUNKS = 2; // 32-block chunks of a Q4_0 row a warp of the staged row-dot loads at once

// One unit of a row: W weights that one lane reads in one step, as raw values q[i] times one scale
// (int8 and 4-bit values become floats with the 2^23 trick: a byte permute and one add, no
// int-to-float conversion, which would bound the kernel), and the column of each. Consecutive lanes
// read consecutive bytes of a row.
template <int64_t QT> struct Unit;

__device__ __forceinline__ float byte_to_float(uint32_t word, int j, float offset) {
  // 0x4B0000bb is 2^23 + bb as a float
  return __int_as_float(__byte_perm(word, 0x4B000000u, 0x7540u + j)) - offset;
}

__device__ __forceinline__ uint2 load_8_bytes_2aligned(const uint8_t* p) {
  const unsigned short* q = reinterpret_cast<const unsigned short*>(p);
  return make_uint2(__ldg(q) | (static_cast<uint32_t>(__ldg(q + 1)) << 16),
                    __ldg(q + 2) | (static_cast<uint32_t>(__ldg(q + 3)) << 16));
}

template <> struct Unit<F16> {
  static constexpr int W = 8;
  __device__ static __forceinline__ float load(const uint8_t* row, int64_t u, float* q) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row) + u);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      q[2 * i] = f.x;
      q[2 * i + 1] = f.y;
    }
    return 1.f;
  }
  __device__ static __forceinline__ int64_t col(int64_t u, int i) { return u * W + i; }
};

template <> struct Unit<BF16> {
  static constexpr int W = 8;
  __device__ static __forceinline__ float load(const uint8_t* row, int64_t u, float* q) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row) + u);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      q[2 * i] = __uint_as_float(w[i] << 16);
      q[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
    return 1.f;
  }
  __device__ static __forceinline__ int64_t col(int64_t u, int i) { return u * W + i; }
};

template <> struct Unit<Q8_0> {  // a quarter block: 8 int8 values (34-byte blocks: 2-byte aligned)
  static constexpr int W = 8;
  __device__ static __forceinline__ float load(const uint8_t* row, int64_t u, float* q) {
    const uint8_t* blk = row + (u >> 2) * sizeof(BlockQ8_0);
    const uint2 v = load_8_bytes_2aligned(blk + 2 + (u & 3) * 8);
    const uint32_t w0 = v.x ^ 0x80808080u, w1 = v.y ^ 0x80808080u;  // int8 + 128 as bytes
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      q[j] = byte_to_float(w0, j, 8388736.f);
      q[4 + j] = byte_to_float(w1, j, 8388736.f);
    }
    return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(blk))));
  }
  __device__ static __forceinline__ int64_t col(int64_t u, int i) { return u * W + i; }
};

template <> struct Unit<Q4_0> {  // half a block: both nibbles of 8 bytes (elements s*8+i and 16+s*8+i)
  static constexpr int W = 16;
  __device__ static __forceinline__ float load(const uint8_t* row, int64_t u, float* q) {
    const uint8_t* blk = row + (u >> 1) * sizeof(BlockQ4_0);
    const uint2 v = load_8_bytes_2aligned(blk + 2 + (u & 1) * 8);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      q[j] = byte_to_float(v.x & 0x0F0F0F0Fu, j, 8388616.f);
      q[4 + j] = byte_to_float(v.y & 0x0F0F0F0Fu, j, 8388616.f);
      q[8 + j] = byte_to_float((v.x >> 4) & 0x0F0F0F0Fu, j, 8388616.f);
      q[12 + j] = byte_to_float((v.y >> 4) & 0x0F0F0F0Fu, j, 8388616.f);
    }
    return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(blk))));
  }
  __device__ static __forceinline__ int64_t col(int64_t u, int i) {
    return (u >> 1) * QK + (i >> 3) * 16 + (u & 1) * 8 + (i & 7);
  }
};

// What a row-dot lane adds for one unit of a row and each token: the unit's weights against x.
// FloatX reads x as float32 (F16, BF16, and block formats whose x is not quantized); QuantX reads
// x as two 8-bit planes per 32-element block with one scale (csrc/quant_blocks.h's ActQ8, as the
// CPU kernels do: ~15 bits, x ~= d * (128 * q0 + q1)) and multiplies Q4_0 rows with __dp4a: four
// products per instruction and 16 bytes of x per 16 weights instead of 64. On an H100 (hs-bench
// kernels, 70B/Falcon-40B rows) Q4_0 went from 31% to 42% of HBM bandwidth with every row, 24-27%
// to 27-33% at 10%; Q8_0 rows lost (70 -> 65%, 55-58 -> 50-57%: the extra quantizing kernel costs
// more than the cheaper dots save), so they keep reading float x.
struct FloatX {
  const float* __restrict__ x;
  int64_t K;
  template <int64_t QT, int T>
  __device__ __forceinline__ void add(const uint8_t* wr, int64_t u, float* acc) const {
    using U = Unit<QT>;
    float q[U::W];
    const float d = U::load(wr, u, q);
#pragma unroll
    for (int t = 0; t < T; ++t) {
      float s = 0.f;
#pragma unroll
      for (int c = 0; c < U::W; c += 8) {  // runs of 8 consecutive columns of x
        const float4* p = reinterpret_cast<const float4*>(x + t * K + U::col(u, c));
        const float4 a = __ldg(p), b = __ldg(p + 1);
        s += q[c] * a.x + q[c + 1] * a.y + q[c + 2] * a.z + q[c + 3] * a.w + q[c + 4] * b.x + q[c + 5] * b.y +
             q[c + 6] * b.z + q[c + 7] * b.w;
      }
      acc[t] += d * s;
    }
  }
};

struct QuantX {
  const int8_t* __restrict__ q0;  // [T, K]: the first plane
  const int8_t* __restrict__ q1;  // [T, K]: what the first leaves, in steps of d
  const float2* __restrict__ dd;  // [T, K / 32]: (d, d * sum(128 * q0 + q1)) per block
  int64_t K;
  // HS_ACT_PLANES=1: the first plane alone (llama.cpp's 8-bit activations, the CPU kernels' switch):
  // q1 is zero and neither read nor multiplied, half the dp4a and half the loads of x
  bool one;
  __device__ __forceinline__ int2 plane(const int8_t* p, int64_t t, int64_t col) const {
    return __ldg(reinterpret_cast<const int2*>(p + t * K + col));
  }
  // 128 * (w . q0) + (w . q1) over block b of token t, w: its 32 int8 weights, four a word (the staged
  // row-dot), with four 16-byte loads of the planes
  __device__ __forceinline__ int block_dot(const int* w, int64_t t, int64_t b) const {
    const int4* p0 = reinterpret_cast<const int4*>(q0 + t * K + b * QK);
    const int4 a = __ldg(p0), a2 = __ldg(p0 + 1);
    int s0 = __dp4a(w[0], a.x, __dp4a(w[1], a.y, __dp4a(w[2], a.z, __dp4a(w[3], a.w, 0))));
    s0 = __dp4a(w[4], a2.x, __dp4a(w[5], a2.y, __dp4a(w[6], a2.z, __dp4a(w[7], a2.w, s0))));
    if (one) return s0 * 128;
    const int4* p1 = reinterpret_cast<const int4*>(q1 + t * K + b * QK);
    const int4 c = __ldg(p1), c2 = __ldg(p1 + 1);
    int s1 = __dp4a(w[0], c.x, __dp4a(w[1], c.y, __dp4a(w[2], c.z, __dp4a(w[3], c.w, 0))));
    s1 = __dp4a(w[4], c2.x, __dp4a(w[5], c2.y, __dp4a(w[6], c2.z, __dp4a(w[7], c2.w, s1))));
    return s0 * 128 + s1;
  }
  template <int64_t QT, int T>
  __device__ __forceinline__ void add(const uint8_t* wr, int64_t u, float* acc) const {
    static_assert(QT == Q4_0, "QuantX: Q4_0 rows");
    // half a block: low nibbles are elements s*8..s*8+7, high nibbles 16+s*8..
    const uint8_t* blk = wr + (u >> 1) * sizeof(BlockQ4_0);
    const int s = static_cast<int>(u & 1);
    const uint2 v = load_8_bytes_2aligned(blk + 2 + s * 8);
    const float dw = __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(blk))));
    const int l0 = static_cast<int>(v.x & 0x0F0F0F0Fu), l1 = static_cast<int>(v.y & 0x0F0F0F0Fu);
    const int h0 = static_cast<int>((v.x >> 4) & 0x0F0F0F0Fu), h1 = static_cast<int>((v.y >> 4) & 0x0F0F0F0Fu);
    const int64_t col = (u >> 1) * QK + s * 8;
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const int2 a = plane(q0, t, col), a2 = plane(q0, t, col + 16);
      const int hi = __dp4a(h1, a2.y, __dp4a(h0, a2.x, __dp4a(l1, a.y, __dp4a(l0, a.x, 0))));
      int lo = 0;
      if (!one) {
        const int2 b = plane(q1, t, col), b2 = plane(q1, t, col + 16);
        lo = __dp4a(h1, b2.y, __dp4a(h0, b2.x, __dp4a(l1, b.y, __dp4a(l0, b.x, 0))));
      }
      const float2 xd = dd[t * (K / QK) + (u >> 1)];
      // the weights' offset of 8: the block's whole term, counted by the lane of its first half
      acc[t] += dw * (xd.x * static_cast<float>(hi * 128 + lo) - (s == 0 ? 8.f * xd.y : 0.f));
    }
  }
};

// Before a dense row-dot waits for the kernel before it (HS_CUDA_PDL=1): the first 2 KiB of this
// warp's slice of its row into L2, where the loads after the wait find them (weights: no kernel
// writes them, so they may be read early). Only with every row (no index list and no mask: those may
// still be being written, and a mask's rows are a fraction of all; session 18 on an H100 prefetched for
// masked launches too, and the 10%-masked row-dot fell from 1694 to 1197 GiB/s on 70B F16 rows).
__device__ __forceinline__ void prefetch_row_start(const uint8_t* row, int64_t row_bytes, int S, int slice, int lane) {
  const int64_t per = row_bytes / S;
  prefetch_l2_warp(row + slice * per, per < 2048 ? per : 2048, lane);
}

// The end of a row-dot block: each warp's lane sums meet (warp_sum), the S slices of a row in shared
// memory, and y[t, k] is written, plus res[t, k] where res is given (the residual added as the GEMV
// writes: one kernel instead of two; rows past n_out only join the block's barrier).
template <int T, int S>
__device__ __forceinline__ void rowdot_store(float* acc, int64_t k, int64_t n_out, float* __restrict__ y,
                                             const float* __restrict__ res) {
  __shared__ float part[DOT_WARPS][T];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, slice = warp % S;
#pragma unroll
  for (int t = 0; t < T; ++t) acc[t] = warp_sum(acc[t]);
  if constexpr (S == 1) {
    if (lane == 0 && k < n_out)
#pragma unroll
      for (int t = 0; t < T; ++t) y[t * n_out + k] = res ? res[t * n_out + k] + acc[t] : acc[t];
  } else {
    if (lane == 0)
#pragma unroll
      for (int t = 0; t < T; ++t) part[warp][t] = acc[t];
    __syncthreads();
    if (slice == 0 && lane < T && k < n_out) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < S; ++j) s += part[warp + j][lane];
      y[lane * n_out + k] = res ? res[lane * n_out + k] + s : s;
    }
  }
}

// Row-dot blocks of 8 warps: each row is split into S column slices, one per warp (S = 1 for many
// rows; 2 or 4 when few rows would leave the GPU's 132 SMs short of warps to hide memory latency),
// the slices' sums meet in shared memory.
template <int64_t QT, int T, int S, typename X>
__global__ void __launch_bounds__(32 * DOT_WARPS)
rowdot_kernel(const uint8_t* __restrict__ w, int64_t row_bytes, X x, int64_t K,
              const int32_t* __restrict__ idx, const bool* __restrict__ mask, int64_t n_out,
              float* __restrict__ y, const float* __restrict__ res, bool early) {
  using U = Unit<QT>;
  constexpr int ROWS = DOT_WARPS / S;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, slice = warp % S;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * ROWS + warp / S;
  if (early && idx == nullptr && mask == nullptr && k < n_out) prefetch_row_start(w + k * row_bytes, row_bytes, S, slice, lane);
  pdl_wait();
  pdl_launch_dependents();
  float acc[T];
#pragma unroll
  for (int t = 0; t < T; ++t) acc[t] = 0.f;
  const int64_t row = k < n_out ? (idx ? idx[k] : k) : 0;
  if (k < n_out && (mask == nullptr || mask[row])) {
    const uint8_t* wr = w + row * row_bytes;
    const int64_t units = K / U::W;
    const int64_t per_slice = (units + S - 1) / S;
    const int64_t u_end = min(units, (slice + 1) * per_slice);
#pragma unroll 4
    for (int64_t u = slice * per_slice + lane; u < u_end; u += 32) x.template add<QT, T>(wr, u, acc);
  }
  rowdot_store<T, S>(acc, k, n_out, y, res);
}

// x for the fused row-dot: FloatX's dot without NORM; with NORM, x is RMS-normalized on the fly. RMSNorm(x) . w_row =
// rstd * sum_c w_row[c] * (nw[c] * x[c]) with rstd = rsqrt(mean(x^2) + eps), and a warp reading a row
// reads all of x (its slice of x with S warps a row) anyway: it adds up x^2 as it goes (ss) and
// weighs x by the norm weight nw; the row's dot is scaled by rstd at the end. No norm kernel, no
// normalized copy of x, no prologue before the weights stream.
template <bool NORM>
struct NormX {
  const float* __restrict__ x;
  const float* __restrict__ nw;  // [K] (NORM)
  int64_t K;
  template <int64_t QT, int T>
  __device__ __forceinline__ void add(const uint8_t* wr, int64_t u, float* acc, float* ss) const {
    if constexpr (!NORM) {
      FloatX{x, K}.template add<QT, T>(wr, u, acc);
    } else {
      using U = Unit<QT>;
      float q[U::W];
      const float d = U::load(wr, u, q);
#pragma unroll
      for (int c = 0; c < U::W; c += 8) {
        const float4* pn = reinterpret_cast<const float4*>(nw + U::col(u, c));
        const float4 na = __ldg(pn), nb = __ldg(pn + 1);
#pragma unroll
        for (int t = 0; t < T; ++t) {
          const float4* p = reinterpret_cast<const float4*>(x + t * K + U::col(u, c));
          const float4 a = __ldg(p), b = __ldg(p + 1);
          acc[t] += d * (q[c] * (a.x * na.x) + q[c + 1] * (a.y * na.y) + q[c + 2] * (a.z * na.z) +
                         q[c + 3] * (a.w * na.w) + q[c + 4] * (b.x * nb.x) + q[c + 5] * (b.y * nb.y) +
                         q[c + 6] * (b.z * nb.z) + q[c + 7] * (b.w * nb.w));
          ss[t] += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
        }
      }
    }
  }
};

// What the fused row-dot does around its GEMV: with nw, the RMS norm of x before it (NormX); with
// act >= 0, the rows are gate rows then up rows and it writes act(gate . x) * (up . x).
struct Fusion {
  float eps;
  int act;         // -1: rows are outputs
  bool act_on_up;  // act(gate) * act(up) (dReLU)
};

// A decode GEMV over every row with what surrounds it in a layer folded in (HS_CUDA_FUSE=0: not used,
// see runtime/kernels.py): the RMS norm before the q/k/v and gate/up GEMVs (NormX), and with act >= 0
// the gated activation after gate/up: a block's warps read gate row k and up row k side by side and
// write act(gate . x) * (up . x). Two kernels a layer fewer (three with the activation's). Blocks as
// rowdot_kernel's: S warps a row, their sums (and sums of squares) meeting in shared memory.
template <int64_t QT, int T, int S, bool NORM>
__global__ void __launch_bounds__(32 * DOT_WARPS)
rowdot_fused_kernel(const uint8_t* __restrict__ w, int64_t row_bytes, NormX<NORM> x, int64_t n_out,
                    float* __restrict__ y, Fusion f, bool early) {
  __shared__ float part[DOT_WARPS][T], part_ss[DOT_WARPS][T];
  constexpr int ROWS = DOT_WARPS / S;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, slice = warp % S, r = warp / S;
  const bool gated = f.act >= 0;
  const int64_t K = x.K;
  // gated: the block's outputs are ROWS / 2 neurons, warps r = 2j (gate) and 2j + 1 (up) for neuron j
  const int outs = gated ? ROWS / 2 : ROWS;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * outs + (gated ? r / 2 : r);
  const int64_t row = gated && (r & 1) ? n_out + k : k;
  if (early && k < n_out) prefetch_row_start(w + row * row_bytes, row_bytes, S, slice, lane);
  pdl_wait();
  pdl_launch_dependents();
  using U = Unit<QT>;
  float acc[T], ss[T];
#pragma unroll
  for (int t = 0; t < T; ++t) acc[t] = ss[t] = 0.f;
  if (k < n_out) {
    const uint8_t* wr = w + row * row_bytes;
    const int64_t units = K / U::W;
    const int64_t per_slice = (units + S - 1) / S;
    const int64_t u_end = min(units, (slice + 1) * per_slice);
#pragma unroll 4
    for (int64_t u = slice * per_slice + lane; u < u_end; u += 32) x.template add<QT, T>(wr, u, acc, ss);
  }
#pragma unroll
  for (int t = 0; t < T; ++t) {
    acc[t] = warp_sum(acc[t]);
    if constexpr (NORM) ss[t] = warp_sum(ss[t]);
  }
  if (lane == 0)
#pragma unroll
    for (int t = 0; t < T; ++t) part[warp][t] = acc[t], part_ss[warp][t] = ss[t];
  __syncthreads();
  const int tid = threadIdx.x;
  if (tid >= outs * T) return;
  const int j = tid / T, t = tid % T;
  const int64_t kk = static_cast<int64_t>(blockIdx.x) * outs + j;
  if (kk >= n_out) return;
  // the rows of output j: warps (j * S ..) or, gated, gate (2j * S ..) and up ((2j + 1) * S ..)
  const int w0 = (gated ? 2 * j : j) * S;
  float v = 0.f, sq = 0.f;
#pragma unroll
  for (int s = 0; s < S; ++s) v += part[w0 + s][t], sq += part_ss[w0 + s][t];
  const float rstd = NORM ? rsqrtf(sq / static_cast<float>(K) + f.eps) : 1.f;
  if (!gated) {
    y[t * n_out + kk] = v * rstd;
    return;
  }
  float u = 0.f;
#pragma unroll
  for (int s = 0; s < S; ++s) u += part[w0 + S + s][t];
  const float g = v * rstd;
  u *= rstd;
  y[t * n_out + kk] = act_f(g, f.act) * (f.act_on_up ? act_f(u, f.act) : u);
}

// Q4_0 rows a whole block per lane: a warp copies 32 consecutive blocks of its row (576 bytes, which
// start 16-byte aligned when the row does) into shared memory with 16-byte loads, where the half-block
// lanes of rowdot_kernel make four 2-byte loads per 8 bytes (18-byte blocks are only 2-byte aligned),
// then each lane takes its block's quants from there as four 32-bit words (shifted by 2 bytes for the
// even lanes) and makes 16 __dp4a a token against four 16-byte loads of QuantX's planes. Rows need
// 16-byte alignment (start and length: K a multiple of 256); launch_rowdot uses rowdot_kernel
// otherwise, or with HS_CUDA_STAGED=0. On an H100 (hs-bench kernels, 70B / Falcon-40B rows, side by
// side in one call) Q4_0 went from 44-46% to 76-77% of HBM bandwidth with every row and from 29-35% to
// 46-47% at 10%. The same staging for Q8_0 rows against float x lost (73-74% -> 33% with every row: 32
// weights as floats and eight x loads a lane), so Q8_0 keeps rowdot_kernel by default; with
// HS_CUDA_STAGED_Q8=1 Q8_0 rows take this kernel against QuantX too (34-byte blocks, eight words of
// quants a lane, 16 __dp4a a token: the Q4_0 form's arithmetic on twice its bytes), opt-in until a
// GPU has measured it. Since session 17 a warp loads STAGED_CHUNKS chunks at once.
template <int64_t QT, int T, int S>
__global__ void __launch_bounds__(32 * DOT_WARPS)
rowdot_staged_kernel(const uint8_t* __restrict__ w, int64_t row_bytes, QuantX x, int64_t K,
                     const int32_t* __restrict__ idx, const bool* __restrict__ mask, int64_t n_out,
                     float* __restrict__ y, const float* __restrict__ res, bool early) {
  constexpr int BYTES = QT == Q4_0 ? sizeof(BlockQ4_0) : sizeof(BlockQ8_0);
  constexpr int ROWS = DOT_WARPS / S, CHUNK = 32 * BYTES, VECS = CHUNK / 16;
  constexpr int NV = (VECS + 31) / 32;  // 16-byte loads a lane makes per chunk
  // 16 bytes beyond each chunk: the last lane's last word, which a lane whose quants start 4-byte
  // aligned reads and does not use
  __shared__ __align__(16) uint8_t stage[DOT_WARPS][STAGED_CHUNKS][CHUNK + 16];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, slice = warp % S;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * ROWS + warp / S;
  if (early && idx == nullptr && mask == nullptr && k < n_out) prefetch_row_start(w + k * row_bytes, row_bytes, S, slice, lane);
  pdl_wait();
  pdl_launch_dependents();
  float acc[T];
#pragma unroll
  for (int t = 0; t < T; ++t) acc[t] = 0.f;
  const int64_t row = k < n_out ? (idx ? idx[k] : k) : 0;
  if (k < n_out && (mask == nullptr || mask[row])) {
    const uint8_t* wr = w + row * row_bytes;
    const int64_t nb = K / QK, chunks = (nb + 31) / 32;
    const int64_t per_slice = (chunks + S - 1) / S;
    const int64_t c_end = min(chunks, (slice + 1) * per_slice);
    const int off = lane * BYTES;  // this lane's block in a chunk; its quants 2 bytes on
    const int shift = ((off + 2) & 3) * 8;
    for (int64_t c0 = slice * per_slice; c0 < c_end; c0 += STAGED_CHUNKS) {
      // STAGED_CHUNKS chunks' loads in flight at once (one at a time left a warp a memory round trip
      // per 576 bytes: the few rows of a 10% active set could not fill HBM)
      uint4 v[STAGED_CHUNKS][NV];
      int nblk[STAGED_CHUNKS];
#pragma unroll
      for (int u = 0; u < STAGED_CHUNKS; ++u) {
        const int64_t b0 = (c0 + u) * 32;
        nblk[u] = c0 + u < c_end ? static_cast<int>(min(static_cast<int64_t>(32), nb - b0)) : 0;
        // the last 16 bytes may pass the row's end (within the same aligned 16 bytes)
        const int nvec = (nblk[u] * BYTES + 15) / 16;
        const uint4* src = reinterpret_cast<const uint4*>(wr + b0 * BYTES);
#pragma unroll
        for (int j = 0; j < NV; ++j)
          v[u][j] = lane + 32 * j < nvec ? __ldg(src + lane + 32 * j) : make_uint4(0, 0, 0, 0);
      }
      __syncwarp();  // the last chunks' reads are done
#pragma unroll
      for (int u = 0; u < STAGED_CHUNKS; ++u)
#pragma unroll
        for (int j = 0; j < NV; ++j)
          if (lane + 32 * j < VECS) reinterpret_cast<uint4*>(stage[warp][u])[lane + 32 * j] = v[u][j];
      __syncwarp();
#pragma unroll
      for (int u = 0; u < STAGED_CHUNKS; ++u) {
        if (lane >= nblk[u]) continue;
        const uint8_t* st = stage[warp][u];
        const uint32_t* words = reinterpret_cast<const uint32_t*>(st + ((off + 2) & ~3));
        const float dw = __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(st + off)));
        const int64_t b = (c0 + u) * 32 + lane;
        int wq[8];  // the block's 32 weights as int8, four a word
        if constexpr (QT == Q4_0) {  // low nibbles: elements 0-15, high: 16-31
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint32_t q = __funnelshift_r(words[i], words[i + 1], shift);
            wq[i] = static_cast<int>(q & 0x0F0F0F0Fu);
            wq[4 + i] = static_cast<int>((q >> 4) & 0x0F0F0F0Fu);
          }
        } else {  // Q8_0: 32 signed bytes
#pragma unroll
          for (int i = 0; i < 8; ++i) wq[i] = static_cast<int>(__funnelshift_r(words[i], words[i + 1], shift));
        }
#pragma unroll
        for (int t = 0; t < T; ++t) {
          const float2 xd = x.dd[t * nb + b];
          // Q4_0's nibbles carry an offset of 8: the block's whole term, x's block sum times 8
          acc[t] += dw * (xd.x * static_cast<float>(x.block_dot(wq, t, b)) - (QT == Q4_0 ? 8.f * xd.y : 0.f));
        }
      }
    }
  }
  rowdot_store<T, S>(acc, k, n_out, y, res);
}

__device__ __forceinline__ float round_half_away(float v) {  // csrc/cpu_dot.h's, step for step
  const float t = truncf(v), f = __fsub_rn(v, t);
  return t + (f >= 0.5f ? 1.f : 0.f) - (f <= -0.5f ? 1.f : 0.f);
}

// x [n_blocks * 32] to QuantX's planes, one warp per 32-element block, with the CPU's float steps
// (csrc/cpu_dot.h quantize_two_planes; no fused multiply-adds); one: the second plane zero, as the
// CPU's quantize_act_q8 with HS_ACT_PLANES=1
__global__ void quantize_x_kernel(const float* __restrict__ x, int64_t n_blocks, int8_t* __restrict__ q0,
                                  int8_t* __restrict__ q1, float2* __restrict__ dd, bool one) {
  pdl_wait();
  pdl_launch_dependents();
  const int lane = threadIdx.x % 32;
  const int64_t b = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (b >= n_blocks) return;
  const float v = x[b * QK + lane];
  float amax = fabsf(v);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, off));
  const float d0 = __fdiv_rn(amax, 127.f), id0 = d0 != 0.f ? __fdiv_rn(1.f, d0) : 0.f;
  const float id1 = __fmul_rn(id0, 128.f);
  const float a = round_half_away(__fmul_rn(v, id0));
  const float c = one ? 0.f : round_half_away(__fmul_rn(__fsub_rn(v, __fmul_rn(d0, a)), id1));
  q0[b * QK + lane] = static_cast<int8_t>(a);
  q1[b * QK + lane] = static_cast<int8_t>(c);
  int sum = static_cast<int>(a) * 128 + static_cast<int>(c);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
  if (lane == 0) {
    const float d = __fdiv_rn(d0, 128.f);
    dd[b] = make_float2(d, __fmul_rn(d, static_cast<float>(sum)));
  }
}

template <int64_t QT> __host__ __device__ constexpr int axpy_max_tokens() { return Unit<QT>::W == 8 ? 4 : 2; }

template <int64_t QT, int T>
__global__ void __launch_bounds__(32 * AXPY_WARPS)
axpy_kernel(const uint8_t* __restrict__ w, int64_t row_bytes, const float* __restrict__ h, int64_t ldh,
            const int32_t* __restrict__ idx, int64_t n_rows, int64_t D, float* __restrict__ y) {
  using U = Unit<QT>;
  constexpr int COLS = 32 * U::W;  // the block's column tile: one unit per lane
  __shared__ float part[AXPY_WARPS][T][COLS];
  pdl_wait();  // h (which rows to read) comes from the kernels before
  pdl_launch_dependents();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t u = static_cast<int64_t>(blockIdx.x) * 32 + lane;  // this lane's unit
  const bool in_range = u * U::W < D;
  float acc[T][U::W];
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int i = 0; i < U::W; ++i) acc[t][i] = 0.f;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * AXPY_ROWS;
  const int64_t k1 = min(k0 + AXPY_ROWS, n_rows);
  for (int64_t k = k0 + warp; k < k1; k += AXPY_WARPS) {
    float hk[T];
    bool any = false;
#pragma unroll
    for (int t = 0; t < T; ++t) {
      hk[t] = h[t * ldh + k];
      any |= hk[t] != 0.f;
    }
    if (!any || !in_range) continue;  // an inactive neuron: its row is not read
    const int64_t row = idx ? idx[k] : k;
    float q[U::W];
    const float d = U::load(w + row * row_bytes, u, q);
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float hd = hk[t] * d;
#pragma unroll
      for (int i = 0; i < U::W; ++i) acc[t][i] += hd * q[i];
    }
  }
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * COLS;
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int i = 0; i < U::W; ++i) part[warp][t][U::col(lane, i)] = acc[t][i];  // lane's columns in the tile
  __syncthreads();
  for (int c = threadIdx.x; c < T * COLS; c += blockDim.x) {
    const int t = c / COLS, col = c % COLS;
    if (col0 + col >= D) continue;
    float s = 0.f;
#pragma unroll
    for (int wp = 0; wp < AXPY_WARPS; ++wp) s += part[wp][t][col];
    if (s != 0.f) atomicAdd(y + t * D + col0 + col, s);
  }
}

// Warps per row (S) of a row-dot over n_rows rows: 1, or 2 / 4 where fewer would leave the GPU short
// of warps in flight: 132 * 32 (an H100/H200's SMs at half occupancy) by default; HS_CUDA_WANT_WARPS
// sets that target for side-by-side runs (132 * 64: full occupancy, so a 4096-row GEMV such as a 7B
// layer's attention output or down projection gets two warps a row).
int row_split(int64_t n_rows) {
  const int64_t set = env_int("HS_CUDA_WANT_WARPS", 0);
  const int64_t want = set > 0 ? set : 132 * 32;
  return n_rows * 2 >= want ? 1 : (n_rows * 4 >= want ? 2 : 4);
}

// rowdot_kernel, or with STAGED rowdot_staged_kernel (Q4_0 or Q8_0 rows, X = QuantX)
template <int64_t QT, int T, bool STAGED, typename X>
void rowdot_launch_t(const uint8_t* w, int64_t row_bytes, X x, int64_t K, const int32_t* idx,
                     const bool* mask, int64_t n_out, float* y, const float* res, cudaStream_t stream) {
  const int S = row_split(n_out);
  const int64_t rows_per_block = DOT_WARPS / S;
  const dim3 grid((n_out + rows_per_block - 1) / rows_per_block), block(32 * DOT_WARPS);
  const bool early = pdl_enabled();  // launched early: prefetch before waiting
  if constexpr (STAGED) {
    if (S == 1) launch(rowdot_staged_kernel<QT, T, 1>, grid, block, 0, stream, w, row_bytes, x, K, idx, mask, n_out, y, res, early);
    else if (S == 2) launch(rowdot_staged_kernel<QT, T, 2>, grid, block, 0, stream, w, row_bytes, x, K, idx, mask, n_out, y, res, early);
    else launch(rowdot_staged_kernel<QT, T, 4>, grid, block, 0, stream, w, row_bytes, x, K, idx, mask, n_out, y, res, early);
  } else {
    if (S == 1) launch(rowdot_kernel<QT, T, 1, X>, grid, block, 0, stream, w, row_bytes, x, K, idx, mask, n_out, y, res, early);
    else if (S == 2) launch(rowdot_kernel<QT, T, 2, X>, grid, block, 0, stream, w, row_bytes, x, K, idx, mask, n_out, y, res, early);
    else launch(rowdot_kernel<QT, T, 4, X>, grid, block, 0, stream, w, row_bytes, x, K, idx, mask, n_out, y, res, early);
  }
}

template <int64_t QT, bool STAGED = false, typename X>
void rowdot_launch(const uint8_t* w, int64_t row_bytes, X x, int64_t K, const int32_t* idx,
                   const bool* mask, int64_t n_out, float* y, const float* res, int T, cudaStream_t stream) {
  switch (T) {
    case 1: rowdot_launch_t<QT, 1, STAGED>(w, row_bytes, x, K, idx, mask, n_out, y, res, stream); break;
    case 2: rowdot_launch_t<QT, 2, STAGED>(w, row_bytes, x, K, idx, mask, n_out, y, res, stream); break;
    case 3: rowdot_launch_t<QT, 3, STAGED>(w, row_bytes, x, K, idx, mask, n_out, y, res, stream); break;
    case 4: rowdot_launch_t<QT, 4, STAGED>(w, row_bytes, x, K, idx, mask, n_out, y, res, stream); break;
    case 5: rowdot_launch_t<QT, 5, STAGED>(w, row_bytes, x, K, idx, mask, n_out, y, res, stream); break;
    case 6: rowdot_launch_t<QT, 6, STAGED>(w, row_bytes, x, K, idx, mask, n_out, y, res, stream); break;
    case 7: rowdot_launch_t<QT, 7, STAGED>(w, row_bytes, x, K, idx, mask, n_out, y, res, stream); break;
    default: rowdot_launch_t<QT, 8, STAGED>(w, row_bytes, x, K, idx, mask, n_out, y, res, stream); break;
  }
}

template <int64_t QT, int T, bool NORM>
void rowdot_fused_launch_t(const uint8_t* w, int64_t row_bytes, NormX<NORM> x, int64_t n_out, float* y,
                           const Fusion& f, cudaStream_t stream) {
  const int S = row_split(f.act >= 0 ? 2 * n_out : n_out);
  const int64_t outs_per_block = (DOT_WARPS / S) / (f.act >= 0 ? 2 : 1);
  const dim3 grid((n_out + outs_per_block - 1) / outs_per_block), block(32 * DOT_WARPS);
  const bool early = pdl_enabled();  // launched early: prefetch before waiting
  if (S == 1) launch(rowdot_fused_kernel<QT, T, 1, NORM>, grid, block, 0, stream, w, row_bytes, x, n_out, y, f, early);
  else if (S == 2) launch(rowdot_fused_kernel<QT, T, 2, NORM>, grid, block, 0, stream, w, row_bytes, x, n_out, y, f, early);
  else launch(rowdot_fused_kernel<QT, T, 4, NORM>, grid, block, 0, stream, w, row_bytes, x, n_out, y, f, early);
}

template <int64_t QT, bool NORM>
void rowdot_fused_launch(const uint8_t* w, int64_t row_bytes, NormX<NORM> x, int64_t n_out, float* y, int T,
                         const Fusion& f, cudaStream_t stream) {
  switch (T) {
    case 1: return rowdot_fused_launch_t<QT, 1, NORM>(w, row_bytes, x, n_out, y, f, stream);
    case 2: return rowdot_fused_launch_t<QT, 2, NORM>(w, row_bytes, x, n_out, y, f, stream);
    case 3: return rowdot_fused_launch_t<QT, 3, NORM>(w, row_bytes, x, n_out, y, f, stream);
    default: return rowdot_fused_launch_t<QT, 4, NORM>(w, row_bytes, x, n_out, y, f, stream);
  }
}

template <bool NORM>
void rowdot_fused_types(int64_t qtype, const uint8_t* w, int64_t row_bytes, NormX<NORM> x, int64_t n_out, float* y,
                        int T, const Fusion& f, cudaStream_t stream) {
  switch (qtype) {
    case F16: return rowdot_fused_launch<F16, NORM>(w, row_bytes, x, n_out, y, T, f, stream);
    case BF16: return rowdot_fused_launch<BF16, NORM>(w, row_bytes, x, n_out, y, T, f, stream);
    default: return rowdot_fused_launch<Q8_0, NORM>(w, row_bytes, x, n_out, y, T, f, stream);
  }
}

// rows the staged kernel can read: 16-byte aligned start and length
bool staged_ok(const void* w, int64_t row_bytes) {
  return reinterpret_cast<uintptr_t>(w) % 16 == 0 && row_bytes % 16 == 0;
}

// y[T, D] must hold zeros (or what the sum is added to); tokens go in chunks of axpy_max_tokens.
template <int64_t QT>
void axpy_launch(const uint8_t* w, int64_t row_bytes, const float* h, int64_t n_rows, const int32_t* idx,
                 int64_t D, float* y, int T, cudaStream_t stream) {
  constexpr int TM = axpy_max_tokens<QT>();
  const dim3 grid((D + 32 * Unit<QT>::W - 1) / (32 * Unit<QT>::W), (n_rows + AXPY_ROWS - 1) / AXPY_ROWS);
  for (int t0 = 0; t0 < T; t0 += TM) {
    const int tt = T - t0 < TM ? T - t0 : TM;
    const float* hh = h + t0 * n_rows;
    float* yy = y + t0 * D;
    if (tt == 1) launch(axpy_kernel<QT, 1>, grid, dim3(32 * AXPY_WARPS), 0, stream, w, row_bytes, hh, n_rows, idx, n_rows, D, yy);
    else if (tt == 2) launch(axpy_kernel<QT, 2>, grid, dim3(32 * AXPY_WARPS), 0, stream, w, row_bytes, hh, n_rows, idx, n_rows, D, yy);
    else if constexpr (TM == 4) {
      if (tt == 3) launch(axpy_kernel<QT, 3>, grid, dim3(32 * AXPY_WARPS), 0, stream, w, row_bytes, hh, n_rows, idx, n_rows, D, yy);
      else launch(axpy_kernel<QT, 4>, grid, dim3(32 * AXPY_WARPS), 0, stream, w, row_bytes, hh, n_rows, idx, n_rows, D, yy);
    }
  }
}

}  // namespace

// Launchers only: argument checks live in cuda_ops.cpp (host C++), because a c10::Error thrown from
// nvcc-compiled code crashed the process on the GPU machine instead of raising.
// xq: scratch of rowdot_scratch_bytes (x quantized there first, for Q4_0 rows and with
// HS_CUDA_STAGED_Q8=1 aligned Q8_0 rows); without it they read float32 x. res: null, or [T, n_out]
// added to y as it is written.
void launch_rowdot(int64_t qtype, const uint8_t* w, int64_t row_bytes, const float* x, int64_t K,
                   const int32_t* idx, const bool* mask, int64_t n_out, float* y, const float* res, int T,
                   uint8_t* xq, cudaStream_t stream) {
  const FloatX fx{x, K};
  switch (xq ? -1 : qtype) {
    case F16: return rowdot_launch<F16>(w, row_bytes, fx, K, idx, mask, n_out, y, res, T, stream);
    case BF16: return rowdot_launch<BF16>(w, row_bytes, fx, K, idx, mask, n_out, y, res, T, stream);
    case Q8_0: return rowdot_launch<Q8_0>(w, row_bytes, fx, K, idx, mask, n_out, y, res, T, stream);
    case Q4_0: return rowdot_launch<Q4_0>(w, row_bytes, fx, K, idx, mask, n_out, y, res, T, stream);
  }
  const int64_t n = T * K, n_blocks = n / QK;
  int8_t* q0 = reinterpret_cast<int8_t*>(xq);
  int8_t* q1 = q0 + n;
  float2* dd = reinterpret_cast<float2*>(xq + 2 * n);
  const bool one = env_is("HS_ACT_PLANES", '1');
  launch(quantize_x_kernel, dim3((n_blocks + 7) / 8), dim3(256), 0, stream, x, n_blocks, q0, q1, dd, one);
  const QuantX qx{q0, q1, dd, K, one};
  // Q8_0 rows get scratch only for the staged kernel (rowdot_scratch_bytes)
  if (qtype == Q8_0) return rowdot_launch<Q8_0, true>(w, row_bytes, qx, K, idx, mask, n_out, y, res, T, stream);
  if (staged_ok(w, row_bytes) && !env_off("HS_CUDA_STAGED"))
    return rowdot_launch<Q4_0, true>(w, row_bytes, qx, K, idx, mask, n_out, y, res, T, stream);
  rowdot_launch<Q4_0>(w, row_bytes, qx, K, idx, mask, n_out, y, res, T, stream);
}

// bytes of scratch launch_rowdot needs to quantize x: both planes and a float2 per 32-element block.
// Q4_0 rows (HS_CUDA_QUANT_X=0: none, they read float x); Q8_0 rows with HS_CUDA_STAGED_Q8=1 when their
// rows are 16-byte aligned (the staged kernel against x in two 8-bit planes; opt-in until measured:
// Q8_0 rows against float x staged that way lost)
int64_t rowdot_scratch_bytes(int64_t qtype, int64_t T, int64_t K, const void* w, int64_t row_bytes) {
  const bool quant_x = qtype == Q4_0 ? !env_off("HS_CUDA_QUANT_X")
                                     : qtype == Q8_0 && env_on("HS_CUDA_STAGED_Q8") && staged_ok(w, row_bytes);
  return quant_x ? T * K * 2 + T * (K / QK) * 8 : 0;
}

void launch_axpy(int64_t qtype, const uint8_t* w, int64_t row_bytes, const float* h, int64_t n_rows,
                 const int32_t* idx, int64_t D, float* y, int T, cudaStream_t stream) {
  switch (qtype) {
    case F16: axpy_launch<F16>(w, row_bytes, h, n_rows, idx, D, y, T, stream); break;
    case BF16: axpy_launch<BF16>(w, row_bytes, h, n_rows, idx, D, y, T, stream); break;
    case Q8_0: axpy_launch<Q8_0>(w, row_bytes, h, n_rows, idx, D, y, T, stream); break;
    default: axpy_launch<Q4_0>(w, row_bytes, h, n_rows, idx, D, y, T, stream); break;
  }
}

// The fused decode GEMV (rowdot_fused_kernel): y [T, n_out]; rows [n_out, K], or [2 n_out, K] (gate
// rows, then up rows) when act >= 0; nw: the RMS norm's weight [K] or null (no norm). F16, BF16 and
// Q8_0 rows (the types that read float x), T <= 4.
void launch_rowdot_fused(int64_t qtype, const uint8_t* w, int64_t row_bytes, const float* x, int64_t K,
                         int64_t n_out, float* y, int T, const float* nw, float eps, int act, bool act_on_up,
                         cudaStream_t stream) {
  const Fusion f{eps, act, act_on_up};
  if (nw) rowdot_fused_types<true>(qtype, w, row_bytes, NormX<true>{x, nw, K}, n_out, y, T, f, stream);
  else rowdot_fused_types<false>(qtype, w, row_bytes, NormX<false>{x, nullptr, K}, n_out, y, T, f, stream);
}

int fused_max_tokens() { return 4; }

int cuda_max_tokens() { return 8; }

// Q4_0 / Q8_0 rows -> float16, for many-token matmuls (prefill), which cuBLAS then computes: one
// 32-element block per thread, its 18 / 34 bytes read two at a time (blocks are 2-byte aligned), its
// 32 halves written as four 16-byte stores. Each value is d * q rounded once to float16, as the torch
// twin (`quants.dequantize(...).half()`) rounds it: d * q is exact in float32.
namespace {
// two values rounded to float16, a in the low half
__device__ __forceinline__ uint32_t half_pair(float a, float b) {
  return __half_as_ushort(__float2half_rn(a)) | (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(b))) << 16);
}

template <int64_t QT>
__global__ void dequant_f16_kernel(const uint8_t* w, int64_t n_blocks, __half* out) {
  pdl_wait();
  pdl_launch_dependents();
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= n_blocks) return;
  constexpr int BB = QT == Q4_0 ? sizeof(BlockQ4_0) : sizeof(BlockQ8_0);
  const unsigned short* p = reinterpret_cast<const unsigned short*>(w + b * BB);
  const float d = __half2float(__ushort_as_half(__ldg(p)));
  uint32_t v[16];  // the block's halves in pairs, element 2i in the low half of v[i]
  if constexpr (QT == Q4_0) {  // byte j: element j (low nibble) and j + 16 (high nibble), both minus 8
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t two = __ldg(p + 1 + i);  // bytes 2i and 2i + 1
      const float a = static_cast<float>(static_cast<int>(two & 15) - 8) * d;
      const float c = static_cast<float>(static_cast<int>((two >> 8) & 15) - 8) * d;
      const float e = static_cast<float>(static_cast<int>((two >> 4) & 15) - 8) * d;
      const float f = static_cast<float>(static_cast<int>((two >> 12) & 15) - 8) * d;
      v[i] = half_pair(a, c);
      v[8 + i] = half_pair(e, f);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t two = __ldg(p + 1 + i);
      const float a = static_cast<float>(static_cast<int8_t>(two & 255)) * d;
      const float c = static_cast<float>(static_cast<int8_t>(two >> 8)) * d;
      v[i] = half_pair(a, c);
    }
  }
  uint4* o = reinterpret_cast<uint4*>(out + b * QK);
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = make_uint4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
}
}  // namespace

void launch_dequant_f16(int64_t qtype, const uint8_t* w, int64_t n_blocks, void* out, cudaStream_t stream) {
  if (n_blocks == 0) return;
  const dim3 grid(static_cast<unsigned>((n_blocks + 255) / 256)), block(256);
  if (qtype == Q4_0) launch(dequant_f16_kernel<Q4_0>, grid, block, 0, stream, w, n_blocks, static_cast<__half*>(out));
  else launch(dequant_f16_kernel<Q8_0>, grid, block, 0, stream, w, n_blocks, static_cast<__half*>(out));
}

}  // namespace hs
