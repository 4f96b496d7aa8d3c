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
// Everything runs on torch's current stream with no host synchronisation (CUDA-graph capturable).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "quant_blocks.h"

namespace hs {
namespace {

constexpr int DOT_WARPS = 8;     // warps per block of the row-dot
constexpr int AXPY_WARPS = 8;
constexpr int AXPY_ROWS = 64;    // rows per block of the axpy

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

__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffff, s, off);
  return s;
}

// Row-dot blocks of 8 warps: each row is split into S column slices, one per warp (S = 1 for many
// rows; 2 or 4 when few rows would leave the GPU's 132 SMs short of warps to hide memory latency),
// the slices' sums meet in shared memory.
template <int64_t QT, int T, int S>
__global__ void __launch_bounds__(32 * DOT_WARPS)
rowdot_kernel(const uint8_t* __restrict__ w, int64_t row_bytes, const float* __restrict__ x, int64_t K,
              const int32_t* __restrict__ idx, const bool* __restrict__ mask, int64_t n_out,
              float* __restrict__ y) {
  using U = Unit<QT>;
  constexpr int ROWS = DOT_WARPS / S;
  __shared__ float part[DOT_WARPS][T];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, slice = warp % S;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * ROWS + warp / S;
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
    for (int64_t u = slice * per_slice + lane; u < u_end; u += 32) {
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
  }
#pragma unroll
  for (int t = 0; t < T; ++t) acc[t] = warp_sum(acc[t]);
  if constexpr (S == 1) {
    if (lane == 0 && k < n_out)
#pragma unroll
      for (int t = 0; t < T; ++t) y[t * n_out + k] = acc[t];
  } else {
    if (lane == 0)
#pragma unroll
      for (int t = 0; t < T; ++t) part[warp][t] = acc[t];
    __syncthreads();
    if (slice == 0 && lane < T && k < n_out) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < S; ++j) s += part[warp + j][lane];
      y[lane * n_out + k] = s;
    }
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

template <int64_t QT, int T>
void rowdot_launch_t(const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, const int32_t* idx,
                     const bool* mask, int64_t n_out, float* y, cudaStream_t stream) {
  constexpr int64_t WANT_WARPS = 132 * 32;  // enough warps in flight on an H100/H200
  const int S = n_out * 2 >= WANT_WARPS ? 1 : (n_out * 4 >= WANT_WARPS ? 2 : 4);
  const int64_t rows_per_block = DOT_WARPS / S;
  const dim3 grid((n_out + rows_per_block - 1) / rows_per_block), block(32 * DOT_WARPS);
  if (S == 1) rowdot_kernel<QT, T, 1><<<grid, block, 0, stream>>>(w, row_bytes, x, K, idx, mask, n_out, y);
  else if (S == 2) rowdot_kernel<QT, T, 2><<<grid, block, 0, stream>>>(w, row_bytes, x, K, idx, mask, n_out, y);
  else rowdot_kernel<QT, T, 4><<<grid, block, 0, stream>>>(w, row_bytes, x, K, idx, mask, n_out, y);
}

template <int64_t QT>
void rowdot_launch(const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, const int32_t* idx,
                   const bool* mask, int64_t n_out, float* y, int T, cudaStream_t stream) {
  switch (T) {
    case 1: rowdot_launch_t<QT, 1>(w, row_bytes, x, K, idx, mask, n_out, y, stream); break;
    case 2: rowdot_launch_t<QT, 2>(w, row_bytes, x, K, idx, mask, n_out, y, stream); break;
    case 3: rowdot_launch_t<QT, 3>(w, row_bytes, x, K, idx, mask, n_out, y, stream); break;
    case 4: rowdot_launch_t<QT, 4>(w, row_bytes, x, K, idx, mask, n_out, y, stream); break;
    case 5: rowdot_launch_t<QT, 5>(w, row_bytes, x, K, idx, mask, n_out, y, stream); break;
    case 6: rowdot_launch_t<QT, 6>(w, row_bytes, x, K, idx, mask, n_out, y, stream); break;
    case 7: rowdot_launch_t<QT, 7>(w, row_bytes, x, K, idx, mask, n_out, y, stream); break;
    default: rowdot_launch_t<QT, 8>(w, row_bytes, x, K, idx, mask, n_out, y, stream); break;
  }
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
    if (tt == 1) axpy_kernel<QT, 1><<<grid, 32 * AXPY_WARPS, 0, stream>>>(w, row_bytes, hh, n_rows, idx, n_rows, D, yy);
    else if (tt == 2) axpy_kernel<QT, 2><<<grid, 32 * AXPY_WARPS, 0, stream>>>(w, row_bytes, hh, n_rows, idx, n_rows, D, yy);
    else if constexpr (TM == 4) {
      if (tt == 3) axpy_kernel<QT, 3><<<grid, 32 * AXPY_WARPS, 0, stream>>>(w, row_bytes, hh, n_rows, idx, n_rows, D, yy);
      else axpy_kernel<QT, 4><<<grid, 32 * AXPY_WARPS, 0, stream>>>(w, row_bytes, hh, n_rows, idx, n_rows, D, yy);
    }
  }
}

}  // namespace

// Launchers only: argument checks live in cuda_ops.cpp (host C++), because a c10::Error thrown from
// nvcc-compiled code crashed the process on the GPU machine instead of raising.
void launch_rowdot(int64_t qtype, const uint8_t* w, int64_t row_bytes, const float* x, int64_t K,
                   const int32_t* idx, const bool* mask, int64_t n_out, float* y, int T, cudaStream_t stream) {
  switch (qtype) {
    case F16: rowdot_launch<F16>(w, row_bytes, x, K, idx, mask, n_out, y, T, stream); break;
    case BF16: rowdot_launch<BF16>(w, row_bytes, x, K, idx, mask, n_out, y, T, stream); break;
    case Q8_0: rowdot_launch<Q8_0>(w, row_bytes, x, K, idx, mask, n_out, y, T, stream); break;
    default: rowdot_launch<Q4_0>(w, row_bytes, x, K, idx, mask, n_out, y, T, stream); break;
  }
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

int cuda_max_tokens() { return 8; }

}  // namespace hs
