// Registration of the hybridsparse ops with torch's dispatcher (schema once, one kernel per device).
#include <torch/library.h>

namespace hs {
at::Tensor qmatmul_cpu(const at::Tensor& w, int64_t qtype, const at::Tensor& x);
at::Tensor qmatmul_t_cpu(const at::Tensor& w, int64_t qtype, const at::Tensor& h);
bool has_cuda();
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& w, double eps);
}  // namespace hs

TORCH_LIBRARY(hybridsparse, m) {
  m.def("qmatmul(Tensor w, int qtype, Tensor x) -> Tensor");
  m.def("qmatmul_t(Tensor w, int qtype, Tensor h) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("has_cuda() -> bool", &hs::has_cuda);
}

TORCH_LIBRARY_IMPL(hybridsparse, CPU, m) {
  m.impl("qmatmul", &hs::qmatmul_cpu);
  m.impl("qmatmul_t", &hs::qmatmul_t_cpu);
  m.impl("rms_norm", &hs::rms_norm_cpu);
}

#ifndef HS_WITH_CUDA
namespace hs {
bool has_cuda() { return false; }
}  // namespace hs
#endif
