// Fused CPU versions of the small per-layer steps a decode step is made of. Each replaces 5-20 torch
// ops, whose dispatch overhead (~5 us each) otherwise costs more than the arithmetic on small models.
//   rope_           : rotary embedding in place (NEOX halves or NORM adjacent pairs)
//   attention       : store k/v at their positions in the cache, causal (+ sliding window) softmax
//                     attention over the first kv_len slots, grouped-query heads
//   gated_act       : act(gate) * up, or act(gate) * act(up)
//   attention_block : one token's attention half of a llama / Gemma 3 block (norm, q/k/v, rope, attention, o + residual)
//   ffn_block       : one token's dense gated FFN half (norm, gate/up, activation, down + residual)
//   sparse_ffn_block: one token's FFN half of a CPU-only sparse layer (norm, predictor, ids, fused FFN + residual)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "check.h"
#include "cpu_dot.h"
#include "cpu_ops.h"

namespace hs {

void rope_cpu(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, bool neox) {
  HS_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.is_contiguous(),
           "rope_: x must be a contiguous float32 [tokens, heads, head_dim] tensor");
  HS_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) == x.size(0) &&
           cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
           "rope_: cos/sin must be float32 [tokens, rot_dim / 2]");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = cos.size(1);
  HS_CHECK(2 * half <= D, "rope_: rotary dimension ", 2 * half, " exceeds head_dim ", D);
  auto cc = cos.contiguous(), ss = sin.contiguous();
  float* xp = x.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* sp = ss.data_ptr<float>();
  // a decode step's few heads (one token: 64 rows of 64 pairs for Llama-2-7B's q and k) on this thread:
  // the GPU machine's Xeon took 53 us a layer for them with an OpenMP team of 4 between GEMVs of 16
  // (session 26, tests/gpu/cpu_step_parts.py)
  const int64_t grain = T * H * half < (1 << 16) ? T * H : 16;
  at::parallel_for(0, T * H, grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* v = xp + r * D;
      const float* c = cp + (r / H) * half;
      const float* s = sp + (r / H) * half;
      for (int64_t i = 0; i < half; ++i) {
        float* a = neox ? v + i : v + 2 * i;
        float* bb = neox ? v + i + half : v + 2 * i + 1;
        const float x0 = *a, x1 = *bb;
        *a = x0 * c[i] - x1 * s[i];
        *bb = x0 * s[i] + x1 * c[i];
      }
    }
  });
}

