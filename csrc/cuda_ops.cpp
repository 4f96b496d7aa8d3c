// The CUDA ops as torch sees them: argument checks on the host, then the launchers of *.cu files.
#ifdef HS_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "check.h"
#include "quant_blocks.h"

namespace hs {

void launch_rowdot(int64_t qtype, const uint8_t* w, int64_t row_bytes, const float* x, int64_t K,
                   const int32_t* idx, const bool* mask, int64_t n_out, float* y, const float* res, int T,
                   uint8_t* xq, cudaStream_t stream);
int64_t rowdot_scratch_bytes(int64_t qtype, int64_t T, int64_t K, const void* w, int64_t row_bytes);
void launch_axpy(int64_t qtype, const uint8_t* w, int64_t row_bytes, const float* h, int64_t n_rows,
                 const int32_t* idx, int64_t D, float* y, int T, cudaStream_t stream);
int cuda_max_tokens();
void launch_dequant_f16(int64_t qtype, const uint8_t* w, int64_t n_blocks, void* out, cudaStream_t stream);
void launch_rowdot_fused(int64_t qtype, const uint8_t* w, int64_t row_bytes, const float* x, int64_t K,
                         int64_t n_out, float* y, int T, const float* nw, float eps, int act, bool act_on_up,
                         cudaStream_t stream);
int fused_max_tokens();
void launch_rope(float* x, int64_t st, int64_t sh, int64_t T, int H, int half, const float* cos, const float* sin,
                 bool neox, cudaStream_t stream);
void launch_attention(const float* q, int64_t sqt, int64_t sqh, const float* k, const float* v, int64_t skt,
                      int64_t skh, int64_t svt, int64_t svh, void* kc, void* vc, bool half_cache,
                      const int64_t* pos, int64_t T, int Hq, int Hkv, int64_t n_ctx, int D, int64_t kv_len,
                      int64_t window, float scale, float* out, float* part_o, float* part_ml, cudaStream_t stream);
int attention_chunks(int64_t T, int Hq, int64_t kv_len);
int attention_max_head_dim();
int attention_max_kv();
void launch_rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t D, float eps,
                     cudaStream_t stream);
void launch_layer_norm(const float* x, const float* w, const float* b, float* y, int64_t rows, int64_t D, float eps,
                       cudaStream_t stream);
void launch_gated_act(const float* g, int64_t sg, const float* u, int64_t su, float* y, int64_t T, int64_t N,
                      int act, bool act_on_up, cudaStream_t stream);

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
  HS_CHECK(qtype == F16 || qtype == BF16 || qtype == Q8_0 || qtype == Q4_0, op, " (CUDA): weight type id ",
           qtype, " is not supported (F16, BF16, Q8_0 and Q4_0 are)");
  HS_CHECK(w.is_cuda() && w.dim() == 2 && w.is_contiguous(), op, " (CUDA): weight must be a contiguous 2-D GPU tensor");
  const int64_t row_bytes = w.size(1) * w.element_size();
  const int64_t n = cuda_row_elements(qtype, row_bytes);
  HS_CHECK(n > 0 && n % 8 == 0, op, " (CUDA): a row of ", row_bytes, " bytes is not a whole number of 8-element units");
  HS_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0 || (qtype != F16 && qtype != BF16), op,
           " (CUDA): float16 weights must start at a 16-byte boundary");
  return n;
}

void check_index(const char* op, const c10::optional<at::Tensor>& idx, const at::Tensor& like) {
  if (!idx) return;
  HS_CHECK(idx->dim() == 1 && idx->scalar_type() == at::kInt && idx->is_contiguous() && idx->device() == like.device(),
           op, " (CUDA): the index set must be a contiguous int32 vector on the weight's GPU");
}

