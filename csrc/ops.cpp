// Registration of the hybridsparse ops with torch's dispatcher (schema once, one kernel per device).
#include <torch/library.h>

#include "cpu_ops.h"

TORCH_LIBRARY(hybridsparse, m) {
  m.def("qmatmul(Tensor w, int qtype, Tensor x) -> Tensor");
  m.def("qmatmul_t(Tensor w, int qtype, Tensor h) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("layer_norm(Tensor x, Tensor w, Tensor? b, float eps) -> Tensor");  // CUDA only (CPU: torch's)
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, bool neox) -> ()");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor positions, "
        "int kv_len, int window, float scale) -> Tensor");
  m.def("gated_act(Tensor gate, Tensor up, int act, bool act_on_up) -> Tensor");
  m.def("sparse_rowdot(Tensor w, int qtype, Tensor x, Tensor? idx, Tensor? mask) -> Tensor");
  m.def("matmul_add(Tensor w, int qtype, Tensor x, Tensor res) -> Tensor");  // CUDA only (CPU: matmul, then +)
  m.def("rowdot_fused(Tensor w, int qtype, Tensor x, Tensor? norm_w, float eps, int act, bool act_on_up) -> Tensor");  // CUDA only (kernels.matmul_fused_reference is its twin)
  m.def("sparse_axpy(Tensor w, int qtype, Tensor h, Tensor? idx) -> Tensor");
  m.def("dequantize_f16(Tensor w, int qtype) -> Tensor");  // CUDA only (twin: quants.dequantize, then .half())
  m.def("has_cuda() -> bool", &hs::has_cuda);
}

TORCH_LIBRARY_IMPL(hybridsparse, CPU, m) {
  m.impl("qmatmul", &hs::qmatmul_cpu);
  m.impl("qmatmul_t", &hs::qmatmul_t_cpu);
  m.impl("rms_norm", &hs::rms_norm_cpu);
  m.impl("rope_", &hs::rope_cpu);
  m.impl("attention", &hs::attention_cpu);
  m.impl("gated_act", &hs::gated_act_cpu);
  m.impl("sparse_rowdot", &hs::sparse_rowdot_cpu);
  m.impl("sparse_axpy", &hs::sparse_axpy_cpu);
}

#ifndef HS_WITH_CUDA
namespace hs {
bool has_cuda() { return false; }
}  // namespace hs
#endif

