"""Scattered rows from memory by how many a thread streams side by side (HS_FFN_ROWS: 8, the default since
session 27, against 4 and 1), alternating pass by pass in one process (not a test): the one-token sparse
row-dot on 13B-shaped rows (13824 x 5120) in F16 / Q8_0 / Q4_0 at 3% and 10% of the rows listed, weights
enough to exceed the L3 (over 1 GiB of each type, taken in turn). GiB/s of the listed rows, each pass's
median. Another switch in place of HS_FFN_ROWS: RF_VAR and RF_VALUES (e.g. whether Q4_0 groups ask for the
next group's rows, RF_VAR=HS_NEXT_ROWS RF_VALUES=1,0 RF_TYPES=Q4_0); RF_DENSITIES the listed shares.
  RF_THREADS=1,2 python tests/gpu/rows_in_flight_bench.py   (the GPU machine's Xeon: RF_THREADS=16)"""

import os
import sys

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from hybridsparse.runtime import kernels
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/quant_utils.py
from rows_bench import alternating_gib_s, copies_from_memory  # noqa: E402

kernels.ops()
K, N = 5120, 13824
threads = [int(t) for t in os.environ.get("RF_THREADS", "1,2").split(",")]
var = os.environ.get("RF_VAR", "HS_FFN_ROWS")
rows_tried = os.environ.get("RF_VALUES", os.environ.get("RF_ROWS", "8,4,1")).split(",")
densities = [float(d) for d in os.environ.get("RF_DENSITIES", "0.03,0.1").split(",")]
types = [Q[t] for t in os.environ.get("RF_TYPES", "F16,Q8_0,Q4_0").split(",")]
g = np.random.default_rng(0)
print(f"cpu path {kernels.cpu.cpu_path()}", flush=True)
for qt in types:
    ws = copies_from_memory(qt, N, K)
    row = ws[0][0].numel() * ws[0].element_size()
    x = torch.randn(1, K)
    for density in densities:
        idx = torch.from_numpy(np.sort(g.choice(N, int(N * density), replace=False)).astype(np.int32))
        for nt in threads:
            torch.set_num_threads(nt)
            rates = alternating_gib_s({f"{var}={r}": ({var: r}, lambda w: kernels.cpu.sparse_rowdot(w, int(qt), x, idx, None),
                                                     ws) for r in rows_tried}, idx.numel() * row)
            print(f"{qt.name:5s} {density:.0%} t={nt:2d}: " + "  ".join(f"{k} {v:6.1f}" for k, v in rates.items())
                  + " GiB/s", flush=True)
    del ws
os.environ.pop(var, None)
