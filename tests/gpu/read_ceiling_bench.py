"""How fast this machine's memory gives scattered rows, against what the sparse row-dot reaches on them
(not a test): listed rows of a 13B-shaped weight (13824 x 5120; K= for another width) in T (Q4_0 by
default) read and only summed (csrc/cpu_probe.cpp: read_rows) 8 side by side asking for the 8 of the next
group or the one after (+1 / +2), without asking, one at a time, next to the row-dot over the same rows
with HS_NEXT_ROWS=1 and 2 (the kernels' ask, same distances), at 3% / 10% / 33% / 100% of the
rows listed, over 1 GiB of copies taken in turn (more than the L3). GiB/s of the listed rows, medians.
  T=Q4_0 TH=1,16 python tests/gpu/read_ceiling_bench.py"""

import os
import sys

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from hybridsparse.runtime import kernels
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/quant_utils.py
from rows_bench import alternating_gib_s, copies_from_memory  # noqa: E402

kernels.ops()
K, N = int(os.environ.get("K", 5120)), 13824
qt = Q[os.environ.get("T", "Q4_0")]
ws = copies_from_memory(qt, N, K)
row = ws[0][0].numel() * ws[0].element_size()
x = torch.randn(1, K)
print(f"cpu path {kernels.cpu.cpu_path()}, {qt.name} rows of {row} bytes, {len(ws)} copies", flush=True)
for d in [float(v) for v in os.environ.get("D", "0.03,0.1,0.33,1.0").split(",")]:
    idx = torch.tensor(np.sort(np.random.default_rng(1).choice(N, int(N * d), replace=False)), dtype=torch.int32)
    for nt in [int(t) for t in os.environ.get("TH", "1,2").split(",")]:
        torch.set_num_threads(nt)
        def rowdot(w):
            kernels.cpu.sparse_rowdot(w, int(qt), x, idx, None)
        rates = alternating_gib_s({
            "row-dot +1": ({"HS_NEXT_ROWS": "1"}, rowdot, ws),
            "row-dot +2": ({"HS_NEXT_ROWS": "2"}, rowdot, ws),
            "read 8 +1": ({}, lambda w: kernels.cpu.read_rows(w, idx, 8, 1), ws),
            "read 8 +2": ({}, lambda w: kernels.cpu.read_rows(w, idx, 8, 2), ws),
            "read 8": ({}, lambda w: kernels.cpu.read_rows(w, idx, 8, 0), ws),
            "read 1": ({}, lambda w: kernels.cpu.read_rows(w, idx, 1, 0), ws)}, idx.numel() * row)
        print(f"{qt.name} {d:4.0%} t={nt:2d}: " + "  ".join(f"{k} {v:6.1f}" for k, v in rates.items()) + " GiB/s",
              flush=True)
