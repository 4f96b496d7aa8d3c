// The polled hand-over of a hybrid layer's cold FFN between the GPU and the CPU (csrc/cold_ffn.cpp),
// for decode steps captured in a CUDA graph. A host node (cudaLaunchHostFunc) costs ~215 us per layer
// between the GPU's last kernel before it and its first after it even when the task does nothing
// (S1's Falcon-40B on the H200: 12.9 ms of a 26 ms step without CPU work, 60 hand-overs): the driver's
// callback thread is woken by an interrupt. Here both sides poll words in pinned host memory instead
// (HS_HANDOVER=poll; on an H100, S1's step without CPU work: 19.5 ms against 32.6 with host nodes):
//   send: one block writes x (and the cold part of the active mask) straight into the task's pinned
//         buffers, then, after a system-wide fence, bumps the task's step counter (device memory) and
//         writes it to the task's flag word;
//   the CPU thread serving the step (cold_ffn_serve) sees the flag, runs the task, writes y and then
//         the same number to the done word;
//   recv: one thread waits for the done word to reach the step number (giving up after timeout_ns,
//         marking the error word and the process's abort word), then the block copies y into device
//         memory. Once the abort word is set (by a wait that gave up, or by the CPU side when it
//         gives up) no wait waits any more: a broken hand-over costs one time-out, not one a layer.
// The counter lives on the device, so a graph replays the same kernels step after step.
#include <cuda_runtime.h>

#include <cstdint>

namespace hs {
namespace {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// dst[i] = src[i] for n bytes, 16 at a time where both are aligned (n is small: tens of KiB)
__device__ __forceinline__ void block_copy(void* dst, const void* src, int64_t n, bool volatile_src) {
  const bool aligned = (reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % 16 == 0;
  int64_t done = 0;
  if (aligned) {
    const int64_t n16 = n / 16;
    auto* d = static_cast<int4*>(dst);
    const auto* s = static_cast<const int4*>(src);
    for (int64_t i = threadIdx.x; i < n16; i += blockDim.x) d[i] = volatile_src ? __ldcv(s + i) : s[i];
    done = n16 * 16;
  }
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const volatile char*>(src);
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}

__global__ void handover_send_kernel(const float* x, float* x_host, int64_t x_bytes, const bool* mask,
                                     bool* mask_host, int64_t mask_bytes, int64_t* counter, int64_t* flag) {
  block_copy(x_host, x, x_bytes, false);
  if (mask) block_copy(mask_host, mask, mask_bytes, false);
  __threadfence_system();  // this thread's writes reach host memory before the flag ...
  __syncthreads();         // ... and every thread's before thread 0 writes it
  if (threadIdx.x == 0) {
    const int64_t s = *counter + 1;
    *counter = s;
    __threadfence_system();
    *reinterpret_cast<volatile int64_t*>(flag) = s;
  }
}

__global__ void handover_recv_kernel(const float* y_host, float* y, int64_t y_bytes, const int64_t* counter,
                                     const int64_t* done, int64_t* err, int64_t* abort, int64_t timeout_ns) {
  if (threadIdx.x == 0) {
    const int64_t s = *counter;
    const volatile int64_t* d = done;
    volatile int64_t* a = abort;
    const uint64_t t0 = global_ns();
    while (*d < s && !*a) {
      if (global_ns() - t0 > static_cast<uint64_t>(timeout_ns)) {
        *reinterpret_cast<volatile int64_t*>(err) = s;
        *a = 1;  // the layers after this one do not wait either
        break;
      }
    }
    __threadfence_system();
  }
  __syncthreads();
  block_copy(y, y_host, y_bytes, true);
}

}  // namespace

void launch_handover_send(const float* x, float* x_host, int64_t x_bytes, const bool* mask, bool* mask_host,
                          int64_t mask_bytes, int64_t* counter, int64_t* flag, cudaStream_t stream) {
  handover_send_kernel<<<1, 1024, 0, stream>>>(x, x_host, x_bytes, mask, mask_host, mask_bytes, counter, flag);
}

void launch_handover_recv(const float* y_host, float* y, int64_t y_bytes, const int64_t* counter, const int64_t* done,
                          int64_t* err, int64_t* abort, int64_t timeout_ns, cudaStream_t stream) {
  handover_recv_kernel<<<1, 1024, 0, stream>>>(y_host, y, y_bytes, counter, done, err, abort, timeout_ns);
}

}  // namespace hs
