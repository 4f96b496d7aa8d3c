// Row dot products of one weight row (stored format) with quantized activations: scalar reference
// versions and AVX2+FMA+F16C versions, chosen once at run time by CPUID.
#pragma once
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "env.h"
#include "quant_blocks.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#define HS_X86 1
#define HS_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace hs {

constexpr int AXPY_GROUP = 4;  // rows per pass of the grouped axpy (below)

// NEXT kernels (HS_NEXT_ROWS): rows[G..2G-1] are the rows of the group that comes next; as this group's rows
// pass block b (at byte `off` of each row, blocks of `block` bytes), the first block to start in a 64-byte
// line asks for that line of each next row into L2 (prefetcht1): every line once, at the rate they are read
template <int G>
static inline void ask_next_lines(const void* const* next, int64_t off, int64_t block) {
  if ((off & 63) < block)
    for (int j = 0; j < G; ++j) _mm_prefetch(static_cast<const char*>(next[j]) + off, _MM_HINT_T1);
}

// ---- activation quantization (see ActQ8): round half away from zero ------------------------------

// lround for |v| < 2^23 without a libm call (so the loops below vectorise): truncate, then move a
// fraction of at least one half away from zero (v - trunc(v) is exact in that range)
inline int32_t round_half_away(float v) {
  const int32_t t = static_cast<int32_t>(v);
  const float frac = v - static_cast<float>(t);
  return t + (frac >= 0.5f) - (frac <= -0.5f);
}

template <int N>
inline float quantize_two_planes(const float* x, int8_t (*qs)[N]) {
  float amax = 0.f;
  for (int i = 0; i < N; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float d0 = amax / 127.f, id0 = d0 != 0.f ? 1.f / d0 : 0.f;
  const float id1 = id0 * PLANE_SHIFT;
  for (int i = 0; i < N; ++i) {
    const int32_t q0 = round_half_away(x[i] * id0);
    qs[0][i] = static_cast<int8_t>(q0);
    qs[1][i] = static_cast<int8_t>(round_half_away((x[i] - d0 * static_cast<float>(q0)) * id1));
  }
  return d0 / PLANE_SHIFT;
}

inline bool cpu_has_avx2();  // below

#ifdef HS_X86
// round_half_away on 8 lanes, with the same float steps: truncate, then move a fraction of at least
// one half away from zero
HS_AVX2 static inline __m256 round_half_away8(__m256 v) {
  const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(v, t), one = _mm256_set1_ps(1.f);
  const __m256 up = _mm256_and_ps(_mm256_cmp_ps(f, _mm256_set1_ps(0.5f), _CMP_GE_OQ), one);
  const __m256 down = _mm256_and_ps(_mm256_cmp_ps(f, _mm256_set1_ps(-0.5f), _CMP_LE_OQ), one);
  return _mm256_sub_ps(_mm256_add_ps(t, up), down);
}

// 32 int32 values in [-128, 127] (four vectors) to 32 int8 in order (packs work within 128-bit lanes)
HS_AVX2 static inline __m256i pack_i32x32_to_i8(const __m256i* q, __m256i order) {
  return _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
}

// quantize_two_planes<N> eight lanes at a time, bit for bit the same (every float operation is the
// scalar code's, and the product d0 * q0 is kept apart from the subtraction so that no compiler fuses
// them into an FMA, which rounds once instead of twice); also the sums of PLANE_SHIFT * q0 + q1 per
// 16 values. The scalar loops cost ~2.5 ns a value (Zen 4): ~20 us per 8192-wide x, on one thread
// before each parallel region of a decode step.
template <int N>
HS_AVX2 static inline float quantize_two_planes_avx2(const float* x, int8_t (*qs)[N], int32_t* sums16) {
  static_assert(N % 32 == 0, "blocks of 32");
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < N; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const float d0 = amax / 127.f, id0 = d0 != 0.f ? 1.f / d0 : 0.f;
  const float id1 = id0 * PLANE_SHIFT;
  const __m256 vd0 = _mm256_set1_ps(d0), vid0 = _mm256_set1_ps(id0), vid1 = _mm256_set1_ps(id1);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int i = 0; i < N; i += 32) {
    __m256i q0[4], q1[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 xv = _mm256_loadu_ps(x + i + 8 * k);
      const __m256 r0 = round_half_away8(_mm256_mul_ps(xv, vid0));
      __m256 back = _mm256_mul_ps(vd0, r0);
      __asm__("" : "+x"(back));  // no fused multiply-subtract below
      const __m256 r1 = round_half_away8(_mm256_mul_ps(_mm256_sub_ps(xv, back), vid1));
      q0[k] = _mm256_cvttps_epi32(r0);
      q1[k] = _mm256_cvttps_epi32(r1);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs[0] + i), pack_i32x32_to_i8(q0, order));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs[1] + i), pack_i32x32_to_i8(q1, order));
    for (int g = 0; g < 2; ++g) {  // values i + 16g .. i + 16g + 15: vectors 2g and 2g + 1
      const __m256i c = _mm256_add_epi32(
          _mm256_add_epi32(_mm256_slli_epi32(q0[2 * g], 7), q1[2 * g]),
          _mm256_add_epi32(_mm256_slli_epi32(q0[2 * g + 1], 7), q1[2 * g + 1]));
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
      sums16[i / 16 + g] = _mm_cvtsi128_si32(t);
    }
  }
  static_assert(PLANE_SHIFT == 128, "the sums shift by 7");
  return d0 / PLANE_SHIFT;
}
#endif

// HS_ACT_PLANES=1 (opt-in, read per call): activations for Q4_0 / Q5_0 / Q8_0 weights in one int8
// plane per block of 32, as llama.cpp quantizes them (the second plane, which carries the rounding
// error of the first, zero), and the Q4_0 / Q5_0 / Q8_0 rows side by side take one dot per block
// instead of two: for CPUs where those dots, not the memory, bound the FFN (the Xeon's cores turn 4.5 GiB/s of
// Q4_0 rows into dots each). Default 2: two planes, ~15-bit activations.
inline int act_planes() {
  return env_is("HS_ACT_PLANES", '1') ? 1 : 2;
}

inline void quantize_act_q8(const float* x, ActQ8* out, int64_t n) {
#ifdef HS_X86
  if (cpu_has_avx2()) {
    for (int64_t b = 0; b < n / QK; ++b) {
      int32_t s[QK / 16];
      out[b].d = quantize_two_planes_avx2<QK>(x + b * QK, out[b].qs, s);
      out[b].dsum = out[b].d * static_cast<float>(s[0] + s[1]);
    }
  } else
#endif
  {
    for (int64_t b = 0; b < n / QK; ++b) {
      out[b].d = quantize_two_planes<QK>(x + b * QK, out[b].qs);
      int32_t s = 0;
      for (int i = 0; i < QK; ++i) s += PLANE_SHIFT * out[b].qs[0][i] + out[b].qs[1][i];
      out[b].dsum = out[b].d * static_cast<float>(s);
    }
  }
  if (act_planes() == 1) {  // the first plane alone: x ~ d * PLANE_SHIFT * q0
    for (int64_t b = 0; b < n / QK; ++b) {
      int32_t s = 0;
      for (int i = 0; i < QK; ++i) s += out[b].qs[0][i];
      std::memset(out[b].qs[1], 0, QK);
      out[b].dsum = out[b].d * static_cast<float>(PLANE_SHIFT * s);
    }
  }
}

inline void quantize_act_q8k(const float* x, ActQ8K* out, int64_t n) {
#ifdef HS_X86
  if (cpu_has_avx2()) {
    for (int64_t b = 0; b < n / QK_K; ++b) out[b].d = quantize_two_planes_avx2<QK_K>(x + b * QK_K, out[b].qs, out[b].bsums);
    return;
  }
#endif
  for (int64_t b = 0; b < n / QK_K; ++b) {
    out[b].d = quantize_two_planes<QK_K>(x + b * QK_K, out[b].qs);
    for (int g = 0; g < QK_K / 16; ++g) {
      int32_t s = 0;
      for (int i = 0; i < 16; ++i) s += PLANE_SHIFT * out[b].qs[0][g * 16 + i] + out[b].qs[1][g * 16 + i];
      out[b].bsums[g] = s;
    }
  }
}

// the combined activation value of element i of a block, as an integer
template <typename A>
inline int32_t act_q(const A& a, int i) { return PLANE_SHIFT * a.qs[0][i] + a.qs[1][i]; }

// ---- scalar reference dot products ------------------------------------------------------------------

inline void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) { sc = s[j] & 63; m = s[j + 4] & 63; }
  else { sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4); m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

// element i (0..31) of a 32-element block, as a signed integer
inline int q4_0_at(const BlockQ4_0& w, int i) { return (i < 16 ? (w.qs[i] & 0xF) : (w.qs[i - 16] >> 4)) - 8; }
inline int q5_0_at(const BlockQ5_0& w, int i) {
  uint32_t qh; std::memcpy(&qh, w.qh, 4);
  const int low = i < 16 ? (w.qs[i] & 0xF) : (w.qs[i - 16] >> 4);
  return (low | static_cast<int>(((qh >> i) & 1) << 4)) - 16;
}
inline int q8_0_at(const BlockQ8_0& w, int i) { return w.qs[i]; }

template <typename Block, int (*At)(const Block&, int)>
inline float dot_32_ref(const void* row, const ActQ8* a, int64_t nb) {
  const Block* w = static_cast<const Block*>(row);
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t s = 0;
    for (int i = 0; i < QK; ++i) s += At(w[b], i) * act_q(a[b], i);
    acc += fp16_to_float(w[b].d) * a[b].d * s;
  }
  return acc;
}

inline float dot_q4_0_ref(const void* row, const ActQ8* a, int64_t nb) { return dot_32_ref<BlockQ4_0, q4_0_at>(row, a, nb); }
inline float dot_q5_0_ref(const void* row, const ActQ8* a, int64_t nb) { return dot_32_ref<BlockQ5_0, q5_0_at>(row, a, nb); }
inline float dot_q8_0_ref(const void* row, const ActQ8* a, int64_t nb) { return dot_32_ref<BlockQ8_0, q8_0_at>(row, a, nb); }

