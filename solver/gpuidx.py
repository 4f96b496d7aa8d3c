"""PowerInfer's GPU index file, `<model>.generated.gpuidx`, plus our metadata.

A GGUF with architecture `generic.gpu_index` and the magic overwritten to `PWRI`: keys
`generic.gpu_index.block_count` (u32) and `split.vram_capacity` (u64 bytes); per layer i the
tensors `blk.i.gpu_idx` (int32 [n_ff], 1 = on the GPU) and `blk.i.gpu_bucket` (int32, the sorted
ids of the GPU neurons). Our keys (`hybridsparse.*`) say which model, profile, budget and solver made
it and where the dense blocks go; an index without them (PowerInfer's exporter) loads too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hybridsparse.runtime.errors import GGUFError, InputError

ARCH = "generic.gpu_index"


def model_fingerprint(model) -> str:
    """The header (metadata + tensor table) and size of the model file: changes when the model does.
    `model`: a path, or a GGUFFile already open (its header is not parsed again)."""
    from hybridsparse.runtime.gguf_file import GGUFFile
    g = model if isinstance(model, GGUFFile) else GGUFFile(model)
    try:
        h = hashlib.sha256(bytes(g._mm[:g.data_offset]))
        h.update(str(g.file_size).encode())
        return h.hexdigest()[:16]
    finally:
        if g is not model:
            g.close()


def default_index_path(model_path: str | Path) -> Path:
    p = Path(model_path)
    return p.with_name(p.stem + ".generated.gpuidx")


@dataclass
class GpuIndex:
    gpu_neurons: list[np.ndarray]  # per layer: sorted neuron ids on the GPU
    n_ff: list[int]
    vram_capacity: int
    meta: dict  # our keys (empty for PowerInfer's files)


def write_index(path: str | Path, gpu_neurons: list[np.ndarray], n_ff: list[int], vram_capacity: int,
                meta: dict) -> Path:
    from hybridsparse.runtime.gguf_writer import gguf_part
    path = Path(path)
    nbytes = sum(4 * (n + len(ids)) for ids, n in zip(gpu_neurons, n_ff))
    # atomic: renamed over `path` at the end, removed on any error; PWRI: PowerInfer's loader looks for its magic
    with gguf_part(path, ARCH, nbytes, powerinfer=True) as w:
        w.add_uint32(f"{ARCH}.block_count", len(gpu_neurons))
        w.add_uint64("split.vram_capacity", int(vram_capacity))
        w.add_string("hybridsparse.meta", json.dumps(meta, sort_keys=True))
        for i, (ids, n) in enumerate(zip(gpu_neurons, n_ff)):
            mask = np.zeros(n, dtype=np.int32)
            mask[ids] = 1
            w.add_tensor(f"blk.{i}.gpu_idx", mask)
            w.add_tensor(f"blk.{i}.gpu_bucket", np.sort(np.asarray(ids, dtype=np.int32)))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    return path


def read_index(path: str | Path) -> GpuIndex:
    from hybridsparse.runtime.gguf_file import GGUFFile
    path = Path(path)
    try:
        g = GGUFFile(path)
    except GGUFError as e:
        raise InputError(f"{path}: corrupt GPU index ({e}); delete it or pass --reset-gpu-index") from None
    try:
        if g.get("general.architecture") != ARCH:
            raise InputError(f"{path}: not a GPU index (architecture {g.get('general.architecture')!r}, "
                             f"expected {ARCH!r}); pass --reset-gpu-index")
        n = g.get(f"{ARCH}.block_count")
        cap = g.get("split.vram_capacity")
        if not isinstance(n, int) or not isinstance(cap, int):
            raise InputError(f"{path}: GPU index lacks {ARCH}.block_count or split.vram_capacity; pass --reset-gpu-index")
        neurons, n_ff = [], []
        for i in range(n):
            for name in (f"blk.{i}.gpu_idx", f"blk.{i}.gpu_bucket"):
                if name not in g.tensors:
                    raise InputError(f"{path}: GPU index lacks tensor {name}; pass --reset-gpu-index")
            mask = g.raw(f"blk.{i}.gpu_idx").view(-1).view(torch.int32).numpy().copy()
            bucket = g.raw(f"blk.{i}.gpu_bucket").view(-1).view(torch.int32).numpy().copy() \
                if g.tensors[f"blk.{i}.gpu_bucket"].nbytes else np.zeros(0, np.int32)
            ids = np.flatnonzero(mask).astype(np.int32)
            if not np.array_equal(ids, np.sort(bucket)):
                raise InputError(f"{path}: blk.{i}.gpu_bucket disagrees with blk.{i}.gpu_idx; pass --reset-gpu-index")
            neurons.append(ids)
            n_ff.append(len(mask))
        meta = json.loads(g.get("hybridsparse.meta", "{}"))
        return GpuIndex(neurons, n_ff, cap, meta)
    finally:
        g.close()


def stale_reason(index: GpuIndex, expect: dict, vram_budget: int) -> str | None:
    """Why a cached index cannot be used for this model/profile/budget (None: it can)."""
    if index.vram_capacity > vram_budget:
        return (f"it was solved for {index.vram_capacity / 2**30:.2f} GiB of VRAM, more than the "
                f"{vram_budget / 2**30:.2f} GiB budget now")
    absent = {"down_t_type": "f16"}  # keys older indexes lack: what they were solved with
    for key in ("model_fingerprint", "profile_hash", "vram_budget", "solver_version", "group", "n_ctx", "ubatch",
                "down_t_type"):
        if key in expect and index.meta.get(key, absent.get(key)) != expect[key]:
            return f"its {key} is {index.meta.get(key, absent.get(key))!r}, now {expect[key]!r}"
    return None
