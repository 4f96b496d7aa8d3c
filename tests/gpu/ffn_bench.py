"""The CPU's fused sparse FFN for one token (what a hybrid decode step runs per layer for the cold
neurons) on real-scale layers, in GiB/s of the rows it reads: random active sets at given densities,
each rep a new set (little cache reuse: one layer is hundreds of MB), against a sequential read of the
same bytes; with 1, 2, 4 and 8 rows streamed side by side (HS_FFN_ROWS; a gated neuron's two rows count
as two: 8 is four gated neurons, 2 or 1 one neuron at a time). Not a
test. Usage: ffn_bench.py [SHAPE ...]; HS_PREFETCH / thread counts / densities via env (FB_THREADS=8,16,
FB_DENSITIES=0.03,0.07,0.15)."""

import os
import sys
import time

import torch
from gguf import GGMLQuantizationType as Q

from hybridsparse.runtime import kernels
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/quant_utils.py
from quant_utils import random_rows  # noqa: E402

SHAPES = {  # d_model, n_ff, weight type, gated
    "falcon-40b-f16": (8192, 32768, Q.F16, False),
    "llama-13b-f16": (5120, 13824, Q.F16, True),
    "llama-70b-q4_0": (8192, 28672, Q.Q4_0, True),
    "llama-7b-q4_0": (4096, 11008, Q.Q4_0, True),  # S5's rows (CPU only, ~1/3 of the neurons fire)
    "small-q4_0": (1024, 4096, Q.Q4_0, True),  # a smoke test of the script
}
kernels.ops()
names = sys.argv[1:] or list(SHAPES)
threads = [int(t) for t in os.environ.get("FB_THREADS", "16").split(",")]
print(f"cpu path {kernels.cpu.cpu_path()}, HS_PREFETCH={os.environ.get('HS_PREFETCH', '0')}", flush=True)
for name in names:
    d, n_ff, qt, gated = SHAPES[name]
    up = random_rows(qt, n_ff, d).contiguous()
    gate = random_rows(qt, n_ff, d).contiguous() if gated else None
    down_t = random_rows(qt, n_ff, d).contiguous()
    row = up[0].numel() * up.element_size()
    x = torch.randn(1, d)
    for nt in threads:
        torch.set_num_threads(nt)
        # the sequential read of a layer's up rows: what the memory gives one pass over them
        flat = up.view(torch.uint8).view(-1)
        t0 = time.perf_counter()
        for _ in range(3):
            flat.view(torch.int64).sum()
        seq = 3 * flat.numel() / (time.perf_counter() - t0) / 2**30
        densities = [float(v) for v in os.environ.get("FB_DENSITIES", "0.03,0.07,0.15").split(",")]
        for density, side in [(dn, r) for dn in densities for r in (1, 2, 4, 8)]:
            os.environ["HS_FFN_ROWS"] = str(side)
            m = int(n_ff * density)
            total_bytes, total_s = 0, 0.0
            for rep in range(12):
                idx = torch.randperm(n_ff, generator=torch.Generator().manual_seed(rep))[:m].sort().values.int()
                t0 = time.perf_counter()
                y, h = kernels.sparse_ffn(x, up, qt, gate, qt, down_t, qt, idx, None, "relu", False)
                dt = time.perf_counter() - t0
                if rep >= 2:
                    fired = int((h != 0).sum())
                    total_bytes += row * (m * (2 if gated else 1) + fired)
                    total_s += dt
            print(f"{name:16s} t={nt:2d} density {density:.2f} ({m:5d} rows) x{side}: {total_bytes / total_s / 2**30:6.1f} GiB/s "
                  f"({total_s / 10 * 1e3:6.2f} ms/call); sequential sum {seq:6.1f} GiB/s", flush=True)
    del up, gate, down_t
