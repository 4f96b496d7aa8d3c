"""One CPU-side decode layer of a hybrid 70B Q4_0 run, op by op (tool, not a test): the attention
projections (Q4_0, q/k/v in one call and o), a predictor in float16 / Q8_0 (8192 -> W -> 28672), and
the fused sparse FFN over N cold neurons, each timed at -t threads (random weights the shapes of
ReluLLaMA-2-70B; each rep reads another copy of the weights so nothing comes from cache), in GiB/s of
the bytes each reads, beside a sequential read. Usage: cpu_layer_bench.py [THREADS] [COLD_NEURONS] [WIDTH]"""

import os
import sys
import time

import torch
from gguf import GGMLQuantizationType as Q

from hybridsparse.runtime import kernels
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/quant_utils.py
from quant_utils import random_rows  # noqa: E402

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 16
n_cold = int(sys.argv[2]) if len(sys.argv) > 2 else 4200
width = int(sys.argv[3]) if len(sys.argv) > 3 else 512
torch.set_num_threads(threads)
kernels.ops()
d, kv, ff = 8192, 1024, 28672
COPIES = 4  # > L3 each: 4 layers' worth of each weight
x = torch.randn(1, d)
print(f"cpu path {kernels.cpu.cpu_path()}, {threads} threads", flush=True)


def timed(name, fn, nbytes, reps=12):
    fn(0)
    t0 = time.perf_counter()
    for r in range(reps):
        fn(r % COPIES)
    dt = (time.perf_counter() - t0) / reps
    print(f"{name:34s} {dt * 1e3:7.3f} ms  {nbytes / dt / 2**30:6.1f} GiB/s", flush=True)
    return dt


def mats(qt, rows, cols):
    return [random_rows(qt, rows, cols).contiguous() for _ in range(COPIES)]


flat = torch.empty(2**30, dtype=torch.uint8).fill_(1)
t0 = time.perf_counter()
for _ in range(3):
    flat.view(torch.int64).sum()
print(f"{'sequential read (torch sum)':34s} {'':10s} {3 * flat.numel() / (time.perf_counter() - t0) / 2**30:6.1f} GiB/s")
del flat
wq, wk, wv, wo = mats(Q.Q4_0, d, d), mats(Q.Q4_0, kv, d), mats(Q.Q4_0, kv, d), mats(Q.Q4_0, d, d)
qkv_bytes = wq[0].nbytes + wk[0].nbytes + wv[0].nbytes
total = timed("attention q/k/v Q4_0 (one call)", lambda r: kernels.cpu.qmatmul_multi(
    [wq[r], wk[r], wv[r]], [int(Q.Q4_0)] * 3, x), qkv_bytes)
total += timed("attention o Q4_0", lambda r: kernels.cpu.qmatmul(wo[r], int(Q.Q4_0), x), wo[0].nbytes)
del wq, wk, wv, wo
for qt in (Q.F16, Q.Q8_0, Q.Q4_0):
    f1, f2 = mats(qt, width, d), mats(qt, ff, width)
    h = torch.randn(1, width)
    t1 = timed(f"predictor fc1 {qt.name} ({width})", lambda r: kernels.cpu.qmatmul(f1[r], int(qt), x), f1[0].nbytes)
    t2 = timed(f"predictor fc2 {qt.name}", lambda r: kernels.cpu.qmatmul(f2[r], int(qt), h), f2[0].nbytes)
    if qt == Q.F16:
        total += t1 + t2
    del f1, f2
up, gate, down = mats(Q.Q4_0, ff, d), mats(Q.Q4_0, ff, d), mats(Q.Q4_0, ff, d)
row = up[0].shape[1]
for n in (n_cold // 4, n_cold, 2 * n_cold):
    g = torch.Generator().manual_seed(n)
    ids = [torch.randperm(ff, generator=g)[:n].sort().values.int() for _ in range(COPIES)]
    xs = torch.randn(1, d).abs()  # ReLU: about half the neurons fire; count the down rows that do
    _, hh = kernels.sparse_ffn(xs, up[0], Q.Q4_0, gate[0], Q.Q4_0, down[0], Q.Q4_0, ids[0], None, "relu", False)
    fired = int((hh != 0).sum())
    t = timed(f"sparse FFN Q4_0, {n} neurons", lambda r: kernels.sparse_ffn(
        xs, up[r], Q.Q4_0, gate[r], Q.Q4_0, down[r], Q.Q4_0, ids[r], None, "relu", False), row * (2 * n + fired))
    if n == n_cold:
        total += t
print(f"CPU layer (q/k/v + o + F16 predictor + FFN over {n_cold}): {total * 1e3:.2f} ms")
