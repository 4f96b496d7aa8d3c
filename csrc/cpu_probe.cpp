// The memory's ceiling for a sparse op's pattern (benchmarks: `hs-bench kernels`): read the listed rows of
// a weight the way the sparse kernels read them, and do nothing with the bytes but add them up. Threads
// take contiguous shares of the index list (each row read once, by one thread); a thread streams `side`
// rows side by side, one 64-byte line of each a step, and asks for the line at the same offset of the rows
// `ahead` groups further on into L2 (prefetcht1; 0: none), as the kernels' HS_NEXT_ROWS does. What the kernels reach against
// this says how much of their shortfall is arithmetic and how much is the memory under scattered rows.
// Returns the sum of the bytes (so that the loads cannot be left out), which a test checks.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "check.h"
#include "cpu_dot.h"
#include "pool.h"

namespace hs {

namespace {

constexpr int MAX_SIDE = 16;

int64_t sum_rows_scalar(const uint8_t* const* rows, int n, int64_t from, int64_t bytes) {
  int64_t s = 0;
  for (int j = 0; j < n; ++j)
    for (int64_t o = from; o < bytes; ++o) s += rows[j][o];
  return s;
}

#ifdef HS_X86
HS_AVX512 int64_t sum_rows_avx512(const uint8_t* const* rows, int n, const uint8_t* const* next, int n_next,
                                  int64_t bytes) {
  const __m512i z = _mm512_setzero_si512();
  __m512i acc = z;
  int64_t o = 0;
  for (; o + 64 <= bytes; o += 64) {
    for (int j = 0; j < n; ++j) acc = _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_loadu_si512(rows[j] + o), z));
    for (int j = 0; j < n_next; ++j) _mm_prefetch(reinterpret_cast<const char*>(next[j] + o), _MM_HINT_T1);
  }
  return _mm512_reduce_add_epi64(acc) + sum_rows_scalar(rows, n, o, bytes);
}

HS_AVX2 int64_t sum_rows_avx2(const uint8_t* const* rows, int n, const uint8_t* const* next, int n_next,
                              int64_t bytes) {
  const __m256i z = _mm256_setzero_si256();
  __m256i acc = z;
  int64_t o = 0;
  for (; o + 64 <= bytes; o += 64) {
    for (int j = 0; j < n; ++j) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + o));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + o + 32));
      acc = _mm256_add_epi64(acc, _mm256_add_epi64(_mm256_sad_epu8(a, z), _mm256_sad_epu8(b, z)));
    }
    for (int j = 0; j < n_next; ++j) _mm_prefetch(reinterpret_cast<const char*>(next[j] + o), _MM_HINT_T1);
  }
  alignas(32) int64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + sum_rows_scalar(rows, n, o, bytes);
}
#endif

int64_t sum_rows(const uint8_t* const* rows, int n, const uint8_t* const* next, int n_next, int64_t bytes) {
#ifdef HS_X86
  if (cpu_has_avx512()) return sum_rows_avx512(rows, n, next, n_next, bytes);
  if (cpu_has_avx2()) return sum_rows_avx2(rows, n, next, n_next, bytes);
#endif
  (void)next;
  (void)n_next;
  return sum_rows_scalar(rows, n, 0, bytes);
}

}  // namespace

int64_t read_rows_cpu(const at::Tensor& w, const at::Tensor& idx, int64_t side, int64_t ahead) {
  HS_CHECK(w.dim() == 2 && w.is_cpu() && w.is_contiguous(), "read_rows: w must be a contiguous 2-D CPU tensor");
  HS_CHECK(idx.dim() == 1 && idx.scalar_type() == at::kInt && idx.is_contiguous() && idx.is_cpu(),
           "read_rows: idx must be a contiguous int32 CPU vector");
  HS_CHECK(side >= 1 && side <= MAX_SIDE, "read_rows: side must be 1..", MAX_SIDE, ", got ", side);
  HS_CHECK(ahead >= 0, "read_rows: ahead must be >= 0 groups, got ", ahead);
  const int64_t N = w.size(0), M = idx.numel(), bytes = w.size(1) * w.element_size();
  const int32_t* ip = idx.data_ptr<int32_t>();
  for (int64_t k = 0; k < M; ++k)
    HS_CHECK(ip[k] >= 0 && ip[k] < N, "read_rows: index ", ip[k], " out of range for ", N, " rows");
  const uint8_t* base = static_cast<const uint8_t*>(w.data_ptr());
  const int n_threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads(), M / 8)));
  std::vector<int64_t> sums(n_threads, 0);
  parallel_threads(n_threads, [&](int tid) {
    const int64_t r0 = M * tid / n_threads, r1 = M * (tid + 1) / n_threads;
    const uint8_t* rows[MAX_SIDE];
    const uint8_t* next[MAX_SIDE];
    int64_t s = 0;
    for (int64_t k = r0; k < r1; k += side) {
      const int n = static_cast<int>(std::min<int64_t>(side, r1 - k));
      int n_next = 0;
      for (int j = 0; j < n; ++j) rows[j] = base + ip[k + j] * bytes;
      for (const int64_t k2 = k + ahead * side; ahead && n_next < side && k2 + n_next < r1; ++n_next)
        next[n_next] = base + ip[k2 + n_next] * bytes;
      s += sum_rows(rows, n, next, n_next, bytes);
    }
    sums[tid] = s;
  });
  int64_t total = 0;
  for (const int64_t s : sums) total += s;
  return total;
}

}  // namespace hs