// The fields of super-block b of a Q4_K (FIVE_BIT false) or Q5_K row; qh is null for Q4_K.
struct KBlock { const uint8_t* scales; const uint8_t* qs; const uint8_t* qh; uint16_t d; uint16_t dmin; };

template <bool FIVE_BIT>
inline KBlock k_block(const void* row, int64_t b) {
  if constexpr (FIVE_BIT) {
    const BlockQ5_K& w = static_cast<const BlockQ5_K*>(row)[b];
    return {w.scales, w.qs, w.qh, w.d, w.dmin};
  } else {
    const BlockQ4_K& w = static_cast<const BlockQ4_K*>(row)[b];
    return {w.scales, w.qs, nullptr, w.d, w.dmin};
  }
}

template <bool FIVE_BIT>
inline float dot_q45_k_ref(const void* row, const ActQ8K* a, int64_t nb) {
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const auto [scales, qs, qh, d16, dmin16] = k_block<FIVE_BIT>(row, b);
    int64_t sum_q = 0, sum_m = 0;
    for (int j = 0; j < 8; ++j) {
      int sc, m; k_scale_min(scales, j, sc, m);
      const uint8_t* q = qs + (j / 2) * 32;
      int32_t s = 0;
      for (int l = 0; l < 32; ++l) {
        int v = (j & 1) ? (q[l] >> 4) : (q[l] & 0xF);
        if constexpr (FIVE_BIT) v |= ((qh[l] >> j) & 1) << 4;
        s += v * act_q(a[b], j * 32 + l);
      }
      sum_q += static_cast<int64_t>(sc) * s;
      sum_m += static_cast<int64_t>(m) * (a[b].bsums[2 * j] + a[b].bsums[2 * j + 1]);
    }
    acc += a[b].d * (fp16_to_float(d16) * static_cast<float>(sum_q) - fp16_to_float(dmin16) * static_cast<float>(sum_m));
  }
  return acc;
}

inline float dot_q6_k_ref(const void* row, const ActQ8K* a, int64_t nb) {
  const BlockQ6_K* w = static_cast<const BlockQ6_K*>(row);
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int64_t sum = 0;
    for (int n = 0; n < 2; ++n) {
      const uint8_t* ql = w[b].ql + 64 * n;
      const uint8_t* qh = w[b].qh + 32 * n;
      for (int k = 0; k < 4; ++k) {
        for (int half = 0; half < 2; ++half) {
          int32_t s = 0;
          for (int l = half * 16; l < half * 16 + 16; ++l) {
            const int low = (k & 1) ? ql[l + 32] : ql[l];
            const int q = (((k & 2) ? (low >> 4) : (low & 0xF)) | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
            s += q * act_q(a[b], 128 * n + 32 * k + l);
          }
          sum += static_cast<int64_t>(w[b].scales[8 * n + 2 * k + half]) * s;
        }
      }
    }
    acc += a[b].d * fp16_to_float(w[b].d) * static_cast<float>(sum);
  }
  return acc;
}

template <typename T>
inline float dot_float_ref(const void* row, const float* x, int64_t n) {
  const T* w = static_cast<const T*>(row);
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<float>(w[i]) * x[i];
  return acc;
}

#ifdef HS_X86
// ---- AVX2 ------------------------------------------------------------------------------------------

HS_AVX2 static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// signed int8 x signed int8, 32 lanes -> 8 int32 partial sums
HS_AVX2 static inline __m256i dot_i8(__m256i w, __m256i x) {
  const __m256i ax = _mm256_sign_epi8(w, w);
  const __m256i sy = _mm256_sign_epi8(x, w);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1));
}

// 16 bytes -> 32 values 0..15: the bytes loaded into both halves (a load, no shuffle), the upper half
// shifted by 4 (the high nibbles). Without the cross-lane insert of the earlier form, whose port the
// widening moves of the axpy also need: the Q4_0 row-dots of the fused FFN ~15% faster (Zen 4).
HS_AVX2 static inline __m256i nibbles_32(const uint8_t* qs) {
  const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm256_and_si256(_mm256_srlv_epi64(t, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
}

HS_AVX2 static inline __m256i bytes_from_bits_32(const uint8_t* x) {  // bit i set -> byte i = 0xFF
  uint32_t x32; std::memcpy(&x32, x, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x32)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// signed weights of one block against both activation planes, accumulated into acc
HS_AVX2 static inline __m256 block_dot2(__m256i q, const ActQ8& a, float dw, __m256 acc) {
  const __m256i ax = _mm256_sign_epi8(q, q);
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs[0]));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs[1]));
  const __m256i i0 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(x0, q)), _mm256_set1_epi16(PLANE_SHIFT));
  const __m256i i1 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(x1, q)), _mm256_set1_epi16(1));
  return _mm256_fmadd_ps(_mm256_set1_ps(dw * a.d), _mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), acc);
}

// the same against the first plane alone (HS_ACT_PLANES=1: the second is zero)
HS_AVX2 static inline __m256 block_dot1(__m256i q, const ActQ8& a, float dw, __m256 acc) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs[0]));
  const __m256i i0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x0, q)),
                                       _mm256_set1_epi16(1));
  return _mm256_fmadd_ps(_mm256_set1_ps(dw * a.d * PLANE_SHIFT), _mm256_cvtepi32_ps(i0), acc);
}

// unsigned weights (0..31) of one block against both planes x0, x1: sum of qu * (128 q0 + q1), as int32
HS_AVX2 static inline __m256i dot2_unsigned(__m256i qu, __m256i x0, __m256i x1) {
  return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(qu, x0), _mm256_set1_epi16(PLANE_SHIFT)),
                          _mm256_madd_epi16(_mm256_maddubs_epi16(qu, x1), _mm256_set1_epi16(1)));
}
HS_AVX2 static inline __m256i block_dot2_unsigned(__m256i qu, const ActQ8& a) {
  return dot2_unsigned(qu, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs[0])),
                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs[1])));
}

// Q4_0 / Q5_0 keep their weights unsigned (nibble, or nibble | high bit) and subtract the offset
// times the activation sum once per block: no sign juggling in the inner loop. NT tokens at once
// (prefill): each weight block is unpacked once for all of them; a[t * stride + b] is block b of
// token t, out[t] receives its dot product.
// block b of a Q4_0 / Q5_0 row as 32 unsigned values (0..15 / 0..31) and its scale
template <int64_t QT>
HS_AVX2 static inline __m256i unsigned_block_q45_0(const void* row, int64_t b, float& dw) {
  if constexpr (QT == Q4_0) {
    const BlockQ4_0& w = static_cast<const BlockQ4_0*>(row)[b];
    dw = _cvtsh_ss(w.d);
    return nibbles_32(w.qs);
  } else {
    const BlockQ5_0& w = static_cast<const BlockQ5_0*>(row)[b];
    dw = _cvtsh_ss(w.d);
    return _mm256_or_si256(nibbles_32(w.qs), _mm256_and_si256(bytes_from_bits_32(w.qh), _mm256_set1_epi8(0x10)));
  }
}

// R rows side by side against one token, for CPUs without AVX-512 (the sparse row-dot and the fused
// FFN over scattered rows: more streams in flight per core than one row at a time). Q8_0: the
// activation block read once for all R rows.
// NEXT: rows[R..2R-1] are the next group's rows (ask_next_lines)
template <int R, bool ONE_PLANE = false, bool NEXT = false>
HS_AVX2 static inline void dot_q8_0_rows_avx2(const void* const* rows, const ActQ8* a, int64_t nb, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (NEXT) ask_next_lines<R>(rows + R, b * int64_t{sizeof(BlockQ8_0)}, sizeof(BlockQ8_0));
    for (int r = 0; r < R; ++r) {
      const BlockQ8_0& w = static_cast<const BlockQ8_0*>(rows[r])[b];
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs));
      acc[r] = ONE_PLANE ? block_dot1(q, a[b], _cvtsh_ss(w.d), acc[r]) : block_dot2(q, a[b], _cvtsh_ss(w.d), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

// one row: the side-by-side kernel's sums, so a dense GEMV gives the same floats with any HS_GEMV_STREAMS
HS_AVX2 static inline float dot_q8_0_avx2(const void* row, const ActQ8* a, int64_t nb) {
  float o;
  dot_q8_0_rows_avx2<1>(&row, a, nb, &o);
  return o;
}

// float16 rows side by side against a float32 x, 16 values a step in two sums per row, x loaded once per
// step for all R: the sums of dot_floats_avx2 (the one-row dot) in the same order, so a row gives the same
// float whether it is computed alone or beside others (a dense GEMV's streams, a sparse row-dot's tail)
// NEXT: rows[R..2R-1] are the next group's rows (ask_next_lines; a step reads 32 bytes of each row)
template <int R, bool NEXT = false>
HS_AVX2 static inline void dot_f16_rows_avx2(const void* const* rows, const float* x, int64_t n, float* out) {
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if constexpr (NEXT) ask_next_lines<R>(rows + R, 2 * i, 32);
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    for (int r = 0; r < R; ++r) {
      const uint16_t* w = static_cast<const uint16_t*>(rows[r]) + i;
      a0[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))), x0, a0[r]);
      a1[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8))), x1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = hsum(_mm256_add_ps(a0[r], a1[r]));
    for (int64_t j = i; j < n; ++j) s += _cvtsh_ss(static_cast<const uint16_t*>(rows[r])[j]) * x[j];
    out[r] = s;
  }
}

namespace isa_avx2 {  // the kernels of cpu_dot_isa.h for AVX2
#define HS_ISA_TARGET HS_AVX2
#define HS_ISA_VNNI 0
#include "cpu_dot_isa.h"
#undef HS_ISA_TARGET
#undef HS_ISA_VNNI
}  // namespace isa_avx2

HS_AVX2 static inline float dot_q4_0_avx2(const void* row, const ActQ8* a, int64_t nb) {
  float out;
  isa_avx2::dot_q45_0_tokens<Q4_0, 1>(row, a, nb, nb, &out);
  return out;
}

HS_AVX2 static inline float dot_q5_0_avx2(const void* row, const ActQ8* a, int64_t nb) {
  float out;
  isa_avx2::dot_q45_0_tokens<Q5_0, 1>(row, a, nb, nb, &out);
  return out;
}


HS_AVX2 static inline __m256 bf16x8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}


