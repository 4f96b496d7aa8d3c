"""Whether a neuron's gate, up and down rows lying side by side in one row of a bundled tensor (gate | up | down_t)
would make the CPU's sparse FFN faster than the three tensors of today's files (not a test; no file layout
stores bundles yet): the fused one-token sparse FFN (ReLU-gated) over the same listed neurons, from three
separate tensors and from three views of one bundled tensor, alternating, weights enough to exceed the L3.
GiB/s of the gate, up and down rows of the listed neurons (the down rows of neurons that did not fire are not
read, so the figure is a rate to compare, not the bytes read). A listed neuron then costs one scattered run of
three rows' length instead of three runs, which is what the scattered-rows probes say the memory prefers
(dev VM's Xeon, 2 threads, rows only read, 10% listed: 4608-byte rows 18.9 GiB/s, 13824-byte rows 23.9).
  BR_TYPE=Q4_0 BR_SHAPE=70b BR_THREADS=1,2 BR_DENSITIES=0.03,0.1 python tests/gpu/bundle_rows_bench.py
  (BR_SHAPE: 7b 11008x4096, 13b 13824x5120, 70b 28672x8192, falcon-40b 32768x8192 without a gate)"""

import os
import sys

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from hybridsparse.runtime import kernels
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/quant_utils.py
from quant_utils import random_rows  # noqa: E402
from rows_bench import alternating_gib_s  # noqa: E402

SHAPES = {"7b": (11008, 4096, True), "13b": (13824, 5120, True), "70b": (28672, 8192, True),
          "falcon-40b": (32768, 8192, False)}
kernels.ops()
qt = Q[os.environ.get("BR_TYPE", "Q4_0")]
N, K, gated = SHAPES[os.environ.get("BR_SHAPE", "70b")]
parts = 3 if gated else 2
one = [random_rows(qt, N, K, seed=s) for s in range(parts)]
copy_bytes = parts * one[0].numel() * one[0].element_size()
copies = max(2, -(-(1 << 30) // copy_bytes))
bundles = [torch.cat([torch.roll(p, c, 0) for p in one], 1) for c in range(copies)]  # copies differ in row order
width = one[0].shape[1]
views = [tuple(b[:, i * width:(i + 1) * width] for i in range(parts)) for b in bundles]
separate = [tuple(v.contiguous() for v in vs) for vs in views]
row_bytes = width * one[0].element_size()
x = torch.randn(1, K, generator=torch.Generator().manual_seed(1))
bias = None if gated else torch.randn(N) * 0.1


def ffn(w, idx):
    gate, up, down = (w[0], w[1], w[2]) if gated else (None, w[0], w[1])
    return kernels.cpu.sparse_ffn(x, up, int(qt), gate, int(qt) if gated else 0, down, int(qt), idx, bias, 1, False)


print(f"cpu path {kernels.cpu.cpu_path()}, {qt.name} {N}x{K} ({'gate, up, down' if gated else 'up, down'}), "
      f"{row_bytes} bytes a row, {copies} copies of {copy_bytes / 2**20:.0f} MiB", flush=True)
check = torch.arange(0, N, 7, dtype=torch.int32)
torch.set_num_threads(1)
a, b = ffn(separate[0], check), ffn(views[0], check)
assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "the bundled views must give the same sums"
for d in [float(v) for v in os.environ.get("BR_DENSITIES", "0.03,0.1").split(",")]:
    idx = torch.tensor(np.sort(np.random.default_rng(2).choice(N, int(N * d), replace=False)), dtype=torch.int32)
    for nt in [int(t) for t in os.environ.get("BR_THREADS", "1,2").split(",")]:
        torch.set_num_threads(nt)
        rates = alternating_gib_s({"separate": ({}, lambda w: ffn(w, idx), separate),
                                   "bundled": ({}, lambda w: ffn(w, idx), views)}, idx.numel() * parts * row_bytes,
                                  flush_copies=2)
        print(f"{qt.name} {d:4.0%} t={nt:2d}: " + "  ".join(f"{k} {v:6.1f}" for k, v in rates.items()) +
              f" GiB/s  (bundled / separate {rates['bundled'] / rates['separate']:.2f}x)", flush=True)
