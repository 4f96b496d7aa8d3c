// Kernel launches with programmatic dependent launch (PDL, sm_90+), opt-in with HS_CUDA_PDL=1.
//
// A decode step is a chain of short kernels (a 7B step ~13 a layer), and between two of them the GPU
// drains the first grid, then launches and ramps up the second: a few microseconds each, a large part
// of a step whose weights take ~3.5 ms to read. Launched with the programmatic-serialization
// attribute, a kernel may start while the kernel before it on the stream finishes (once every block
// of that one has started, see pdl_launch_dependents): its blocks become resident, and a GEMV over
// all rows can prefetch the first bytes of its weight rows (which no kernel writes) before it waits.
//
// The rule every kernel launched through launch() keeps: pdl_wait() before reading anything an
// earlier kernel may have written (x, index lists, masks, h, positions, caches) and before writing
// anything (its output may be memory an earlier kernel still reads); only weights are touched before.
// pdl_wait() returns once the grids this one depends on have completed and their writes are visible;
// with no programmatic dependency (HS_CUDA_PDL unset, a torch kernel before it, a host node, a copy)
// it returns at once. Kernels that must not start early (the polled hand-over's) use <<<>>>.
// CUDA graphs captured from such launches keep the programmatic edges (CUDA 12.3+).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <utility>

#include "env.h"

namespace hs {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// lets the next kernel on the stream (if launched with PDL) start once every block of this one has
// called it or exited
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// the L2 prefetch of `bytes` from p, a 64-byte step per lane of the calling warp
__device__ __forceinline__ void prefetch_l2_warp(const void* p, int64_t bytes, int lane) {
  for (int64_t off = static_cast<int64_t>(lane) * 64; off < bytes; off += 32 * 64)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(p) + off));
}

// HS_CUDA_PDL=1 on a GPU of compute capability 9.0 or later
inline bool pdl_enabled() {
  static const int major = [] {
    int dev = 0, m = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return m;
  }();
  return major >= 9 && env_on("HS_CUDA_PDL");
}

// kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute where pdl_enabled()
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  if (!pdl_enabled()) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return;
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace hs
