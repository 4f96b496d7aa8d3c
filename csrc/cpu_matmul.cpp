// Dense matmul on weights in their stored GGML format, on the CPU:
//   qmatmul   : y[T, N] = x[T, K] . W[N, K]^T   (one dot product per weight row and token)
//   qmatmul_t : y[T, K] = h[T, N] . W[N, K]     (rows are neurons: ffn_down_t; per-thread partial
//               outputs summed afterwards, so no two threads ever write the same float)
// Activations are quantized to 8 bits per block for the block formats, as llama.cpp does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "check.h"
#include "cpu_dot.h"
#include "pool.h"

namespace hs {
namespace {

void check_weight(const at::Tensor& w, int64_t qtype, int64_t K, const char* op, bool row_pitch = false) {
  HS_CHECK(w.device().is_cpu(), op, ": weight must be on the CPU");
  if (row_pitch) {  // rows may lie further apart than their length (views of a neuron-bundled tensor)
    HS_CHECK(w.dim() == 2 && w.stride(1) == 1 && w.stride(0) >= w.size(1), op,
             ": weight must be a 2-D tensor of contiguous rows");
  } else {
    HS_CHECK(w.dim() == 2 && w.is_contiguous(), op, ": weight must be a contiguous 2-D tensor");
  }
  const int be = block_elems(qtype), bb = block_bytes(qtype);
  HS_CHECK(bb > 0 && qtype != F32, op, ": unsupported weight type id ", qtype);
  if (qtype == F16 || qtype == BF16) {
    HS_CHECK(w.scalar_type() == (qtype == F16 ? at::kHalf : at::kBFloat16) || w.scalar_type() == at::kByte,
             op, ": weight dtype ", w.scalar_type(), " does not match type id ", qtype);
  } else {
    HS_CHECK(w.scalar_type() == at::kByte, op, ": block-format weights must be uint8, got ", w.scalar_type());
  }
  HS_CHECK(K % be == 0, op, ": row length ", K, " is not a multiple of the block size ", be);
  HS_CHECK(w.size(1) * w.element_size() == K / be * bb, op, ": weight row has ", w.size(1) * w.element_size(),
           " bytes, expected ", K / be * bb, " for ", K, " elements");
}

using DotQ8 = float (*)(const void*, const ActQ8*, int64_t);
using DotQ8K = float (*)(const void*, const ActQ8K*, int64_t);
using DotF = float (*)(const void*, const float*, int64_t);

#ifdef HS_X86
// one row against one-plane activations (HS_ACT_PLANES=1, see act_planes): one dot per block
template <int64_t QT>
HS_AVX512 float dot_q45_0_vnni_1(const void* row, const ActQ8* a, int64_t nb) {
  float o;
  isa_vnni::dot_q45_0_rows<QT, 1, true>(&row, a, nb, &o);
  return o;
}
template <int64_t QT>
HS_AVX2 float dot_q45_0_avx2_1(const void* row, const ActQ8* a, int64_t nb) {
  float o;
  isa_avx2::dot_q45_0_rows<QT, 1, true>(&row, a, nb, &o);
  return o;
}
HS_AVX512 float dot_q8_0_avx512_1(const void* row, const ActQ8* a, int64_t nb) {
  float o;
  dot_q8_0_rows_avx512<1, true>(&row, a, nb, &o);
  return o;
}
HS_AVX2 float dot_q8_0_avx2_1(const void* row, const ActQ8* a, int64_t nb) {
  float o;
  dot_q8_0_rows_avx2<1, true>(&row, a, nb, &o);
  return o;
}
#endif

// (activations quantized in the same call: act_planes() is read per call by both)
DotQ8 pick_q8(int64_t qtype) {
  const bool v = cpu_has_avx2();
#ifdef HS_X86
  if (act_planes() == 1 && v) {
    const bool w = cpu_has_avx512();
    switch (qtype) {
      case Q4_0: return w ? dot_q45_0_vnni_1<Q4_0> : dot_q45_0_avx2_1<Q4_0>;
      case Q5_0: return w ? dot_q45_0_vnni_1<Q5_0> : dot_q45_0_avx2_1<Q5_0>;
      case Q8_0: return w ? dot_q8_0_avx512_1 : dot_q8_0_avx2_1;
    }
  }
  if (cpu_has_avx512()) {
    switch (qtype) {
      case Q4_0: return dot_q4_0_avx512;
      case Q5_0: return dot_q5_0_avx512;
      case Q8_0: return dot_q8_0_avx512;
    }
  }
  if (v) {
    switch (qtype) {
      case Q4_0: return dot_q4_0_avx2;
      case Q5_0: return dot_q5_0_avx2;
      case Q8_0: return dot_q8_0_avx2;
    }
  }
#endif
  (void)v;
  switch (qtype) {
    case Q4_0: return dot_q4_0_ref;
    case Q5_0: return dot_q5_0_ref;
    case Q8_0: return dot_q8_0_ref;
  }
  return nullptr;
}

DotQ8K pick_q8k(int64_t qtype) {
#ifdef HS_X86
  if (cpu_has_avx512()) {
    switch (qtype) {
      case Q4_K: return isa_vnni::dot_q45_k<false>;
      case Q5_K: return isa_vnni::dot_q45_k<true>;
      case Q6_K: return isa_vnni::dot_q6_k;
    }
  }
  if (cpu_has_avx2()) {
    switch (qtype) {
      case Q4_K: return isa_avx2::dot_q45_k<false>;
      case Q5_K: return isa_avx2::dot_q45_k<true>;
      case Q6_K: return isa_avx2::dot_q6_k;
    }
  }
#endif
  switch (qtype) {
    case Q4_K: return dot_q45_k_ref<false>;
    case Q5_K: return dot_q45_k_ref<true>;
    case Q6_K: return dot_q6_k_ref;
  }
  return nullptr;
}

DotF pick_float(int64_t qtype) {
#ifdef HS_X86
  if (cpu_has_avx512() && qtype == F16) return dot_f16_avx512;
  if (cpu_has_avx2()) return qtype == F16 ? dot_f16_avx2 : dot_bf16_avx2;
#endif
  return qtype == F16 ? dot_float_ref<c10::Half> : dot_float_ref<c10::BFloat16>;
}

using AxpyRow = void (*)(float, const void*, float*, int64_t);
using AxpyGroup = void (*)(const float*, const void* const*, float*, int64_t);

// The axpy of one row (direct, no row buffer) and of AXPY_GROUP rows for a type; null where the
// compiled code has none (the row then goes through dequant_row, or the caller declines). group_next:
// the group's kernel that also asks for the next group's rows (rows[AXPY_GROUP..2 AXPY_GROUP-1]; the same
// sums as group's), where the type has one.
void pick_axpy(int64_t qtype, AxpyRow& direct, AxpyGroup& group, AxpyGroup* group_next = nullptr) {
  direct = nullptr;
  group = nullptr;
  AxpyGroup next = nullptr;
#ifdef HS_X86
  if (cpu_has_avx2()) {
    const bool w = cpu_has_avx512();
    switch (qtype) {
      case F16:
        direct = axpy_f16_avx2;
        group = w ? axpy_group_f16_avx512 : axpy_group_f16_avx2;
        next = w ? axpy_group_f16_avx512_next : axpy_group_f16_avx2_next;
        break;
      case BF16: direct = axpy_bf16_avx2; break;
      case Q8_0:
        direct = axpy_q8_0_avx2;
        group = w ? axpy_group_q8_0_avx512 : axpy_group_q8_0_avx2;
        next = w ? axpy_group_q8_0_avx512_next : axpy_group_q8_0_avx2_next;
        break;
      case Q4_0:
        direct = w ? axpy_q4_0_avx512 : axpy_q4_0_avx2;
        group = w ? axpy_group_q4_0_avx512 : axpy_group_q4_0_avx2;
        next = w ? axpy_group_q4_0_avx512_next : axpy_group_q4_0_avx2_next;
        break;
      case Q5_0: direct = axpy_q5_0_avx2; group = axpy_group_q5_0_avx2; break;
    }
  }
#else
  (void)qtype;
#endif
  if (group_next) *group_next = next;
}

// How far ahead of the row being computed its thread prefetches (4 rows of a small model, at most
// 4 KiB): keeps loads in flight while the core does the (two-plane) integer arithmetic, without
// pulling in so much that large rows (10-16 KiB) evict themselves from L1 before use.
constexpr int64_t PREFETCH_ROWS = 4;
constexpr int64_t PREFETCH_MAX_BYTES = 4096;

// HS_PREFETCH: 0 the hardware prefetcher only (default), 1 non-temporal software prefetch of the next
// row, 2 the same into all cache levels. Measured (13B rows, F16, 16 threads, the GPU machine's Xeon):
// 172 / 26 / 142 GiB/s; on the 2-core EPYC dev machine 0 and 1 tie. Kept switchable for other CPUs.
int prefetch_mode() {
  static const int mode = static_cast<int>(env_int("HS_PREFETCH", 0));
  return mode;
}

// Software-prefetch n bytes in the given HS_PREFETCH mode (1: non-temporal, 2: into all cache levels).
// 3: into L2 only (prefetcht1), which leaves the L1 fill buffers to the loads.
inline void prefetch_bytes(const char* p, int64_t n, int mode) {
  if (mode == 1)
    for (int64_t off = 0; off < n; off += 64) __builtin_prefetch(p + off, 0, 0);
  else if (mode == 3)
    for (int64_t off = 0; off < n; off += 64) __builtin_prefetch(p + off, 0, 2);
  else
    for (int64_t off = 0; off < n; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// A switch for how many rows a thread computes side by side: 1, 2, 4, or 8 where `up_to_8` (any other
// value: 1)
int rows_together(const char* name, long long fallback, bool up_to_8) {
  const long long n = env_int(name, fallback);
  return n == 2 || n == 4 || (up_to_8 && n == 8) ? static_cast<int>(n) : 1;
}

// Rows (float16, Q8_0, Q4_0, Q5_0; AVX-512 or AVX2) one thread streams side by side for one token when fewer
// than half a weight's rows are listed: rows in the row-dot, rows of the neurons in the fused FFN (a gated
// neuron's two, gate and up: half as many neurons) (HS_FFN_ROWS: 1, 2, 4 or 8, default 8; read per call
// like HS_FUSED_FFN). Scattered rows one at a time leave the memory idle (dev VM, 10% of 13824 rows, 2
// threads: 1.4-1.7x); consecutive rows, which the hardware prefetcher follows as one stream, lose
// (0.5-0.9x). Eight rather than four (session 27, dev VM, tests/gpu/rows_in_flight_bench.py, 10% of
// 13824x5120 rows from memory): the row-dot with one thread F16 11.5 -> 13.9 GiB/s, Q8_0 9.8 -> 12.3, Q4_0
// 6.8 -> 8.0, 1.08-1.18x with two; the ungated FFN (Falcon-40B's F16 rows, 10%) 14.0 -> 15.8 with one thread.
// Gated FFNs streamed four neurons (eight rows) already; eight of them (sixteen rows) lost.
int ffn_rows() { return rows_together("HS_FFN_ROWS", 8, true); }

// Streams per thread of a dense one-token GEMV (HS_GEMV_STREAMS: 1, 2, 4 or 8, default 8; read per call):
// a thread's rows as that many interleaved runs, one row of each computed side by side, so that each
// core has several sequential streams in flight for the hardware prefetcher instead of one. The GPU
// machine's Xeon (H200 host, session 24, tests/gpu/gemv_streams_bench.py, from memory, 16 threads):
// 13B attention F16 93.5 / 109.6 / 113.9 GiB/s with 1 / 2 / 4, 7B attention Q4_0 72.7 / 86.5 / 96.1,
// Q8_0 predictors 68.2 / 77.3 / 88.4; one thread 9.2 -> 12.7, 7.5 -> 11.2, 6.7 -> 11.6. The Zen 4 dev VM
// (2 threads): F16 20.2 -> 27.1, Q4_0 and Q8_0 within noise. Eight since session 33: the Xeon dev VM,
// 2 threads, 4 -> 8 (two runs): F16 22.9 / 21.6 -> 23.3 / 22.4, Q4_0 21.3 / 20.7 -> 22.7 / 22.0, Q8_0
// 17.5 / 17.5 -> 21.0 / 20.7; S5's model CPU-only sparse through hs-run -t 2, alternating, 6.48 / 6.57
// -> 6.82 / 6.89 tok/s; the Xeon of the GPU machine not yet measured.
int gemv_streams() { return rows_together("HS_GEMV_STREAMS", 8, true); }

// Neurons a thread of the fused FFN claims at a time (HS_FFN_CHUNK; 0: one fixed share per thread).
// Claimed shares keep every thread busy to the end of a layer when one of them starts late or is
// preempted (the driver's callback thread and Python share the cores with the pool); a fixed share
// made the whole layer wait for the slowest thread.
// Default 64 since session 29 (was 16): listed rows ask for the next group's rows only within a chunk (see
// next_groups), so a 16-neuron chunk of 4-neuron groups left every fourth group unasked-for; the guided
// size below keeps the end of a layer as balanced as before (a chunk is 64 only while 2 x threads x 64
// neurons are left). Dev VM, fused gated Q4_0 FFN from memory, alternating 16 / 64: 7B rows at 10% and 27%
// 9.8 / 10.1 -> 11.0 / 11.2 GiB/s on one thread, 11.5 / 17.1 -> 15.3 / 18.6 on two; 70B rows at 27%
// 12.5 / 18.2 -> 13.7 / 20.0 (128 and 256: within 2% of 64).
int ffn_chunk() {
  const long long n = env_int("HS_FFN_CHUNK", 64);
  return n > 0 ? static_cast<int>(n) : 0;
}

using DotRows = void (*)(const void* const*, const float*, int64_t, float*);
using DotRowsQ8 = void (*)(const void* const*, const ActQ8*, int64_t, float*);

#ifdef HS_X86
// Whether a type has such a kernel on this CPU (AVX-512 VNNI, else AVX2).
bool has_dot_rows(int64_t qtype) {
  return cpu_has_avx2() && (qtype == F16 || qtype == Q8_0 || qtype == Q4_0 || qtype == Q5_0);
}
// the kernel of R side-by-side rows, R in {1, 2, 4, 8} (others: 1), from a family templated on R
#define HS_PICK_ROWS(kernel) \
  (n_rows == 2 ? kernel<2> : n_rows == 4 ? kernel<4> : n_rows == 8 ? kernel<8> : kernel<1>)
// the dots of n_rows rows side by side: float16 rows against x, Q8_0/Q4_0/Q5_0 rows against the
// quantized x (null for other types)
// next: the kernel that also asks for the next group's rows, rows[n..2n-1]
template <int R>
HS_AVX512 void dot_f16_rows_avx512n(const void* const* r, const float* x, int64_t n, float* o) {
  dot_f16_rows_avx512<R, true>(r, x, n, o);
}
template <int R>
HS_AVX2 void dot_f16_rows_avx2n(const void* const* r, const float* x, int64_t n, float* o) {
  dot_f16_rows_avx2<R, true>(r, x, n, o);
}
DotRows pick_dot_rows(int n_rows, bool next = false) {
  if (!cpu_has_avx512()) return next ? HS_PICK_ROWS(dot_f16_rows_avx2n) : HS_PICK_ROWS(dot_f16_rows_avx2);
  return next ? HS_PICK_ROWS(dot_f16_rows_avx512n) : HS_PICK_ROWS(dot_f16_rows_avx512);
}
// Q4_0 rows four blocks at a time against the arranged activations (dot_q4_0_rows_wide; q4_wide())
using DotRowsQ4G = void (*)(const void* const*, const ActQ4G*, const ActQ8*, int64_t, float*);
template <int R>
HS_AVX512_VBMI void dot_q4_0_rows_wide2(const void* const* r, const ActQ4G* g, const ActQ8* a, int64_t nb, float* o) {
  dot_q4_0_rows_wide<R>(r, g, a, nb, o);
}
template <int R>
HS_AVX512_VBMI void dot_q4_0_rows_wide1(const void* const* r, const ActQ4G* g, const ActQ8* a, int64_t nb, float* o) {
  dot_q4_0_rows_wide<R, true>(r, g, a, nb, o);
}
// rows one at a time prefetching ahead (a dense GEMV's, see q4_prefetch and dot_q4_0_rows_wide)
template <bool ONE_PLANE>
HS_AVX512_VBMI void dot_q4_0_row_wide_ahead(const void* const* r, const ActQ4G* g, const ActQ8* a, int64_t nb, float* o) {
  dot_q4_0_rows_wide<1, ONE_PLANE, true>(r, g, a, nb, o);
}
// rows side by side asking for the next group's rows meanwhile (rows[n..2n-1]; see dot_q4_0_rows_wide's NEXT)
template <int R>
HS_AVX512_VBMI void dot_q4_0_rows_wide2n(const void* const* r, const ActQ4G* g, const ActQ8* a, int64_t nb, float* o) {
  dot_q4_0_rows_wide<R, false, false, true>(r, g, a, nb, o);
}
template <int R>
HS_AVX512_VBMI void dot_q4_0_rows_wide1n(const void* const* r, const ActQ4G* g, const ActQ8* a, int64_t nb, float* o) {
  dot_q4_0_rows_wide<R, true, false, true>(r, g, a, nb, o);
}
DotRowsQ4G pick_dot_rows_q4g(int n_rows, bool ahead = false, bool next = false) {
  const bool one = act_planes() == 1;
  if (n_rows == 1 && ahead) return one ? dot_q4_0_row_wide_ahead<true> : dot_q4_0_row_wide_ahead<false>;
  if (next) return one ? HS_PICK_ROWS(dot_q4_0_rows_wide1n) : HS_PICK_ROWS(dot_q4_0_rows_wide2n);
  return one ? HS_PICK_ROWS(dot_q4_0_rows_wide1) : HS_PICK_ROWS(dot_q4_0_rows_wide2);
}

// How many groups ahead listed rows side by side (Q4_0, Q5_0, Q8_0, F16) ask for rows while they compute: the next
// group's (HS_NEXT_ROWS=1, the default), none (0); read per call; see dot_q4_0_rows_wide's NEXT. Dev VM's Zen 4, 7B rows (4096 x 11008 Q4_0, from
// memory, 33% listed, alternating in one process, medians): the sparse row-dot 7.2 -> 12.0 GiB/s on one
// thread, 12.3 -> 16.8 on two (a GEMV over all rows: 14.7 / 24.6); the fused gated FFN, its down rows asked
// for a group ahead too, 7.2 -> 9.5 and 13.3 -> 16.7 (8.5 and 15.2 without the down rows). The GPU machine's
// Xeon (H100 host, session 29, tests/gpu/rows_in_flight_bench.py, 13B rows from
// memory, 16 threads, 33% listed): Q4_0 51.9 -> 65.6 GiB/s, Q8_0 41.9 -> 63.8, float16 68.5 -> 86.8.
// HS_NEXT_ROWS=N (1-4): the rows of the group N groups ahead instead, for memory whose latency one group's
// time does not cover (the Xeon with 16 threads busy; the group N ahead must lie within the same share or
// claimed chunk, so the fused FFN's chunks, HS_FFN_CHUNK, must then hold more than N + 1 groups to gain).
int next_groups() { return static_cast<int>(std::clamp<long long>(env_int("HS_NEXT_ROWS", 1), 0, 4)); }

// The arranged activations of one token for the wide Q4_0 dots, or empty where they are off (not one
// token, not Q4_0, no VBMI, HS_Q4_WIDE=0): the groups of four blocks of act (nb blocks)
std::vector<ActQ4G> arranged_q4g(const std::vector<ActQ8>& act, int64_t T, int64_t nb, bool any_q4_0) {
  std::vector<ActQ4G> g;
  if (T == 1 && any_q4_0 && !act.empty() && nb >= 4 && q4_wide()) {
    g.resize(nb / 4);
    arrange_q4g_avx512(act.data(), nb, g.data());
  }
  return g;
}

// The block formats' rows side by side against the quantized x: AVX-512 VNNI or AVX2, one plane or two
// (act_planes), asking for the next group's rows meanwhile (rows[n..2n-1]) or not; R last, for the picker
#define HS_PICK_ROWS_OF(kernel, ...) \
  (n_rows == 2 ? kernel<__VA_ARGS__, 2> : n_rows == 4 ? kernel<__VA_ARGS__, 4> : n_rows == 8 ? kernel<__VA_ARGS__, 8> \
                                                                                           : kernel<__VA_ARGS__, 1>)
template <int64_t QT, bool ONE, bool NEXT, int R>
HS_AVX512 void dot_q45_0_rows_vnni(const void* const* r, const ActQ8* a, int64_t nb, float* o) {
  isa_vnni::dot_q45_0_rows<QT, R, ONE, NEXT>(r, a, nb, o);
}
template <int64_t QT, bool ONE, bool NEXT, int R>
HS_AVX2 void dot_q45_0_rows_avx2(const void* const* r, const ActQ8* a, int64_t nb, float* o) {
  isa_avx2::dot_q45_0_rows<QT, R, ONE, NEXT>(r, a, nb, o);
}
template <bool ONE, bool NEXT, int R>
HS_AVX512 void dot_q8_0_rows_vnni(const void* const* r, const ActQ8* a, int64_t nb, float* o) {
  dot_q8_0_rows_avx512<R, ONE, NEXT>(r, a, nb, o);
}
template <bool ONE, bool NEXT, int R>
HS_AVX2 void dot_q8_0_rows_avx2n(const void* const* r, const ActQ8* a, int64_t nb, float* o) {
  dot_q8_0_rows_avx2<R, ONE, NEXT>(r, a, nb, o);
}
template <bool ONE, bool NEXT>
DotRowsQ8 pick_q8_rows(int64_t qtype, int n_rows) {
  const bool vnni = cpu_has_avx512();
  switch (qtype) {
    case Q4_0:
      return vnni ? HS_PICK_ROWS_OF(dot_q45_0_rows_vnni, Q4_0, ONE, NEXT) : HS_PICK_ROWS_OF(dot_q45_0_rows_avx2, Q4_0, ONE, NEXT);
    case Q5_0:
      return vnni ? HS_PICK_ROWS_OF(dot_q45_0_rows_vnni, Q5_0, ONE, NEXT) : HS_PICK_ROWS_OF(dot_q45_0_rows_avx2, Q5_0, ONE, NEXT);
    case Q8_0:
      return vnni ? HS_PICK_ROWS_OF(dot_q8_0_rows_vnni, ONE, NEXT) : HS_PICK_ROWS_OF(dot_q8_0_rows_avx2n, ONE, NEXT);
  }
  return nullptr;
}
#undef HS_PICK_ROWS_OF
// (for activations quantized in this call: act_planes() is read per call by both; the second plane of one
// plane is zero: one dot per block); next: the kernel that also asks for the next group's rows
DotRowsQ8 pick_dot_rows_q8(int64_t qtype, int n_rows, bool next = false) {
  if (act_planes() == 1) return next ? pick_q8_rows<true, true>(qtype, n_rows) : pick_q8_rows<true, false>(qtype, n_rows);
  return next ? pick_q8_rows<false, true>(qtype, n_rows) : pick_q8_rows<false, false>(qtype, n_rows);
}
#undef HS_PICK_ROWS
#endif
}  // namespace

namespace {

// Checks an optional int32 row-index list against a weight of N rows; returns its length (N if none).
int64_t check_rows(const c10::optional<at::Tensor>& idx, int64_t N, const char* op) {
  if (!idx.has_value() || !idx->defined()) return N;
  HS_CHECK(idx->dim() == 1 && idx->scalar_type() == at::kInt && idx->is_contiguous() && idx->device().is_cpu(),
           op, ": index set must be a contiguous int32 CPU vector");
  const int32_t* p = idx->data_ptr<int32_t>();
  for (int64_t k = 0; k < idx->numel(); ++k)
    HS_CHECK(p[k] >= 0 && p[k] < N, op, ": index ", p[k], " at position ", k, " is outside the ", N, " rows");
  return idx->numel();
}

}  // namespace

// Prompt tokens that share one unpacked weight block. 8 rather than 4: Gemma 3 270M's 64-token prefill
// on the dev VM (2 threads, builds alternated twice) 395-399 -> 439-443 tok/s with VNNI, 356-368 ->
// 409-411 on the AVX2 path; per format on one core Q5_0 / Q4_K / Q8_0 rows gain, Q6_K loses ~4%.
constexpr int TOKEN_TILE = 8;
// a table of the kernels for tiles of 1..8 tokens: HS_TILES(f, A,) = {f<A, 1>, ..., f<A, 8>}
#define HS_TILES(F, ...) {F<__VA_ARGS__ 1>, F<__VA_ARGS__ 2>, F<__VA_ARGS__ 3>, F<__VA_ARGS__ 4>, \
                          F<__VA_ARGS__ 5>, F<__VA_ARGS__ 6>, F<__VA_ARGS__ 7>, F<__VA_ARGS__ 8>}
static_assert(TOKEN_TILE == 8, "HS_TILES lists 8 kernels");
using DotTokens = void (*)(const void*, const ActQ8*, int64_t, int64_t, float*);
using DotTokensK = void (*)(const void*, const ActQ8K*, int64_t, int64_t, float*);
DotTokens pick_tokens(int64_t qtype, int nt);
DotTokensK pick_tokens_k(int64_t qtype, int nt);

#ifdef HS_X86
struct alignas(64) Vec512 { uint8_t b[64]; };  // storage for __m512i (std::vector allocates it aligned)
using Dot8Tokens = void (*)(const void*, const float*, const ActQ8*, int64_t, int64_t, float*);

// Whether a prompt on Q4_0 / Q5_0 / Q8_0 rows takes 16 or 8 rows at a time (dot16_q45_0_tokens: AVX-512
// VNNI; dot8_q45_0_tokens_*: 8 rows, Q8_0 only with VNNI); HS_PROMPT_ROWS16=0 (read per call) keeps one row
// at a time, to compare.
bool rows16_on(int64_t qtype) {
  if (qtype != Q4_0 && qtype != Q5_0 && qtype != Q8_0) return false;
  return (qtype == Q8_0 ? cpu_has_avx512() || cpu_has_avxvnni() : cpu_has_avx2()) && !env_off("HS_PROMPT_ROWS16");
}

// the prompt kernel for 16 (AVX-512) or 8 rows and 1..8 tokens, against two activation planes or one
Dot8Tokens pick_dot8(int64_t qtype, int rows, int nt, bool one_plane) {
#define HS_DOT8(F, QT, ONE) {F<QT, 1, ONE>, F<QT, 2, ONE>, F<QT, 3, ONE>, F<QT, 4, ONE>, F<QT, 5, ONE>, \
                             F<QT, 6, ONE>, F<QT, 7, ONE>, F<QT, 8, ONE>}
#define HS_DOT8_TYPES(F, Q8) {{HS_DOT8(F, Q4_0, false), HS_DOT8(F, Q4_0, true)}, \
                              {HS_DOT8(F, Q5_0, false), HS_DOT8(F, Q5_0, true)}, Q8}
#define HS_DOT8_Q8(F) {HS_DOT8(F, Q8_0, false), HS_DOT8(F, Q8_0, true)}
  // [16 rows, then 8 rows: AVX-512, AVX-VNNI, AVX2][Q4_0, Q5_0, Q8_0][one plane][tokens - 1]
  static const Dot8Tokens table[4][3][2][TOKEN_TILE] = {
      HS_DOT8_TYPES(dot16_q45_0_tokens, HS_DOT8_Q8(dot16_q45_0_tokens)),
      HS_DOT8_TYPES(dot8_q45_0_tokens_vnni256, HS_DOT8_Q8(dot8_q45_0_tokens_vnni256)),
      HS_DOT8_TYPES(dot8_q45_0_tokens_avxvnni, HS_DOT8_Q8(dot8_q45_0_tokens_avxvnni)),
      HS_DOT8_TYPES(dot8_q45_0_tokens_avx2, {})};  // Q8_0 needs VNNI (prompt_offset)
#undef HS_DOT8_Q8
#undef HS_DOT8_TYPES
#undef HS_DOT8
  const int type = qtype == Q4_0 ? 0 : qtype == Q5_0 ? 1 : 2;
  const int form = cpu_has_avx512() ? (rows == 16 ? 0 : 1) : cpu_has_avxvnni() ? 2 : 3;
  return table[form][type][one_plane][nt - 1];
}
#endif

