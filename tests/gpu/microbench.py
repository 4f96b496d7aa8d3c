"""Kernel microbenchmarks on the GPU machine (not a test): CPU matmul bandwidth by thread count for
13B-shaped rows, and GPU GEMV bandwidth, each next to torch. Prints a table."""

import os
import sys
import time

import torch
from gguf import GGMLQuantizationType as Q

from hybridsparse.runtime import kernels
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/quant_utils.py
from quant_utils import random_rows  # noqa: E402


def timeit(f, n=20):
    for _ in range(3):
        f()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


kernels.ops()
print('cpu kernel path:', kernels.cpu.cpu_path(), flush=True)
rows, cols = 13824, 5120
import os
THREADS = [int(t) for t in os.environ.get('MB_THREADS', '1,4,8,16').split(',')]
for qtype in (Q.F16, Q.Q8_0, Q.Q4_0):
    w = random_rows(qtype, rows, cols).contiguous()
    x = torch.randn(1, cols)
    nbytes = w.numel() * w.element_size()
    for threads in THREADS:
        torch.set_num_threads(threads)
        dt = timeit(lambda: kernels.cpu.qmatmul(w, int(qtype), x))
        line = f"cpu {qtype.name:5s} {threads:2d} threads: {nbytes / dt / 2**30:6.1f} GiB/s"
        if qtype == Q.F16:
            dt_t = timeit(lambda: torch.nn.functional.linear(x.half(), w))
            line += f"   torch fp16 linear {nbytes / dt_t / 2**30:6.1f} GiB/s"
        print(line, flush=True)
if torch.cuda.is_available() and not os.environ.get('MB_CPU_ONLY'):
    for r, c in ((4096, 4096), (11008, 4096), (28672, 8192)):
        w = torch.randn(r, c, device="cuda", dtype=torch.float16)
        x = torch.randn(1, c, device="cuda", dtype=torch.float16)
        dt = timeit(lambda: torch.nn.functional.linear(x, w), n=200)
        print(f"gpu cuBLAS fp16 GEMV {r}x{c}: {w.numel() * 2 / dt / 2**30:7.1f} GiB/s ({dt * 1e6:.1f} us)")
        wq = random_rows(Q.Q8_0, r, c).cuda()
        xf = torch.randn(1, c, device="cuda")
        dt = timeit(lambda: kernels.ops().qmatmul(wq, int(Q.Q8_0), xf), n=200)
        print(f"gpu hybridsparse Q8_0 GEMV {r}x{c}: {wq.numel() / dt / 2**30:7.1f} GiB/s ({dt * 1e6:.1f} us)")
