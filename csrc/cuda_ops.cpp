// The CUDA ops as torch sees them: argument checks on the host, then the launchers of *.cu files.
#ifdef HS_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "quant_blocks.h"

namespace hs {

void launch_qgemv(int64_t qtype, const uint8_t* w, int64_t row_bytes, const float* x, float* y, int64_t N,
                  int64_t K, int T, cudaStream_t stream);
int qgemv_max_tokens();

at::Tensor qmatmul_cuda(const at::Tensor& w, int64_t qtype, const at::Tensor& x) {
  TORCH_CHECK(qtype == Q8_0 || qtype == Q4_0, "qmatmul (CUDA): weight type id ", qtype,
              " is not supported (Q8_0 and Q4_0 are)");
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && x.device() == w.device(), "qmatmul (CUDA): x and w must be on one GPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "qmatmul (CUDA): x must be a contiguous float32 [tokens, features] tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kByte,
              "qmatmul (CUDA): weight must be contiguous uint8 blocks");
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  const int max_tokens = qgemv_max_tokens();
  TORCH_CHECK(T <= max_tokens, "qmatmul (CUDA): at most ", max_tokens, " tokens per call, got ", T);
  TORCH_CHECK(K % QK == 0 && w.size(1) == K / QK * block_bytes(qtype), "qmatmul (CUDA): weight row has ",
              w.size(1), " bytes, expected ", K / QK * block_bytes(qtype), " for ", K, " elements");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  launch_qgemv(qtype, w.data_ptr<uint8_t>(), w.size(1), x.data_ptr<float>(), y.data_ptr<float>(), N, K,
               static_cast<int>(T), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

bool has_cuda() { return true; }

}  // namespace hs

TORCH_LIBRARY_IMPL(hybridsparse, CUDA, m) { m.impl("qmatmul", &hs::qmatmul_cuda); }
#endif  // HS_WITH_CUDA
