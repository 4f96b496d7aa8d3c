"""One token's Q4_0 dots four blocks at a time (HS_Q4_WIDE=1, the default where the CPU has AVX-512
VBMI) against the older 256-bit form (HS_Q4_WIDE=0), side by side in one process (not a test):
  - 1024 x 4096 rows in cache, one thread: a third of the rows listed (one at a time and four side by
    side) and every row (the dense GEMV), GiB/s;
  - the fused FFN from memory (768 MiB of layers in turn), alternating the two forms call by call over fresh
    index sets, for S5's 7B rows at 33% and S2's 70B rows at 10%, at each thread count asked;
  - the wide form's dense GEMV from memory, rows one at a time (HS_GEMV_STREAMS=1), with and without
    prefetching ahead (HS_Q4_PREFETCH), alternating.
  python tests/gpu/q4_wide_bench.py [THREADS ...]   (default: 1 2; the GPU machine's Xeon: 1 16)"""

import os
import statistics
import sys
import time

import torch
from gguf import GGMLQuantizationType as Q

from hybridsparse.runtime import kernels
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/quant_utils.py
from quant_utils import random_rows  # noqa: E402

kernels.ops()
threads = [int(t) for t in sys.argv[1:]] or [1, 2]
print(f"cpu path {kernels.cpu.cpu_path()}", flush=True)


def median_s(f, n=60):
    f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


torch.set_num_threads(1)
w = random_rows(Q.Q4_0, 1024, 4096, seed=1).contiguous()
x = torch.randn(1, 4096)
idx = torch.arange(0, 1024, 3, dtype=torch.int32)
listed = idx.numel() * w.shape[1] / 2**30
for rep in range(2):
    for wide in ("0", "1"):
        os.environ["HS_Q4_WIDE"] = wide
        out = []
        for side in ("1", "4"):
            os.environ["HS_FFN_ROWS"] = side
            out.append(f"x{side} {listed / median_s(lambda: kernels.cpu.qmatmul_rows([w], [int(Q.Q4_0)], x, [idx])):5.1f}")
        dense = w.numel() / 2**30 / median_s(lambda: kernels.cpu.qmatmul(w, int(Q.Q4_0), x))
        print(f"HS_Q4_WIDE={wide}: listed rows in cache GiB/s {' '.join(out)}; dense {dense:5.1f}", flush=True)
os.environ.pop("HS_FFN_ROWS", None)

for d, n, dens in ((4096, 11008, 0.33), (8192, 28672, 0.1)):
    # layers enough for 768 MiB of rows, taken in turn: one 7B layer's three weights (74 MiB) would sit
    # partly in a server's L3 (the GPU machine's Xeon: see the session log's lscpu line)
    one = 3 * n * (d // 32 * 18)
    sets = [tuple(random_rows(Q.Q4_0, n, d, seed=3 * i + s).contiguous() for s in (1, 2, 3))
            for i in range(-(-(768 << 20) // one))]
    x = torch.randn(1, d)
    m = int(n * dens)
    gib = 3 * m * sets[0][0].shape[1] / 2**30  # GELU: every listed neuron reads its down row too
    for th in threads:
        torch.set_num_threads(th)
        res = {"0": [], "1": []}
        for rep in range(40):
            ids = torch.randperm(n, generator=torch.Generator().manual_seed(rep))[:m].sort().values.int()
            for wide in ("0", "1") if rep % 2 else ("1", "0"):
                os.environ["HS_Q4_WIDE"] = wide
                up, gate, down = sets[(2 * rep + (wide == "1")) % len(sets)]
                t0 = time.perf_counter()
                kernels.sparse_ffn(x, up, Q.Q4_0, gate, Q.Q4_0, down, Q.Q4_0, ids, None, "gelu", False)
                res[wide].append(time.perf_counter() - t0)
        a, b = statistics.median(res["0"]), statistics.median(res["1"])
        print(f"{d}x{n} density {dens} t={th}: fused FFN {gib / a:5.1f} -> {gib / b:5.1f} GiB/s ({a / b:.2f}x)", flush=True)
    del sets, up, gate, down
os.environ.pop("HS_Q4_WIDE", None)

# the dense GEMV from memory (32 weights of 4096 x 4096, 288 MiB, more than a server's L3, one after
# another), the wide rows one at a time prefetching ahead (HS_Q4_PREFETCH=1; the default up to 4
# threads) or not, alternating call by call; rows one at a time (HS_GEMV_STREAMS=1: in streams side by side,
# the default, they do not prefetch)
os.environ["HS_GEMV_STREAMS"] = "1"
ws = [random_rows(Q.Q4_0, 4096, 4096, seed=10 + i).contiguous() for i in range(32)]
x = torch.randn(1, 4096)
gib = sum(w.numel() for w in ws) / 2**30
for th in threads:
    torch.set_num_threads(th)
    res = {"0": [], "1": []}
    for rep in range(16):
        for pf in ("0", "1") if rep % 2 else ("1", "0"):
            os.environ["HS_Q4_PREFETCH"] = pf
            t0 = time.perf_counter()
            for w in ws:
                kernels.cpu.qmatmul(w, int(Q.Q4_0), x)
            res[pf].append(time.perf_counter() - t0)
    a, b = statistics.median(res["0"]), statistics.median(res["1"])
    print(f"4096x4096 x32 from memory t={th}: dense GEMV {gib / a:5.1f} -> {gib / b:5.1f} GiB/s ({a / b:.2f}x) "
          "with HS_Q4_PREFETCH", flush=True)
os.environ.pop("HS_Q4_PREFETCH", None)
os.environ.pop("HS_GEMV_STREAMS", None)