// y_i[t, k] = W_i[row_i(k)] . x[t] for several weights in one parallel region, row_i(k) = idx_i[k]
// (the sparse row-dot) or k (dense). One fork/join for q/k/v or gate/up, activations quantized once
// per block format, and only the listed rows read.
std::vector<at::Tensor> qmatmul_rows_cpu(const std::vector<at::Tensor>& ws, const std::vector<int64_t>& qtypes,
                                         const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& idxs) {
  HS_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
           "qmatmul: x must be a contiguous float32 [tokens, features] tensor");
  HS_CHECK(ws.size() == qtypes.size() && ws.size() == idxs.size() && !ws.empty(),
           "qmatmul: one type id and one index set (or None) per weight");
  const int64_t T = x.size(0), K = x.size(1);
  const float* xp = x.data_ptr<float>();
  std::vector<ActQ8> act32;
  std::vector<ActQ8K> act256;
  std::vector<at::Tensor> ys;
  std::vector<int64_t> first_row{0};
  for (size_t i = 0; i < ws.size(); ++i) {
    check_weight(ws[i], qtypes[i], K, "qmatmul");
    const int64_t M = check_rows(idxs[i], ws[i].size(0), "qmatmul");
    first_row.push_back(first_row.back() + M);
    const int be = block_elems(qtypes[i]);
    // a prompt's tokens quantized in parallel: on one thread 64 tokens of 11008 values took ~1.8 ms
    // before each down projection, serial work that grows with the threads' share of the rest (one
    // token: on this thread, no parallel region)
    const auto each_token = [T](const auto& quantize) {
      if (T == 1) quantize(0);
      else at::parallel_for(0, T, 1, [&](int64_t b, int64_t e) { for (int64_t t = b; t < e; ++t) quantize(t); });
    };
    if (be == QK && act32.empty()) {
      act32.resize(T * (K / QK));
      each_token([&](int64_t t) { quantize_act_q8(xp + t * K, act32.data() + t * (K / QK), K); });
    } else if (be == QK_K && act256.empty()) {
      act256.resize(T * (K / QK_K));
      each_token([&](int64_t t) { quantize_act_q8k(xp + t * K, act256.data() + t * (K / QK_K), K); });
    }
  }
  const int64_t total = first_row.back();
  // one token: the outputs side by side in one buffer (q/k/v then make one rotary call, rope_qk)
  const at::Tensor all = T == 1 && ws.size() > 1 ? at::empty({1, total}, x.options()) : at::Tensor();
  for (size_t i = 0; i < ws.size(); ++i)
    ys.push_back(all.defined() ? all.narrow(1, first_row[i], first_row[i + 1] - first_row[i])
                               : at::empty({T, first_row[i + 1] - first_row[i]}, x.options()));
  if (T == 0 || total == 0) return ys;