// y[T, n] = x[T, K] . W[rows]^T (+ res[T, n] where given), rows = idx (or all); rows whose mask entry
// is false give 0 (or res).
at::Tensor rowdot_cuda(const at::Tensor& w, int64_t qtype, const at::Tensor& x, const c10::optional<at::Tensor>& idx,
                       const c10::optional<at::Tensor>& mask, const at::Tensor* res) {
  const int64_t K = check_weight("sparse_rowdot", w, qtype);
  check_index("sparse_rowdot", idx, w);
  HS_CHECK(x.is_cuda() && x.device() == w.device() && x.dim() == 2 && x.scalar_type() == at::kFloat &&
           x.is_contiguous() && x.size(1) == K, "sparse_rowdot (CUDA): x must be a contiguous float32 [tokens, ",
           K, "] tensor on the weight's GPU");
  HS_CHECK(x.size(0) <= cuda_max_tokens(), "sparse_rowdot (CUDA): at most ", cuda_max_tokens(),
           " tokens per call, got ", x.size(0));
  if (mask)
    HS_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 1 && mask->size(0) == w.size(0) &&
             mask->is_contiguous() && mask->device() == w.device(),
             "sparse_rowdot (CUDA): mask must be a contiguous bool vector of ", w.size(0), " entries");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n_out = idx ? idx->size(0) : w.size(0), T = x.size(0);
  if (res)
    HS_CHECK(res->is_cuda() && res->device() == x.device() && res->scalar_type() == at::kFloat && res->dim() == 2 &&
             res->size(0) == T && res->size(1) == n_out && res->is_contiguous(),
             "matmul_add (CUDA): res must be a contiguous float32 [", T, ", ", n_out, "] tensor on the weight's GPU");
  auto y = at::empty({T, n_out}, x.options());
  if (T == 0 || n_out == 0) return y;
  // x quantized for the dots (Q4_0; Q8_0 with HS_CUDA_STAGED_Q8=1): scratch from torch's allocator (a
  // graph's pool while capturing); no allocation for the types that read float x
  const int64_t scratch = rowdot_scratch_bytes(qtype, T, K, w.data_ptr(), w.size(1) * w.element_size());
  at::Tensor xq;
  if (scratch) xq = at::empty({scratch}, x.options().dtype(at::kByte));
  launch_rowdot(qtype, static_cast<const uint8_t*>(w.data_ptr()), w.size(1) * w.element_size(), x.data_ptr<float>(),
                K, idx ? idx->data_ptr<int32_t>() : nullptr, mask ? mask->data_ptr<bool>() : nullptr, n_out,
                y.data_ptr<float>(), res ? res->data_ptr<float>() : nullptr, static_cast<int>(T),
                scratch ? xq.data_ptr<uint8_t>() : nullptr, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

}  // namespace

at::Tensor sparse_rowdot_cuda(const at::Tensor& w, int64_t qtype, const at::Tensor& x,
                              const c10::optional<at::Tensor>& idx, const c10::optional<at::Tensor>& mask) {
  return rowdot_cuda(w, qtype, x, idx, mask, nullptr);
}

// res + x . W^T over every row: the decode GEMV that adds the residual as it writes (one kernel, not
// a GEMV and an add)
at::Tensor matmul_add_cuda(const at::Tensor& w, int64_t qtype, const at::Tensor& x, const at::Tensor& res) {
  return rowdot_cuda(w, qtype, x, c10::nullopt, c10::nullopt, &res);
}

