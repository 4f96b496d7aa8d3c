"""What the scattered-rows benchmarks of this folder share (rows_in_flight_bench.py, read_ceiling_bench.py,
hugepage_rows_bench.py, and profile_hybrid.py's page count; not a test): weights enough to come from memory,
variants timed alternating, how much of a mapping the kernel maps with 2 MiB pages."""

import os
import re
import statistics
import time


def copies_from_memory(qt, n, k):
    """N x K rows of type qt, random, in as many copies as make over 1 GiB (more than the L3), taken in turn
    (tests/quant_utils.py must be importable)"""
    from quant_utils import random_rows
    one = random_rows(qt, n, k).contiguous()
    copies = max(2, -(-(1 << 30) // (one.numel() * one.element_size())))
    return [one] + [random_rows(qt, n, k, seed=c + 1).contiguous() for c in range(copies - 1)]


def alternating_gib_s(variants, nbytes, passes=3, flush_copies=4):
    """variants: name -> (settings, fn, weights). Each pass runs every variant in turn, fn(w) for each of its
    weights with its settings put in os.environ (switches read per call); name -> GiB/s of the nbytes a call
    reads, the median over its calls.
    Before each timed call 1 GiB is read on every core and fn runs once on another copy (code, threads and
    allocator warm, as in a decode step), so the listed rows come from memory: rotating over 1 GiB of copies
    alone left them in the L3 at 3-10% listed (30-100 MB touched against the Xeon's 300 MiB and the dev VM's
    480 MiB L3; as hs-bench kernels does since session 26). With the flush only the first flush_copies of the
    weights are timed; HS_ROWS_FLUSH=0: the rotation alone, every copy (the figures before session 31)."""
    import torch
    flush = None if os.environ.get("HS_ROWS_FLUSH") == "0" else torch.ones((1 << 30) // 4)
    cores = os.cpu_count() or 1
    times = {name: [] for name in variants}
    for _ in range(passes):
        for name, (settings, fn, weights) in variants.items():
            os.environ.update(settings)
            timed = weights if flush is None else weights[:flush_copies]
            for i, w in enumerate(timed):
                if flush is not None:
                    threads = torch.get_num_threads()
                    torch.set_num_threads(cores)
                    flush.sum()
                    torch.set_num_threads(threads)
                    fn(weights[(i + 1) % len(weights)])
                t0 = time.perf_counter()
                fn(w)
                times[name].append(time.perf_counter() - t0)
    return {name: nbytes / 2**30 / statistics.median(t) for name, t in times.items()}


def mapped_kib(keep):
    """(KiB in 2 MiB pages, KiB resident) of this process's mappings whose /proc/self/smaps header line
    ("lo-hi perms offset dev inode path") keep() accepts: AnonHugePages, ShmemPmdMapped, FilePmdMapped"""
    pmd = rss = 0
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
        if keep(block.split("\n", 1)[0]):
            pmd += sum(int(v) for v in re.findall(r"(?:AnonHugePages|ShmemPmdMapped|FilePmdMapped):\s+(\d+)", block))
            rss += sum(int(v) for v in re.findall(r"\nRss:\s+(\d+)", block))
    return pmd, rss