#ifdef HS_X86
  const std::vector<ActQ4G> act4 = arranged_q4g(act32, T, K / QK,
                                                std::find(qtypes.begin(), qtypes.end(), Q4_0) != qtypes.end());
#endif
  const int64_t grain = std::max<int64_t>(16, total / (at::get_num_threads() * 4));
  const int pf = prefetch_mode();
#ifdef HS_X86
  const bool q4_ahead = q4_prefetch(at::get_num_threads());  // the wide Q4_0 rows one at a time
#endif
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    size_t i = 0;
    while (first_row[i + 1] <= begin) ++i;
    for (int64_t g = begin; g < end;) {
      const int64_t stop = std::min(end, first_row[i + 1]);
      const at::Tensor& w = ws[i];
      const int64_t qtype = qtypes[i], N = w.size(0), row_bytes = w.size(1) * w.element_size();
      const int64_t M = first_row[i + 1] - first_row[i];
      const int32_t* idx = idxs[i].has_value() && idxs[i]->defined() ? idxs[i]->data_ptr<int32_t>() : nullptr;
      const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
      float* yp = ys[i].data_ptr<float>();
      const int be = block_elems(qtype);
      const int64_t nb = K / be;
      const bool is_float = qtype == F16 || qtype == BF16;
      const DotF dot_f = is_float ? pick_float(qtype) : nullptr;
      const DotQ8 dot_32 = be == QK ? pick_q8(qtype) : nullptr;
      const DotQ8K dot_256 = be == QK_K ? pick_q8k(qtype) : nullptr;
      const int64_t ahead = std::min(PREFETCH_ROWS * row_bytes, PREFETCH_MAX_BYTES);
      int64_t k = g - first_row[i];
      const int64_t k_end = stop - first_row[i];
#ifdef HS_X86
      // one token, a sparse listed set of rows: `side` rows streamed side by side (see ffn_rows; rows
      // next to each other in memory go faster one at a time: the hardware prefetcher follows them)
      const int side = (T == 1 && !pf && idx && 2 * M < N && has_dot_rows(qtype)) ? ffn_rows() : 1;
      const bool wide = qtype == Q4_0 && !act4.empty();  // one token: Q4_0 rows four blocks at a time
      // the dots of n rows side by side against this token, one kernel picked per use (next: the kernel that
      // also asks for the next group's rows, rows[n..2n-1], where the type has one)
      const auto side_dots = [&](int n, bool next) {
        const DotRows dots = is_float ? pick_dot_rows(n, next) : nullptr;
        const DotRowsQ8 dots_q = is_float ? nullptr : pick_dot_rows_q8(qtype, n, next);
        const DotRowsQ4G dots_w = wide ? pick_dot_rows_q4g(n, false, next) : nullptr;
        return [=, &act4, &act32](const void* const* rws, float* out) {
          if (dots) dots(rws, xp, K, out);
          else if (dots_w) dots_w(rws, act4.data(), act32.data(), nb, out);
          else dots_q(rws, act32.data(), nb, out);
        };
      };
      const int streams = (T == 1 && !pf && !idx && has_dot_rows(qtype)) ? gemv_streams() : 1;
      if (streams > 1 && k_end - k >= 4 * streams) {  // a dense GEMV: runs of L rows, one of each side by side
        const auto dots = side_dots(streams, false);
        const int64_t L = (k_end - k) / streams;
        const void* rws[8];
        float outs[8];
        for (int64_t j = 0; j < L; ++j) {
          for (int s = 0; s < streams; ++s) rws[s] = wp + (k + s * L + j) * row_bytes;
          dots(rws, outs);
          for (int s = 0; s < streams; ++s) yp[k + s * L + j] = outs[s];
        }
        k += streams * L;  // the last (k_end - k) % streams rows: one at a time below
      }
      if (side > 1) {
        // each group but the last asks for the rows of the group next_groups() ahead while it computes
        const int64_t dist = next_groups() * side;  // 0: no ask
        const auto dots = side_dots(side, false), dots_ask = side_dots(side, dist > 0);
        const void* rws[16];
        for (; k + side <= k_end; k += side) {
          for (int j = 0; j < side; ++j) rws[j] = wp + static_cast<int64_t>(idx[k + j]) * row_bytes;
          const bool ask = dist && k + dist + side <= k_end;
          if (ask)
            for (int j = 0; j < side; ++j) rws[side + j] = wp + static_cast<int64_t>(idx[k + dist + j]) * row_bytes;
          (ask ? dots_ask : dots)(rws, yp + k);
        }
      }
      if (T > 1 && k_end - k >= 8 && rows16_on(qtype)) {
        // a prompt on Q4_0 / Q5_0 / Q8_0 rows: 16 (then 8) rows at a time, unpacked once for all the tokens
        // (dot16_q45_0_tokens / dot8_q45_0_tokens_*); the last k_end - k < 8 rows go one at a time below
        thread_local std::vector<Vec512> packed;
        thread_local std::vector<float> scales;
        packed.resize(nb * 8);
        scales.resize(nb * 16);
        const auto pack = qtype == Q4_0 ? pack8_q45_0<Q4_0> : qtype == Q5_0 ? pack8_q45_0<Q5_0> : pack8_q45_0<Q8_0>;
        const bool one = act_planes() == 1;
        const void* rws[16];
        float tile[TOKEN_TILE * 16];
        for (int rows = cpu_has_avx512() ? 16 : 8; rows >= 8; rows -= 8) {
          for (; k + rows <= k_end; k += rows) {
            for (int j = 0; j < rows; ++j) rws[j] = wp + (idx ? static_cast<int64_t>(idx[k + j]) : k + j) * row_bytes;
            for (int h = 0; h < rows / 8; ++h)
              pack(rws + 8 * h, nb, reinterpret_cast<__m256i*>(packed.data()), scales.data(), h, rows / 8);
            for (int64_t t = 0; t < T; t += TOKEN_TILE) {
              const int nt = static_cast<int>(std::min<int64_t>(TOKEN_TILE, T - t));
              pick_dot8(qtype, rows, nt, one)(packed.data(), scales.data(), act32.data() + t * nb, nb, nb, tile);
              for (int j = 0; j < nt; ++j)
                for (int r = 0; r < rows; ++r) yp[(t + j) * M + k + r] = tile[j * rows + r];
            }
          }
        }
      }
      if (wide) {  // the rest one at a time (every row, when they are not listed sparsely)
        const DotRowsQ4G one = pick_dot_rows_q4g(1, q4_ahead);
        for (; k < k_end; ++k) {
          const void* r = wp + (idx ? static_cast<int64_t>(idx[k]) : k) * row_bytes;
          one(&r, act4.data(), act32.data(), nb, yp + k);
        }
      }
#endif
      for (; k < k_end; ++k) {
        const int64_t n = idx ? idx[k] : k;
        if (pf) {
          const char* next = nullptr;
          if (idx) {  // the next listed row, all of it: it is not where the hardware prefetcher looks
            if (k + 1 < M) next = reinterpret_cast<const char*>(wp + static_cast<int64_t>(idx[k + 1]) * row_bytes);
          } else if ((n + 1) * row_bytes + ahead <= N * row_bytes) {
            next = reinterpret_cast<const char*>(wp + n * row_bytes + ahead);
          }
          if (next) prefetch_bytes(next, row_bytes, pf);
        }
        const uint8_t* row = wp + n * row_bytes;
        int64_t t = 0;
        if (T > 1 && (dot_32 || dot_256)) {  // prefill: tiles of tokens share each unpacked weight block
          for (float tile[TOKEN_TILE]; t < T; t += TOKEN_TILE) {
            const int nt = static_cast<int>(std::min<int64_t>(TOKEN_TILE, T - t));
            if (dot_32) {
              const DotTokens multi = pick_tokens(qtype, nt);
              if (!multi) break;
              multi(row, act32.data() + t * nb, nb, nb, tile);
            } else {
              const DotTokensK multi = pick_tokens_k(qtype, nt);
              if (!multi) break;
              multi(row, act256.data() + t * nb, nb, nb, tile);
            }
            for (int j = 0; j < nt; ++j) yp[(t + j) * M + k] = tile[j];
          }
        }
        for (; t < T; ++t) {
          float v;
          if (is_float) v = dot_f(row, xp + t * K, K);
          else if (dot_32) v = dot_32(row, act32.data() + t * nb, nb);
          else v = dot_256(row, act256.data() + t * nb, nb);
          yp[t * M + k] = v;
        }
      }
      g = stop;
      ++i;
    }
  });
  return ys;
}