// The decode GEMV with the layer's RMS norm before it (norm_w given) and, for act >= 0, the gated
// activation after it: W is then [2N, K], gate rows then up rows, and y [T, N] = act(gate . x) * (up . x)
// (act_on_up: act(up . x)).
at::Tensor rowdot_fused_cuda(const at::Tensor& w, int64_t qtype, const at::Tensor& x,
                             const c10::optional<at::Tensor>& norm_w, double eps, int64_t act, bool act_on_up) {
  const int64_t K = check_weight("rowdot_fused", w, qtype);
  HS_CHECK(qtype != Q4_0, "rowdot_fused (CUDA): Q4_0 rows are not supported (F16, BF16 and Q8_0 are)");
  HS_CHECK(x.is_cuda() && x.device() == w.device() && x.dim() == 2 && x.scalar_type() == at::kFloat &&
           x.is_contiguous() && x.size(1) == K && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
           "rowdot_fused (CUDA): x must be a contiguous, 16-byte aligned float32 [tokens, ", K,
           "] tensor on the weight's GPU");
  const int64_t T = x.size(0);
  HS_CHECK(T >= 1 && T <= fused_max_tokens(), "rowdot_fused (CUDA): 1 to ", fused_max_tokens(), " tokens, got ", T);
  HS_CHECK(act >= -1 && act <= 3, "rowdot_fused (CUDA): act must be -1 (none) or an activation id 0-3, got ", act);
  HS_CHECK(!norm_w || (norm_w->is_cuda() && norm_w->device() == x.device() && norm_w->scalar_type() == at::kFloat &&
                       norm_w->dim() == 1 && norm_w->size(0) == K && norm_w->is_contiguous() &&
                       reinterpret_cast<uintptr_t>(norm_w->data_ptr()) % 16 == 0),
           "rowdot_fused (CUDA): the norm weight must be a contiguous, 16-byte aligned float32 [", K,
           "] vector on x's GPU");
  HS_CHECK(act < 0 || w.size(0) % 2 == 0, "rowdot_fused (CUDA): a gated activation needs gate rows then up rows, got ",
           w.size(0), " rows");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n_out = act >= 0 ? w.size(0) / 2 : w.size(0);
  auto y = at::empty({T, n_out}, x.options());
  if (n_out == 0) return y;
  launch_rowdot_fused(qtype, static_cast<const uint8_t*>(w.data_ptr()), w.size(1) * w.element_size(),
                      x.data_ptr<float>(), K, n_out, y.data_ptr<float>(), static_cast<int>(T),
                      norm_w ? norm_w->data_ptr<float>() : nullptr, static_cast<float>(eps), static_cast<int>(act),
                      act_on_up, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

// y[T, D] = h[T, n] . W_t[rows], rows = idx (or all); rows whose h is zero for every token are skipped.
at::Tensor sparse_axpy_cuda(const at::Tensor& w, int64_t qtype, const at::Tensor& h,
                            const c10::optional<at::Tensor>& idx) {
  const int64_t D = check_weight("sparse_axpy", w, qtype);
  check_index("sparse_axpy", idx, w);
  const int64_t n_rows = idx ? idx->size(0) : w.size(0);
  HS_CHECK(h.is_cuda() && h.device() == w.device() && h.dim() == 2 && h.scalar_type() == at::kFloat &&
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

// Rows of Q4_0 / Q8_0 as float16 [rows, elements] (prefill: cuBLAS multiplies them)
at::Tensor dequantize_f16_cuda(const at::Tensor& w, int64_t qtype) {
  HS_CHECK(qtype == Q8_0 || qtype == Q4_0, "dequantize_f16 (CUDA): weight type id ", qtype,
           " is not supported (Q8_0 and Q4_0 are)");
  HS_CHECK(w.is_cuda() && w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
           "dequantize_f16 (CUDA): weight must be a contiguous uint8 [rows, row_bytes] GPU tensor");
  const int64_t row_bytes = w.size(1), n = cuda_row_elements(qtype, row_bytes);
  HS_CHECK(n > 0, "dequantize_f16 (CUDA): a row of ", row_bytes, " bytes is not a whole number of blocks");
  HS_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 2 == 0, "dequantize_f16 (CUDA): weight must be 2-byte aligned");
  const c10::cuda::CUDAGuard guard(w.device());
  auto out = at::empty({w.size(0), n}, w.options().dtype(at::kHalf));
  launch_dequant_f16(qtype, w.data_ptr<uint8_t>(), w.size(0) * n / QK, out.data_ptr(),
                     c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor qmatmul_cuda(const at::Tensor& w, int64_t qtype, const at::Tensor& x) {
  return sparse_rowdot_cuda(w, qtype, x, c10::nullopt, c10::nullopt);
}

// The per-layer decode steps (csrc/cuda_layers.cu). Python checks their arguments first (see
// kernels.py); the checks here are the second line.
void rope_cuda(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, bool neox) {
  HS_CHECK(x.is_cuda() && x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1,
           "rope_ (CUDA): x must be float32 [tokens, heads, head_dim] with unit stride in head_dim");
  HS_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
           sin.sizes() == cos.sizes() && 2 * cos.size(1) <= x.size(2) && cos.scalar_type() == at::kFloat,
           "rope_ (CUDA): cos/sin must be contiguous float32 [tokens, rot_dim / 2]");
  const c10::cuda::CUDAGuard guard(x.device());
  launch_rope(x.data_ptr<float>(), x.stride(0), x.stride(1), x.size(0), static_cast<int>(x.size(1)),
              static_cast<int>(cos.size(1)), cos.data_ptr<float>(), sin.data_ptr<float>(), neox,
              c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                          at::Tensor v_cache, const at::Tensor& positions, int64_t kv_len, int64_t window,
                          double scale) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1);
  HS_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && q.scalar_type() == at::kFloat &&
           k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && Hq % Hkv == 0 &&
           D <= attention_max_head_dim(), "attention (CUDA): float32 q/k/v with unit stride, head_dim <= ",
           attention_max_head_dim());
  const bool half_cache = k_cache.scalar_type() == at::kHalf;
  HS_CHECK((half_cache || k_cache.scalar_type() == at::kFloat) && v_cache.scalar_type() == k_cache.scalar_type() &&
           k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(0) == Hkv && k_cache.size(2) == D,
           "attention (CUDA): the cache must be contiguous float16/float32 [Hkv, n_ctx, D]");
  HS_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == T,
           "attention (CUDA): positions must be int64 [T]");
  HS_CHECK(kv_len >= 1 && kv_len <= attention_max_kv() && kv_len <= k_cache.size(1),
           "attention (CUDA): kv_len must be 1..", attention_max_kv());
  const c10::cuda::CUDAGuard guard(q.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n_ctx = k_cache.size(1);
  auto out = at::empty({T, Hq * D}, q.options());
  if (T == 0) return out;
  // the chunks' partial sums (split-KV); none when one chunk covers the cache
  const int n_chunks = attention_chunks(T, static_cast<int>(Hq), kv_len);
  auto part = at::empty({n_chunks > 1 ? T * Hq * n_chunks * (D + 2) : 0}, q.options());
  float* part_o = n_chunks > 1 ? part.data_ptr<float>() : nullptr;
  float* part_ml = n_chunks > 1 ? part_o + T * Hq * n_chunks * D : nullptr;
  launch_attention(q.data_ptr<float>(), q.stride(0), q.stride(1), k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0),
                   k.stride(1), v.stride(0), v.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), half_cache,
                   positions.data_ptr<int64_t>(), T, static_cast<int>(Hq), static_cast<int>(Hkv), n_ctx,
                   static_cast<int>(D), kv_len, window, static_cast<float>(scale), out.data_ptr<float>(), part_o,
                   part_ml, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& w, double eps) {
  HS_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.is_contiguous() &&
           w.is_contiguous() && w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm (CUDA): float32, matching sizes");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty_like(x);
  const int64_t D = x.size(-1);
  launch_rms_norm(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), D ? x.numel() / D : 0, D,
                  static_cast<float>(eps), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor layer_norm_cuda(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b, double eps) {
  const int64_t D = x.size(-1);
  HS_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.is_contiguous() &&
           w.is_contiguous() && w.dim() == 1 && D == w.size(0) && w.device() == x.device() &&
           (!b || (b->scalar_type() == at::kFloat && b->is_contiguous() && b->dim() == 1 && b->size(0) == D &&
                   b->device() == x.device())),
           "layer_norm (CUDA): float32, matching sizes, one device");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty_like(x);
  launch_layer_norm(x.data_ptr<float>(), w.data_ptr<float>(), b ? b->data_ptr<float>() : nullptr, y.data_ptr<float>(),
                    D ? x.numel() / D : 0, D, static_cast<float>(eps), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor gated_act_cuda(const at::Tensor& gate, const at::Tensor& up, int64_t act, bool act_on_up) {
  HS_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 && up.stride(1) == 1 &&
           gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && act >= 0 && act <= 3,
           "gated_act (CUDA): float32 [T, N] with unit stride in N, activation id 0-3");
  const c10::cuda::CUDAGuard guard(gate.device());
  auto y = at::empty(gate.sizes(), gate.options());
  launch_gated_act(gate.data_ptr<float>(), gate.stride(0), up.data_ptr<float>(), up.stride(0), y.data_ptr<float>(),
                   gate.size(0), gate.size(1), static_cast<int>(act), act_on_up, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

bool has_cuda() { return true; }

}  // namespace hs

TORCH_LIBRARY_IMPL(hybridsparse, CUDA, m) {
  m.impl("qmatmul", &hs::qmatmul_cuda);
  m.impl("dequantize_f16", &hs::dequantize_f16_cuda);
  m.impl("sparse_rowdot", &hs::sparse_rowdot_cuda);
  m.impl("matmul_add", &hs::matmul_add_cuda);
  m.impl("rowdot_fused", &hs::rowdot_fused_cuda);
  m.impl("sparse_axpy", &hs::sparse_axpy_cuda);
  m.impl("rope_", &hs::rope_cuda);
  m.impl("attention", &hs::attention_cuda);
  m.impl("rms_norm", &hs::rms_norm_cuda);
  m.impl("layer_norm", &hs::layer_norm_cuda);
  m.impl("gated_act", &hs::gated_act_cuda);
}
#endif  // HS_WITH_CUDA