// Rows of float16 / bfloat16 / float32 values, 8 at a time as float32 (functors, not lambdas: GCC
// does not give lambdas the AVX2 target of the function they are written in).
struct F16Row {
  const uint16_t* w;
  HS_AVX2 __m256 operator()(int64_t i) const { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i))); }
  HS_AVX2 float at(int64_t i) const { return _cvtsh_ss(w[i]); }
};
struct BF16Row {
  const uint16_t* w;
  HS_AVX2 __m256 operator()(int64_t i) const { return bf16x8(w + i); }
  float at(int64_t i) const {
    uint32_t bits = static_cast<uint32_t>(w[i]) << 16; float f; std::memcpy(&f, &bits, 4);
    return f;
  }
};
struct F32Row {
  const float* w;
  HS_AVX2 __m256 operator()(int64_t i) const { return _mm256_loadu_ps(w + i); }
  float at(int64_t i) const { return w[i]; }
};

template <typename Row>
HS_AVX2 static inline float dot_floats_avx2(Row row, const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(row(i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(row(i + 8), _mm256_loadu_ps(x + i + 8), a1);
  }
  float acc = hsum(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) acc += row.at(i) * x[i];
  return acc;
}

HS_AVX2 static inline float dot_f16_avx2(const void* row, const float* x, int64_t n) {
  return dot_floats_avx2(F16Row{static_cast<const uint16_t*>(row)}, x, n);
}
HS_AVX2 static inline float dot_bf16_avx2(const void* row, const float* x, int64_t n) {
  return dot_floats_avx2(BF16Row{static_cast<const uint16_t*>(row)}, x, n);
}
HS_AVX2 static inline float dot_f32_avx2(const float* a, const float* b, int64_t n) {
  return dot_floats_avx2(F32Row{a}, b, n);
}

HS_AVX2 static inline void axpy_f32_avx2(float s, const float* x, float* y, int64_t n) {
  const __m256 sv = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(sv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += s * x[i];
}
// y[0..n) += s * row, the row in its stored format, for the sparse axpy (no row buffer)
HS_AVX2 static inline void axpy_f16_avx2(float s, const void* row, float* y, int64_t n) {
  const uint16_t* w = static_cast<const uint16_t*>(row);
  const __m256 sv = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(sv, v, _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += s * _cvtsh_ss(w[i]);
}

HS_AVX2 static inline void axpy_bf16_avx2(float s, const void* row, float* y, int64_t n) {
  const uint16_t* w = static_cast<const uint16_t*>(row);
  const __m256 sv = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(sv, bf16x8(w + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(w[i]) << 16; float f; std::memcpy(&f, &bits, 4);
    y[i] += s * f;
  }
}

// 32 signed int8 values times a scale added into y[0..32)
HS_AVX2 static inline void axpy_i8x32_avx2(float s, __m256i q, float* y) {
  const __m256 sv = _mm256_set1_ps(s);
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m256 v[4] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
                       _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
                       _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
                       _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))};
  for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + 8 * j, _mm256_fmadd_ps(sv, v[j], _mm256_loadu_ps(y + 8 * j)));
}

// the 32 int8 values of block b of a row in a block format, centred (Q4_0, Q5_0: minus the offset)
template <int64_t QT>
HS_AVX2 static inline __m256i block_i8x32(const void* row, int64_t b, float* d) {
  if constexpr (QT == Q8_0) {
    const BlockQ8_0& w = static_cast<const BlockQ8_0*>(row)[b];
    *d = _cvtsh_ss(w.d);
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs));
  } else {
    return _mm256_sub_epi8(unsigned_block_q45_0<QT>(row, b, *d), _mm256_set1_epi8(QT == Q4_0 ? 8 : 16));
  }
}

// y[0..n) += s * row for the block formats, a block at a time
template <int64_t QT>
HS_AVX2 static inline void axpy_blocks_avx2(float s, const void* row, float* y, int64_t n) {
  for (int64_t b = 0; b < n / QK; ++b) {
    float d;
    const __m256i q = block_i8x32<QT>(row, b, &d);
    axpy_i8x32_avx2(s * d, q, y + b * QK);
  }
}
HS_AVX2 static inline void axpy_q8_0_avx2(float s, const void* row, float* y, int64_t n) {
  axpy_blocks_avx2<Q8_0>(s, row, y, n);
}
HS_AVX2 static inline void axpy_q4_0_avx2(float s, const void* row, float* y, int64_t n) {
  axpy_blocks_avx2<Q4_0>(s, row, y, n);
}
HS_AVX2 static inline void axpy_q5_0_avx2(float s, const void* row, float* y, int64_t n) {
  axpy_blocks_avx2<Q5_0>(s, row, y, n);
}

// ---- AVX-512 (F, BW, DQ, VL, VNNI): two 32-element blocks per 512-bit register ---------------------
// ---- grouped axpy: y += sum_j s_j * row_j over a group of AXPY_GROUP rows ---------------------------
// One load and one store of y per group instead of per row: with one row at a time the y traffic
// (a 4-byte load and store per 2-byte weight) held the sparse down projection to a quarter of the
// row-dot's bandwidth on the GPU machine's Xeon. (AXPY_GROUP: top of this file.)

// NEXT: rows[AXPY_GROUP..2 AXPY_GROUP-1] are the next group's rows (ask_next_lines)
template <int64_t QT, bool NEXT = false>
HS_AVX2 static inline void axpy_group_blocks_avx2(const float* s, const void* const* rows, float* y, int64_t n) {
  constexpr int64_t block = QT == Q8_0 ? sizeof(BlockQ8_0) : QT == Q5_0 ? sizeof(BlockQ5_0) : sizeof(BlockQ4_0);
  for (int64_t b = 0; b < n / QK; ++b) {
    if constexpr (NEXT) ask_next_lines<AXPY_GROUP>(rows + AXPY_GROUP, b * block, block);
    float* yb = y + b * QK;
    __m256 acc[4] = {_mm256_loadu_ps(yb), _mm256_loadu_ps(yb + 8), _mm256_loadu_ps(yb + 16), _mm256_loadu_ps(yb + 24)};
    for (int j = 0; j < AXPY_GROUP; ++j) {
      float d;
      const __m256i q = block_i8x32<QT>(rows[j], b, &d);
      const __m256 sv = _mm256_set1_ps(s[j] * d);
      const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
      acc[0] = _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), acc[0]);
      acc[1] = _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), acc[1]);
      acc[2] = _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), acc[2]);
      acc[3] = _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), acc[3]);
    }
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(yb + 8 * k, acc[k]);
  }
}

template <bool NEXT = false>
HS_AVX2 static inline void axpy_rows_f16_avx2(const float* s, const void* const* rows, float* y, int64_t n) {
  __m256 sv[AXPY_GROUP];
  for (int j = 0; j < AXPY_GROUP; ++j) sv[j] = _mm256_set1_ps(s[j]);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if constexpr (NEXT) ask_next_lines<AXPY_GROUP>(rows + AXPY_GROUP, 2 * i, 16);
    __m256 acc = _mm256_loadu_ps(y + i);
    for (int j = 0; j < AXPY_GROUP; ++j)
      acc = _mm256_fmadd_ps(sv[j], _mm256_cvtph_ps(_mm_loadu_si128(
                                       reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(rows[j]) + i))), acc);
    _mm256_storeu_ps(y + i, acc);
  }
  for (; i < n; ++i)
    for (int j = 0; j < AXPY_GROUP; ++j) y[i] += s[j] * _cvtsh_ss(static_cast<const uint16_t*>(rows[j])[i]);
}
HS_AVX2 static inline void axpy_group_f16_avx2(const float* s, const void* const* rows, float* y, int64_t n) {
  axpy_rows_f16_avx2(s, rows, y, n);
}
HS_AVX2 static inline void axpy_group_f16_avx2_next(const float* s, const void* const* rows, float* y, int64_t n) {
  axpy_rows_f16_avx2<true>(s, rows, y, n);
}
HS_AVX2 static inline void axpy_group_q8_0_avx2(const float* s, const void* const* r, float* y, int64_t n) {
  axpy_group_blocks_avx2<Q8_0>(s, r, y, n);
}
HS_AVX2 static inline void axpy_group_q8_0_avx2_next(const float* s, const void* const* r, float* y, int64_t n) {
  axpy_group_blocks_avx2<Q8_0, true>(s, r, y, n);
}
// Q4_0: the 16 bytes of a block widened to 32-bit lanes straight from memory (byte i holds values i
// and i + 16: the low nibbles give lanes 0-15, the high ones 16-31), converted and added in; the
// offset of 8 once per block for the group (-8 * sum of the scales) instead of per value. Fewer
// shuffles than the int8 form above, whose cross-lane moves were the limit: ~1.3x per row (Zen 4).
template <bool NEXT = false>
HS_AVX2 static inline void axpy_rows_q4_0_avx2(const float* s, const void* const* rows, float* y, int64_t n) {
  const __m256i m4 = _mm256_set1_epi32(0x0F);
  for (int64_t b = 0; b < n / QK; ++b) {
    if constexpr (NEXT) ask_next_lines<AXPY_GROUP>(rows + AXPY_GROUP, b * int64_t{sizeof(BlockQ4_0)}, sizeof(BlockQ4_0));
    float* yb = y + b * QK;
    __m256 acc[4] = {_mm256_loadu_ps(yb), _mm256_loadu_ps(yb + 8), _mm256_loadu_ps(yb + 16), _mm256_loadu_ps(yb + 24)};
    float scales = 0.f;
    for (int j = 0; j < AXPY_GROUP; ++j) {
      const BlockQ4_0& w = static_cast<const BlockQ4_0*>(rows[j])[b];
      const float sd = s[j] * _cvtsh_ss(w.d);
      scales += sd;
      const __m256 sv = _mm256_set1_ps(sd);
      const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.qs)));
      const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.qs + 8)));
      acc[0] = _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_and_si256(v0, m4)), acc[0]);
      acc[1] = _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_and_si256(v1, m4)), acc[1]);
      acc[2] = _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), acc[2]);
      acc[3] = _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), acc[3]);
    }
    const __m256 off = _mm256_set1_ps(-8.f * scales);
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(yb + 8 * k, _mm256_add_ps(acc[k], off));
  }
}
HS_AVX2 static inline void axpy_group_q4_0_avx2(const float* s, const void* const* rows, float* y, int64_t n) {
  axpy_rows_q4_0_avx2(s, rows, y, n);
}
HS_AVX2 static inline void axpy_group_q4_0_avx2_next(const float* s, const void* const* rows, float* y, int64_t n) {
  axpy_rows_q4_0_avx2<true>(s, rows, y, n);
}
HS_AVX2 static inline void axpy_group_q5_0_avx2(const float* s, const void* const* r, float* y, int64_t n) {
  axpy_group_blocks_avx2<Q5_0>(s, r, y, n);
}