std::vector<at::Tensor> qmatmul_multi_cpu(const std::vector<at::Tensor>& ws, const std::vector<int64_t>& qtypes,
                                          const at::Tensor& x) {
  return qmatmul_rows_cpu(ws, qtypes, x, std::vector<c10::optional<at::Tensor>>(ws.size()));
}

at::Tensor qmatmul_cpu(const at::Tensor& w, int64_t qtype, const at::Tensor& x) {
  return qmatmul_multi_cpu({w}, {qtype}, x)[0];
}

// Several tokens against one row at once, for the formats that have such a kernel (else nullptr).

DotTokens pick_tokens(int64_t qtype, int nt) {
#ifdef HS_X86
  if (!cpu_has_avx2()) return nullptr;
  static const DotTokens q4[TOKEN_TILE] = HS_TILES(isa_avx2::dot_q45_0_tokens, Q4_0,);
  static const DotTokens q5[TOKEN_TILE] = HS_TILES(isa_avx2::dot_q45_0_tokens, Q5_0,);
  static const DotTokens q4v[TOKEN_TILE] = HS_TILES(isa_vnni::dot_q45_0_tokens, Q4_0,);
  static const DotTokens q5v[TOKEN_TILE] = HS_TILES(isa_vnni::dot_q45_0_tokens, Q5_0,);
  static const DotTokens q8v[TOKEN_TILE] = HS_TILES(dot_q8_0_tokens_vnni);
  const bool vnni = cpu_has_avx512();  // prefill of Gemma 3 270M (Q5_0 rows), 2 threads: +4%
  if (qtype == Q8_0) return vnni ? q8v[nt - 1] : nullptr;  // AVX2: one token at a time
  if (qtype == Q4_0) return (vnni ? q4v : q4)[nt - 1];
  if (qtype == Q5_0) return (vnni ? q5v : q5)[nt - 1];
#endif
  (void)qtype; (void)nt;
  return nullptr;
}

