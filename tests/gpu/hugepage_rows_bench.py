"""Listed rows by where their pages come from (not a test): the one-token sparse row-dot over 13B-shaped rows
(13824 x 5120, over 1 GiB of copies so that they exceed the L3), the matrices placed in turn in anonymous
memory with 4 KiB pages, anonymous memory advised MADV_HUGEPAGE (2 MiB pages where the kernel has them), a
file in /dev/shm (tmpfs: 4 KiB pages unless shmem THP is on) and a file on disk (HP_DIR, default the
working directory; page-cache large folios map as 2 MiB pages on recent kernels with ext4/xfs), all
memory-mapped read-only like a model. GiB/s of the listed rows, each placement's median over passes that
alternate. How many of each placement's bytes the kernel mapped with 2 MiB pages is printed first.
  T=Q4_0 TH=1,2 D=0.03,0.1,0.33 python tests/gpu/hugepage_rows_bench.py"""

import mmap
import os
import sys
import tempfile
import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from hybridsparse.runtime import kernels
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/quant_utils.py
from rows_bench import alternating_gib_s, copies_from_memory, mapped_kib  # noqa: E402

kernels.ops()
warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # read-only maps, only read
K, N = 5120, 13824
qt = Q[os.environ.get("T", "Q4_0")]
PMD = 2 << 20


def anon(t, huge):
    nb = t.numel() * t.element_size()
    m = mmap.mmap(-1, nb, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    out = torch.from_numpy(np.frombuffer(m, dtype=np.uint8)).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out, m


def filed(t, folder):
    fd, path = tempfile.mkstemp(dir=folder, suffix=".hp")
    with os.fdopen(fd, "wb") as f:
        f.write(t.numpy().tobytes())
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    os.unlink(path)  # the mapping keeps the pages
    a = np.frombuffer(m, dtype=np.uint8)
    return torch.from_numpy(a).view(t.dtype).view(t.shape), m


def pmd_mapped_kib(tensors):
    """KiB of these tensors' mappings the kernel maps with 2 MiB pages"""
    starts = {t.data_ptr() for t in tensors}

    def holds_one(header):
        lo, hi = (int(a, 16) for a in header.split()[0].split("-"))
        return any(lo <= s < hi for s in starts)
    return mapped_kib(holds_one)[0]


with torch.inference_mode():
    raw = copies_from_memory(qt, N, K)
    row = raw[0][0].numel() * raw[0].element_size()
    places = {"anon 4K": lambda t: anon(t, False), "anon THP": lambda t: anon(t, True),
              "/dev/shm": lambda t: filed(t, "/dev/shm"), "disk": lambda t: filed(t, os.environ.get("HP_DIR", "."))}
    ws, keep = {}, []
    for name, place in places.items():
        got = [place(r) for r in raw]
        ws[name] = [g[0] for g in got]
        keep += [g[1] for g in got]
        for w in ws[name]:
            w.view(torch.uint8).sum(dtype=torch.int64)  # fault every page in
        nb = sum(w.numel() * w.element_size() for w in ws[name])
        print(f"{name:9s}: {pmd_mapped_kib(ws[name]) / (nb / 1024):4.0%} of {nb / 2**30:.2f} GiB in 2 MiB pages", flush=True)
    del raw
    x = torch.randn(1, K)
    g = np.random.default_rng(0)
    print(f"cpu path {kernels.cpu.cpu_path()}, {qt.name} rows of {row} bytes", flush=True)
    for density in [float(d) for d in os.environ.get("D", "0.03,0.1,0.33").split(",")]:
        idx = torch.from_numpy(np.sort(g.choice(N, int(N * density), replace=False)).astype(np.int32))
        for nt in [int(t) for t in os.environ.get("TH", "1,2").split(",")]:
            torch.set_num_threads(nt)
            rates = alternating_gib_s({h: ({}, lambda w: kernels.cpu.sparse_rowdot(w, int(qt), x, idx, None), wl)
                                       for h, wl in ws.items()}, idx.numel() * row, passes=5)
            print(f"{qt.name} {density:4.0%} t={nt:2d}: " + "  ".join(f"{h} {v:6.1f}" for h, v in rates.items())
                  + " GiB/s", flush=True)
