// Threads for the hybrid decode's CPU side (csrc/pool.cpp).
//
// A layer's cold FFN runs on a CUDA host node, i.e. on the driver's callback thread, once per layer
// with ~0.1-0.5 ms of GPU work between two of them. OpenMP there is the wrong tool: that thread gets a
// second team of its own (the default size, not `-t`), libgomp then counts more threads than cores and
// lets idle ones sleep after ~1000 spins, so every layer wakes 15 threads by futex, and any thread the
// scheduler preempts holds the whole layer for a time slice. Inside a `PoolScope` the fused FFN's
// threads come from this pool instead: `n` threads (the caller is one of them) that spin between
// layers for HS_POOL_SPIN_US microseconds (default 2000; past HS_POOL_YIELD_US, default 50, yielding
// the core to any other thread that wants it) and only then sleep.
#pragma once

#include <functional>

namespace hs {

// The thread count the CPU kernels use here: the scope's inside a PoolScope, else at::get_num_threads().
int num_threads();

// fn(tid) for tid in [0, n): on the pool inside a PoolScope (the calling thread runs tid 0), else
// through at::parallel_for.
void parallel_threads(int n, const std::function<void(int)>& fn);

// Idle threads: spin for spin_us microseconds, yielding after yield_us of them, then sleep.
void pool_configure(int64_t spin_us, int64_t yield_us);

// Idle threads sleep now instead of spinning until the next task: for a thread about to run CPU work
// of its own (a layer whose attention is on the CPU: OpenMP threads on every core), which 15 spinning
// pool threads would otherwise slow down for up to HS_POOL_SPIN_US.
void pool_rest();

// Within the scope (on this thread), parallel_threads uses the spinning pool with `n` threads.
struct PoolScope {
  explicit PoolScope(int n);
  ~PoolScope();
  PoolScope(const PoolScope&) = delete;
  PoolScope& operator=(const PoolScope&) = delete;

 private:
  int previous_;
};

}  // namespace hs