DotTokensK pick_tokens_k(int64_t qtype, int nt) {
#ifdef HS_X86
  if (!cpu_has_avx2()) return nullptr;
  static const DotTokensK q4[TOKEN_TILE] = HS_TILES(isa_avx2::dot_q45_k_tokens, false,);
  static const DotTokensK q5[TOKEN_TILE] = HS_TILES(isa_avx2::dot_q45_k_tokens, true,);
  static const DotTokensK q6[TOKEN_TILE] = HS_TILES(isa_avx2::dot_q6_k_tokens);
  static const DotTokensK q4v[TOKEN_TILE] = HS_TILES(isa_vnni::dot_q45_k_tokens, false,);
  static const DotTokensK q5v[TOKEN_TILE] = HS_TILES(isa_vnni::dot_q45_k_tokens, true,);
  static const DotTokensK q6v[TOKEN_TILE] = HS_TILES(isa_vnni::dot_q6_k_tokens);
  const bool vnni = cpu_has_avx512();
  if (qtype == Q4_K) return (vnni ? q4v : q4)[nt - 1];
  if (qtype == Q5_K) return (vnni ? q5v : q5)[nt - 1];
  if (qtype == Q6_K) return (vnni ? q6v : q6)[nt - 1];
#endif
  (void)qtype; (void)nt;
  return nullptr;
}

// Which CPU code path the dot products take on this machine ("avx2" or "scalar").
std::string cpu_path() { return cpu_has_avx512() ? "avx512" : cpu_has_avx2() ? "avx2" : "scalar"; }

// The activation quantization's output as bytes (ActQ8 per 32 values, or ActQ8K per 256 with
// k_quant), for tests: the vector and scalar paths must agree bit for bit.
at::Tensor quantize_act_bytes(const at::Tensor& x, bool k_quant) {
  HS_CHECK(x.dim() == 1 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() % (k_quant ? QK_K : QK) == 0,
           "quantize_act_bytes: x must be a contiguous float32 vector of whole blocks");
  const int64_t n = x.numel();
  if (k_quant) {
    std::vector<ActQ8K> a(n / QK_K);
    quantize_act_q8k(x.data_ptr<float>(), a.data(), n);
    return at::from_blob(a.data(), {static_cast<int64_t>(a.size() * sizeof(ActQ8K))}, at::kByte).clone();
  }
  std::vector<ActQ8> a(n / QK);
  quantize_act_q8(x.data_ptr<float>(), a.data(), n);
  return at::from_blob(a.data(), {static_cast<int64_t>(a.size() * sizeof(ActQ8))}, at::kByte).clone();
}

