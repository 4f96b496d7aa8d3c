// Kernels written once and compiled for two instruction sets: cpu_dot.h includes this file twice, on
// purpose without an include guard, in namespace isa_avx2 with HS_ISA_TARGET = HS_AVX2 and
// HS_ISA_VNNI 0, and in isa_vnni with the AVX-512 VNNI target and HS_ISA_VNNI 1. The VNNI forms
// compute the same int32 sums with fewer instructions (vpdpbusd, vpdpwssd), so both give the same
// results: the Q4_0/Q5_0 and K-quant (Q4_K, Q5_K, Q6_K) dot products against two-plane
// activations, NT tokens at once.

// Q4_0 / Q5_0 keep their weights unsigned (nibble, or nibble | high bit) and subtract the offset
// times the activation sum once per block: no sign juggling in the inner loop. NT tokens at once
// (prefill): each weight block is unpacked once for all of them; a[t * stride + b] is block b of
// token t, out[t] receives its dot product.
template <int64_t QT, int NT>
HS_ISA_TARGET static inline void dot_q45_0_tokens(const void* row, const ActQ8* a, int64_t nb, int64_t stride,
                                                  float* out) {
  __m256 acc[NT];
  float corr[NT];
  for (int t = 0; t < NT; ++t) { acc[t] = _mm256_setzero_ps(); corr[t] = 0.f; }
  constexpr float offset = QT == Q4_0 ? 8.f : 16.f;
  for (int64_t b = 0; b < nb; ++b) {
    float dw;
    const __m256i qu = unsigned_block_q45_0<QT>(row, b, dw);
    for (int t = 0; t < NT; ++t) {
      const ActQ8& at = a[t * stride + b];
#if HS_ISA_VNNI
      const __m256i i = dot2_vnni256(qu, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at.qs[0])),
                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at.qs[1])));
#else
      const __m256i i = block_dot2_unsigned(qu, at);
#endif
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * at.d), _mm256_cvtepi32_ps(i), acc[t]);
      corr[t] += dw * offset * at.dsum;
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[t]) - corr[t];
}

// The dots of R Q4_0 / Q5_0 rows with one token, side by side (R = 1 is the plain dot; scattered rows,
// as the sparse row-dot and the fused FFN read them, keep more streams in flight than one at a time):
// the activation planes loaded once per block for all R rows, the offset subtracted once per block
// and row as above. With VNNI one vpdpbusd per plane instead of maddubs + madd. (Two blocks per
// 512-bit register measured slower on Zen 4, whose 512-bit integer ops are double-pumped.)
// ONE_PLANE: the activations' second plane is zero (HS_ACT_PLANES=1, see act_planes): one dot per
// block and row, the plane's weight folded into the scale.
// NEXT: rows[R..2R-1] are the next group's rows (ask_next_lines).
template <int64_t QT, int R, bool ONE_PLANE = false, bool NEXT = false>
HS_ISA_TARGET static inline void dot_q45_0_rows(const void* const* rows, const ActQ8* a, int64_t nb, float* out) {
  constexpr float offset = QT == Q4_0 ? 8.f : 16.f;
  constexpr int64_t block = QT == Q4_0 ? sizeof(BlockQ4_0) : sizeof(BlockQ5_0);
  __m256 acc[R];
  float corr[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); corr[r] = 0.f; }
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (NEXT) ask_next_lines<R>(rows + R, b * block, block);
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[b].qs[0]));
    const __m256i x1 = ONE_PLANE ? _mm256_setzero_si256()
                                 : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[b].qs[1]));
    const float ad = ONE_PLANE ? a[b].d * PLANE_SHIFT : a[b].d, as = offset * a[b].dsum;
    for (int r = 0; r < R; ++r) {
      float dw;
      const __m256i qu = unsigned_block_q45_0<QT>(rows[r], b, dw);
      __m256i i;
      if constexpr (ONE_PLANE) {
#if HS_ISA_VNNI
        i = _mm256_dpbusd_epi32(_mm256_setzero_si256(), qu, x0);
#else
        i = _mm256_madd_epi16(_mm256_maddubs_epi16(qu, x0), _mm256_set1_epi16(1));
#endif
      } else {
#if HS_ISA_VNNI
        i = dot2_vnni256(qu, x0, x1);
#else
        i = dot2_unsigned(qu, x0, x1);
#endif
      }
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ad), _mm256_cvtepi32_ps(i), acc[r]);
      corr[r] += dw * as;
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) - corr[r];
}

