"""How fast this CPU's cores compute the one-token sparse ops when the bytes are at hand (not a test): each
thread's share of the rows (CC_KIB KiB of each weight a thread, 128 and 512 by default: within a core's L2)
read over and over, against the same ops on rows from memory (1 GiB flushed before each call). The rates
are marginal: the bytes the larger share adds over the time it adds, so that a call's fixed cost (Python,
waking the threads, quantizing x; printed apart) does not count. With the two rates
per core, compute (c) and memory alone (m, tests/gpu/read_ceiling_bench.py), a kernel whose compute and
memory time add up reaches 1 / (1/c + 1/m); one that overlaps them, min(c, m). On the Xeon of the GPU machine
the Q4_0 row-dot read 4.7 GiB/s on one thread from memory where only reading gave 10.3 (session 30).
Ops: the sparse row-dot (every other row listed, eight side by side), the sparse axpy (the down rows), the fused
gated FFN (gate, up and down rows; GELU, so every listed neuron reads its down row), for 70B rows (8192
wide) in Q4_0 / Q8_0 / F16 (CC_TYPES), on CC_THREADS threads (default 1,16).
  python tests/gpu/compute_ceiling_bench.py"""

import os
import statistics
import sys
import time

import torch
from gguf import GGMLQuantizationType as Q

from hybridsparse.runtime import kernels
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/quant_utils.py
from quant_utils import random_rows  # noqa: E402
from rows_bench import alternating_gib_s  # noqa: E402

kernels.ops()
K = int(os.environ.get("K", 8192))
kib = [int(k) for k in os.environ.get("CC_KIB", "128,512").split(",")]


def ops_on(qt, x, h):
    """name -> (fn(weights), bytes read per call for n rows)"""
    return {
        "row-dot": (lambda ws: kernels.sparse_rowdot(ws[0], qt, x, ws[3]), 1),
        "axpy": (lambda ws: kernels.sparse_axpy(ws[2], qt, h[:, :ws[3].numel()], ws[3]), 1),
        "fused FFN": (lambda ws: kernels.sparse_ffn(x, ws[0], qt, ws[1], qt, ws[2], qt, ws[3], None, "gelu", False), 3),
    }


def in_cache_gib_s(fn, ws, nbytes, calls=200):
    for _ in range(5):
        fn(ws)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(ws)
        times.append(time.perf_counter() - t0)
    return nbytes / 2**30 / statistics.median(times)


def weights(qt, n, seed):
    """up, gate, down_t of 2n + 1 rows and every other row listed (fewer than half: the listed rows' kernels,
    eight rows side by side, as a decode step's cold neurons go)"""
    return [random_rows(qt, 2 * n + 1, K, seed=seed + s).contiguous() for s in (1, 2, 3)] + [
        torch.arange(0, 2 * n, 2, dtype=torch.int32)]


print(f"cpu path {kernels.cpu.cpu_path()}, {os.cpu_count()} cores, rows {K} wide, {kib[0]} and {kib[1]} KiB of each "
      "weight a thread", flush=True)
for name in os.environ.get("CC_TYPES", "Q4_0,Q8_0,F16").split(","):
    qt = Q[name]
    one = random_rows(qt, 1, K)
    row = one[0].numel() * one.element_size()  # bytes
    x = torch.randn(1, K)
    for nt in [int(t) for t in os.environ.get("CC_THREADS", "1,16").split(",")]:
        torch.set_num_threads(nt)
        ns = [max(8, nt * k * 1024 // row // 8 * 8) for k in kib]  # rows: k KiB a thread, whole groups of eight
        h = torch.randn(1, ns[1])
        per_call = {}  # (op, where) -> [seconds a call at the smaller n, at the larger]
        for n in ns:
            cache = weights(qt, n, 0)
            # five copies: alternating_gib_s flushes 1 GiB before each of its timed calls on the first four
            mem = [weights(qt, n, 10 * (c + 1)) for c in range(5)]
            for op, (fn, mats) in ops_on(qt, x, h).items():
                nbytes = mats * n * row
                per_call.setdefault((op, "cache"), []).append(nbytes / 2**30 / in_cache_gib_s(fn, cache, nbytes))
                per_call.setdefault((op, "memory"), []).append(
                    nbytes / 2**30 / alternating_gib_s({op: ({}, fn, mem)}, nbytes)[op])
            del cache, mem
        line = []
        for op, (_, mats) in ops_on(qt, x, h).items():
            extra = mats * (ns[1] - ns[0]) * row / 2**30
            c, m = (extra / max(1e-9, per_call[op, w][1] - per_call[op, w][0]) for w in ("cache", "memory"))
            fixed = per_call[op, "cache"][0] - mats * ns[0] * row / 2**30 / c
            line.append(f"{op} {c:6.1f} in cache / {m:6.1f} from memory (fixed {fixed * 1e6:4.0f} us)")
        print(f"{name:5s} t={nt:2d} ({ns[0]} / {ns[1]} rows): " + ";  ".join(line) + " GiB/s", flush=True)