// Index of the largest value of a float32 vector (greedy sampling), ties to the lowest index.
int64_t argmax_cpu(const at::Tensor& x) {
  HS_CHECK(x.dim() == 1 && x.numel() > 0 && x.scalar_type() == at::kFloat && x.is_contiguous(),
           "argmax: x must be a non-empty contiguous float32 vector");
  const float* p = x.data_ptr<float>();
  const int64_t n = x.numel();
  const int nt = at::get_num_threads();
  std::vector<int64_t> best(nt, 0);
  at::parallel_for(0, nt, 1, [&](int64_t tb, int64_t te) {
    for (int64_t tid = tb; tid < te; ++tid) {
      const int64_t lo = n * tid / nt, hi = n * (tid + 1) / nt;
      int64_t bi = lo;
      for (int64_t i = lo + 1; i < hi; ++i) if (p[i] > p[bi]) bi = i;
      best[tid] = bi;
    }
  });
  int64_t bi = best[0];
  for (int tid = 1; tid < nt; ++tid) if (n * tid / nt < n * (tid + 1) / nt && p[best[tid]] > p[bi]) bi = best[tid];
  return bi;
}

// ---- the transposed product (rows are neurons) ------------------------------------------------------

void dequant_row(const uint8_t* row, int64_t qtype, int64_t K, float* out);  // dequant.cpp

// Several tokens' axpy over up to TOKEN_AXPY_ROWS rows at once (axpy_tokens_avx512, or _avx2 without AVX-512):
// F16, Q8_0, Q4_0 rows, else nullptr. Taken for a chunk of rows where enough of its (token, row)
// pairs are active (the kernel computes every pair; the per-token axpy only the active ones): 2 in 5.
// Dev VM (session 30, a Xeon), 7B-shaped Q4_0 down_t rows (11008 x 4096), 32 tokens, every pair, 2 threads:
// 41.8-42.9 -> 15.0-16.0 ms. HS_AXPY_TOKENS=0 (read per call): each token's own axpy, to compare.
constexpr int TOKEN_AXPY_ROWS = 16;
using AxpyTokens = void (*)(const float*, int64_t, const void* const*, int, float*, int64_t);
AxpyTokens pick_axpy_tokens(int64_t qtype, int nt) {
#ifdef HS_X86
  if (!cpu_has_avx2() || env_off("HS_AXPY_TOKENS")) return nullptr;
  static const AxpyTokens f16[2][TOKEN_TILE] = {HS_TILES(axpy_tokens_avx2, F16,), HS_TILES(axpy_tokens_avx512, F16,)};
  static const AxpyTokens q8[2][TOKEN_TILE] = {HS_TILES(axpy_tokens_avx2, Q8_0,), HS_TILES(axpy_tokens_avx512, Q8_0,)};
  static const AxpyTokens q4[2][TOKEN_TILE] = {HS_TILES(axpy_tokens_avx2, Q4_0,), HS_TILES(axpy_tokens_avx512, Q4_0,)};
  const bool w = cpu_has_avx512();
  switch (qtype) {
    case F16: return f16[w][nt - 1];
    case Q8_0: return q8[w][nt - 1];
    case Q4_0: return q4[w][nt - 1];
  }
#else
  (void)qtype; (void)nt;
#endif
  return nullptr;
}

// y[t] += sum_j hc[t * hs + j] * rows[j] for T tokens and n <= TOKEN_AXPY_ROWS rows, `active` of the pairs
// non-zero: all the tokens at once a tile at a time where 2 in 5 of the pairs are active and the type has
// the kernel, else each active pair on its own (direct)
void axpy_rows_tokens(int64_t qtype, AxpyRow direct, const float* hc, int64_t hs, const void* const* rows, int n,
                      int64_t active, float* y, int64_t K, int64_t T) {
  if (5 * active >= 2 * T * n && pick_axpy_tokens(qtype, 1)) {
    for (int64_t t = 0; t < T; t += TOKEN_TILE) {
      const int nt = static_cast<int>(std::min<int64_t>(TOKEN_TILE, T - t));
      pick_axpy_tokens(qtype, nt)(hc + t * hs, hs, rows, n, y + t * K, K);
    }
    return;
  }
  for (int j = 0; j < n; ++j)
    for (int64_t t = 0; t < T; ++t)
      if (hc[t * hs + j] != 0.f) direct(hc[t * hs + j], rows[j], y + t * K, K);
}

// y[t] = sum_k h[t, k] * W_t[row(k)], row(k) = idx[k] (the sparse axpy over active neurons) or k
// (the dense transposed product, ffn_down_t). Each thread sums its rows into its own buffer and the
// buffers are added afterwards: no two threads ever write the same float.
at::Tensor sparse_axpy_cpu(const at::Tensor& w, int64_t qtype, const at::Tensor& h,
                           const c10::optional<at::Tensor>& idx) {
  HS_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(),
           "sparse_axpy: h must be a contiguous float32 [tokens, rows] tensor");
  const int64_t T = h.size(0), N = w.size(0);
  const int64_t M = check_rows(idx, N, "sparse_axpy");
  HS_CHECK(h.size(1) == M, "sparse_axpy: h has ", h.size(1), " columns for ", M, " rows");
  const int be = block_elems(qtype), bb = block_bytes(qtype);
  HS_CHECK(bb > 0, "sparse_axpy: unsupported weight type id ", qtype);
  const int64_t row_bytes = w.size(1) * w.element_size();
  const int64_t K = row_bytes / bb * be;
  check_weight(w, qtype, K, "sparse_axpy");
  auto y = at::zeros({T, K}, h.options());
  if (T == 0 || M == 0 || K == 0) return y;
  const int32_t* ip = idx.has_value() && idx->defined() ? idx->data_ptr<int32_t>() : nullptr;
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* hp = h.data_ptr<float>();
  const int n_threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), M));
  // each thread zeroes its own sum (in parallel, and first touched by the thread that uses it)
  std::unique_ptr<float[]> partial(new float[static_cast<size_t>(n_threads) * T * K]);
  AxpyRow direct;  // y += s * row straight from the stored format (AVX2), else via a row buffer
  AxpyGroup group;  // y += sum of AXPY_GROUP rows, one pass over y
  pick_axpy(qtype, direct, group);
  const int pf = prefetch_mode();
  at::parallel_for(0, n_threads, 1, [&](int64_t tb, int64_t te) {
    std::vector<float> row(direct ? 0 : K);
    const void* rows[AXPY_GROUP];
    int64_t ks[AXPY_GROUP];
    float sc[AXPY_GROUP];
    for (int64_t tid = tb; tid < te; ++tid) {
      float* acc = partial.get() + tid * T * K;
      std::fill(acc, acc + T * K, 0.f);
      const int64_t r0 = M * tid / n_threads, r1 = M * (tid + 1) / n_threads;
      int n_group = 0;
      if (T > 1 && pick_axpy_tokens(qtype, 1)) {
        // chunks of TOKEN_AXPY_ROWS rows, all the tokens at once where enough of the pairs are active
        const void* crows[TOKEN_AXPY_ROWS];
        for (int64_t c0 = r0; c0 < r1; c0 += TOKEN_AXPY_ROWS) {
          const int n = static_cast<int>(std::min<int64_t>(TOKEN_AXPY_ROWS, r1 - c0));
          int64_t active = 0;
          for (int64_t t = 0; t < T; ++t)
            for (int j = 0; j < n; ++j) active += hp[t * M + c0 + j] != 0.f;
          for (int j = 0; j < n; ++j) crows[j] = wp + (ip ? ip[c0 + j] : c0 + j) * row_bytes;
          axpy_rows_tokens(qtype, direct, hp + c0, M, crows, n, active, acc, K, T);
        }
        continue;
      }
      for (int64_t k = r0; k < r1; ++k) {
        bool any = false;
        for (int64_t t = 0; t < T && !any; ++t) any = hp[t * M + k] != 0.f;
        if (!any) continue;  // an inactive neuron costs nothing
        const uint8_t* src = wp + (ip ? ip[k] : k) * row_bytes;
        if (pf && k + 1 < r1) {  // HS_PREFETCH as in the row-dot (non-temporal was 6x slower on a Xeon)
          prefetch_bytes(reinterpret_cast<const char*>(wp + (ip ? ip[k + 1] : k + 1) * row_bytes), row_bytes, pf);
        }
        if (group) {  // collect AXPY_GROUP active rows, then one pass over y per token
          rows[n_group] = src;
          ks[n_group++] = k;
          if (n_group < AXPY_GROUP) continue;
          for (int64_t t = 0; t < T; ++t) {
            for (int j = 0; j < AXPY_GROUP; ++j) sc[j] = hp[t * M + ks[j]];
            group(sc, rows, acc + t * K, K);
          }
          n_group = 0;
          continue;
        }
        if (!direct) dequant_row(src, qtype, K, row.data());
        for (int64_t t = 0; t < T; ++t) {
          const float s = hp[t * M + k];
          if (s == 0.f) continue;
          if (direct) direct(s, src, acc + t * K, K);
          else axpy_f32(s, row.data(), acc + t * K, K);
        }
      }
      for (int j = 0; j < n_group; ++j)  // the group's remainder, a row at a time
        for (int64_t t = 0; t < T; ++t) {
          const float s = hp[t * M + ks[j]];
          if (s != 0.f) direct(s, rows[j], acc + t * K, K);
        }
    }
  });
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T * K, 4096, [&](int64_t b, int64_t e) {
    for (int tid = 0; tid < n_threads; ++tid) {
      const float* p = partial.get() + static_cast<int64_t>(tid) * T * K;
      for (int64_t i = b; i < e; ++i) yp[i] += p[i];
    }
  });
  return y;
}

