// Fused CPU versions of the small per-layer steps a decode step is made of. Each replaces 5-20 torch
// ops, whose dispatch overhead (~5 us each) otherwise costs more than the arithmetic on small models.
//   rope_           : rotary embedding in place (NEOX halves or NORM adjacent pairs)
//   attention       : store k/v at their positions in the cache, causal (+ sliding window) softmax
//                     attention over the first kv_len slots, grouped-query heads
//   gated_act       : act(gate) * up, or act(gate) * act(up)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "check.h"
#include "cpu_dot.h"

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
  at::parallel_for(0, T * H, 16, [&](int64_t b, int64_t e) {
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

template <typename C>
void attend_cached(const float* qp, const C* kcp, const C* vcp, const int64_t* pos, float* op, int64_t T, int64_t Hq,
                   int64_t group, int64_t D, int64_t n_ctx, int64_t kv_len, int64_t window, double scale) {
  // a decode step over a short cache is a few microseconds of work: not worth waking the threads
  const int64_t work = T * Hq * kv_len * D;
  const int64_t grain = work < (1 << 20) ? T * Hq : 1;
  at::parallel_for(0, T * Hq, grain, [&](int64_t b, int64_t e) {
    std::vector<float> scores(kv_len);
    for (int64_t r = b; r < e; ++r) {
      const int64_t t = r / Hq, h = r % Hq, hk = h / group;
      const float* qv = qp + (t * Hq + h) * D;
      const int64_t last = std::min<int64_t>(pos[t], kv_len - 1);
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos[t] - window + 1) : 0;
      if (last < first) continue;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t s = first; s <= last; ++s) {
        scores[s] = cache_dot(qv, kcp + (hk * n_ctx + s) * D, D) * static_cast<float>(scale);
        mx = std::max(mx, scores[s]);
      }
      float sum = 0.f;
      for (int64_t s = first; s <= last; ++s) sum += (scores[s] = std::exp(scores[s] - mx));
      const float inv = 1.f / sum;
      float* o = op + t * Hq * D + h * D;
      for (int64_t s = first; s <= last; ++s) cache_axpy(scores[s] * inv, vcp + (hk * n_ctx + s) * D, o, D);
    }
  });
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