#define HS_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))

// unsigned weights u (0..128) against both planes with 256-bit VNNI: 128 * (u . x0) + (u . x1) per
// int32 lane; dpbusd sums four products in 32 bits (no int16 saturation on the way)
HS_AVX512 static inline __m256i dot2_vnni256(__m256i u, __m256i x0, __m256i x1) {
  const __m256i i0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x0);
  const __m256i i1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x1);
  return _mm256_add_epi32(_mm256_slli_epi32(i0, 7), i1);  // PLANE_SHIFT = 128
}

namespace isa_vnni {  // the kernels of cpu_dot_isa.h with AVX-512 VNNI
#define HS_ISA_TARGET HS_AVX512
#define HS_ISA_VNNI 1
#include "cpu_dot_isa.h"
#undef HS_ISA_TARGET
#undef HS_ISA_VNNI
}  // namespace isa_vnni

HS_AVX512 static inline __m512i join256(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// both activation planes of blocks b and b+1, 64 bytes each
HS_AVX512 static inline void act_planes_2(const ActQ8* a, __m512i& x0, __m512i& x1) {
  x0 = join256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[0].qs[0])),
               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[1].qs[0])));
  x1 = join256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[0].qs[1])),
               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[1].qs[1])));
}

// one float per 256-bit half: the scales of blocks b and b+1
HS_AVX512 static inline __m512 scales_2(float s0, float s1) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(s0)), _mm256_set1_ps(s1), 1);
}

// The dots of R Q8_0 rows with one quantized x, side by side (see dot_f16_rows_avx512; R = 1 is the
// plain dot): two blocks per 512-bit register, the activation planes loaded once per pair of blocks for all
// R rows. The weights go unsigned (w + 128: one xor with 0x80), and each plane's dot starts from -128 times
// the sum of its four activations per lane (one vpdpbusd with ones a plane and pair of blocks, shared by the
// rows), so that a row's lane ends at the same int32 as w . x; where moving the weight's sign onto the
// activations took a mask, two masked subtractions and an absolute value per row (session 33: one
// operation a row and pair of blocks instead of four; the same int32 sums, so the same floats, checked bit
// for bit against the old form; dev VM, a Xeon, eight 4096-wide rows in L2: 19.0-19.5 -> 22.9-23.4 GiB/s;
// S5's Q8_0 predictors from memory in eight streams, 2 threads: 20.7-21.0 -> 22.3). A pair's two scales
// come from one 64-byte load of it by a word permute and one conversion, times the activations' pair of
// scales made once per step for all the rows, where each row converted and multiplied two scalars and
// broadcast them into halves: 21.6-22.2 -> 28.6-28.9 GiB/s in L2, the predictors from memory 21.2-21.5 ->
// 22.7 (two threads), 11.7-12.1 -> 12.8 (one); the same floats. Gathering a chunk of 16 scales at once
// was faster still in cache (28.9) but 10% slower from memory (it reads lines the stream has not reached),
// and gathering the next chunk's while this one computes gave 23.7 in cache and lost from memory too.
// NEXT: as dot_q4_0_rows_wide's, rows[R..2R-1] are the next group's rows, asked for as this group's pass the
// same place (a step's 68 bytes touch at most two lines of each)
// Word k of a pair of Q8_0 blocks' scales (from the pair's first 64 bytes): the first block's d (word 0) for
// k < 8, the second's (word 17) for 8 <= k < 16
alignas(64) inline constexpr uint16_t Q8_0_PAIR_D_INDEX[32] = {0, 0, 0, 0, 0, 0, 0, 0, 17, 17, 17, 17, 17, 17, 17, 17};

template <int R, bool ONE_PLANE = false, bool NEXT = false>
HS_AVX512 static inline void dot_q8_0_rows_avx512(const void* const* rows, const ActQ8* a, int64_t nb, float* out) {
  static_assert(PLANE_SHIFT == 128, "the planes combine with a shift by 7");
  const BlockQ8_0* w[R];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    w[r] = static_cast<const BlockQ8_0*>(rows[r]);
    acc[r] = _mm512_setzero_ps();
  }
  const __m512i didx = _mm512_load_si512(Q8_0_PAIR_D_INDEX);
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    if constexpr (NEXT) {
      for (int r = 0; r < R; ++r) {
        const char* nx = static_cast<const char*>(rows[R + r]) + b * static_cast<int64_t>(sizeof(BlockQ8_0));
        _mm_prefetch(nx, _MM_HINT_T1);
        _mm_prefetch(nx + 2 * sizeof(BlockQ8_0) - 1, _MM_HINT_T1);
      }
    }
    __m512i x0, x1;
    act_planes_2(a + b, x0, x1);
    const float d0 = a[b].d * (ONE_PLANE ? PLANE_SHIFT : 1), d1 = a[b + 1].d * (ONE_PLANE ? PLANE_SHIFT : 1);
    // -128 * (the plane's four activations of each lane): the start of the plane's dot with w + 128
    const __m512i ones = _mm512_set1_epi8(1);
    const __m512i s0 = _mm512_sub_epi32(_mm512_setzero_si512(),
                                        _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, x0), 7));
    __m512i s1 = _mm512_setzero_si512();
    if constexpr (!ONE_PLANE)
      s1 = _mm512_sub_epi32(_mm512_setzero_si512(),
                            _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, x1), 7));
    const __m512 dx = scales_2(d0, d1);
    for (int r = 0; r < R; ++r) {
      const __m512i u = _mm512_xor_si512(join256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r][b].qs)),
                                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r][b + 1].qs))),
                                         _mm512_set1_epi8(static_cast<char>(0x80)));
      // the pair's two d's from its first 64 bytes, one to each half (a word permute)
      const __m512i A = _mm512_loadu_si512(w[r] + b);
      __m512i i;
      if constexpr (ONE_PLANE) {
        i = _mm512_dpbusd_epi32(s0, u, x0);
      } else {
        i = _mm512_add_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(s0, u, x0), 7), _mm512_dpbusd_epi32(s1, u, x1));
      }
      const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(didx, A)));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(i), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r] = _mm512_reduce_add_ps(acc[r]);
    if (b < nb)
      out[r] += hsum(block_dot2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r][b].qs)), a[b],
                                _cvtsh_ss(w[r][b].d), _mm256_setzero_ps()));
  }
}

HS_AVX512 static inline float dot_q8_0_avx512(const void* row, const ActQ8* a, int64_t nb) {
  float out;
  dot_q8_0_rows_avx512<1>(&row, a, nb, &out);
  return out;
}

// Q8_0 rows against a tile of tokens with VNNI: the weights' magnitudes and signs taken once per
// block for all the tokens, the sign moved onto each token's activations (one token's rows instead start
// each plane's dot from its activations' lane sums, dot_q8_0_rows_avx512), one vpdpbusd per plane. Without it a prompt read each row once per token.
template <int NT>
HS_AVX512 static inline void dot_q8_0_tokens_vnni(const void* row, const ActQ8* a, int64_t nb, int64_t stride,
                                                  float* out) {
  const BlockQ8_0* w = static_cast<const BlockQ8_0*>(row);
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b].qs));
    const __mmask32 neg = _mm256_movepi8_mask(q);
    const __m256i mag = _mm256_abs_epi8(q);
    const float dw = _cvtsh_ss(w[b].d);
    for (int t = 0; t < NT; ++t) {
      const ActQ8& at = a[t * stride + b];
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at.qs[0]));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at.qs[1]));
      const __m256i y0 = _mm256_mask_sub_epi8(x0, neg, _mm256_setzero_si256(), x0);
      const __m256i y1 = _mm256_mask_sub_epi8(x1, neg, _mm256_setzero_si256(), x1);
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * at.d), _mm256_cvtepi32_ps(dot2_vnni256(mag, y0, y1)), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[t]);
}

template <int64_t QT>
HS_AVX512 static inline float dot_q45_0_vnni(const void* row, const ActQ8* a, int64_t nb) {
  float out;
  isa_vnni::dot_q45_0_rows<QT, 1>(&row, a, nb, &out);
  return out;
}
HS_AVX512 static inline float dot_q4_0_avx512(const void* row, const ActQ8* a, int64_t nb) {
  return dot_q45_0_vnni<Q4_0>(row, a, nb);
}
HS_AVX512 static inline float dot_q5_0_avx512(const void* row, const ActQ8* a, int64_t nb) {
  return dot_q45_0_vnni<Q5_0>(row, a, nb);
}