at::Tensor qmatmul_t_cpu(const at::Tensor& w, int64_t qtype, const at::Tensor& h) {
  return sparse_axpy_cpu(w, qtype, h, c10::nullopt);
}

}  // namespace hs

namespace hs {

// ---- the fused sparse FFN for one token ----------------------------------------------------------
// Per active neuron, on one thread: g = gate_i . x, u = up_i . x, h = act(g) * u, then y += h * d_i
// into the thread's own sum (AXPY_GROUP rows per pass over it); the sums are added at the end. One
// parallel region per layer instead of three (row-dots, activation, axpy) and each neuron's three rows
// read back to back. Decoding only (one token), formats with an AVX2 dot and a grouped axpy;
// HS_FUSED_FFN=0 turns it off for side-by-side measurements. Returns false where it does not apply.

namespace {

inline float act_scalar(float v, int64_t act) {
  switch (act) {
    case 0: return v / (1.f + std::exp(-v));
    case 1: return v > 0.f ? v : 0.f;
    case 2: return 0.5f * v * (1.f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    default: return 0.5f * v * (1.f + std::erf(v * 0.7071067811865476f));
  }
}

bool fused_enabled() {  // read per call (tens of ns): benchmarks switch it within one process
  return !env_off("HS_FUSED_FFN");
}

bool gate_first_enabled() {  // HS_GATE_FIRST, read per call like HS_FUSED_FFN
  return !env_off("HS_GATE_FIRST");
}

}  // namespace

bool sparse_ffn_fused_cpu(const at::Tensor& x, const at::Tensor& up, int64_t up_type,
                          const c10::optional<at::Tensor>& gate, int64_t gate_type, const at::Tensor& down_t,
                          int64_t down_type, const at::Tensor& idx, const c10::optional<at::Tensor>& up_bias,
                          int64_t act, bool act_on_up, at::Tensor& y_out, at::Tensor& h_out,
                          const c10::optional<at::Tensor>& mask) {
#ifdef HS_X86
  const bool masked = mask.has_value() && mask->defined();
  if (!fused_enabled() || !cpu_has_avx2() || x.dim() != 2 || act < 0 || act > 3) return false;
  if (x.size(0) != 1 && !masked) return false;  // several tokens: the per-token form only
  const bool gated = gate.has_value() && gate->defined();
  if (gated && gate_type != up_type) return false;
  if (up_type != F16 && up_type != Q8_0 && up_type != Q4_0 && up_type != Q5_0) return false;
  AxpyRow direct;
  AxpyGroup group, group_next;
  pick_axpy(down_type, direct, group, &group_next);
  if (!group) return false;
  // listed rows side by side ask for the next group's rows while they compute (next_groups); one token's down
  // rows where the type has such a kernel: a group's axpy runs once the group after it is queued, asking for
  // its rows meanwhile
  const int ahead_groups = next_groups();
  const bool ask_next = ahead_groups > 0;
  if (!(x.size(0) == 1 && !masked && ask_next)) group_next = nullptr;
  HS_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "sparse_ffn: x must be contiguous float32");
  const int64_t T = x.size(0), K = x.size(1);
  check_weight(up, up_type, K, "sparse_ffn", true);
  if (gated) check_weight(*gate, gate_type, K, "sparse_ffn", true);
  const int64_t M = check_rows(idx, up.size(0), "sparse_ffn");
  if (masked)
    HS_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 2 && mask->size(0) == T && mask->size(1) == M &&
                 mask->is_contiguous(), "sparse_ffn: the per-token mask must be a contiguous bool [", T, ", ", M, "]");
  const int dbe = block_elems(down_type), dbb = block_bytes(down_type);
  const int64_t drow = down_t.size(1) * down_t.element_size(), D = drow / dbb * dbe;
  check_weight(down_t, down_type, D, "sparse_ffn", true);
  HS_CHECK(down_t.size(0) == up.size(0), "sparse_ffn: ffn_down_t has ", down_t.size(0), " rows, up has ",
           up.size(0));
  const bool has_bias = up_bias.has_value() && up_bias->defined();
  if (has_bias)
    HS_CHECK(up_bias->dim() == 1 && up_bias->size(0) == up.size(0) && up_bias->scalar_type() == at::kFloat &&
                 up_bias->is_contiguous(), "sparse_ffn: up bias must be float32 [n_ff]");
  y_out = at::zeros({T, D}, x.options());
  h_out = at::zeros({T, M}, x.options());
  if (M == 0 || T == 0) return true;

