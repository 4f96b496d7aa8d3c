// One layer's cold FFN as a task the CUDA stream runs itself (the KTransformers technique): the
// stream copies x and the cold part of the active mask into pinned buffers, then reaches a host
// node (cudaLaunchHostFunc) that runs this task on the driver's callback thread, then copies the
// pinned output back to the GPU. The Python thread never waits per layer, and the node can be
// captured in a CUDA graph with the rest of a decode step.
//
// The task: compact the cold ids whose mask entry is set, run the fused sparse FFN over them
// (sparse_ffn_cpu), write y (zeros when nothing cold is active). Its threads: the `-t` count in force
// when the last task was made, from the spinning pool of csrc/pool.h (HS_COLD_POOL=0: OpenMP, for
// side-by-side measurements). Exceptions cannot leave a host node: the first message is kept for
// cold_ffn_error().
//
// In a captured decode step the hand-over is polled instead (csrc/cuda_handover.cu): the stream's
// kernels write x and the mask into the pinned buffers and a step number into the task's flag word;
// cold_ffn_serve, on the thread that replayed the graph, runs the step's tasks in order as their flags
// arrive and answers each through its done word, which a kernel on the stream waits for. No interrupt,
// no callback thread: ~215 us less GPU idle time per layer (HS_HANDOVER=poll; runtime/kernels.py).
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "check.h"
#include "cpu_dot.h"
#include "cpu_ops.h"
#include "env.h"
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#include "pool.h"

#ifdef HS_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace hs {

namespace {

struct ColdFFN {
  at::Tensor x, mask, ids, idx, y;  // x, mask, y: the pinned exchange buffers; idx: scratch
  at::Tensor up, down_t;
  c10::optional<at::Tensor> gate, up_bias;
  int64_t up_type, gate_type, down_type, act;
  bool act_on_up;
  // the polled hand-over: int64 words [flag (step number from the GPU), done (to the GPU), the GPU's
  // time-out mark, spare] in pinned memory, and the last step this side served
  at::Tensor sync;
  int64_t served = 0;
};

// The tasks' thread count: `-t` as in force when the last task was made, or cold_ffn_set_threads's
std::atomic<int> task_threads{1};

bool skip_compute() {  // HS_COLD_SKIP=1 (diagnostics): y = 0 at once, to time a step without CPU work
  return env_on("HS_COLD_SKIP");
}

thread_local bool serving_on_omp = false;  // inside cold_ffn_serve(..., use_pool=false)

bool pool_enabled() {  // read per task (tens of ns): benchmarks switch it within one process
  return !serving_on_omp && !env_off("HS_COLD_POOL");
}

// The polled hand-overs' abort word (pinned int64, set once either side gives up: every later wait on
// either side ends at once, and every later serve fails until a task gets new hand-over words, i.e.
// the model is loaded again). Allocated once per process when the first task gets hand-over words,
// outside any graph capture (cudaHostAlloc is not permitted while a stream captures), never freed
// (graphs captured with it may outlive any owner); null without a GPU.
std::atomic<int64_t*> abort_word{nullptr};

void ensure_abort_word() {
#ifdef HS_WITH_CUDA
  if (abort_word.load()) return;
  void* p = nullptr;
  if (cudaHostAlloc(&p, 64, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  std::memset(p, 0, 64);
  int64_t* expected = nullptr;
  if (!abort_word.compare_exchange_strong(expected, static_cast<int64_t*>(p))) cudaFreeHost(p);
#endif
}

// Time inside tasks, their count and the neurons they computed, for tools (cold_ffn_stats)
std::atomic<int64_t> busy_ns{0}, runs{0}, rows{0};

std::mutex error_mutex;
std::string first_error;

void fail(ColdFFN* c, const char* what) {
  std::lock_guard<std::mutex> lock(error_mutex);
  if (first_error.empty()) first_error = what;
  std::memset(c->y.data_ptr<float>(), 0, c->y.numel() * sizeof(float));
}

#if defined(__x86_64__) || defined(_M_X64)
// compact() 32 bytes at a time: one compare and one movemask a step (dev VM, a 5% dense 30k mask: 1.5
// instead of 3.8 us; it runs on one thread before each layer's parallel FFN)
__attribute__((target("avx2"))) int64_t compact_avx2(const bool* m, const int32_t* ids, int64_t e, int32_t* out,
                                                       int64_t& i) {
  int64_t n = 0;
  for (; i + 32 <= e; i += 32) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + i));
    uint32_t bits = ~static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, _mm256_setzero_si256())));
    while (bits) {
      out[n++] = ids[i + __builtin_ctz(bits)];
      bits &= bits - 1;
    }
  }
  return n;
}
#endif

