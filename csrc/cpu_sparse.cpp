// The fused sparse FFN on the CPU, for the neurons in an index set S (all neurons when S is None):
//   h_i = act(g_i . x) * (u_i . x)            gated (ReLU-gated, SwiGLU, GeGLU)
//   h_i = act(g_i . x) * act(u_i . x)         dReLU
//   h_i = act(u_i . x + b_i)                  no gate, with biases (OPT, ReluFalcon)
//   y   = sum_{i in S} h_i * d_i              d_i: row i of ffn_down_t
// Returns (y [T, d_model], h [T, |S|]); h is what profiling and thresholds look at.
#include <ATen/ATen.h>

#include <atomic>
#include <tuple>
#include <vector>

#include "check.h"

namespace hs {

std::vector<at::Tensor> qmatmul_rows_cpu(const std::vector<at::Tensor>& ws, const std::vector<int64_t>& qtypes,
                                         const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& idxs);
at::Tensor sparse_axpy_cpu(const at::Tensor& w, int64_t qtype, const at::Tensor& h,
                           const c10::optional<at::Tensor>& idx);
at::Tensor gated_act_cpu(const at::Tensor& gate, const at::Tensor& up, int64_t act, bool act_on_up);
bool sparse_ffn_fused_cpu(const at::Tensor& x, const at::Tensor& up, int64_t up_type,
                          const c10::optional<at::Tensor>& gate, int64_t gate_type, const at::Tensor& down_t,
                          int64_t down_type, const at::Tensor& idx, const c10::optional<at::Tensor>& up_bias,
                          int64_t act, bool act_on_up, at::Tensor& y_out, at::Tensor& h_out,
                          const c10::optional<at::Tensor>& mask);

// h over the neurons idx (None: all) for every token, from the row-dots of gate and up (the unfused form)
static at::Tensor ffn_activations(const at::Tensor& x, const at::Tensor& up, int64_t up_type,
                                  const c10::optional<at::Tensor>& gate, int64_t gate_type,
                                  const c10::optional<at::Tensor>& idx, const c10::optional<at::Tensor>& up_bias,
                                  int64_t act, bool act_on_up) {
  const bool gated = gate.has_value() && gate->defined();
  std::vector<at::Tensor> ws;
  std::vector<int64_t> types;
  if (gated) {
    ws.push_back(*gate);
    types.push_back(gate_type);
  }
  ws.push_back(up);
  types.push_back(up_type);
  auto rows = qmatmul_rows_cpu(ws, types, x, std::vector<c10::optional<at::Tensor>>(ws.size(), idx));
  at::Tensor u = rows.back();
  if (up_bias.has_value() && up_bias->defined()) {
    HS_CHECK(up_bias->dim() == 1 && up_bias->size(0) == up.size(0) && up_bias->scalar_type() == at::kFloat,
             "sparse_ffn: up bias must be float32 [n_ff]");
    u.add_(idx.has_value() && idx->defined() ? up_bias->index_select(0, idx->to(at::kLong)) : *up_bias);
  }
  return gated ? gated_act_cpu(rows[0], u, act, act_on_up) : gated_act_cpu(u, at::ones_like(u), act, false);
}

// One token's listed neurons and those of them that fired (h != 0), with the bytes of the fired ones' rows (gate,
// up, down): what an engine told exactly which neurons fire must read. Every one-token FFN over an index set
// passes here (the hybrid's cold tasks, a CPU-only layer's sparse_ffn_block, the Python calls), so the benchmark
// can set a run against the rows its own tokens needed rather than the profile's expectation (sparse_ffn_stats).
static std::atomic<int64_t> one_token_calls{0}, one_token_listed{0}, one_token_fired{0}, one_token_fired_bytes{0};

static void count_one_token(const at::Tensor& h, const at::Tensor& up, const c10::optional<at::Tensor>& gate,
                            const at::Tensor& down_t) {
  const float* hp = h.data_ptr<float>();
  int64_t fired = 0;
  for (int64_t k = 0; k < h.numel(); ++k) fired += hp[k] != 0.f;
  const int64_t neuron = up.size(1) * up.element_size() + down_t.size(1) * down_t.element_size() +
                         (gate.has_value() && gate->defined() ? gate->size(1) * gate->element_size() : 0);
  ++one_token_calls;
  one_token_listed += h.numel();
  one_token_fired += fired;
  one_token_fired_bytes += fired * neuron;
}

std::vector<int64_t> sparse_ffn_stats() {
  return {one_token_calls.load(), one_token_listed.load(), one_token_fired.load(), one_token_fired_bytes.load()};
}

std::tuple<at::Tensor, at::Tensor> sparse_ffn_cpu(const at::Tensor& x, const at::Tensor& up, int64_t up_type,
                                                  const c10::optional<at::Tensor>& gate, int64_t gate_type,
                                                  const at::Tensor& down_t, int64_t down_type,
                                                  const c10::optional<at::Tensor>& idx,
                                                  const c10::optional<at::Tensor>& up_bias, int64_t act,
                                                  bool act_on_up) {
  const bool listed = idx.has_value() && idx->defined();
  at::Tensor y, h;
  if (!(listed && sparse_ffn_fused_cpu(x, up, up_type, gate, gate_type, down_t, down_type, *idx, up_bias, act,
                                       act_on_up, y, h, c10::nullopt))) {  // decoding: one fused pass per neuron
    h = ffn_activations(x, up, up_type, gate, gate_type, idx, up_bias, act, act_on_up);
    y = sparse_axpy_cpu(down_t, down_type, h, idx);
  }
  if (listed && x.size(0) == 1) count_one_token(h, up, gate, down_t);
  return {y, h};
}

// Several tokens over the union idx of their active sets, token t using only the neurons where
// mask[t, k] (batched decode, short prompts): each listed row read once, and only the (token, neuron)
// pairs the mask keeps computed (the union form computes every pair, the per-token form reads shared
// rows once per token). h is 0 outside the mask.
std::tuple<at::Tensor, at::Tensor> sparse_ffn_masked_cpu(const at::Tensor& x, const at::Tensor& up, int64_t up_type,
                                                         const c10::optional<at::Tensor>& gate, int64_t gate_type,
                                                         const at::Tensor& down_t, int64_t down_type,
                                                         const at::Tensor& idx, const at::Tensor& mask,
                                                         const c10::optional<at::Tensor>& up_bias, int64_t act,
                                                         bool act_on_up) {
  at::Tensor y, h;
  if (sparse_ffn_fused_cpu(x, up, up_type, gate, gate_type, down_t, down_type, idx, up_bias, act, act_on_up, y, h,
                           mask))
    return {y, h};
  HS_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == x.size(0) &&
               mask.size(1) == idx.numel(), "sparse_ffn: the per-token mask must be bool [tokens, |idx|]");
  h = ffn_activations(x, up, up_type, gate, gate_type, idx, up_bias, act, act_on_up);
  h.mul_(mask.to(at::kFloat));
  return {sparse_axpy_cpu(down_t, down_type, h, idx), h};
}

// The dispatcher form of the sparse row-dot (same schema as the CUDA op): rows = idx (or all); with a
// mask, rows whose entry is false are not read and give 0 (on the CPU the mask is compacted first).
at::Tensor sparse_rowdot_cpu(const at::Tensor& w, int64_t qtype, const at::Tensor& x,
                             const c10::optional<at::Tensor>& idx, const c10::optional<at::Tensor>& mask) {
  if (!mask.has_value() || !mask->defined()) return qmatmul_rows_cpu({w}, {qtype}, x, {idx})[0];
  HS_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 1 && mask->size(0) == w.size(0),
           "sparse_rowdot: mask must be a bool vector of ", w.size(0), " entries");
  const at::Tensor rows = idx.has_value() && idx->defined() ? *idx : at::arange(w.size(0), x.options().dtype(at::kInt));
  const at::Tensor keep = mask->index_select(0, rows.to(at::kLong)).nonzero().squeeze(1);
  const at::Tensor active = rows.index_select(0, keep).to(at::kInt).contiguous();
  at::Tensor y = at::zeros({x.size(0), rows.size(0)}, x.options());
  y.index_copy_(1, keep, qmatmul_rows_cpu({w}, {qtype}, x, {active})[0]);
  return y;
}

}  // namespace hs