namespace {

// the cache's rows as float32 for the dot and the weighted sum: float32 or float16 storage
inline float cache_dot(const float* q, const float* k, int64_t D) { return dot_f32(q, k, D); }
inline float cache_dot(const float* q, const uint16_t* k, int64_t D) { return dot_f32_f16(q, k, D); }
inline void cache_axpy(float s, const float* v, float* o, int64_t D) { axpy_f32(s, v, o, D); }
inline void cache_axpy(float s, const uint16_t* v, float* o, int64_t D) { axpy_f16(s, v, o, D); }

#ifdef HS_X86
namespace att_avx512 {  // 16 floats a register
using vf = __m512;
constexpr int64_t VW = 16;
#define HS_ISA_TARGET HS_AVX512
HS_ISA_TARGET inline vf vzero() { return _mm512_setzero_ps(); }
HS_ISA_TARGET inline vf vset1(float v) { return _mm512_set1_ps(v); }
HS_ISA_TARGET inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
HS_ISA_TARGET inline vf vload(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
HS_ISA_TARGET inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
HS_ISA_TARGET inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
HS_ISA_TARGET inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
HS_ISA_TARGET inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
HS_ISA_TARGET inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
HS_ISA_TARGET inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
HS_ISA_TARGET inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
HS_ISA_TARGET inline float vmaxall(vf v) { return _mm512_reduce_max_ps(v); }
HS_ISA_TARGET inline vf vfloor(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
HS_ISA_TARGET inline vf vpow2i(vf n) {  // 2^n for whole n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#include "cpu_attention_isa.h"
#undef HS_ISA_TARGET
}  // namespace att_avx512

namespace att_avx2 {  // 8 floats a register: CPUs without AVX-512 (most desktop Intel cores, Zen 1-3)
using vf = __m256;
constexpr int64_t VW = 8;
#define HS_ISA_TARGET HS_AVX2
HS_ISA_TARGET inline vf vzero() { return _mm256_setzero_ps(); }
HS_ISA_TARGET inline vf vset1(float v) { return _mm256_set1_ps(v); }
HS_ISA_TARGET inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
HS_ISA_TARGET inline vf vload(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
HS_ISA_TARGET inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
HS_ISA_TARGET inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
HS_ISA_TARGET inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
HS_ISA_TARGET inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
HS_ISA_TARGET inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
HS_ISA_TARGET inline float vsum(vf v) { return hsum(v); }
HS_ISA_TARGET inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
HS_ISA_TARGET inline float vmaxall(vf v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
HS_ISA_TARGET inline vf vfloor(vf v) { return _mm256_floor_ps(v); }
HS_ISA_TARGET inline vf vpow2i(vf n) {  // 2^n for whole n in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#include "cpu_attention_isa.h"
#undef HS_ISA_TARGET
}  // namespace att_avx2
#endif

// The query heads of one key/value head together (grouped-query attention: Llama 3, Mistral, Qwen,
// Gemma): each cache row is read once for the whole group, while it is in L1, instead of once per
// query head (a long cache of one key/value head is ~1 MiB at 4k positions, past L2). Work items are
// (pass, span of positions), a pass being some tokens' query heads of one key/value head (below);
// spans (flash-decoding's split, when there are fewer passes than threads) keep each one's maximum,
// total and unnormalized output and are merged at the end. With AVX-512 (AVX2) and head_dim a multiple of 16 (8) a group's dots and sums run
// in registers and the softmax's exponentials are vectorized (csrc/cpu_attention_isa.h). Dev VM (Zen 4),
// 2 threads, one token, float16 cache, `hs-bench attention -t 2` (cache read from memory), before ->
// after: Llama-3-8B's heads (32 over 8, 128 wide) at 4001 positions 1.57 -> 0.94-1.00 ms a layer, at
// 257 0.21 -> 0.14-0.16; Gemma 3 270M's (4 over 1, 256 wide) at 4001 0.44 -> 0.31-0.32; 32 heads over
// 32 (row by row, memory-bound) 2.2-2.3 ms either way. Prompts (passes of several tokens, below):
// 512 tokens with Llama-2-7B's heads 28.8 ms a layer against torch's batched GEMMs' 75.7 (`--tokens
// 512`; the op read each row once per token and lost to them from 16 tokens before); see
// runtime/layers.py CPU_ATTENTION.
constexpr int64_t ATT_MAX_GROUP = 8;  // query vectors handled in one pass over the rows
constexpr int64_t ATT_SPAN_MIN = 512;  // positions per span at least

// A pass: up to ATT_MAX_GROUP query vectors that read the same cache rows, i.e. `tt` tokens times `gq`
// query heads of one key/value head. Several tokens of a prompt share a pass (each its own causal
// limits; rows past a token's limit weigh zero for it), so a prompt reads each row once per pass, not
// once per token.
template <typename C>
void attend_cached(const float* qp, const C* kcp, const C* vcp, const int64_t* pos, float* op, int64_t T, int64_t Hq,
                   int64_t group, int64_t D, int64_t n_ctx, int64_t kv_len, int64_t window, double scale) {
  const int64_t Hkv = Hq / group;
  const int64_t sub = (group + ATT_MAX_GROUP - 1) / ATT_MAX_GROUP;  // passes per group (very wide groups)
  const int64_t gq = (group + sub - 1) / sub;                       // query heads per pass
  const int64_t tt = std::max<int64_t>(1, std::min<int64_t>(T, ATT_MAX_GROUP / gq));  // tokens per pass
  const int64_t tiles = (T + tt - 1) / tt;
  const int64_t G = tt * gq;  // query vectors per pass
  const int64_t passes = tiles * Hkv * sub;
  // A decode step over a short cache is little arithmetic, but its rows come from memory (a whole
  // token's weights were read since this layer last ran), which one thread reads at a fraction of the
  // bandwidth: only rows under 512 KiB stay on the calling thread (until session 26: any step under 2^20
  // multiply-adds, e.g. Llama-2-7B's heads up to 255 positions). Dev VM, 2 threads, those heads, caches
  // of 32 layers in turn, one thread -> two, alternating: float32 cache, 64 positions 266 -> 150 us a
  // layer, 192 positions 564 -> 313; float16 at 192 372 -> 228; 16 positions (float16, 256 KiB) lost
  // with two (41-66 us against 29-49), so stays on one. S5's model decoding at ~136 positions: the
  // attention op 304-321 -> 218-247 us a layer.
  const int64_t work = T * Hq * kv_len * D;
  const bool small = work < (1 << 20) && 2 * Hkv * kv_len * D * static_cast<int64_t>(sizeof(C)) < (512 << 10);
  const int64_t threads = at::get_num_threads();
  const int64_t spans = work < (1 << 20) || passes >= threads ? 1
                        : std::max<int64_t>(1, std::min<int64_t>((threads + passes - 1) / passes, kv_len / ATT_SPAN_MIN));
  const int64_t span_len = (kv_len + spans - 1) / spans;
  // per (pass, span, query vector): maximum, total, unnormalized output (spans > 1 only)
  std::vector<float> part_ml(spans > 1 ? passes * spans * G * 2 : 0), part_o(spans > 1 ? passes * spans * G * D : 0);
  const int64_t grain = small ? passes * spans : 1;
  // the vector kernels: AVX-512 for head sizes a multiple of 16, AVX2 for multiples of 8 (none: null)
  void (*vec_pass)(int64_t, const float*, const C*, const C*, int64_t, int64_t, float, float*, float*, bool) = nullptr;
  void (*vec_softmax)(float*, int64_t, float&, float&) = nullptr;
#ifdef HS_X86
  if (D % 16 == 0 && cpu_has_avx512()) {
    vec_pass = att_avx512::group_attend<C>;
    vec_softmax = att_avx512::softmax_unnormalized;
  } else if (D % 8 == 0 && cpu_has_avx2()) {
    vec_pass = att_avx2::group_attend<C>;
    vec_softmax = att_avx2::softmax_unnormalized;
  }
#endif
  // pass p's query vectors: token t0 + j / g_n, head h0 + j % g_n, at row `row(...)` of q and of the output
  const auto row = [&](int64_t t0, int64_t h0, int64_t g_n, int64_t j) { return ((t0 + j / g_n) * Hq + h0 + j % g_n) * D; };
  const auto pass_of = [&](int64_t p, int64_t& t0, int64_t& t_n, int64_t& hk, int64_t& h0, int64_t& g_n) {
    const int64_t tile = p / (Hkv * sub);
    hk = p / sub % Hkv;
    h0 = hk * group + p % sub * gq;
    g_n = std::min(gq, (hk + 1) * group - h0);
    t0 = tile * tt;
    t_n = std::min(tt, T - t0);
  };
  at::parallel_for(0, passes * spans, grain, [&](int64_t b, int64_t e) {
    std::vector<float> scores, acc(spans > 1 ? 0 : G * D), qbuf(G * D);
    for (int64_t item = b; item < e; ++item) {
      const int64_t p = item / spans, sp = item % spans;
      int64_t t0, t_n, hk, h0, g_n;
      pass_of(p, t0, t_n, hk, h0, g_n);
      const int64_t q_n = t_n * g_n;
      // each query vector's rows: its token's causal (and window) limits within this span
      int64_t lo_j[ATT_MAX_GROUP], hi_j[ATT_MAX_GROUP], lo = INT64_MAX, hi = -1;
      for (int64_t j = 0; j < q_n; ++j) {
        const int64_t t = t0 + j / g_n;
        hi_j[j] = std::min<int64_t>({pos[t], kv_len - 1, (sp + 1) * span_len - 1});
        lo_j[j] = std::max<int64_t>(window > 0 ? std::max<int64_t>(0, pos[t] - window + 1) : 0, sp * span_len);
        if (lo_j[j] <= hi_j[j]) {
          lo = std::min(lo, lo_j[j]);
          hi = std::max(hi, hi_j[j]);
        }
      }
      float* o = spans > 1 ? part_o.data() + (p * spans + sp) * G * D : acc.data();
      float* ml = spans > 1 ? part_ml.data() + (p * spans + sp) * G * 2 : nullptr;
      std::fill(o, o + G * D, 0.f);
      const auto out_row = [&](int64_t j) { return op + row(t0, h0, g_n, j); };
      if (hi < lo) {  // a span outside every token's causal (or sliding) window
        for (int64_t j = 0; j < q_n; ++j) {
          if (ml) { ml[2 * j] = -std::numeric_limits<float>::infinity(); ml[2 * j + 1] = 0.f; }
          else std::fill(out_row(j), out_row(j) + D, 0.f);
        }
        continue;
      }
      const int64_t n = hi - lo + 1;
      if (static_cast<int64_t>(scores.size()) < G * n) scores.resize(G * n);
      for (int64_t j = 0; j < q_n; ++j)  // the pass's query vectors side by side
        std::copy(qp + row(t0, h0, g_n, j), qp + row(t0, h0, g_n, j) + D, qbuf.data() + j * D);
      const C* kspan = kcp + (hk * n_ctx + lo) * D;
      const C* vspan = vcp + (hk * n_ctx + lo) * D;
      const bool vec = vec_pass && q_n > 1;  // one query vector: the row-by-row loops (memory-bound already)
      if (vec) {
        vec_pass(q_n, qbuf.data(), kspan, vspan, n, D, static_cast<float>(scale), scores.data(), o, false);
      } else {
        for (int64_t s = 0; s < n; ++s)  // each key row once for the pass's query vectors
          for (int64_t j = 0; j < q_n; ++j) scores[j * n + s] = cache_dot(qbuf.data() + j * D, kspan + s * D, D) * static_cast<float>(scale);
      }
      float mx[ATT_MAX_GROUP], sum[ATT_MAX_GROUP];
      for (int64_t j = 0; j < q_n; ++j) {
        float* sc = scores.data() + j * n;
        if (lo_j[j] > hi_j[j]) {  // no row of this span for this token
          std::fill(sc, sc + n, 0.f);
          mx[j] = -std::numeric_limits<float>::infinity();
          sum[j] = 0.f;
          continue;
        }
        std::fill(sc, sc + (lo_j[j] - lo), 0.f);  // rows outside its limits weigh nothing
        std::fill(sc + (hi_j[j] - lo + 1), sc + n, 0.f);
        float* own = sc + (lo_j[j] - lo);
        const int64_t m = hi_j[j] - lo_j[j] + 1;
        if (vec_softmax) {
          vec_softmax(own, m, mx[j], sum[j]);
          continue;
        }
        mx[j] = *std::max_element(own, own + m);
        sum[j] = 0.f;
        for (int64_t s = 0; s < m; ++s) sum[j] += (own[s] = std::exp(own[s] - mx[j]));
      }
      if (vec) {
        vec_pass(q_n, qbuf.data(), kspan, vspan, n, D, 0.f, scores.data(), o, true);
      } else {
        for (int64_t s = 0; s < n; ++s)  // each value row once likewise
          for (int64_t j = 0; j < q_n; ++j)
            if (scores[j * n + s] != 0.f) cache_axpy(scores[j * n + s], vspan + s * D, o + j * D, D);
      }
      for (int64_t j = 0; j < q_n; ++j) {
        if (ml) {
          ml[2 * j] = mx[j];
          ml[2 * j + 1] = sum[j];
        } else {
          const float inv = sum[j] > 0.f ? 1.f / sum[j] : 0.f;
          float* out = out_row(j);
          for (int64_t d = 0; d < D; ++d) out[d] = o[j * D + d] * inv;
        }
      }
    }
  });
  if (spans == 1) return;
  for (int64_t p = 0; p < passes; ++p) {  // the spans of each query vector merged
    int64_t t0, t_n, hk, h0, g_n;
    pass_of(p, t0, t_n, hk, h0, g_n);
    for (int64_t j = 0; j < t_n * g_n; ++j) {
      float mx = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t sp = 0; sp < spans; ++sp) mx = std::max(mx, part_ml[((p * spans + sp) * G + j) * 2]);
      float* out = op + row(t0, h0, g_n, j);
      std::fill(out, out + D, 0.f);
      for (int64_t sp = 0; sp < spans; ++sp) {
        const float* m = part_ml.data() + ((p * spans + sp) * G + j) * 2;
        if (m[1] == 0.f) continue;  // an empty span
        const float w = std::exp(m[0] - mx);
        total += w * m[1];
        axpy_f32(w, part_o.data() + ((p * spans + sp) * G + j) * D, out, D);
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      for (int64_t d = 0; d < D; ++d) out[d] *= inv;
    }
  }
}

}  // namespace

// The cache is float32 or float16 (llama.cpp's default type, half the memory and the bytes a long
// context's decode step reads); k and v are stored in its type, rounded to nearest.
at::Tensor attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& positions, int64_t kv_len, int64_t window,
                         double scale) {
  HS_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "attention: q [T,Hq,D], k/v [T,Hkv,D]");
  const auto ct = k_cache.scalar_type();
  HS_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
           (ct == at::kFloat || ct == at::kHalf) && v_cache.scalar_type() == ct,
           "attention: float32 q/k/v and a float32 or float16 cache (k and v of one type) expected");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1);
  HS_CHECK(k.size(0) == T && k.size(2) == D && Hkv > 0 && Hq % Hkv == 0, "attention: head shapes disagree");
  HS_CHECK(k_cache.dim() == 3 && k_cache.size(0) == Hkv && k_cache.size(2) == D && k_cache.is_contiguous() &&
           v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(), "attention: cache must be [Hkv, n_ctx, D]");
  const int64_t n_ctx = k_cache.size(1);
  HS_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.scalar_type() == at::kLong,
           "attention: positions must be int64 [T]");
  HS_CHECK(kv_len >= 0 && kv_len <= n_ctx, "attention: kv_len ", kv_len, " outside the cache of ", n_ctx);
  auto qc = q.contiguous(), pc = positions.contiguous();
  auto kc = k.to(ct).contiguous(), vc = v.to(ct).contiguous();
  const int64_t* pos = pc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    HS_CHECK(pos[t] >= 0 && pos[t] < n_ctx, "attention: position ", pos[t], " outside the cache of ", n_ctx);
  const int64_t esize = k_cache.element_size();
  auto* kcp = static_cast<char*>(k_cache.data_ptr());
  auto* vcp = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(kc.data_ptr());
  const auto* vs = static_cast<const char*>(vc.data_ptr());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hkv; ++h) {
      std::memcpy(kcp + (h * n_ctx + pos[t]) * D * esize, ks + (t * Hkv + h) * D * esize, D * esize);
      std::memcpy(vcp + (h * n_ctx + pos[t]) * D * esize, vs + (t * Hkv + h) * D * esize, D * esize);
    }
  auto out = at::zeros({T, Hq * D}, q.options());
  if (ct == at::kHalf)
    attend_cached(qc.data_ptr<float>(), reinterpret_cast<const uint16_t*>(kcp), reinterpret_cast<const uint16_t*>(vcp),
                  pos, out.data_ptr<float>(), T, Hq, Hq / Hkv, D, n_ctx, kv_len, window, scale);
  else
    attend_cached(qc.data_ptr<float>(), reinterpret_cast<const float*>(kcp), reinterpret_cast<const float*>(vcp),
                  pos, out.data_ptr<float>(), T, Hq, Hq / Hkv, D, n_ctx, kv_len, window, scale);
  return out;
}

