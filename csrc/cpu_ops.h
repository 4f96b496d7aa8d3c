// Declarations of the CPU-side functions the extension's translation units define and call across files
// (the ops registered in ops.cpp, and the pieces the compiled block halves and the cold FFN task are
// made of): one list, so that a signature lives in one place.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <vector>

namespace hs {
at::Tensor qmatmul_cpu(const at::Tensor& w, int64_t qtype, const at::Tensor& x);
std::vector<at::Tensor> qmatmul_multi_cpu(const std::vector<at::Tensor>& ws, const std::vector<int64_t>& qtypes,
                                          const at::Tensor& x);
int64_t argmax_cpu(const at::Tensor& x);
// benchmarks: the listed rows read `side` at a time (asking for the group `ahead` groups on; 0: none), bytes summed
int64_t read_rows_cpu(const at::Tensor& w, const at::Tensor& idx, int64_t side, int64_t ahead);
std::string cpu_path();
at::Tensor quantize_act_bytes(const at::Tensor& x, bool k_quant);
std::vector<at::Tensor> qmatmul_rows_cpu(const std::vector<at::Tensor>& ws, const std::vector<int64_t>& qtypes,
                                         const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& idxs);
at::Tensor sparse_axpy_cpu(const at::Tensor& w, int64_t qtype, const at::Tensor& h,
                           const c10::optional<at::Tensor>& idx);
std::tuple<at::Tensor, at::Tensor> sparse_ffn_cpu(const at::Tensor& x, const at::Tensor& up, int64_t up_type,
                                                  const c10::optional<at::Tensor>& gate, int64_t gate_type,
                                                  const at::Tensor& down_t, int64_t down_type,
                                                  const c10::optional<at::Tensor>& idx,
                                                  const c10::optional<at::Tensor>& up_bias, int64_t act,
                                                  bool act_on_up);
std::tuple<at::Tensor, at::Tensor> sparse_ffn_masked_cpu(const at::Tensor& x, const at::Tensor& up, int64_t up_type,
                                                         const c10::optional<at::Tensor>& gate, int64_t gate_type,
                                                         const at::Tensor& down_t, int64_t down_type,
                                                         const at::Tensor& idx, const at::Tensor& mask,
                                                         const c10::optional<at::Tensor>& up_bias, int64_t act,
                                                         bool act_on_up);
at::Tensor sparse_rowdot_cpu(const at::Tensor& w, int64_t qtype, const at::Tensor& x,
                             const c10::optional<at::Tensor>& idx, const c10::optional<at::Tensor>& mask);
at::Tensor qmatmul_t_cpu(const at::Tensor& w, int64_t qtype, const at::Tensor& h);
at::Tensor dequantize_rows_cpu(const at::Tensor& w, int64_t qtype, const c10::optional<at::Tensor>& out);
bool has_cuda();
void rope_cpu(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, bool neox);
at::Tensor attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& positions, int64_t kv_len, int64_t window,
                         double scale);
at::Tensor gated_act_cpu(const at::Tensor& gate, const at::Tensor& up, int64_t act, bool act_on_up);
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor attention_block_cpu(const at::Tensor& x, const at::Tensor& norm_w, double eps,
                               const std::vector<at::Tensor>& qkv, const std::vector<int64_t>& qkv_types,
                               const at::Tensor& o, int64_t o_type, int64_t n_heads, int64_t n_kv_heads,
                               const at::Tensor& cos, const at::Tensor& sin, bool neox, at::Tensor k_cache,
                               at::Tensor v_cache, const at::Tensor& positions, int64_t kv_len, double scale,
                               int64_t window, const c10::optional<at::Tensor>& q_norm,
                               const c10::optional<at::Tensor>& k_norm, const c10::optional<at::Tensor>& post_norm);
at::Tensor ffn_block_cpu(const at::Tensor& x, const at::Tensor& norm_w, double eps, const std::vector<at::Tensor>& gate_up,
                         const std::vector<int64_t>& gate_up_types, const at::Tensor& down, int64_t down_type,
                         bool down_transposed, int64_t act, bool act_on_up, const c10::optional<at::Tensor>& post_norm);
at::Tensor sparse_ffn_block_cpu(const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& fc1,
                                int64_t fc1_type, const at::Tensor& fc2, int64_t fc2_type, double threshold,
                                const at::Tensor& ids, const at::Tensor& up, int64_t up_type,
                                const c10::optional<at::Tensor>& gate, int64_t gate_type, const at::Tensor& down_t,
                                int64_t down_type, const c10::optional<at::Tensor>& up_bias, int64_t act,
                                bool act_on_up, const c10::optional<at::Tensor>& down_bias);
int64_t cold_ffn_new(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& ids, const at::Tensor& y,
                     const at::Tensor& up, int64_t up_type, const c10::optional<at::Tensor>& gate, int64_t gate_type,
                     const at::Tensor& down_t, int64_t down_type, const c10::optional<at::Tensor>& up_bias,
                     int64_t act, bool act_on_up);
void cold_ffn_run(int64_t handle);
at::Tensor select_ids(const at::Tensor& mask, const at::Tensor& ids, c10::optional<double> threshold);
void cold_ffn_enqueue(int64_t handle);
void cold_ffn_enqueue_polled(int64_t handle, const at::Tensor& x, const c10::optional<at::Tensor>& mask,
                             const at::Tensor& y, const at::Tensor& counter, double timeout_s);
void cold_ffn_attach_sync(int64_t handle, const at::Tensor& sync);
int64_t cold_ffn_serve(const std::vector<int64_t>& handles, double timeout_s, bool use_pool);
void cold_ffn_free(int64_t handle);
std::string cold_ffn_error();
std::vector<int64_t> cold_ffn_stats();
std::vector<int64_t> sparse_ffn_stats();
void cold_ffn_set_threads(int64_t n);
void pool_configure(int64_t spin_us, int64_t yield_us);
void pool_rest();
int64_t pool_selftest(int64_t n, int64_t throw_at);
}  // namespace hs