// acc + unsigned weights (0..63) x both activation planes at element offset `off`, times a per-16
// scale pair, combined in int32 (plane 0 weighs PLANE_SHIFT) -> 8 int32. With VNNI the scale's
// multiply-add and the accumulation are one vpdpwssd (the same int32 sums).
template <typename A>
HS_ISA_TARGET static inline __m256i dot_u8_scaled(__m256i acc, __m256i q, const A& a, int off, int16_t s_lo,
                                                 int16_t s_hi) {
  const __m256i p0 = _mm256_maddubs_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs[0] + off)));
  const __m256i p1 = _mm256_maddubs_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs[1] + off)));
  const __m256i s1 = _mm256_set_m128i(_mm_set1_epi16(s_hi), _mm_set1_epi16(s_lo));
  const __m256i s0 = _mm256_slli_epi16(s1, 7);  // * PLANE_SHIFT; |scale| <= 128 fits int16
#if HS_ISA_VNNI
  return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(acc, p0, s0), p1, s1);
#else
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(p0, s0), _mm256_madd_epi16(p1, s1)));
#endif
}

// K-quants, NT tokens at once (see dot_q45_0_tokens for a and out).
template <bool FIVE_BIT, int NT>
HS_ISA_TARGET static inline void dot_q45_k_tokens(const void* row, const ActQ8K* a, int64_t nb, int64_t stride,
                                                 float* out) {
  float acc[NT] = {};
  const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < nb; ++b) {
    const auto [scales, qs, qh, d16, dmin16] = k_block<FIVE_BIT>(row, b);
    int sc[8], m[8];
    for (int j = 0; j < 8; ++j) k_scale_min(scales, j, sc[j], m[j]);
    __m256 sumf[NT];  // float: a super-block's int32 sum can overflow
    for (int t = 0; t < NT; ++t) sumf[t] = _mm256_setzero_ps();
    const __m256i hbits = FIVE_BIT ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)) : _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      __m256i lo = _mm256_and_si256(bits, m4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
      if constexpr (FIVE_BIT) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j + 1), one), 4));
      }
      for (int t = 0; t < NT; ++t) {
        const ActQ8K& at = a[t * stride + b];
        const __m256i both = dot_u8_scaled(dot_u8_scaled(_mm256_setzero_si256(), lo, at, 64 * j, sc[2 * j], sc[2 * j]),
                                           hi, at, 64 * j + 32, sc[2 * j + 1], sc[2 * j + 1]);
        sumf[t] = _mm256_add_ps(sumf[t], _mm256_cvtepi32_ps(both));
      }
    }
    for (int t = 0; t < NT; ++t) {
      const ActQ8K& at = a[t * stride + b];
      int32_t sum_m = 0;
      for (int j = 0; j < 8; ++j) sum_m += m[j] * (at.bsums[2 * j] + at.bsums[2 * j + 1]);
      acc[t] += at.d * (_cvtsh_ss(d16) * hsum(sumf[t]) - _cvtsh_ss(dmin16) * static_cast<float>(sum_m));
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = acc[t];
}

template <bool FIVE_BIT>
HS_ISA_TARGET static inline float dot_q45_k(const void* row, const ActQ8K* a, int64_t nb) {
  float out;
  dot_q45_k_tokens<FIVE_BIT, 1>(row, a, nb, nb, &out);
  return out;
}

template <int NT>
HS_ISA_TARGET static inline void dot_q6_k_tokens(const void* row, const ActQ8K* a, int64_t nb, int64_t stride,
                                                float* out) {
  const BlockQ6_K* w = static_cast<const BlockQ6_K*>(row);
  float acc[NT] = {};
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < nb; ++b) {
    __m256 sumf[NT];
    int32_t corr[NT] = {};
    for (int t = 0; t < NT; ++t) sumf[t] = _mm256_setzero_ps();
    for (int n = 0; n < 2; ++n) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b].ql + 64 * n));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b].ql + 64 * n + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b].qh + 32 * n));
      const __m256i q[4] = {
        _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4)),
        _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4)),
      };
      for (int k = 0; k < 4; ++k) {
        const int8_t s0 = w[b].scales[8 * n + 2 * k], s1 = w[b].scales[8 * n + 2 * k + 1];
        for (int t = 0; t < NT; ++t) {
          const ActQ8K& at = a[t * stride + b];
          sumf[t] = _mm256_add_ps(sumf[t], _mm256_cvtepi32_ps(dot_u8_scaled(_mm256_setzero_si256(), q[k], at, 128 * n + 32 * k, s0, s1)));
          corr[t] += s0 * at.bsums[8 * n + 2 * k] + s1 * at.bsums[8 * n + 2 * k + 1];
        }
      }
    }
    for (int t = 0; t < NT; ++t)
      acc[t] += a[t * stride + b].d * _cvtsh_ss(w[b].d) * (hsum(sumf[t]) - 32.f * static_cast<float>(corr[t]));
  }
  for (int t = 0; t < NT; ++t) out[t] = acc[t];
}

HS_ISA_TARGET static inline float dot_q6_k(const void* row, const ActQ8K* a, int64_t nb) {
  float out;
  dot_q6_k_tokens<1>(row, a, nb, nb, &out);
  return out;
}