// One token's attention half of a llama-family block (no q/k/v biases) as one call:
//   x + o . attention(rope(q), rope(k), v),  q/k/v = W_q/k/v . rms_norm(x)
// the same five ops the Python block calls, without the Python around them (in a decode step on the GPU
// machine's Xeon ~2 us a Python operation, ~40 of them for this half: more than its small ops take).
// Gemma 3's form too: q and k normed per head (q_norm, k_norm) before the rotation, a sliding window
// (window > 0), the output normed (post_norm) before the residual add.
at::Tensor attention_block_cpu(const at::Tensor& x, const at::Tensor& norm_w, double eps,
                               const std::vector<at::Tensor>& qkv, const std::vector<int64_t>& qkv_types,
                               const at::Tensor& o, int64_t o_type, int64_t n_heads, int64_t n_kv_heads,
                               const at::Tensor& cos, const at::Tensor& sin, bool neox, at::Tensor k_cache,
                               at::Tensor v_cache, const at::Tensor& positions, int64_t kv_len, double scale,
                               int64_t window, const c10::optional<at::Tensor>& q_norm,
                               const c10::optional<at::Tensor>& k_norm, const c10::optional<at::Tensor>& post_norm) {
  HS_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
           "attention_block: x must be one token, contiguous float32 [1, d_model]");
  HS_CHECK(qkv.size() == 3 && qkv_types.size() == 3, "attention_block: q, k and v weights and their types expected");
  HS_CHECK(n_heads > 0 && n_kv_heads > 0 && qkv[0].size(0) % n_heads == 0, "attention_block: head counts");
  const bool qk_norm = q_norm.has_value() && q_norm->defined();
  HS_CHECK(qk_norm == (k_norm.has_value() && k_norm->defined()), "attention_block: q_norm and k_norm go together");
  const int64_t D = qkv[0].size(0) / n_heads;
  HS_CHECK(qkv[1].size(0) == n_kv_heads * D && qkv[2].size(0) == n_kv_heads * D,
           "attention_block: k and v must have n_kv_heads * head_dim rows");
  const at::Tensor xn = rms_norm_cpu(x, norm_w, eps);
  const auto ys = qmatmul_rows_cpu(qkv, qkv_types, xn, std::vector<c10::optional<at::Tensor>>(3));
  at::Tensor q = ys[0].view({1, n_heads, D}), k = ys[1].view({1, n_kv_heads, D});
  if (qk_norm) {  // normed into tensors of their own, rotated one after the other
    q = rms_norm_cpu(q, *q_norm, eps);
    k = rms_norm_cpu(k, *k_norm, eps);
    rope_cpu(q, cos, sin, neox);
    rope_cpu(k, cos, sin, neox);
  } else {  // one token: q, k, v side by side in one buffer (qmatmul_rows_cpu), so q and k rotate in one call
    const int64_t total = (n_heads + 2 * n_kv_heads) * D;
    rope_cpu(ys[0].as_strided({1, n_heads + n_kv_heads, D}, {total, D, 1}), cos, sin, neox);
  }
  const at::Tensor a = attention_cpu(q, k, ys[2].view({1, n_kv_heads, D}), k_cache, v_cache, positions, kv_len,
                                     window, scale);
  at::Tensor y = qmatmul_cpu(o, o_type, a);
  if (post_norm.has_value() && post_norm->defined()) y = rms_norm_cpu(y, *post_norm, eps);
  return y.add_(x);
}