// out <- ids[i] for the i where m[i] (a bool per byte), eight bytes at a time: most words of a sparse
// mask are zero and cost one test (a ~5% dense 32k mask: ~10 us instead of ~80 us byte by byte).
int64_t compact(const bool* m, const int32_t* ids, int64_t e, int32_t* out) {
  int64_t n = 0, i = 0;
#if defined(__x86_64__) || defined(_M_X64)
  static const bool avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
  }();
  if (avx2) n = compact_avx2(m, ids, e, out, i);
#endif
  for (; i + 8 <= e; i += 8) {
    uint64_t w;
    std::memcpy(&w, m + i, 8);
    while (w) {
      const int b = __builtin_ctzll(w) >> 3;
      out[n++] = ids[i + b];
      w &= ~(0xffULL << (b * 8));
    }
  }
  for (; i < e; ++i)
    if (m[i]) out[n++] = ids[i];
  return n;
}

void compute(ColdFFN* c) {
  try {
    const bool* m = c->mask.data_ptr<bool>();
    const int32_t* ids = c->ids.data_ptr<int32_t>();
    int32_t* out = c->idx.data_ptr<int32_t>();
    const int64_t n = compact(m, ids, c->ids.numel(), out);
    rows += n;
    float* y = c->y.data_ptr<float>();
    if (n == 0 || skip_compute()) {
      std::memset(y, 0, c->y.numel() * sizeof(float));
      return;
    }
    std::unique_ptr<PoolScope> scope;
    if (pool_enabled()) scope.reset(new PoolScope(task_threads.load()));
    const at::Tensor yv = std::get<0>(sparse_ffn_cpu(c->x, c->up, c->up_type, c->gate, c->gate_type, c->down_t,
                                                     c->down_type, c->idx.narrow(0, 0, n), c->up_bias, c->act,
                                                     c->act_on_up));
    std::memcpy(y, yv.data_ptr<float>(), c->y.numel() * sizeof(float));
  } catch (const c10::Error& e) {
    fail(c, e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(c, e.what());
  }
}

void run(ColdFFN* c) {
  const auto t0 = std::chrono::steady_clock::now();
  compute(c);
  busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  ++runs;
}

ColdFFN* get(int64_t handle) {
  HS_CHECK(handle != 0, "cold_ffn: null handle");
  return reinterpret_cast<ColdFFN*>(handle);
}

}  // namespace

int64_t cold_ffn_new(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& ids, const at::Tensor& y,
                     const at::Tensor& up, int64_t up_type, const c10::optional<at::Tensor>& gate, int64_t gate_type,
                     const at::Tensor& down_t, int64_t down_type, const c10::optional<at::Tensor>& up_bias,
                     int64_t act, bool act_on_up) {
  HS_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.is_cpu(),
           "cold_ffn: x must be a contiguous float32 [1, d_model] CPU tensor");
  HS_CHECK(y.sizes() == x.sizes() && y.scalar_type() == at::kFloat && y.is_contiguous() && y.is_cpu(),
           "cold_ffn: y must be a contiguous float32 [1, d_model] CPU tensor");
  HS_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kInt && ids.is_contiguous() && ids.is_cpu(),
           "cold_ffn: ids must be a contiguous int32 CPU vector");
  HS_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.numel() == ids.numel() && mask.is_cpu(),
           "cold_ffn: mask must be a contiguous bool CPU tensor with one entry per id");
  const int64_t n_ff = up.size(0);
  if (ids.numel()) {
    const auto mm = at::aminmax(ids);
    HS_CHECK(std::get<0>(mm).item<int32_t>() >= 0 && std::get<1>(mm).item<int32_t>() < n_ff,
             "cold_ffn: ids must lie in [0, ", n_ff, ")");
  }
  // every weight check of the fused FFN, now (an empty index set): the task itself must not throw,
  // since it runs where an exception cannot go (the driver's callback thread)
  sparse_ffn_cpu(x, up, up_type, gate, gate_type, down_t, down_type, ids.narrow(0, 0, 0), up_bias, act, act_on_up);
  auto* c = new ColdFFN{x, mask, ids, at::empty_like(ids), y, up, down_t, gate, up_bias,
                        up_type, gate_type, down_type, act, act_on_up};
  task_threads = num_threads();
  return reinterpret_cast<int64_t>(c);
}