// Prompts (several tokens) on Q4_0 / Q5_0 rows, 8 or 16 rows at a time with VNNI: the rows' blocks are
// unpacked once per call into a buffer laid out row-interleaved (pack8_q45_0: int32 lane r of the k-th
// vector of a block holds elements 4k..4k+3 of row r), and each token's four activation bytes meet all
// the rows in one vpdpbusd with a broadcast operand, so one instruction serves 8 (256-bit) or 16
// (512-bit) rows, and the scales, the offset term and the float accumulation are one vector operation
// per token and block for all of them, where the per-row tile (dot_q45_0_tokens) spent them per row.
// The same int32 sums as the per-row kernels; the float sums round in another order.
// Q8_0 rows go the same way with their weights made unsigned (w + 128, an exact byte flip) and an offset of
// 128: their biased int32 sums exceed float's 24 bits, so they round once in the conversion (at most 4
// in ~10^8; the float sums of the per-row kernels round more). AVX2's vpmaddubsw would saturate on
// them: Q8_0 takes this route only with VNNI.
constexpr float prompt_offset(int64_t qt) { return qt == Q4_0 ? 8.f : qt == Q5_0 ? 16.f : 128.f; }
template <int64_t QT>
HS_AVX2 static inline __m256i unsigned_block_prompt(const void* row, int64_t b, float& dw) {
  if constexpr (QT == Q8_0) {
    const BlockQ8_0& w = static_cast<const BlockQ8_0*>(row)[b];
    dw = _cvtsh_ss(w.d);
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs)), _mm256_set1_epi8(char(0x80)));
  } else {
    return unsigned_block_q45_0<QT>(row, b, dw);
  }
}
// pack8_q45_0: rows[0..7] -> the 256-bit half `half` of `halves` of each vector: block b's k-th vector
// at w[(b * 8 + k) * halves + half], row r's scale at d[(b * halves + half) * 8 + r]
template <int64_t QT>
HS_AVX2 static inline void pack8_q45_0(const void* const* rows, int64_t nb, __m256i* w, float* d, int half,
                                         int halves) {
  for (int64_t b = 0; b < nb; ++b) {
    __m256i u[8];
    float* db = d + (b * halves + half) * 8;
    for (int r = 0; r < 8; ++r) u[r] = unsigned_block_prompt<QT>(rows[r], b, db[r]);
    // 8 x 8 int32 transpose: u[r] lane k -> vector k lane r
    __m256i t[8], s[8];
    for (int r = 0; r < 8; r += 2) {
      t[r] = _mm256_unpacklo_epi32(u[r], u[r + 1]);
      t[r + 1] = _mm256_unpackhi_epi32(u[r], u[r + 1]);
    }
    for (int h = 0; h < 8; h += 4) {
      s[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
      s[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
      s[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
      s[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
    }
    __m256i* o = w + b * 8 * halves + half;
    for (int k = 0; k < 4; ++k) {
      _mm256_store_si256(o + k * halves, _mm256_permute2x128_si256(s[k], s[k + 4], 0x20));
      _mm256_store_si256(o + (k + 4) * halves, _mm256_permute2x128_si256(s[k], s[k + 4], 0x31));
    }
  }
}

// The dots of 16 packed rows (pack8_q45_0 into 2 halves) with NT tokens: out[t * 16 + r] = row r . token t,
// where a[t * stride + b] is block b of token t. ONE_PLANE: the activations' second plane is zero. (Eight
// rows, the last group of a share: dot8_q45_0_tokens_vnni256 below.)
template <int64_t QT, int NT, bool ONE_PLANE = false>
HS_AVX512 static inline void dot16_q45_0_tokens(const void* w, const float* d, const ActQ8* a, int64_t nb,
                                               int64_t stride, float* out) {
  constexpr float offset = prompt_offset(QT);
  const __m512i* wv = static_cast<const __m512i*>(w);
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i wk[8];
    for (int k = 0; k < 8; ++k) wk[k] = wv[b * 8 + k];
    const __m512 dw = _mm512_loadu_ps(d + b * 16);
    for (int t = 0; t < NT; ++t) {
      const ActQ8& at = a[t * stride + b];
      const float ad = ONE_PLANE ? at.d * PLANE_SHIFT : at.d, as = offset * at.dsum;
      const int32_t* x0 = reinterpret_cast<const int32_t*>(at.qs[0]);
      const int32_t* x1 = reinterpret_cast<const int32_t*>(at.qs[1]);
      __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
      for (int k = 0; k < 8; ++k) i0 = _mm512_dpbusd_epi32(i0, wk[k], _mm512_set1_epi32(x0[k]));
      if constexpr (!ONE_PLANE) {
        for (int k = 0; k < 8; ++k) i1 = _mm512_dpbusd_epi32(i1, wk[k], _mm512_set1_epi32(x1[k]));
        i0 = _mm512_add_epi32(_mm512_slli_epi32(i0, 7), i1);  // PLANE_SHIFT = 128
      }
      const __m512 u = _mm512_fmsub_ps(_mm512_cvtepi32_ps(i0), _mm512_set1_ps(ad), _mm512_set1_ps(as));
      acc[t] = _mm512_fmadd_ps(dw, u, acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + t * 16, acc[t]);
}

// dot16_q45_0_tokens for eight rows (pack8_q45_0 into 1 half), in 256-bit registers: with AVX-512 VNNI
// (the last group of a share), with AVX-VNNI (Alder Lake and later: the 256-bit vpdpbusd in VEX form) or
// with AVX2's vpmaddubsw, whose int16 pair sums (at most 2 * 31 * 127) add up four at a time before
// vpmaddwd widens them (weighted by the plane, as dot2_unsigned does). Sixteen vector registers without
// AVX-512: the eight packed vectors are reloaded per token (from L1).
#define HS_DOT8_256_BODY(DOT_PLANE)                                                                    \
  constexpr float offset = prompt_offset(QT);                                                          \
  __m256 acc[NT];                                                                                      \
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();                                           \
  for (int64_t b = 0; b < nb; ++b) {                                                                   \
    const __m256i* wk = static_cast<const __m256i*>(wv) + b * 8;                                      \
    const __m256 dw = _mm256_loadu_ps(d + b * 8);                                                      \
    for (int t = 0; t < NT; ++t) {                                                                     \
      const ActQ8& at = a[t * stride + b];                                                             \
      const float ad = ONE_PLANE ? at.d * PLANE_SHIFT : at.d, as = offset * at.dsum;                   \
      __m256i i = DOT_PLANE(wk, reinterpret_cast<const int32_t*>(at.qs[0]), ONE_PLANE ? 1 : PLANE_SHIFT); \
      if constexpr (!ONE_PLANE)                                                                        \
        i = _mm256_add_epi32(i, DOT_PLANE(wk, reinterpret_cast<const int32_t*>(at.qs[1]), 1));          \
      const __m256 u = _mm256_fmsub_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(ad), _mm256_set1_ps(as)); \
      acc[t] = _mm256_fmadd_ps(dw, u, acc[t]);                                                         \
    }                                                                                                  \
  }                                                                                                    \
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out + t * 8, acc[t]);

// weight * sum over k of packed vector k against the broadcast activation dword x[k]
HS_AVX2 static inline __m256i dot8_plane_avx2(const __m256i* wk, const int32_t* x, int16_t weight) {
  __m256i s = _mm256_setzero_si256();
  for (int h = 0; h < 8; h += 4) {
    __m256i p = _mm256_maddubs_epi16(_mm256_load_si256(wk + h), _mm256_set1_epi32(x[h]));
    for (int k = h + 1; k < h + 4; ++k)
      p = _mm256_add_epi16(p, _mm256_maddubs_epi16(_mm256_load_si256(wk + k), _mm256_set1_epi32(x[k])));
    s = _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(weight)));
  }
  return s;
}
template <int64_t QT, int NT, bool ONE_PLANE>
HS_AVX2 static inline void dot8_q45_0_tokens_avx2(const void* wv, const float* d, const ActQ8* a, int64_t nb,
                                                   int64_t stride, float* out) {
  HS_DOT8_256_BODY(dot8_plane_avx2)
}

#define HS_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
HS_AVXVNNI static inline __m256i dot8_plane_avxvnni(const __m256i* wk, const int32_t* x, int16_t weight) {
  __m256i s = _mm256_setzero_si256();
  for (int k = 0; k < 8; ++k) s = _mm256_dpbusd_avx_epi32(s, _mm256_load_si256(wk + k), _mm256_set1_epi32(x[k]));
  return weight == 1 ? s : _mm256_slli_epi32(s, 7);  // PLANE_SHIFT = 128
}
template <int64_t QT, int NT, bool ONE_PLANE>
HS_AVXVNNI static inline void dot8_q45_0_tokens_avxvnni(const void* wv, const float* d, const ActQ8* a, int64_t nb,
                                                        int64_t stride, float* out) {
  HS_DOT8_256_BODY(dot8_plane_avxvnni)
}
HS_AVX512 static inline __m256i dot8_plane_vnni256(const __m256i* wk, const int32_t* x, int16_t weight) {
  __m256i s = _mm256_setzero_si256();
  for (int k = 0; k < 8; ++k) s = _mm256_dpbusd_epi32(s, _mm256_load_si256(wk + k), _mm256_set1_epi32(x[k]));
  return weight == 1 ? s : _mm256_slli_epi32(s, 7);  // PLANE_SHIFT = 128
}
template <int64_t QT, int NT, bool ONE_PLANE>
HS_AVX512 static inline void dot8_q45_0_tokens_vnni256(const void* wv, const float* d, const ActQ8* a, int64_t nb,
                                                       int64_t stride, float* out) {
  HS_DOT8_256_BODY(dot8_plane_vnni256)
}
#undef HS_DOT8_256_BODY

// Q4_0 rows four blocks (72 bytes) at a time in 512-bit registers (AVX-512 VBMI + VNNI; HS_Q4_WIDE=0
// turns it off): one byte permute gathers the four blocks' 64 nibble
// bytes, the low and high nibbles meet activations laid out to match (ActQ4G, arranged once per call),
// and the Q4_0 offset is an int32 term per lane, so a block costs ~5 vector instructions instead of ~15.
// One token only (a prompt's tiles keep the per-block form). Dev VM (Zen 4, whose 512-bit integer ops
// are double-pumped), one thread: 4096-wide rows in cache 13.2 -> 19.6 GiB/s every row, 11.9 -> 15.7
// listed; the fused FFN over 7B / 13B / 70B Q4_0 rows from memory 1.09-1.18x. The same int32 sums as
// dot_q45_0_rows; the scales are applied per lane (d_w * d_x), so the float sums round in another order.
// Activations of blocks 4G .. 4G+3 for them: lo/hi = elements 0..15 / 16..31 of each block, block j at
// bytes 16j .. 16j+15, one array per plane; int32 lane 4j + k (vpdpbusd's sum of bytes 4L .. 4L+3 of
// lo and hi) gets corr = -8 * the sum of its 8 elements' 128 * q0 + q1, and d = block j's scale.
struct alignas(64) ActQ4G {
  int8_t lo0[64], hi0[64], lo1[64], hi1[64];
  int32_t corr[16];
  float d[16];
};

#define HS_AVX512_VBMI \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c")))

// byte 16j + m of a group's nibbles: byte 18j + 2 + m of its 72 (vpermt2b: 64 and up from the second
// register); word 4j + k of its scales: word 9j (block j's d)
alignas(64) inline constexpr uint8_t Q4G_QS_INDEX[64] = {
    2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22, 23, 24, 25,
    26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49,
    50, 51, 52, 53, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71};
alignas(64) inline constexpr uint16_t Q4G_D_INDEX[32] = {0,  0,  0,  0,  9,  9,  9,  9,  18, 18, 18,
                                                         18, 27, 27, 27, 27, 0,  0,  0,  0,  0,  0,
                                                         0,  0,  0,  0,  0,  0,  0,  0,  0,  0};

// ActQ4G from a token's ActQ8 blocks (whole groups of four), once per call (8192 values: ~1.6 us on one
// Zen 4 core; scalar code took ~5.7): the halves copied 16 bytes at a time, each lane's sums of the
// planes by vpdpbusd with ones
HS_AVX512_VBMI static inline void arrange_q4g_avx512(const ActQ8* a, int64_t nb, ActQ4G* g) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t G = 0; G < nb / 4; ++G) {
    ActQ4G& o = g[G];
    const ActQ8* b = a + 4 * G;
    for (int j = 0; j < 4; ++j) {
      _mm_store_si128(reinterpret_cast<__m128i*>(o.lo0 + 16 * j), _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[j].qs[0])));
      _mm_store_si128(reinterpret_cast<__m128i*>(o.hi0 + 16 * j), _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[j].qs[0] + 16)));
      _mm_store_si128(reinterpret_cast<__m128i*>(o.lo1 + 16 * j), _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[j].qs[1])));
      _mm_store_si128(reinterpret_cast<__m128i*>(o.hi1 + 16 * j), _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[j].qs[1] + 16)));
    }
    const __m512i s0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_load_si512(o.lo0)),
                                           ones, _mm512_load_si512(o.hi0));
    const __m512i s1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_load_si512(o.lo1)),
                                           ones, _mm512_load_si512(o.hi1));
    // -8 * (128 * s0 + s1)
    _mm512_store_si512(o.corr, _mm512_sub_epi32(_mm512_setzero_si512(),
                                                _mm512_add_epi32(_mm512_slli_epi32(s0, 10), _mm512_slli_epi32(s1, 3))));
    _mm512_store_ps(o.d, _mm512_setr_ps(b[0].d, b[0].d, b[0].d, b[0].d, b[1].d, b[1].d, b[1].d, b[1].d, b[2].d, b[2].d,
                                        b[2].d, b[2].d, b[3].d, b[3].d, b[3].d, b[3].d));
  }
}