// One token's dense gated FFN half (llama, Gemma 3) as one call:
//   x + [post_norm](down . act(gate . xn) * up . xn),  xn = rms_norm(x)
// the down projection over ffn_down rows (a GEMV) or, down_transposed, over ffn_down_t rows (the axpy
// the Python path's qmatmul_t makes); the same calls as the Python FFN, in its order.
at::Tensor ffn_block_cpu(const at::Tensor& x, const at::Tensor& norm_w, double eps, const std::vector<at::Tensor>& gate_up,
                         const std::vector<int64_t>& gate_up_types, const at::Tensor& down, int64_t down_type,
                         bool down_transposed, int64_t act, bool act_on_up, const c10::optional<at::Tensor>& post_norm) {
  HS_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
           "ffn_block: x must be one token, contiguous float32 [1, d_model]");
  HS_CHECK(gate_up.size() == 2 && gate_up_types.size() == 2, "ffn_block: gate and up weights and their types expected");
  const at::Tensor xn = rms_norm_cpu(x, norm_w, eps);
  const auto gu = qmatmul_multi_cpu(gate_up, gate_up_types, xn);
  const at::Tensor h = gated_act_cpu(gu[0], gu[1], act, act_on_up);
  at::Tensor y = down_transposed ? sparse_axpy_cpu(down, down_type, h, c10::nullopt) : qmatmul_cpu(down, down_type, h);
  HS_CHECK(y.sizes() == x.sizes(), "ffn_block: the down projection gives ", y.size(1), " values for a d_model of ",
           x.size(1));
  if (post_norm.has_value() && post_norm->defined()) y = rms_norm_cpu(y, *post_norm, eps);
  return y.add_(x);
}

