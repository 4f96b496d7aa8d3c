"""Where a CPU-side hybrid layer spends its time (13B rows, F16, 11% of neurons active, 16 threads):
the fused sparse FFN, its parts, the predictor, and one whole HybridFFN call. Run once per
HS_PREFETCH mode (read once per process)."""

import os
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from hybridsparse.runtime import kernels
from hybridsparse.runtime.hybrid import HybridFFN, LayerPredictor
from hybridsparse.runtime.layers import FFN_VARIANTS, FFNWeights
from hybridsparse.runtime.weights import QWeight

torch.set_num_threads(int(os.environ.get("THREADS", "16")))
kernels.build()
d, ff, L = 5120, 13824, 6
g = torch.Generator().manual_seed(0)
layers = []
for _ in range(L):  # 6 layers x 425 MB: far more than the caches
    w = [(torch.randn(ff, d, generator=g) * 0.02).half() for _ in range(3)]
    layers.append(w)
x = torch.randn(1, d)
rng = np.random.default_rng(0)
idx = [torch.from_numpy(np.sort(rng.choice(ff, int(0.11 * ff), replace=False)).astype(np.int32)) for _ in range(L)]


def timeit(name, fn, bytes_per_call=None):
    for i in range(L):
        fn(i)
    t = time.perf_counter()
    reps = 4
    for _ in range(reps):
        for i in range(L):
            fn(i)
    dt = (time.perf_counter() - t) / (reps * L)
    bw = f", {bytes_per_call / dt / 2**30:.1f} GiB/s" if bytes_per_call else ""
    print(f"HS_PREFETCH={os.environ.get('HS_PREFETCH', '0')} {name:40s} {dt * 1e3:8.3f} ms{bw}", flush=True)


rows = int(0.11 * ff) * d * 2
timeit("sparse_ffn (gate+up row-dot, axpy)", lambda i: kernels.cpu.sparse_ffn(
    x, layers[i][1], int(Q.F16), layers[i][0], int(Q.F16), layers[i][2], int(Q.F16), idx[i], None, 1, False), 3 * rows)
timeit("sparse_rowdot gate", lambda i: kernels.cpu.sparse_rowdot(layers[i][0], int(Q.F16), x, idx[i], None), rows)
h = torch.randn(1, int(0.11 * ff)).abs()
timeit("sparse_axpy down", lambda i: kernels.cpu.sparse_axpy(layers[i][2], int(Q.F16), h, idx[i]), rows)
timeit("dense rowdot gate (all rows)", lambda i: kernels.cpu.sparse_rowdot(layers[i][0], int(Q.F16), x, None, None),
       ff * d * 2)
timeit("dense axpy down (all rows)", lambda i: kernels.cpu.sparse_axpy(layers[i][2], int(Q.F16), torch.randn(1, ff), None),
       ff * d * 2)
preds = [LayerPredictor(torch.randn(512, d) * 0.02, torch.randn(ff, 512) * 0.02, 0.0).to("cpu") for _ in range(L)]
timeit("predictor 512 wide", lambda i: preds[i].mask(x), (512 * d + ff * 512) * 2)
freq = torch.rand(ff) * 0.22
ffns = [HybridFFN(FFNWeights(QWeight(w[1], Q.F16, d), QWeight(w[2], Q.F16, d), QWeight(w[0], Q.F16, d), True),
                  QWeight(w[2], Q.F16, d), FFN_VARIANTS["relu"], np.zeros(0), None, preds[i], "sampled", None, freq)
        for i, w in enumerate(layers)]
timeit("HybridFFN CPU-only, sampled", lambda i: ffns[i](x), 3 * rows)
timeit("torch.rand + compare", lambda i: torch.rand(1, ff) < freq)