// PREFETCH (rows one at a time: a dense GEMV's with HS_GEMV_STREAMS=1, see q4_prefetch): each step also asks for the bytes Q4_WIDE_AHEAD
// ahead of it (HS_Q4_AHEAD, read once; default 256, 3.5 steps). A dense GEMV's rows follow each other
// in memory, yet from memory this loop read half what it does in cache (Zen 4 dev VM, one thread,
// 4096-wide rows: 10 GiB/s against 20); 128 / 256 / 512 / 1024 bytes ahead: 16-17 / 16-17 / 15-16 /
// 15. The distance is a variable on purpose: a compile-time 256 reached only 12 GiB/s with this GCC.
// Rows side by side (listed rows, the fused FFN) gained nothing from asking ahead within their own rows;
// what they gain from is asking for the next group's rows (NEXT below).
inline const int64_t Q4_WIDE_AHEAD = [] {
  const long long n = env_int("HS_Q4_AHEAD", 256);
  return n > 0 ? static_cast<int64_t>(n) : int64_t{256};
}();
// The int32 sums of one row's four blocks (72 bytes at p, the first 64 in A) against x's group: lane 4j + k
// is block j's k-th quarter, offset term included. The high nibbles come down by one GF(2) affine byte
// transform (bits 4-7 to 0-3, the rest cleared) where a shift and a mask took two operations.
template <bool ONE_PLANE>
HS_AVX512_VBMI static inline __m512i q4g_row_sums(__m512i A, const uint8_t* p, __m512i iq, __m512i lo0, __m512i hi0,
                                                  __m512i lo1, __m512i hi1, __m512i corr) {
  const __m512i B = _mm512_zextsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 64)));
  const __m512i q = _mm512_permutex2var_epi8(A, iq, B);
  const __m512i lo = _mm512_and_si512(q, _mm512_set1_epi8(0x0F));
  const __m512i hi = _mm512_gf2p8affine_epi64_epi8(q, _mm512_set1_epi64(0x1020408000000000LL), 0);
  const __m512i p0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, lo0), hi, hi0);
  if constexpr (ONE_PLANE) return _mm512_add_epi32(_mm512_slli_epi32(p0, 7), corr);
  return _mm512_add_epi32(_mm512_slli_epi32(p0, 7), _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(corr, lo, lo1), hi, hi1));
}

// Word 4j + r of four rows' scales: row r's block j (word 9j of its 64 bytes), rows 0 / 1 by one two-source
// word permute, rows 2 / 3 by another, then blended (words 4j+2, 4j+3 from the second)
alignas(64) inline constexpr uint16_t Q4G_D01_INDEX[32] = {0, 32, 0, 0, 9, 41, 0, 0, 18, 50, 0, 0, 27, 59, 0, 0};
alignas(64) inline constexpr uint16_t Q4G_D23_INDEX[32] = {0, 0, 0, 32, 0, 0, 9, 41, 0, 0, 18, 50, 0, 0, 27, 59};

// NEXT (rows side by side at scattered places: a sparse row-dot's or the fused FFN's groups): rows[R..2R-1]
// are the rows of the group that comes next, and each step asks for their lines into L2 (prefetcht1), one
// line of each a step and every eighth step one more (a row of ng groups has ~1.125 ng lines), so that
// their reads are spread over this group's work and under way when it starts; the hardware prefetchers
// do not follow a jump from one listed row to the next (dev VM's Zen 4, 7B Q4_0 rows, 33% listed, one
// thread: 7.2 -> 9.6 GiB/s, where a GEMV over all rows reads 14-15; all the next rows asked for at once,
// +5%; into L1 (prefetcht0), slower than none).
// R a multiple of 4: the rows four at a time, their int32 sums (16 lanes a row, 4 a block) added down to one lane
// per row and block by two rounds of unpacks within 128-bit lanes (lane 4j + r: row r, block j), so that the
// scales, the conversion to float and the multiply-add are one operation per group for four rows instead of
// one per row; with the affine high nibbles, dev VM (a Xeon, one thread, 8192-wide rows in L2, eight side by
// side): 22.7 -> 25.8 GiB/s (/tmp microbenchmark, session 33). The same int32 sums; a block's four quarters
// are added as integers before one multiply by d_w * d_x (rows one or two at a time too, by two in-lane
// shuffles, so that a row gives the same float sum beside any rows), and the float sums round in another
// order than the 256-bit form's.
template <int R, bool ONE_PLANE = false, bool PREFETCH = false, bool NEXT = false>
HS_AVX512_VBMI static inline void dot_q4_0_rows_wide(const void* const* rows, const ActQ4G* g, const ActQ8* a,
                                                     int64_t nb, float* out) {
  static_assert(PLANE_SHIFT == 128, "the planes combine with a shift by 7");
  constexpr bool FOURS = R % 4 == 0;
  constexpr int NACC = FOURS ? R / 4 : R;
  const int64_t ng = nb / 4;
  const __m512i iq = _mm512_load_si512(Q4G_QS_INDEX);
  const __m512i id = _mm512_load_si512(Q4G_D_INDEX);
  const __m512i id01 = _mm512_load_si512(Q4G_D01_INDEX), id23 = _mm512_load_si512(Q4G_D23_INDEX);
  const uint8_t* w[R];
  __m512 acc[NACC];
  for (int r = 0; r < R; ++r) w[r] = static_cast<const uint8_t*>(rows[r]);
  for (int r = 0; r < NACC; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t G = 0; G < ng; ++G) {
    if constexpr (NEXT) {
      for (int r = 0; r < R; ++r) {
        const char* nx = static_cast<const char*>(rows[R + r]);
        _mm_prefetch(nx + G * 64, _MM_HINT_T1);
        if ((G & 7) == 0) _mm_prefetch(nx + (ng + (G >> 3)) * 64, _MM_HINT_T1);
      }
    }
    const ActQ4G& x = g[G];
    const __m512i lo0 = _mm512_load_si512(x.lo0), hi0 = _mm512_load_si512(x.hi0);
    const __m512i corr = _mm512_load_si512(x.corr);
    const __m512 dx = _mm512_load_ps(x.d);
    __m512i lo1 = _mm512_setzero_si512(), hi1 = _mm512_setzero_si512();
    if constexpr (!ONE_PLANE) {
      lo1 = _mm512_load_si512(x.lo1);
      hi1 = _mm512_load_si512(x.hi1);
    }
    if constexpr (FOURS) {
      for (int r4 = 0; r4 < R; r4 += 4) {
        __m512i A[4], v[4];
        for (int s = 0; s < 4; ++s) {
          const uint8_t* p = w[r4 + s] + G * 4 * sizeof(BlockQ4_0);
          A[s] = _mm512_loadu_si512(p);
          v[s] = q4g_row_sums<ONE_PLANE>(A[s], p, iq, lo0, hi0, lo1, hi1, corr);
        }
        const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
        const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
        const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
        const __m512i dw = _mm512_mask_blend_epi16(0xCCCC, _mm512_permutex2var_epi16(A[0], id01, A[1]),
                                                   _mm512_permutex2var_epi16(A[2], id23, A[3]));
        acc[r4 / 4] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(dw)), dx),
                                      _mm512_cvtepi32_ps(u), acc[r4 / 4]);
      }
    } else {
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + G * 4 * sizeof(BlockQ4_0);
        if constexpr (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(p + Q4_WIDE_AHEAD), _MM_HINT_T0);
        const __m512i A = _mm512_loadu_si512(p);
        const __m512i v = q4g_row_sums<ONE_PLANE>(A, p, iq, lo0, hi0, lo1, hi1, corr);
        // every lane of block j its whole sum, so that lanes 0, 4, 8, 12 hold what the four-rows form does
        const __m512i v2 = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_BADC));
        const __m512i u = _mm512_add_epi32(v2, _mm512_shuffle_epi32(v2, _MM_PERM_CDAB));
        const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(id, A)));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(u), acc[r]);
      }
    }
  }
  float tail[R] = {};
  if (nb > 4 * ng) {  // the last 1-3 blocks: the 256-bit kernel on the rows' ends
    const void* ends[R];
    for (int r = 0; r < R; ++r) ends[r] = w[r] + ng * 4 * sizeof(BlockQ4_0);
    isa_vnni::dot_q45_0_rows<Q4_0, R, ONE_PLANE>(ends, a + 4 * ng, nb - 4 * ng, tail);
  }
  // row r4 + s: lanes s, 4 + s, 8 + s, 12 + s of its group's sums (the row's own, one at a time: lanes 0, 4, 8, 12),
  // added in the same order either way, so that a row's dot does not depend on the rows beside it
  for (int k = 0; k < NACC; ++k) {
    alignas(64) float l[16];
    _mm512_store_ps(l, acc[k]);
    for (int s = 0; s < (FOURS ? 4 : 1); ++s) {
      const int r = FOURS ? 4 * k + s : k;
      out[r] = ((l[s] + l[4 + s]) + (l[8 + s] + l[12 + s])) + tail[r];
    }
  }
}