  const float* xp = x.data_ptr<float>();
  std::vector<ActQ8> act32;
  DotQ8 dq = nullptr;
  DotF df = nullptr;
  const int64_t nb = K / QK;
  if (up_type == F16) {
    df = pick_float(F16);
  } else {
    dq = pick_q8(up_type);
    act32.resize(T * nb);
    if (T == 1) {
      quantize_act_q8(xp, act32.data(), K);
    } else {  // several tokens: spread over the FFN's own threads (see qmatmul_rows_cpu)
      const int nq = static_cast<int>(std::min<int64_t>(num_threads(), T));
      parallel_threads(nq, [&](int i) {
        for (int64_t t = T * i / nq; t < T * (i + 1) / nq; ++t) quantize_act_q8(xp + t * K, act32.data() + t * nb, K);
      });
    }
  }
#ifdef HS_X86
  // one token of Q4_0 rows: four blocks at a time (HS_Q4_WIDE; gate and up are of one type here)
  const std::vector<ActQ4G> act4 = arranged_q4g(act32, T, nb, up_type == Q4_0 && (!gated || gate_type == Q4_0));
  const DotRowsQ4G wide1 = act4.empty() ? nullptr : pick_dot_rows_q4g(1);
#endif
  const int64_t rb = up.size(1) * up.element_size();
  // rows pitch apart: the tensors' own rows, or views of one neuron-bundled tensor (gate | up | down a row)
  const int64_t up_pitch = up.stride(0) * up.element_size(), down_pitch = down_t.stride(0) * down_t.element_size();
  const int64_t gate_pitch = gated ? gate->stride(0) * gate->element_size() : 0;
  const uint8_t* upp = static_cast<const uint8_t*>(up.data_ptr());
  const uint8_t* gp = gated ? static_cast<const uint8_t*>(gate->data_ptr()) : nullptr;
  const uint8_t* dp = static_cast<const uint8_t*>(down_t.data_ptr());
  const float* bp = has_bias ? up_bias->data_ptr<float>() : nullptr;
  const int32_t* ip = idx.data_ptr<int32_t>();
  const bool* mp = masked ? mask->data_ptr<bool>() : nullptr;
  float* hp = h_out.data_ptr<float>();
  const int pf = prefetch_mode();
  const int side_by_side =  // neurons: HS_FFN_ROWS rows, two a neuron where gated
      (T == 1 && !masked && 2 * M < up.size(0) && has_dot_rows(up_type)) ? std::max(1, ffn_rows() / (gated ? 2 : 1)) : 1;
  // A ReLU gate that does not fire zeroes its neuron whatever the up row gives: one row at a time
  // (several tokens, or many rows listed), the gate row is read first and the up row only where it
  // fired. Predictors that over-predict (to keep recall) list neurons that do not fire; each of those
  // then costs one row instead of two (dev VM, 70B Q4_0 rows, 25% listed, 2 threads: 1.04x / 1.09x /
  // 1.16x with 0 / 20 / 40% of them not firing; F16 1.02-1.23x). Rows side by side keep both: split
  // into a gate pass and an up pass they lost 0.86-0.99x. HS_GATE_FIRST=0: both rows always.
  const bool gate_first = gated && act == 1 && gate_first_enabled();
  // at least 8 neurons a thread: fewer is not worth waking a thread for
  const int n_threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads(), M / 8)));
  // the threads' sums (zeroed per thread), kept from call to call up to 16 MiB (a decode step's): a
  // fresh 0.5 MiB each layer is an mmap, page faults and an munmap whose TLB shootdown interrupts every
  // thread of the process; a prompt's larger sums are allocated per call
  const size_t n_partial = static_cast<size_t>(n_threads) * T * D;
  thread_local std::vector<float> kept;
  const bool keep = n_partial <= (size_t{1} << 22);
  if (keep && kept.size() < n_partial) kept.resize(n_partial);
  std::unique_ptr<float[]> once(keep ? nullptr : new float[n_partial]);
  float* const partial = keep ? kept.data() : once.get();
  // shares claimed a chunk at a time (a multiple of the side-by-side rows), or fixed (HS_FFN_CHUNK=0)
  const int64_t chunk = ffn_chunk() == 0 ? 0 : (ffn_chunk() + side_by_side - 1) / side_by_side * side_by_side;
  std::atomic<int64_t> next{0};
  parallel_threads(n_threads, [&](int tid) {
    float* acc = partial + tid * T * D;
    std::fill(acc, acc + T * D, 0.f);
    const void* rows[2 * AXPY_GROUP];
    float sc[2 * AXPY_GROUP];
    int n_group = 0;
    // neuron r's h from its row-dots (g unused without a gate)
    const auto activation = [&](int64_t r, float u, float g) {
      if (bp) u += bp[r];
      return gated ? act_scalar(g, act) * (act_on_up ? act_scalar(u, act) : u) : act_scalar(u, act);
    };
    // one token: neuron r's down row queued for the grouped axpy
    const auto queue_down = [&](int64_t r, float h) {
      rows[n_group] = dp + r * down_pitch;
      if (pf) prefetch_bytes(reinterpret_cast<const char*>(rows[n_group]), drow, pf);
      sc[n_group++] = h;
      if (group_next) {
        if (n_group == 2 * AXPY_GROUP) {
          group_next(sc, rows, acc, D);
          for (int j = 0; j < AXPY_GROUP; ++j) {
            rows[j] = rows[AXPY_GROUP + j];
            sc[j] = sc[AXPY_GROUP + j];
          }
          n_group = AXPY_GROUP;
        }
      } else if (n_group == AXPY_GROUP) {
        group(sc, rows, acc, D);
        n_group = 0;
      }
    };
    // the neurons [r0, r1) of one share: fused row-dots, activation, down rows queued
    const auto share = [&](const int64_t r0, const int64_t r1) {
      int64_t k = r0;
      if (side_by_side > 1) {  // one token: `side_by_side` neurons' rows streamed together
        const int per = gated ? 2 : 1, n = side_by_side * per;
        // [1]: the kernel that also asks for the next group's rows (within a claimed chunk), where the type has one
        const bool f16 = up_type == F16;
        const DotRows dots[2] = {f16 ? pick_dot_rows(n) : nullptr, f16 ? pick_dot_rows(n, ask_next) : nullptr};
        const DotRowsQ8 dots_q[2] = {f16 ? nullptr : pick_dot_rows_q8(up_type, n),
                                     f16 ? nullptr : pick_dot_rows_q8(up_type, n, ask_next)};
#ifdef HS_X86
        const DotRowsQ4G dots_w[2] = {act4.empty() ? nullptr : pick_dot_rows_q4g(n),
                                      act4.empty() ? nullptr : pick_dot_rows_q4g(n, false, ask_next)};
#endif
        const void* rws[16];
        float val[8];
        for (; k + side_by_side <= r1; k += side_by_side) {
          for (int j = 0; j < side_by_side; ++j) {
            const int64_t r = ip[k + j];
            rws[j * per] = upp + r * up_pitch;
            if (gated) rws[j * per + 1] = gp + r * gate_pitch;
          }
          const int64_t dist = ahead_groups * side_by_side;
          const int ask = ask_next && k + dist + side_by_side <= r1;
          if (ask) {  // the rows of the group `ahead_groups` after this one
            for (int j = 0; j < side_by_side; ++j) {
              const int64_t r = ip[k + dist + j];
              rws[n + j * per] = upp + r * up_pitch;
              if (gated) rws[n + j * per + 1] = gp + r * gate_pitch;
            }
          }
          if (f16) dots[ask](rws, xp, K, val);
#ifdef HS_X86
          else if (dots_w[0]) dots_w[ask](rws, act4.data(), act32.data(), nb, val);
#endif
          else dots_q[ask](rws, act32.data(), nb, val);
          for (int j = 0; j < side_by_side; ++j) {
            const int64_t r = ip[k + j];
            const float h = activation(r, val[j * per], gated ? val[j * per + 1] : 0.f);
            hp[k + j] = h;
            if (h != 0.f) queue_down(r, h);
          }
        }
      }
      // several tokens: the down rows of up to TOKEN_AXPY_ROWS consecutive neurons [k0, k0 + nq) held back and
      // added for all the tokens at once (axpy_rows_tokens, their h read from hp) where 2 in 5 of the pairs
      // fired, else each token's own
      const void* qrows[TOKEN_AXPY_ROWS];
      int nq = 0;
      int64_t k0 = k, fired = 0;
      const auto flush_tokens = [&]() {
        if (nq) axpy_rows_tokens(down_type, direct, hp + k0, M, qrows, nq, fired, acc, D, T);
        nq = 0;
        fired = 0;
      };
      const bool by_tokens = T > 1 && pick_axpy_tokens(down_type, 1);
      for (; k < r1; ++k) {
        const int64_t r = ip[k];
        const uint8_t* ur = upp + r * up_pitch;
        const uint8_t* gr = gated ? gp + r * gate_pitch : nullptr;
        if (by_tokens) {
          if (nq == 0) k0 = k;
          qrows[nq++] = dp + r * down_pitch;
        }
        if (pf && k + 1 < r1) {  // HS_PREFETCH: the next neuron's rows, where no hardware prefetcher looks
          prefetch_bytes(reinterpret_cast<const char*>(upp + ip[k + 1] * up_pitch), rb, pf);
          if (gated) prefetch_bytes(reinterpret_cast<const char*>(gp + ip[k + 1] * gate_pitch), rb, pf);
        }
        // each listed row is read once; only the tokens that need the neuron compute with it
        for (int64_t t = 0; t < T; ++t) {
          if (mp && !mp[t * M + k]) continue;
          const float* xt = xp + t * K;
          const ActQ8* at = dq ? act32.data() + t * nb : nullptr;
          const auto qdot = [&](const uint8_t* row) {
#ifdef HS_X86
            if (wide1) {  // one token (act4 is empty otherwise)
              float v;
              const void* r = row;
              wide1(&r, act4.data(), act32.data(), nb, &v);
              return v;
            }
#endif
            return dq(row, at, nb);
          };
          const float g = gated ? (df ? df(gr, xt, K) : qdot(gr)) : 0.f;
          const float u = gate_first && !(g > 0.f) ? 0.f : df ? df(ur, xt, K) : qdot(ur);
          const float h = activation(r, u, g);
          hp[t * M + k] = h;
          if (h == 0.f) continue;  // a ReLU neuron that did not fire costs no down row
          if (by_tokens) ++fired;
          else if (T > 1) direct(h, dp + r * down_pitch, acc + t * D, D);  // several tokens: straight into that token's sum
          else queue_down(r, h);
        }
        if (nq == TOKEN_AXPY_ROWS) flush_tokens();
      }
      flush_tokens();
    };
    if (chunk == 0) {
      share(M * tid / n_threads, M * (tid + 1) / n_threads);
    } else {
      // guided: a chunk is at most `chunk` neurons and at least the side-by-side rows, about 1/(2 n)
      // of what is left, so that the threads run out of work together (with 16-neuron chunks of
      // 32 KiB rows, ~110 us a chunk on one of 16 Xeon threads, a layer's last chunk left the other
      // threads idle for up to that long in a ~0.3-0.9 ms cold FFN)
      for (;;) {
        const int64_t left = M - next.load(std::memory_order_relaxed);
        const int64_t c = std::max<int64_t>(side_by_side, std::min<int64_t>(chunk, left / (2 * n_threads) /
                                                                                     side_by_side * side_by_side));
        const int64_t r0 = next.fetch_add(c, std::memory_order_relaxed);
        if (r0 >= M) break;
        share(r0, std::min(M, r0 + c));
      }
    }
    int j = 0;
    if (n_group >= AXPY_GROUP) {  // the group held back for the one after it (group_next)
      group(sc, rows, acc, D);
      j = AXPY_GROUP;
    }
    for (; j < n_group; ++j) direct(sc[j], rows[j], acc, D);
  });
  float* yp = y_out.data_ptr<float>();
  // the threads' sums added slice by slice (16 x 5120 floats for a 13B layer: ~30 us on one thread)
  const int64_t TD = T * D;
  const int n_slices = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n_threads, TD / 256)));
  parallel_threads(n_slices, [&](int s) {
    const int64_t b = TD * s / n_slices, e = TD * (s + 1) / n_slices;
    for (int tid = 0; tid < n_threads; ++tid) {
      const float* p = partial + static_cast<int64_t>(tid) * TD;
      for (int64_t i = b; i < e; ++i) yp[i] += p[i];
    }
  });
  return true;
#else
  (void)x; (void)up; (void)up_type; (void)gate; (void)gate_type; (void)down_t; (void)down_type; (void)idx;
  (void)up_bias; (void)act; (void)act_on_up; (void)y_out; (void)h_out; (void)mask;
  return false;
#endif
}

}  // namespace hs
