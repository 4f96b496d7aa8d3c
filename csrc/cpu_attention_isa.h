// The grouped-query attention kernels of csrc/cpu_layers.cpp (attend_cached), written once and
// compiled for two instruction sets: cpu_layers.cpp includes this file twice, on purpose without an
// include guard, in namespace att_avx512 (512-bit registers, VW = 16) and att_avx2 (256-bit, VW = 8),
// each with HS_ISA_TARGET and the few vector helpers (vf, vzero, vset1, vload, vfma, vadd, vstore,
// vmul, vsub, vsum, vmax, vmaxall, vfloor, vpow2i) defined before the include.

// scores[g * ld + s] = scale * (q_g . k_s) for the G query heads q (D apart) and the n cache rows k
// (D a multiple of VW, 2 <= G <= 8): each row converted once for every head of the group; R rows at a
// time so that a small group still has R * G independent sums in flight. G is a template argument so
// that the sums stay in registers (a run-time count kept them on the stack: ~4x slower). (One query
// head per key/value head keeps attend_cached's row-by-row loops, which are at memory bandwidth.)
template <int G, int R, typename C>
HS_ISA_TARGET void group_scores_rows(const float* q, const C* k, int64_t n, int64_t D, float scale, float* scores,
                                     int64_t ld) {
  int64_t s = 0;
  for (; s + R <= n; s += R) {
    vf acc[R][G];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) acc[r][g] = vzero();
    for (int64_t c = 0; c < D; c += VW)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const vf kv = vload(k + (s + r) * D + c);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) acc[r][g] = vfma(kv, vload(q + g * D + c), acc[r][g]);
      }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) scores[g * ld + s + r] = vsum(acc[r][g]) * scale;
  }
  if (s < n) group_scores_rows<G, 1>(q, k + s * D, n - s, D, scale, scores + s, ld);
}

// out[g * D + d] += sum_s p[g * ld + s] * v_s[d] for the G heads (D a multiple of VW, 2 <= G <= 8):
// Z * VW columns at a time, the heads' sums in registers across the rows, each row's values converted
// once, U rows a step into U sets of sums where the group is small (more sums in flight); rows in
// blocks of 32, whose values stay in L1 for the column passes after the first
template <int G, int Z, int U, typename C>
HS_ISA_TARGET void group_values_rows(const float* p, int64_t ld, const C* v, int64_t n, int64_t D, float* out) {
  constexpr int64_t RB = 32;
  for (int64_t s0 = 0; s0 < n; s0 += RB) {
    const int64_t rn = std::min(RB, n - s0);
    for (int64_t c = 0; c < D; c += VW * Z) {
      const int z_n = static_cast<int>(std::min<int64_t>(Z, (D - c) / VW));
      vf o[U][G][Z];
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
          for (int z = 0; z < Z; ++z) o[u][g][z] = vzero();
      for (int64_t s = s0; s < s0 + rn; s += U)
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) {
          if (s + u >= s0 + rn) break;
          const C* vr = v + (s + u) * D + c;
          vf vz[Z];
#pragma GCC unroll 4
          for (int z = 0; z < Z; ++z) vz[z] = z < z_n ? vload(vr + VW * z) : vzero();
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) {
            const vf w = vset1(p[g * ld + s + u]);
#pragma GCC unroll 4
            for (int z = 0; z < Z; ++z) o[u][g][z] = vfma(w, vz[z], o[u][g][z]);
          }
        }
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g)
        for (int z = 0; z < z_n; ++z) {
          vf sum = o[0][g][z];
#pragma GCC unroll 4
          for (int u = 1; u < U; ++u) sum = vadd(sum, o[u][g][z]);
          float* og = out + g * D + c + VW * z;
          vstore(og, vadd(vload(og), sum));
        }
    }
  }
}

// The two passes of one group of G query heads, with G fixed at compile time
template <int G, typename C>
HS_ISA_TARGET void group_pass(const float* q, const C* k, const C* v, int64_t n, int64_t D, float scale,
                              float* scores, float* out, bool values) {
  if (!values) {
    group_scores_rows<G, G == 2 ? 2 : 1>(q, k, n, D, scale, scores, n);
    return;
  }
  if constexpr (G == 2) group_values_rows<G, 2, 2>(scores, n, v, n, D, out);
  else if constexpr (G <= 4) group_values_rows<G, 2, 1>(scores, n, v, n, D, out);
  else group_values_rows<G, 1, 1>(scores, n, v, n, D, out);
}

// scores (values = false) or the weighted sum of values (values = true) for gn = 2..8 query heads
template <typename C>
HS_ISA_TARGET void group_attend(int64_t gn, const float* q, const C* k, const C* v, int64_t n, int64_t D, float scale,
                                float* scores, float* out, bool values) {
  switch (gn) {
    case 2: return group_pass<2>(q, k, v, n, D, scale, scores, out, values);
    case 3: return group_pass<3>(q, k, v, n, D, scale, scores, out, values);
    case 4: return group_pass<4>(q, k, v, n, D, scale, scores, out, values);
    case 5: return group_pass<5>(q, k, v, n, D, scale, scores, out, values);
    case 6: return group_pass<6>(q, k, v, n, D, scale, scores, out, values);
    case 7: return group_pass<7>(q, k, v, n, D, scale, scores, out, values);
    default: return group_pass<8>(q, k, v, n, D, scale, scores, out, values);
  }
}

// exp(x) for x <= 0 (a score minus the maximum): Cephes' expf, 2^n times a degree-7 polynomial of the
// rest, ~1 ulp; below -87 it gives ~0 (2^-126 scaled), where the float result would be denormal
HS_ISA_TARGET inline vf vexp_nonpositive(vf x) {
  x = vmax(x, vset1(-87.f));
  const vf n = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
  x = vfma(n, vset1(-0.693359375f), x);
  x = vfma(n, vset1(2.12194440e-4f), x);
  vf y = vset1(1.9875691500e-4f);
  y = vfma(y, x, vset1(1.3981999507e-3f));
  y = vfma(y, x, vset1(8.3334519073e-3f));
  y = vfma(y, x, vset1(4.1665795894e-2f));
  y = vfma(y, x, vset1(1.6666665459e-1f));
  y = vfma(y, x, vset1(5.0000001201e-1f));
  y = vfma(y, vmul(x, x), vadd(x, vset1(1.f)));
  return vmul(y, vpow2i(n));
}

// sc[s] <- exp(sc[s] - max), mx <- the maximum, sum <- the total: one query head's softmax before the
// division (attend_cached divides the weighted sum once instead)
HS_ISA_TARGET inline void softmax_unnormalized(float* sc, int64_t n, float& mx, float& sum) {
  int64_t s = 0;
  vf m = vset1(-std::numeric_limits<float>::infinity());
  for (; s + VW <= n; s += VW) m = vmax(m, vload(sc + s));
  mx = vmaxall(m);
  for (; s < n; ++s) mx = std::max(mx, sc[s]);
  const vf mv = vset1(mx);
  vf total = vzero();
  for (s = 0; s + VW <= n; s += VW) {
    const vf e = vexp_nonpositive(vsub(vload(sc + s), mv));
    vstore(sc + s, e);
    total = vadd(total, e);
  }
  sum = vsum(total);
  for (; s < n; ++s) sum += (sc[s] = std::exp(sc[s] - mx));
}