// The dots of R float16 rows with one x (out[r] = rows[r] . x): R rows streamed side by side, x read
// once per step, two sums per row; R = 1 is the plain dot. For rows scattered in memory (sparse
// row-dots, the fused FFN) more streams in flight per core than one row at a time gives.
// NEXT: as dot_q4_0_rows_wide's, rows[R..2R-1] are the next group's rows, a line of each asked for a step
template <int R, bool NEXT = false>
HS_AVX512 static inline void dot_f16_rows_avx512(const void* const* rows, const float* x, int64_t n, float* out) {
  const uint16_t* w[R];
  __m512 a[R][2];
  for (int r = 0; r < R; ++r) {
    w[r] = static_cast<const uint16_t*>(rows[r]);
    a[r][0] = _mm512_setzero_ps();
    a[r][1] = _mm512_setzero_ps();
  }
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if constexpr (NEXT) ask_next_lines<R>(rows + R, 2 * i, 64);  // a step reads a line of each row
    const __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + i + 16);
    for (int r = 0; r < R; ++r) {
      a[r][0] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + i))), x0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + i + 16))), x1,
                                a[r][1]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][0], a[r][1])) + (i < n ? dot_f16_avx2(w[r] + i, x + i, n - i) : 0.f);
}

HS_AVX512 static inline float dot_f16_avx512(const void* row, const float* x, int64_t n) {
  float out;
  dot_f16_rows_avx512<1>(&row, x, n, &out);
  return out;
}

// NEXT: rows[G..2G-1] are the rows of the group that comes next, a line of each asked for into L2 as this
// group's rows pass one (see axpy_rows_blocks_avx512's NEXT)
template <bool NEXT = false>
HS_AVX512 static inline void axpy_rows_f16_avx512(const float* s, const void* const* rows, float* y, int64_t n) {
  __m512 sv[AXPY_GROUP];
  for (int j = 0; j < AXPY_GROUP; ++j) sv[j] = _mm512_set1_ps(s[j]);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if constexpr (NEXT) ask_next_lines<AXPY_GROUP>(rows + AXPY_GROUP, 2 * i, 32);  // a step reads 32 bytes of each row
    __m512 acc = _mm512_loadu_ps(y + i);
    for (int j = 0; j < AXPY_GROUP; ++j)
      acc = _mm512_fmadd_ps(sv[j], _mm512_cvtph_ps(_mm256_loadu_si256(
                                       reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(rows[j]) + i))), acc);
    _mm512_storeu_ps(y + i, acc);
  }
  if (i < n) {
    const void* rest[AXPY_GROUP];
    for (int j = 0; j < AXPY_GROUP; ++j) rest[j] = static_cast<const uint16_t*>(rows[j]) + i;
    axpy_group_f16_avx2(s, rest, y + i, n - i);
  }
}
HS_AVX512 static inline void axpy_group_f16_avx512(const float* s, const void* const* rows, float* y, int64_t n) {
  axpy_rows_f16_avx512(s, rows, y, n);
}
HS_AVX512 static inline void axpy_group_f16_avx512_next(const float* s, const void* const* rows, float* y, int64_t n) {
  axpy_rows_f16_avx512<true>(s, rows, y, n);
}

// The scales s[j] * d of blocks c .. c+m-1 (m <= 16) of G rows of a block format, as floats in sd[j][0..m): the
// d's gathered by plain 16-bit moves, then one convert and one multiply a row. The axpy loops then take each
// block-row's scale as a broadcast from memory (a load, no shuffle), where they turned d into a float and
// broadcast it for every block of every row: 3-4 of the ~10 vector instructions a block-row, on a Xeon whose
// 512-bit work has two ports (dev VM, session 31, 4096-wide Q4_0 rows in cache, one thread: 213 -> 165 ns a
// row). The same products, so the same sums.
// Q4_0, 16 whole blocks (288 bytes): word 9k of the first 128 bytes is block k's d (k < 8), and of the 128 from
// byte 144 block 8 + k's, so two two-source word permutes with one index gather the 16 (four 64-byte loads,
// where the 16-bit moves and inserts took ~25 operations a row, most of them on the shuffle port; dev VM, a
// Xeon, 8192-wide rows in L2, four rows a group, /tmp microbenchmark, session 33: 11.7 / 11.3 -> 13.2 / 12.4 GiB/s).
alignas(64) inline constexpr uint16_t Q4_0_D8_INDEX[32] = {0, 9, 18, 27, 36, 45, 54, 63};
template <class Block, int G>
HS_AVX512 static inline void block_scales16(const float* s, const void* const* rows, int64_t c, int m, float (*sd)[16]) {
  if constexpr (std::is_same_v<Block, BlockQ4_0>) {
    if (m == 16) {
      const __m512i idx = _mm512_load_si512(Q4_0_D8_INDEX);
      for (int j = 0; j < G; ++j) {
        const uint8_t* r = reinterpret_cast<const uint8_t*>(static_cast<const Block*>(rows[j]) + c);
        const __m512i a = _mm512_permutex2var_epi16(_mm512_loadu_si512(r), idx, _mm512_loadu_si512(r + 64));
        const __m512i b = _mm512_permutex2var_epi16(_mm512_loadu_si512(r + 144), idx, _mm512_loadu_si512(r + 208));
        const __m256i d = _mm256_inserti128_si256(_mm512_castsi512_si256(a), _mm512_castsi512_si128(b), 1);
        _mm512_store_ps(sd[j], _mm512_mul_ps(_mm512_set1_ps(s[j]), _mm512_cvtph_ps(d)));
      }
      return;
    }
  }
  alignas(32) uint16_t dh[16] = {};
  for (int j = 0; j < G; ++j) {
    const Block* r = static_cast<const Block*>(rows[j]) + c;
    for (int k = 0; k < m; ++k) dh[k] = r[k].d;
    _mm512_store_ps(sd[j], _mm512_mul_ps(_mm512_set1_ps(s[j]),
                                         _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dh)))));
  }
}

// A block's 32 values as floats, before its scale: Q4_0's 16 bytes widened to 32-bit lanes once (byte i holds
// values i and i + 16) and the nibbles turned into floats by a 16-entry table holding q - 8 (vpermps reads
// only the low 4 bits of each lane: no mask, no offset term; against a mask, cvtdq2ps and the offset added
// per block: 7.9 -> 9.3 GiB/s on one Zen 4 core with the rows in cache, 6.4 -> 7.5 from memory); Q8_0's two
// halves widened and converted.
HS_AVX512 static inline void block_values_avx512(const BlockQ4_0& w, __m512& v0, __m512& v1) {
  const __m512 lut = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs)));
  v0 = _mm512_permutexvar_ps(v, lut);                       // low nibbles
  v1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);  // high nibbles
}
HS_AVX512 static inline void block_values_avx512(const BlockQ8_0& w, __m512& v0, __m512& v1) {
  v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs))));
  v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + 16))));
}

// Q4_0 / Q8_0 rows added into y with 512-bit lanes, G at a time (1: the direct axpy, AXPY_GROUP: the group's),
// one load and store of y per block for the G rows, the scales from block_scales16.
// NEXT: rows[G..2G-1] are the rows of the group that comes next, asked for into L2 a line of each as this
// group's blocks pass one (see dot_q4_0_rows_wide's NEXT)
template <class Block, int G, bool NEXT = false>
HS_AVX512 static inline void axpy_rows_blocks_avx512(const float* s, const void* const* rows, float* y, int64_t n) {
  const int64_t nb = n / QK;
  alignas(64) float sd[G][16];
  for (int64_t c = 0; c < nb; c += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, nb - c));
    block_scales16<Block, G>(s, rows, c, m, sd);
    for (int k = 0; k < m; ++k) {
      const int64_t b = c + k;
      if constexpr (NEXT) ask_next_lines<G>(rows + G, b * int64_t{sizeof(Block)}, sizeof(Block));
      float* yb = y + b * QK;
      __m512 a0 = _mm512_loadu_ps(yb), a1 = _mm512_loadu_ps(yb + 16);
      for (int j = 0; j < G; ++j) {
        __m512 v0, v1;
        block_values_avx512(static_cast<const Block*>(rows[j])[b], v0, v1);
        const __m512 sv = _mm512_set1_ps(sd[j][k]);
        a0 = _mm512_fmadd_ps(sv, v0, a0);
        a1 = _mm512_fmadd_ps(sv, v1, a1);
      }
      _mm512_storeu_ps(yb, a0);
      _mm512_storeu_ps(yb + 16, a1);
    }
  }
}
HS_AVX512 static inline void axpy_group_q4_0_avx512(const float* s, const void* const* rows, float* y, int64_t n) {
  axpy_rows_blocks_avx512<BlockQ4_0, AXPY_GROUP>(s, rows, y, n);
}
HS_AVX512 static inline void axpy_group_q4_0_avx512_next(const float* s, const void* const* rows, float* y, int64_t n) {
  axpy_rows_blocks_avx512<BlockQ4_0, AXPY_GROUP, true>(s, rows, y, n);
}
HS_AVX512 static inline void axpy_q4_0_avx512(float s, const void* row, float* y, int64_t n) {
  axpy_rows_blocks_avx512<BlockQ4_0, 1>(&s, &row, y, n);
}

