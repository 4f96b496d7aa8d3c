// The spinning thread pool of csrc/pool.h.
#include "pool.h"

#include "env.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HS_PAUSE() _mm_pause()
#else
#define HS_PAUSE() std::this_thread::yield()
#endif

namespace hs {
namespace {

thread_local int scope_threads = 0;  // > 0 inside a PoolScope
thread_local bool in_pool_task = false;  // a pool task's own parallel_threads runs serially

// How long an idle pool thread spins before it sleeps, and after how long of that it spins with
// sched_yield() (other threads that need a core, e.g. the CUDA driver's, get it at once): nanoseconds,
// from HS_POOL_SPIN_US (default 2000) and HS_POOL_YIELD_US (default 50), or pool_configure.
int64_t env_us(const char* name, int64_t fallback) {
  return env_int(name, fallback) * 1000;
}
std::atomic<int64_t> spin_limit_ns{env_us("HS_POOL_SPIN_US", 2000)};
std::atomic<int64_t> yield_after_ns{env_us("HS_POOL_YIELD_US", 50)};
// pool_rest(): idle threads sleep at once (and those still busy, when they finish) until the next task
std::atomic<bool> resting{false};

class SpinPool {
 public:
  ~SpinPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  // fn(tid) for tid in [0, n) on n threads (this one runs tid 0); returns when all are done.
  // One caller at a time (busy_): a second concurrent caller gets false and runs elsewhere. Every pool
  // thread answers every generation (those past n at once), so none can still be reading the last
  // task's fn_ / n_tasks_ when the next caller writes them.
  bool run(int n, const std::function<void(int)>& fn) {
    bool expected = false;
    if (!busy_.compare_exchange_strong(expected, true)) return false;
    while (static_cast<int>(threads_.size()) < n - 1) {
      const int id = static_cast<int>(threads_.size()) + 1;
      const uint64_t now = generation_.load(std::memory_order_acquire);  // the thread waits for the next one
      threads_.emplace_back([this, id, now] { loop(id, now); });
    }
    resting.store(false, std::memory_order_relaxed);
    fn_ = &fn;
    n_tasks_ = n;
    remaining_.store(static_cast<int>(threads_.size()), std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);  // a sleeper checks generation_ under the lock
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    task(0);
    while (remaining_.load(std::memory_order_acquire) > 0) HS_PAUSE();
    std::exception_ptr error;
    std::swap(error, error_);
    busy_.store(false, std::memory_order_release);
    if (error) std::rethrow_exception(error);  // on the caller, once every thread is done
    return true;
  }

 private:
  void task(int id) {
    in_pool_task = true;
    try {
      (*fn_)(id);
    } catch (...) {  // kept for the caller: an exception must not end a pool thread (std::terminate)
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    in_pool_task = false;
  }

  void loop(int id, uint64_t seen) {
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      uint64_t g;
      int spins = 0;
      while ((g = generation_.load(std::memory_order_acquire)) == seen) {
        HS_PAUSE();
        if (++spins % 64 != 0) continue;  // look at the clock now and then
        const int64_t idle = std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::steady_clock::now() - start).count();
        if (idle > spin_limit_ns.load(std::memory_order_relaxed) || resting.load(std::memory_order_relaxed)) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
          start = std::chrono::steady_clock::now();
        } else if (idle > yield_after_ns.load(std::memory_order_relaxed)) {
          std::this_thread::yield();
        }
      }
      seen = g;
      if (stop_) return;
      if (id < n_tasks_) task(id);
      remaining_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::vector<std::thread> threads_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> busy_{false};
  const std::function<void(int)>* fn_ = nullptr;
  int n_tasks_ = 0;
  bool stop_ = false;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

SpinPool& pool() {
  static SpinPool* p = new SpinPool();  // never destroyed: its threads may outlive static teardown order
  return *p;
}

}  // namespace

void pool_rest() { resting.store(true, std::memory_order_relaxed); }

void pool_configure(int64_t spin_us, int64_t yield_us) {
  spin_limit_ns = spin_us * 1000;
  yield_after_ns = yield_us * 1000;
}

int num_threads() { return scope_threads > 0 ? scope_threads : at::get_num_threads(); }

void parallel_threads(int n, const std::function<void(int)>& fn) {
  if (n <= 1 || in_pool_task) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  if (scope_threads > 0 && pool().run(n, fn)) return;
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) fn(static_cast<int>(i));
  });
}

// For tests: inside a PoolScope(n), task tid adds 2^tid to a sum (a task run twice or not at all
// shows), task `throw_at` throws; returns the sum.
int64_t pool_selftest(int64_t n, int64_t throw_at) {
  PoolScope scope(static_cast<int>(n));
  std::atomic<int64_t> sum{0};
  parallel_threads(static_cast<int>(n), [&](int tid) {
    if (tid == throw_at) throw std::runtime_error("pool_selftest: task " + std::to_string(tid) + " failed");
    sum += int64_t{1} << tid;
  });
  return sum.load();
}

PoolScope::PoolScope(int n) : previous_(scope_threads) { scope_threads = n < 1 ? 1 : n; }

PoolScope::~PoolScope() { scope_threads = previous_; }

}  // namespace hs