void cold_ffn_run(int64_t handle) { run(get(handle)); }

#ifdef HS_X86
// select_ids' scores form 16 ids a step: their scores gathered and compared, the kept ids packed in a
// register and stored whole (a compress straight to memory is microcoded on Zen 4); op has room, since
// k <= i. Ordered >=, so a NaN score is not kept, as in the scalar loop.
HS_AVX512 int64_t select_scores_avx512(const float* sp, float t, const int32_t* ip, int64_t m, int32_t* op) {
  const __m512 tv = _mm512_set1_ps(t);
  int64_t k = 0, i = 0;
  for (; i + 16 <= m; i += 16) {
    const __m512i id = _mm512_loadu_si512(ip + i);
    const __mmask16 keep = _mm512_cmp_ps_mask(_mm512_i32gather_ps(id, sp, 4), tv, _CMP_GE_OQ);
    _mm512_storeu_si512(op + k, _mm512_maskz_compress_epi32(keep, id));
    k += __builtin_popcount(keep);
  }
  for (; i < m; ++i) {
    op[k] = ip[i];
    k += sp[ip[i]] >= t;
  }
  return k;
}
#endif

// The ids[k] whose entry in a whole layer's mask (bool [n_ff]) is set, in ids' order: a layer whose
// x is on the CPU picks its active cold neurons in one pass (torch's index_select and boolean
// indexing took ~150 us for 28672 neurons). With a threshold, `mask` is the predictor's float32 scores
// and an entry is set where score >= threshold (the comparison folded in: torch's `>=` on 11008
// scores took 7-13 us on the dev VM, and one more tensor).
at::Tensor select_ids(const at::Tensor& mask, const at::Tensor& ids, c10::optional<double> threshold) {
  const bool scores = threshold.has_value();
  HS_CHECK(mask.device().is_cpu() && mask.scalar_type() == (scores ? at::kFloat : at::kBool) && mask.dim() == 1 &&
               mask.is_contiguous(),
           "select_ids: mask must be a contiguous 1-D ", scores ? "float32 (scores, with a threshold)" : "bool",
           " CPU tensor");
  HS_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kInt && ids.dim() == 1 && ids.is_contiguous(),
           "select_ids: ids must be a contiguous 1-D int32 CPU tensor");
  const int64_t n = mask.numel(), m = ids.numel();
  const int32_t* ip = ids.data_ptr<int32_t>();
  at::Tensor out = at::empty({m}, ids.options());
  int32_t* op = out.data_ptr<int32_t>();
  int32_t lo = 0, hi = 0;  // the ids' range, in a loop the compiler vectorizes; the culprit found only on error
  if (m) lo = hi = ip[0];
  for (int64_t i = 1; i < m; ++i) {
    lo = std::min(lo, ip[i]);
    hi = std::max(hi, ip[i]);
  }
  if (lo < 0 || hi >= n) {
    for (int64_t i = 0; i < m; ++i)
      HS_CHECK(ip[i] >= 0 && ip[i] < n, "select_ids: id ", ip[i], " out of range for a mask of ", n);
  }
  // without a branch on the mask: a third of the neurons active at random mispredicts one in two ids
  // (dev VM: 50 us a layer for Llama-2-7B's 11008 neurons with the branch)
  int64_t k = 0;
  if (scores) {
    const float* sp = mask.data_ptr<float>();
    const float t = static_cast<float>(*threshold);
#ifdef HS_X86
    if (cpu_has_avx512()) return out.narrow(0, 0, select_scores_avx512(sp, t, ip, m, op));
#endif
    for (int64_t i = 0; i < m; ++i) {
      op[k] = ip[i];
      k += sp[ip[i]] >= t;
    }
  } else {
    const bool* mp = mask.data_ptr<bool>();
    for (int64_t i = 0; i < m; ++i) {
      op[k] = ip[i];
      k += mp[ip[i]];
    }
  }
  return out.narrow(0, 0, k);
}