// Several tokens' axpy over n rows at once (a prompt's or a batch's down projection): y[t * K + i] +=
// sum_j h[t * hs + j] * row_j[i] for NT tokens. Each block of each row is turned into floats once for the
// NT tokens and their sums over the block stay in registers across the n rows, where the per-token axpy
// turned every row into floats once per token and passed over each token's y (16 KiB a token for a
// 4096-wide model: the tokens' sums live in L2, not L1) once per group of rows. F16, Q8_0, Q4_0.
template <int64_t QT, int NT>
HS_AVX512 static inline void axpy_tokens_avx512(const float* h, int64_t hs, const void* const* rows, int n, float* y,
                                               int64_t K) {
  for (int64_t b = 0; b < K / QK; ++b) {
    __m512 a[NT][2];
    for (int t = 0; t < NT; ++t) {
      a[t][0] = _mm512_loadu_ps(y + t * K + b * QK);
      a[t][1] = _mm512_loadu_ps(y + t * K + b * QK + 16);
    }
    for (int j = 0; j < n; ++j) {
      __m512 w0, w1;
      if constexpr (QT == F16) {
        const uint16_t* r = static_cast<const uint16_t*>(rows[j]) + b * QK;
        w0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r)));
        w1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 16)));
      } else {
        static_assert(QT == Q8_0 || QT == Q4_0, "F16, Q8_0 or Q4_0");
        using Block = std::conditional_t<QT == Q8_0, BlockQ8_0, BlockQ4_0>;
        const Block& w = static_cast<const Block*>(rows[j])[b];
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(w.d));
        block_values_avx512(w, w0, w1);
        w0 = _mm512_mul_ps(d, w0);
        w1 = _mm512_mul_ps(d, w1);
      }
      for (int t = 0; t < NT; ++t) {
        const __m512 sv = _mm512_set1_ps(h[t * hs + j]);
        a[t][0] = _mm512_fmadd_ps(sv, w0, a[t][0]);
        a[t][1] = _mm512_fmadd_ps(sv, w1, a[t][1]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      _mm512_storeu_ps(y + t * K + b * QK, a[t][0]);
      _mm512_storeu_ps(y + t * K + b * QK + 16, a[t][1]);
    }
  }
  if constexpr (QT == F16) {  // a float16 row's last K % 32 values
    for (int64_t i = K / QK * QK; i < K; ++i)
      for (int j = 0; j < n; ++j) {
        const float w = _cvtsh_ss(static_cast<const uint16_t*>(rows[j])[i]);
        for (int t = 0; t < NT; ++t) y[t * K + i] += h[t * hs + j] * w;
      }
  }
}

// axpy_tokens_avx512 for CPUs without AVX-512: eight values of the n rows at a time (one 256-bit sum per
// token in registers), each block's eighths turned into floats once for the NT tokens.
template <int64_t QT, int NT>
HS_AVX2 static inline void axpy_tokens_avx2(const float* h, int64_t hs, const void* const* rows, int n, float* y,
                                            int64_t K) {
  for (int64_t i = 0; i + 8 <= K / QK * QK; i += 8) {
    const int64_t b = i / QK, e = i % QK;  // block, first element in it
    __m256 a[NT];
    for (int t = 0; t < NT; ++t) a[t] = _mm256_loadu_ps(y + t * K + i);
    for (int j = 0; j < n; ++j) {
      __m256 w;
      if constexpr (QT == F16) {
        w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(rows[j]) + i)));
      } else if constexpr (QT == Q8_0) {
        const BlockQ8_0& blk = static_cast<const BlockQ8_0*>(rows[j])[b];
        w = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(blk.d)),
                          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.qs + e)))));
      } else {
        static_assert(QT == Q4_0, "F16, Q8_0 or Q4_0");
        const BlockQ4_0& blk = static_cast<const BlockQ4_0*>(rows[j])[b];
        // elements e..e+7: the low nibbles of bytes e..e+7 (e < 16) or the high ones of bytes e-16..e-9
        __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.qs + (e & 15))));
        if (e >= 16) q = _mm256_srli_epi32(q, 4);
        q = _mm256_and_si256(q, _mm256_set1_epi32(0x0F));
        const float d = _cvtsh_ss(blk.d);
        w = _mm256_fmsub_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(d), _mm256_set1_ps(8.f * d));
      }
      for (int t = 0; t < NT; ++t) a[t] = _mm256_fmadd_ps(_mm256_set1_ps(h[t * hs + j]), w, a[t]);
    }
    for (int t = 0; t < NT; ++t) _mm256_storeu_ps(y + t * K + i, a[t]);
  }
  if constexpr (QT == F16) {  // a float16 row's last K % 32 values
    for (int64_t i = K / QK * QK; i < K; ++i)
      for (int j = 0; j < n; ++j) {
        const float w = _cvtsh_ss(static_cast<const uint16_t*>(rows[j])[i]);
        for (int t = 0; t < NT; ++t) y[t * K + i] += h[t * hs + j] * w;
      }
  }
}

HS_AVX512 static inline void axpy_group_q8_0_avx512(const float* s, const void* const* rows, float* y, int64_t n) {
  axpy_rows_blocks_avx512<BlockQ8_0, AXPY_GROUP>(s, rows, y, n);
}
HS_AVX512 static inline void axpy_group_q8_0_avx512_next(const float* s, const void* const* rows, float* y, int64_t n) {
  axpy_rows_blocks_avx512<BlockQ8_0, AXPY_GROUP, true>(s, rows, y, n);
}
#endif  // HS_X86

inline bool cpu_has_avx2() {
#ifdef HS_X86
  static const bool ok = [] {
    const char* forced = std::getenv("HS_CPU_PATH");  // "scalar": test the portable fallback
    if (forced && std::string(forced) == "scalar") return false;
    __builtin_cpu_init();  // libgcc's CPU model may not be initialised yet inside a dlopen'ed library
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok;
#else
  return false;
#endif
}

// AVX-512 F/BW/DQ/VL with VNNI (Ice Lake and later Xeons, Zen 4): the int8 dot products use vpdpbusd
// on 512-bit registers. HS_CPU_PATH=avx2 (or scalar) turns it off, to test the other paths.
inline bool cpu_has_avx512() {
#ifdef HS_X86
  static const bool ok = [] {
    const char* forced = std::getenv("HS_CPU_PATH");
    if (forced && (std::string(forced) == "avx2" || std::string(forced) == "avxvnni" || std::string(forced) == "scalar"))
      return false;
    __builtin_cpu_init();
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
#else
  return false;
#endif
}

// AVX-VNNI (the 256-bit vpdpbusd in VEX form: Alder Lake and later, Zen 5), from CPUID leaf 7 subleaf 1
// (EAX bit 4): this GCC's __builtin_cpu_supports does not know it. HS_CPU_PATH=avx2 or scalar: off;
// HS_CPU_PATH=avxvnni: AVX2 with it (AVX-512 off), as on those CPUs.
inline bool cpu_has_avxvnni() {
#ifdef HS_X86
  static const bool ok = [] {
    const char* forced = std::getenv("HS_CPU_PATH");
    if (forced && (std::string(forced) == "avx2" || std::string(forced) == "scalar")) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return cpu_has_avx2() && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax >> 4 & 1u);
  }();
  return ok;
#else
  return false;
#endif
}

// The wide Q4_0 dots (dot_q4_0_rows_wide): AVX-512 VNNI plus VBMI's byte permute and GFNI's affine byte
// transform (Ice Lake and later Xeons, Zen 4), unless HS_Q4_WIDE=0 (read per call: the older 256-bit form,
// for side-by-side runs).
inline bool q4_wide() {
#ifdef HS_X86
  static const bool vbmi = [] {
    __builtin_cpu_init();
    return cpu_has_avx512() && __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("gfni");
  }();
  return vbmi && !env_off("HS_Q4_WIDE");
#else
  return false;
#endif
}

// Whether wide Q4_0 rows one at a time prefetch ahead (dot_q4_0_rows_wide's PREFETCH; a dense GEMV's
// rows go so only with HS_GEMV_STREAMS=1, else in streams side by side, which do not) with `threads`
// threads: HS_Q4_PREFETCH=1 always, =0 never (read per call, for side-by-side runs); unset, up to 4
// threads, the counts measured (1 and 2 on the Zen 4 dev VM: 1.2-1.6x). The GPU machine's Xeon gains
// nothing from it (tests/gpu/q4_wide_bench.py, from memory: 6.5 -> 6.5 GiB/s one thread, 57.3 -> 59.6
// with 16), so it stays off above 4 threads, where an older whole-row prefetch cost 17% (HS_PREFETCH=2).
inline bool q4_prefetch(int threads) {
  if (env_on("HS_Q4_PREFETCH")) return true;
  if (env_off("HS_Q4_PREFETCH")) return false;
  return threads <= 4;
}

}  // namespace hs

namespace hs {

// float32 dot product and y += s * x, vectorized where the CPU allows (attention over the cache)
inline float dot_f32(const float* a, const float* b, int64_t n) {
#ifdef HS_X86
  if (cpu_has_avx2()) return dot_f32_avx2(a, b, n);
#endif
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy_f32(float s, const float* x, float* y, int64_t n) {
#ifdef HS_X86
  if (cpu_has_avx2()) return axpy_f32_avx2(s, x, y, n);
#endif
  for (int64_t i = 0; i < n; ++i) y[i] += s * x[i];
}

// the same over float16 values (a float16 KV cache): x . h and y += s * h
inline float dot_f32_f16(const float* x, const uint16_t* h, int64_t n) {
#ifdef HS_X86
  if (cpu_has_avx2()) return dot_f16_avx2(h, x, n);
#endif
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += x[i] * fp16_to_float(h[i]);
  return acc;
}

inline void axpy_f16(float s, const uint16_t* h, float* y, int64_t n) {
#ifdef HS_X86
  if (cpu_has_avx2()) return axpy_f16_avx2(s, h, y, n);
#endif
  for (int64_t i = 0; i < n; ++i) y[i] += s * fp16_to_float(h[i]);
}

}  // namespace hs
