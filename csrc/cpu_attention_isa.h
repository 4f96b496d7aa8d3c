// The grouped-query attention kernels of csrc/cpu_layers.cpp (attend_cached), written once and
// compiled for two instruction sets: cpu_layers.cpp includes this file twice, on purpose without an
// include guard, in namespace att_avx512 (512-bit registers, VW = 16) and att_avx2 (256-bit, VW = 8),
// each with HS_ISA_TARGET and the few vector helpers (vf, vzero, vset1, vload, vfma, vadd, vstore,
// vsum) defined before the include.

// scores[g * ld + s] = scale * (q_g . k_s) for the gn query heads q (D apart) and the n cache rows k
// (D a multiple of VW, 2 <= gn <= 8): each row converted once for every head of the group; R rows at
// a time so that a small group still has R * gn independent sums in flight. (One query head per
// key/value head keeps attend_cached's row-by-row loops: a sum a row waited on its own multiply-adds
// here and ran ~1.4x slower than they do.)
template <int R, typename C>
HS_ISA_TARGET void group_scores_rows(const float* q, int64_t gn, const C* k, int64_t n, int64_t D, float scale,
                                     float* scores, int64_t ld) {
  int64_t s = 0;
  for (; s + R <= n; s += R) {
    vf acc[R][8];
    for (int r = 0; r < R; ++r)
      for (int64_t g = 0; g < gn; ++g) acc[r][g] = vzero();
    for (int64_t c = 0; c < D; c += VW)
      for (int r = 0; r < R; ++r) {
        const vf kv = vload(k + (s + r) * D + c);
        for (int64_t g = 0; g < gn; ++g) acc[r][g] = vfma(kv, vload(q + g * D + c), acc[r][g]);
      }
    for (int r = 0; r < R; ++r)
      for (int64_t g = 0; g < gn; ++g) scores[g * ld + s + r] = vsum(acc[r][g]) * scale;
  }
  if (s < n) group_scores_rows<1>(q, gn, k + s * D, n - s, D, scale, scores + s, ld);
}

template <typename C>
HS_ISA_TARGET void group_scores(const float* q, int64_t gn, const C* k, int64_t n, int64_t D, float scale,
                                float* scores, int64_t ld) {
  if (gn == 2) group_scores_rows<2>(q, gn, k, n, D, scale, scores, ld);
  else group_scores_rows<1>(q, gn, k, n, D, scale, scores, ld);
}

// out[g * D + d] += sum_s p[g * ld + s] * v_s[d] for the gn heads (D a multiple of VW, 2 <= gn <= 8): Z * VW
// columns at a time, the heads' sums in registers across the rows, each row's values converted once,
// two rows a step into two sets of sums where the group is small (more sums in flight)
template <int Z, int U, typename C>
HS_ISA_TARGET void group_values_block(const float* p, int64_t ld, int64_t gn, const C* v, int64_t n, int64_t D,
                                      float* out) {
  for (int64_t c = 0; c < D; c += VW * Z) {
    const int z_n = static_cast<int>(std::min<int64_t>(Z, (D - c) / VW));
    vf o[U][8][Z];
    for (int u = 0; u < U; ++u)
      for (int64_t g = 0; g < gn; ++g)
        for (int z = 0; z < Z; ++z) o[u][g][z] = vzero();
    for (int64_t s = 0; s < n; s += U)
      for (int u = 0; u < U && s + u < n; ++u) {
        const int64_t r = s + u;
        const C* vr = v + r * D + c;
        vf vz[Z];
        for (int z = 0; z < Z; ++z) vz[z] = z < z_n ? vload(vr + VW * z) : vzero();
        for (int64_t g = 0; g < gn; ++g) {
          const vf w = vset1(p[g * ld + r]);
          for (int z = 0; z < Z; ++z) o[u][g][z] = vfma(w, vz[z], o[u][g][z]);
        }
      }
    for (int64_t g = 0; g < gn; ++g)
      for (int z = 0; z < z_n; ++z) {
        vf sum = o[0][g][z];
        for (int u = 1; u < U; ++u) sum = vadd(sum, o[u][g][z]);
        float* og = out + g * D + c + VW * z;
        vstore(og, vadd(vload(og), sum));
      }
  }
}


template <int Z, int U, typename C>
HS_ISA_TARGET void group_values_cols(const float* p, int64_t ld, int64_t gn, const C* v, int64_t n, int64_t D,
                                     float* out) {
  constexpr int64_t RB = 32;  // rows per block: its values stay in L1 for the column passes after the first
  for (int64_t s0 = 0; s0 < n; s0 += RB) {
    const int64_t rn = std::min(RB, n - s0);
    group_values_block<Z, U>(p + s0, ld, gn, v + s0 * D, rn, D, out);
  }
}

template <typename C>
HS_ISA_TARGET void group_values(const float* p, int64_t ld, int64_t gn, const C* v, int64_t n, int64_t D,
                                float* out) {
  if (gn == 2) group_values_cols<2, 2>(p, ld, gn, v, n, D, out);
  else if (gn <= 4) group_values_cols<2, 1>(p, ld, gn, v, n, D, out);
  else group_values_cols<1, 1>(p, ld, gn, v, n, D, out);
}
