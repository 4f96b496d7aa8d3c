"""Dense CPU GEMV by thread count (tool, not a test): qmatmul on 8192 x 8192 weights in Q4_0, Q8_0 and
F16 (GS_TYPES), each rep another copy (beyond the caches), at 1..16 threads (GS_THREADS); the Q4_0 rows also as a sparse list
of half of them (the side-by-side row kernel) and as the fused FFN's dot. Usage: gemv_scaling.py"""

import os
import sys
import time

import torch
from gguf import GGMLQuantizationType as Q

from hybridsparse.runtime import kernels
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/quant_utils.py
from quant_utils import random_rows  # noqa: E402

kernels.ops()
print(f"cpu path {kernels.cpu.cpu_path()}", flush=True)
x = torch.randn(1, 8192)
for qt in [Q[t] for t in os.environ.get("GS_TYPES", "Q4_0,Q8_0,F16").split(",")]:
    ws = [random_rows(qt, 8192, 8192).contiguous() for _ in range(6)]
    half = torch.randperm(8192, generator=torch.Generator().manual_seed(0))[:4000].sort().values.int()
    for th in [int(t) for t in os.environ.get("GS_THREADS", "1,2,4,8,16").split(",")]:
        torch.set_num_threads(th)
        for label, fn, nbytes in (("dense", lambda r: kernels.cpu.qmatmul(ws[r % 6], int(qt), x), ws[0].nbytes),
                                  ("half rows", lambda r: kernels.sparse_rowdot(ws[r % 6], qt, x, half, check=False),
                                   ws[0].nbytes * 4000 // 8192)):
            fn(0)
            t = time.perf_counter()
            for r in range(24):
                fn(r)
            dt = (time.perf_counter() - t) / 24
            print(f"{qt.name:5s} t={th:2d} {label:9s} {dt * 1e3:7.3f} ms {nbytes / dt / 2**30:6.1f} GiB/s", flush=True)
    del ws