// The same CPU functions as plain Python callables: skipping the dispatcher saves a few
// microseconds per call, which adds up over the ~250 small calls of a decode step on the CPU.
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &hs::qmatmul_cpu);
  m.def("qmatmul_multi", &hs::qmatmul_multi_cpu);
  m.def("argmax", &hs::argmax_cpu);
  m.def("read_rows", &hs::read_rows_cpu, "benchmarks: the listed rows of w read as the sparse kernels read them "
        "(side by side, asking ahead), their bytes summed: the memory's ceiling for the pattern");
  m.def("cpu_path", &hs::cpu_path);
  m.def("quantize_act_bytes", &hs::quantize_act_bytes, "tests: the activation quantization (ActQ8 / ActQ8K) as bytes");
  m.def("qmatmul_rows", &hs::qmatmul_rows_cpu, "y_i = x . W_i[idx_i]^T (idx_i None: all rows)");
  m.def("sparse_rowdot", &hs::sparse_rowdot_cpu, "y = x . W[idx]^T, masked-out rows 0");
  m.def("sparse_axpy", &hs::sparse_axpy_cpu, "y = h . W_t[idx] (idx None: all rows)");
  m.def("sparse_ffn", &hs::sparse_ffn_cpu, "the FFN over the neurons idx (None: all); returns (y, h)");
  m.def("sparse_ffn_masked", &hs::sparse_ffn_masked_cpu,
        "several tokens over the neurons idx, token t only where mask[t, k]; returns (y, h)");
  m.def("qmatmul_t", &hs::qmatmul_t_cpu);
  m.def("dequantize", &hs::dequantize_rows_cpu, "rows of a block format (or float16/bfloat16) -> float32, in parallel "
        "(into out's storage when given)", py::arg("w"), py::arg("qtype"), py::arg("out") = py::none());
  m.def("rms_norm", &hs::rms_norm_cpu);
  m.def("rope_", &hs::rope_cpu);
  m.def("attention", &hs::attention_cpu);
  m.def("attention_block", &hs::attention_block_cpu,
        "one token: x + o . attention(rope(q), rope(k), v) of rms_norm(x) (a llama block's attention half; Gemma 3's "
        "with q/k norms, a window and a post norm)",
        py::arg("x"), py::arg("norm_w"), py::arg("eps"), py::arg("qkv"), py::arg("qkv_types"), py::arg("o"),
        py::arg("o_type"), py::arg("n_heads"), py::arg("n_kv_heads"), py::arg("cos"), py::arg("sin"), py::arg("neox"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("positions"), py::arg("kv_len"), py::arg("scale"),
        py::arg("window") = 0, py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
        py::arg("post_norm") = py::none());
  m.def("ffn_block", &hs::ffn_block_cpu,
        "one token: x + [post_norm](down . act(gate . xn) * up . xn), xn = rms_norm(x) (a dense gated FFN half)",
        py::arg("x"), py::arg("norm_w"), py::arg("eps"), py::arg("gate_up"), py::arg("gate_up_types"), py::arg("down"),
        py::arg("down_type"), py::arg("down_transposed"), py::arg("act"), py::arg("act_on_up"),
        py::arg("post_norm") = py::none());
  m.def("sparse_ffn_block", &hs::sparse_ffn_block_cpu,
        "one token: x + the sparse FFN of rms_norm(x) over the ids its predictor's scores keep (a CPU-only "
        "sparse layer's FFN half)");
  m.def("gated_act", &hs::gated_act_cpu);
  m.def("cold_ffn_new", &hs::cold_ffn_new, "a layer's cold FFN task over pinned x / mask / y buffers (csrc/cold_ffn.cpp)");
  m.def("cold_ffn_run", &hs::cold_ffn_run, "run the task on this thread");
  m.def("select_ids", &hs::select_ids, "ids[k] where mask[ids[k]] (a whole layer's bool mask; with a threshold, "
        "its float32 scores >= threshold), in order", py::arg("mask"), py::arg("ids"), py::arg("threshold") = py::none());
  m.def("cold_ffn_enqueue", &hs::cold_ffn_enqueue, "run the task as a host node of the current CUDA stream");
  m.def("cold_ffn_enqueue_polled", &hs::cold_ffn_enqueue_polled,
        "the task's polled hand-over on the current CUDA stream (x and mask out, y in; cold_ffn_serve answers)");
  m.def("cold_ffn_attach_sync", &hs::cold_ffn_attach_sync, "the int64 [4] words of the task's polled hand-over");
  m.def("cold_ffn_serve", &hs::cold_ffn_serve, "run one step's polled tasks in order as the GPU hands them over",
        py::arg("handles"), py::arg("timeout_s"), py::arg("use_pool") = true, py::call_guard<py::gil_scoped_release>());
  m.def("cold_ffn_free", &hs::cold_ffn_free);
  m.def("cold_ffn_error", &hs::cold_ffn_error, "the first error a task met since the last call, cleared");
  m.def("cold_ffn_set_threads", &hs::cold_ffn_set_threads, "the tasks' thread count from now on (made: -t then)");
  m.def("pool_selftest", &hs::pool_selftest, "tests: n pool tasks each add 2^tid to a sum (task throw_at throws)");
  m.def("pool_rest", &hs::pool_rest, "the cold FFN pool's idle threads sleep now (before CPU work on this thread)");
  m.def("pool_configure", &hs::pool_configure, "the cold FFN pool's idle threads: spin_us spinning (yielding after yield_us), then sleep");
  m.def("sparse_ffn_stats", &hs::sparse_ffn_stats, "[one-token sparse FFN calls, neurons listed, neurons fired, bytes "
        "of the fired neurons' rows] since the process started");
  m.def("cold_ffn_stats", &hs::cold_ffn_stats, "[task runs, nanoseconds inside them, neurons computed] since the process started");
}
