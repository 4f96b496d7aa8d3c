// Fused RMSNorm on the CPU: one pass for the sum of squares, one for the scaled output. torch's
// CPU rms_norm is a composite of ~8 ops, which dominates a small model's decode step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "check.h"

namespace hs {

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& w, double eps) {
  HS_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
           "rms_norm: x and weight must be float32");
  HS_CHECK(x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: weight has ",
           w.size(0), " elements, x rows have ", x.size(-1));
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto y = at::empty_like(xc);
  const int64_t D = xc.size(-1), rows = D ? xc.numel() / D : 0;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = xp + r * D;
      float ss = 0.f;
      for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
      const float scale = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      float* yr = yp + r * D;
      for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] * scale * wp[i];
    }
  });
  return y;
}

}  // namespace hs
