"""A dense one-token GEMV from memory with each thread's rows as 1, 2 or 4 interleaved streams
(HS_GEMV_STREAMS), alternating pass by pass in one process (not a test): the weights of decode steps
that run on the CPU (S3's 13B attention in F16, S5's 7B attention in Q4_0, Q8_0 predictors), rotated
so that every call reads from memory; GiB/s of the rows read, median of the passes. Then the time of a
call on a tiny weight (the fixed cost of a parallel region with these threads).
  python tests/gpu/gemv_streams_bench.py [THREADS ...]   (default: 2; the GPU machine's Xeon: 16 1)"""

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
threads = [int(t) for t in sys.argv[1:]] or [2]
modes = os.environ.get("GS_MODES", "1,2,4").split(",")
print(f"cpu path {kernels.cpu.cpu_path()}", flush=True)


def weights(qtype, shapes, copies):
    """(weight, x) pairs: the weights in their stored form and a token for each, made once."""
    out = []
    for c in range(copies):
        for i, (n, k) in enumerate(shapes):
            if qtype == Q.F16:
                w = torch.randn(n, k, generator=torch.Generator().manual_seed(10 * c + i)).half()
            else:
                w = random_rows(qtype, n, k, seed=10 * c + i).contiguous()
            out.append((w, torch.ones(1, k)))
    return out


CASES = (  # name, type, (rows, features) of one layer's weights, copies (together well above any L3)
    ("13B attention F16 (S3)", Q.F16, [(15360, 5120), (5120, 5120)], 2),
    ("7B attention Q4_0 (S5)", Q.Q4_0, [(12288, 4096), (4096, 4096)], 12),
    ("7B predictor Q8_0 (S5)", Q.Q8_0, [(512, 4096), (11008, 512)], 24),
)
for name, qtype, shapes, copies in CASES:
    ws = weights(qtype, shapes, copies)
    gib = sum(w.numel() * w.element_size() for w, _ in ws) / 2**30
    for th in threads:
        torch.set_num_threads(th)
        res = {m: [] for m in modes}
        for rep in range(12 if th > 2 else 4):
            for m in (modes if rep % 2 == 0 else modes[::-1]):
                os.environ["HS_GEMV_STREAMS"] = m
                t0 = time.perf_counter()
                for w, x in ws:
                    kernels.cpu.qmatmul(w, int(qtype), x)
                res[m].append(time.perf_counter() - t0)
        line = "  ".join(f"{m}: {gib / statistics.median(res[m]):6.1f}" for m in modes)
        print(f"{name:24s} t={th:2d} ({gib:.2f} GiB a pass): GiB/s by HS_GEMV_STREAMS  {line}", flush=True)
    del ws
os.environ.pop("HS_GEMV_STREAMS", None)

w = random_rows(Q.Q4_0, 16, 4096, seed=1).contiguous()
x = torch.ones(1, 4096)
for th in threads:
    torch.set_num_threads(th)
    for _ in range(100):
        kernels.cpu.qmatmul(w, int(Q.Q4_0), x)
    ts = []
    for _ in range(400):
        t0 = time.perf_counter()
        kernels.cpu.qmatmul(w, int(Q.Q4_0), x)
        ts.append(time.perf_counter() - t0)
    print(f"tiny GEMV (16 x 4096 Q4_0) t={th}: {statistics.median(ts) * 1e6:.1f} us a call (median of 400)", flush=True)
