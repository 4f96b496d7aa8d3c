// The CUDA ops as torch sees them: argument checks on the host, then the launchers of *.cu files.
#ifdef HS_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "quant_blocks.h"

namespace hs {

void launch_rowdot(int64_t qtype, const uint8_t* w, int64_t row_bytes, const float* x, int64_t K,
                   const int32_t* idx, const bool* mask, int64_t n_out, float* y, int T, cudaStream_t stream);
void launch_axpy(int64_t qtype, const uint8_t* w, int64_t row_bytes, const float* h, int64_t n_rows,
                 const int32_t* idx, int64_t D, float* y, int T, cudaStream_t stream);
int cuda_max_tokens();

namespace {

// Elements in a row of `row_bytes` bytes of a type the CUDA kernels read (0: not one of them).
int64_t cuda_row_elements(int64_t qtype, int64_t row_bytes) {
  switch (qtype) {
    case F16: case BF16: return row_bytes % 2 ? 0 : row_bytes / 2;
    case Q8_0: return row_bytes % sizeof(BlockQ8_0) ? 0 : row_bytes / sizeof(BlockQ8_0) * QK;
    case Q4_0: return row_bytes % sizeof(BlockQ4_0) ? 0 : row_bytes / sizeof(BlockQ4_0) * QK;
    default: return 0;
  }
}

int64_t check_weight(const char* op, const at::Tensor& w, int64_t qtype) {
  TORCH_CHECK(qtype == F16 || qtype == BF16 || qtype == Q8_0 || qtype == Q4_0, op, " (CUDA): weight type id ",
              qtype, " is not supported (F16, BF16, Q8_0 and Q4_0 are)");
  TORCH_CHECK(w.is_cuda() && w.dim() == 2 && w.is_contiguous(), op, " (CUDA): weight must be a contiguous 2-D GPU tensor");
  const int64_t row_bytes = w.size(1) * w.element_size();
  const int64_t n = cuda_row_elements(qtype, row_bytes);
  TORCH_CHECK(n > 0 && n % 8 == 0, op, " (CUDA): a row of ", row_bytes, " bytes is not a whole number of 8-element units");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0 || (qtype != F16 && qtype != BF16), op,
              " (CUDA): float16 weights must start at a 16-byte boundary");
  return n;
}

void check_index(const char* op, const c10::optional<at::Tensor>& idx, const at::Tensor& like) {
  if (!idx) return;
  TORCH_CHECK(idx->dim() == 1 && idx->scalar_type() == at::kInt && idx->is_contiguous() && idx->device() == like.device(),
              op, " (CUDA): the index set must be a contiguous int32 vector on the weight's GPU");
}

}  // namespace

// y[T, n] = x[T, K] . W[rows]^T, rows = idx (or all); rows whose mask entry is false give 0.
at::Tensor sparse_rowdot_cuda(const at::Tensor& w, int64_t qtype, const at::Tensor& x,
                              const c10::optional<at::Tensor>& idx, const c10::optional<at::Tensor>& mask) {
  const int64_t K = check_weight("sparse_rowdot", w, qtype);
  check_index("sparse_rowdot", idx, w);
  TORCH_CHECK(x.is_cuda() && x.device() == w.device() && x.dim() == 2 && x.scalar_type() == at::kFloat &&
              x.is_contiguous() && x.size(1) == K, "sparse_rowdot (CUDA): x must be a contiguous float32 [tokens, ",
              K, "] tensor on the weight's GPU");
  TORCH_CHECK(x.size(0) <= cuda_max_tokens(), "sparse_rowdot (CUDA): at most ", cuda_max_tokens(),
              " tokens per call, got ", x.size(0));
  if (mask)
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 1 && mask->size(0) == w.size(0) &&
                mask->is_contiguous() && mask->device() == w.device(),
                "sparse_rowdot (CUDA): mask must be a contiguous bool vector of ", w.size(0), " entries");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n_out = idx ? idx->size(0) : w.size(0), T = x.size(0);
  auto y = at::empty({T, n_out}, x.options());
  if (T == 0 || n_out == 0) return y;
  launch_rowdot(qtype, static_cast<const uint8_t*>(w.data_ptr()), w.size(1) * w.element_size(), x.data_ptr<float>(),
                K, idx ? idx->data_ptr<int32_t>() : nullptr, mask ? mask->data_ptr<bool>() : nullptr, n_out,
                y.data_ptr<float>(), static_cast<int>(T), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

// y[T, D] = h[T, n] . W_t[rows], rows = idx (or all); rows whose h is zero for every token are skipped.
at::Tensor sparse_axpy_cuda(const at::Tensor& w, int64_t qtype, const at::Tensor& h,
                            const c10::optional<at::Tensor>& idx) {
  const int64_t D = check_weight("sparse_axpy", w, qtype);
  check_index("sparse_axpy", idx, w);
  const int64_t n_rows = idx ? idx->size(0) : w.size(0);
  TORCH_CHECK(h.is_cuda() && h.device() == w.device() && h.dim() == 2 && h.scalar_type() == at::kFloat &&
              h.is_contiguous() && h.size(1) == n_rows, "sparse_axpy (CUDA): h must be a contiguous float32 [tokens, ",
              n_rows, "] tensor on the weight's GPU");
  const c10::cuda::CUDAGuard guard(h.device());
  auto y = at::zeros({h.size(0), D}, h.options());
  if (h.size(0) == 0 || n_rows == 0) return y;
  launch_axpy(qtype, static_cast<const uint8_t*>(w.data_ptr()), w.size(1) * w.element_size(), h.data_ptr<float>(),
              n_rows, idx ? idx->data_ptr<int32_t>() : nullptr, D, y.data_ptr<float>(), static_cast<int>(h.size(0)),
              c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor qmatmul_cuda(const at::Tensor& w, int64_t qtype, const at::Tensor& x) {
  return sparse_rowdot_cuda(w, qtype, x, c10::nullopt, c10::nullopt);
}

bool has_cuda() { return true; }

}  // namespace hs

TORCH_LIBRARY_IMPL(hybridsparse, CUDA, m) {
  m.impl("qmatmul", &hs::qmatmul_cuda);
  m.impl("sparse_rowdot", &hs::sparse_rowdot_cuda);
  m.impl("sparse_axpy", &hs::sparse_axpy_cuda);
}
#endif  // HS_WITH_CUDA