// The words the polled hand-over of this task goes through: int64 [4], zeros, contiguous, in pinned
// memory for a GPU (any CPU memory for tests, where a thread stands in for the GPU).
void cold_ffn_attach_sync(int64_t handle, const at::Tensor& sync) {
  ColdFFN* c = get(handle);
  HS_CHECK(sync.is_cpu() && sync.scalar_type() == at::kLong && sync.is_contiguous() && sync.numel() == 4,
           "cold_ffn_attach_sync: expected a contiguous int64 [4] CPU tensor");
  c->sync = sync;
  c->served = sync.data_ptr<int64_t>()[0];
  ensure_abort_word();
  if (int64_t* a = abort_word.load()) __atomic_store_n(a, 0, __ATOMIC_RELEASE);  // a model loaded anew
}

// Serve one step of polled hand-overs: for each task in order, wait for its flag to move past the last
// step served, run it, answer with the same number. Returns the tasks run; stops at the first whose
// flag does not come within timeout_s (the error is kept for cold_ffn_error) or whose GPU side gave
// up waiting on an earlier step. use_pool=false: the tasks' threads are this thread's OpenMP team, not
// the spinning pool (a step whose CPU layers run on that team between the GPU's runs: two sets of 16
// threads then fought over 16 cores).
int64_t cold_ffn_serve(const std::vector<int64_t>& handles, double timeout_s, bool use_pool) {
  const auto limit = std::chrono::nanoseconds(static_cast<int64_t>(timeout_s * 1e9));
  struct OnOmp {
    bool before = serving_on_omp;
    explicit OnOmp(bool omp) { serving_on_omp = omp; }
    ~OnOmp() { serving_on_omp = before; }
  } on_omp(!use_pool);
  int64_t n = 0;
  int64_t* abort = abort_word.load();
  const auto give_up = [&](ColdFFN* c, const char* why) {
    if (abort) __atomic_store_n(abort, 1, __ATOMIC_RELEASE);
    fail(c, why);
    return n;
  };
  for (const int64_t h : handles) {
    ColdFFN* c = get(h);
    if (!c->sync.defined()) return give_up(c, "cold_ffn_serve: a task without hand-over words (cold_ffn_attach_sync)");
    int64_t* w = c->sync.data_ptr<int64_t>();
    if (__atomic_load_n(w + 2, __ATOMIC_ACQUIRE) != 0 || (abort && __atomic_load_n(abort, __ATOMIC_ACQUIRE)))
      return give_up(c, "the GPU stopped waiting for a hybrid layer's CPU part (hand-over timed out; load the "
                        "model again)");
    const auto t0 = std::chrono::steady_clock::now();
    int64_t step;
    for (int64_t spin = 0; (step = __atomic_load_n(w, __ATOMIC_ACQUIRE)) == c->served; ++spin) {
      if ((spin & 1023) == 1023) {
        if (std::chrono::steady_clock::now() - t0 > limit)
          return give_up(c, "cold_ffn_serve: the GPU did not hand over a hybrid layer in time (is the decode "
                            "graph running?)");
        if (spin > (1 << 20)) std::this_thread::yield();
      }
#if defined(__x86_64__) || defined(_M_X64)
      __builtin_ia32_pause();
#endif
    }
    run(c);
    c->served = step;
    __atomic_store_n(w + 1, step, __ATOMIC_RELEASE);
    ++n;
  }
  return n;
}

void cold_ffn_set_threads(int64_t n) {
  HS_CHECK(n >= 1 && n <= 1024, "cold_ffn_set_threads: expected 1..1024 threads, got ", n);
  task_threads = static_cast<int>(n);
}

// [task runs, nanoseconds inside them, neurons computed] since the process started
std::vector<int64_t> cold_ffn_stats() { return {runs.load(), busy_ns.load(), rows.load()}; }

void cold_ffn_free(int64_t handle) { delete get(handle); }

// The first error a task met since the last call (empty: none), and clear it.
std::string cold_ffn_error() {
  std::lock_guard<std::mutex> lock(error_mutex);
  std::string e;
  e.swap(first_error);
  return e;
}

#ifdef HS_WITH_CUDA
void launch_handover_send(const float* x, float* x_host, int64_t x_bytes, const bool* mask, bool* mask_host,
                          int64_t mask_bytes, int64_t* counter, int64_t* flag, cudaStream_t stream);