// One token's FFN half of a CPU-only sparse layer (a llama block's second half), as one call:
//   x + FFN_idx(xn) (+ down bias),  xn = rms_norm(x),  idx = {i in ids : fc2 . relu(fc1 . xn) [i] >= threshold}
// the same norm, predictor GEMVs, id selection and fused sparse FFN the hybrid runtime's bound calls
// make (runtime/hybrid.py, HybridFFN._cpu_token_fn), without ~15 Python operations around them.
at::Tensor sparse_ffn_block_cpu(const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& fc1,
                                int64_t fc1_type, const at::Tensor& fc2, int64_t fc2_type, double threshold,
                                const at::Tensor& ids, const at::Tensor& up, int64_t up_type,
                                const c10::optional<at::Tensor>& gate, int64_t gate_type, const at::Tensor& down_t,
                                int64_t down_type, const c10::optional<at::Tensor>& up_bias, int64_t act,
                                bool act_on_up, const c10::optional<at::Tensor>& down_bias) {
  HS_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
           "sparse_ffn_block: x must be one token, contiguous float32 [1, d_model]");
  const at::Tensor xn = rms_norm_cpu(x, norm_w, eps);
  const at::Tensor scores = qmatmul_cpu(fc2, fc2_type, qmatmul_cpu(fc1, fc1_type, xn).relu_());
  HS_CHECK(scores.size(1) == up.size(0), "sparse_ffn_block: the predictor gives ", scores.size(1), " scores for ",
           up.size(0), " neurons");
  const at::Tensor idx = select_ids(scores[0], ids, threshold);
  at::Tensor y = idx.numel() ? std::get<0>(sparse_ffn_cpu(xn, up, up_type, gate, gate_type, down_t, down_type, idx,
                                                          up_bias, act, act_on_up))
                             : at::zeros_like(x);
  HS_CHECK(y.sizes() == x.sizes(), "sparse_ffn_block: the FFN gives ", y.size(1), " values for a d_model of ",
           x.size(1));
  if (down_bias.has_value() && down_bias->defined()) y.add_(*down_bias);
  return y.add_(x);
}

// act: 0 silu, 1 relu, 2 gelu (tanh approximation), 3 gelu (erf); act_on_up: dReLU-style. ATen's
// vectorized activations, called from C++: one dispatch from Python instead of two or three.
at::Tensor gated_act_cpu(const at::Tensor& gate, const at::Tensor& up, int64_t act, bool act_on_up) {
  HS_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat,
           "gated_act: gate and up must be float32 of one shape");
  HS_CHECK(act >= 0 && act <= 3, "gated_act: unknown activation id ", act);
  auto f = [act](const at::Tensor& x) {
    switch (act) {
      case 0: return at::silu(x);
      case 1: return at::relu(x);
      case 2: return at::gelu(x, "tanh");
      default: return at::gelu(x);
    }
  };
  return f(gate).mul_(act_on_up ? f(up) : up);
}

}  // namespace hs