void launch_handover_recv(const float* y_host, float* y, int64_t y_bytes, const int64_t* counter, const int64_t* done,
                          int64_t* err, int64_t* abort, int64_t timeout_ns, cudaStream_t stream);

namespace {
void CUDART_CB host_node(void* data) { run(static_cast<ColdFFN*>(data)); }

template <typename T>
T* device_view(const at::Tensor& host, const char* what) {  // pinned memory as the GPU addresses it
  void* p = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&p, host.data_ptr(), 0);
  if (e != cudaSuccess) cudaGetLastError();
  HS_CHECK(e == cudaSuccess, "cold_ffn_enqueue_polled: the task's ", what, " is not pinned memory the GPU can map (",
           cudaGetErrorString(e), ")");
  return static_cast<T*>(p);
}
}  // namespace

// Put the task on the current CUDA stream (captured into a graph when the stream is capturing).
void cold_ffn_enqueue(int64_t handle) {
  C10_CUDA_CHECK(cudaLaunchHostFunc(c10::cuda::getCurrentCUDAStream(), host_node, get(handle)));
}

// The polled hand-over on the current stream: x (float32 [1, d_model]) and mask (the cold ids' bool
// entries, or None: keep the task's) out, y (float32 [1, d_model]) in; counter: int64 [1] on the GPU,
// zero at first. Someone must run cold_ffn_serve for every pass of the stream over this (a graph's
// replay): the GPU waits timeout_s for each answer.
void cold_ffn_enqueue_polled(int64_t handle, const at::Tensor& x, const c10::optional<at::Tensor>& mask,
                             const at::Tensor& y, const at::Tensor& counter, double timeout_s) {
  ColdFFN* c = get(handle);
  HS_CHECK(c->sync.defined(), "cold_ffn_enqueue_polled: the task has no hand-over words (cold_ffn_attach_sync)");
  HS_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() == c->x.numel(),
           "cold_ffn_enqueue_polled: x must be a contiguous float32 CUDA tensor of ", c->x.numel(), " values");
  HS_CHECK(y.is_cuda() && y.scalar_type() == at::kFloat && y.is_contiguous() && y.numel() == c->y.numel() &&
           y.device() == x.device(), "cold_ffn_enqueue_polled: y must be a contiguous float32 tensor of ",
           c->y.numel(), " values on x's device");
  HS_CHECK(counter.is_cuda() && counter.scalar_type() == at::kLong && counter.numel() == 1 &&
           counter.device() == x.device(), "cold_ffn_enqueue_polled: counter must be one int64 on x's device");
  const bool* m = nullptr;
  if (mask) {
    HS_CHECK(mask->is_cuda() && mask->scalar_type() == at::kBool && mask->is_contiguous() &&
             mask->numel() == c->mask.numel() && mask->device() == x.device(),
             "cold_ffn_enqueue_polled: mask must be a contiguous bool tensor of ", c->mask.numel(), " on x's device");
    m = mask->data_ptr<bool>();
  }
  int64_t* w = device_view<int64_t>(c->sync, "hand-over words");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  launch_handover_send(x.data_ptr<float>(), device_view<float>(c->x, "x buffer"), x.numel() * 4, m,
                       device_view<bool>(c->mask, "mask buffer"), c->mask.numel(), counter.data_ptr<int64_t>(), w,
                       stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  HS_CHECK(abort_word.load(), "cold_ffn_enqueue_polled: no pinned abort word (cudaHostAlloc failed when the task got ",
           "its hand-over words)");
  int64_t* abort = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&abort), abort_word.load(), 0));
  launch_handover_recv(device_view<float>(c->y, "y buffer"), y.data_ptr<float>(), y.numel() * 4,
                       counter.data_ptr<int64_t>(), w + 1, w + 2, abort, static_cast<int64_t>(timeout_s * 1e9),
                       stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#else
void cold_ffn_enqueue(int64_t) { HS_CHECK(false, "cold_ffn_enqueue: built without CUDA"); }
void cold_ffn_enqueue_polled(int64_t, const at::Tensor&, const c10::optional<at::Tensor>&, const at::Tensor&,
                             const at::Tensor&, double) {
  HS_CHECK(false, "cold_ffn_enqueue_polled: built without CUDA");
}
#endif

}  // namespace hs
