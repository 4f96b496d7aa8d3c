"""Streaming, atomic GGUF writing (hs-convert, hs-quantize, test and synthetic models).

The tensor table is written first from shapes and types alone; then each tensor is produced, written
and dropped, one at a time, so no model is ever whole in memory. Everything goes to `<out>.part`,
renamed over `<out>` only when the last byte is written: an error or Ctrl-C leaves no partial file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFValueType

from .errors import GGUFError


@dataclass
class PlannedTensor:
    name: str
    shape: tuple[int, ...]  # numpy order: the last dimension is the contiguous row
    qtype: Q
    produce: Callable[[], np.ndarray]  # the data: float32/float16/int arrays, or uint8 blocks

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.qtype)


def tensor_nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return n // block * block_bytes


_NUMPY_DTYPES = {Q.F32: np.float32, Q.F16: np.float16, Q.I8: np.int8, Q.I16: np.int16, Q.I32: np.int32,
                 Q.I64: np.int64, Q.F64: np.float64}


def as_written(arr: np.ndarray, qtype: Q) -> np.ndarray:
    """Float data in the tensor's stored dtype (BF16 as its 16 high bits, rounded to nearest even)."""
    if qtype == Q.BF16:
        from gguf import quants
        return quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), Q.BF16)
    if qtype in _NUMPY_DTYPES:
        return np.ascontiguousarray(arr, dtype=_NUMPY_DTYPES[qtype])
    return np.ascontiguousarray(arr)


def add_metadata(writer: gguf.GGUFWriter, key: str, value) -> None:
    """One metadata entry, its GGUF type chosen from the Python value (ints as u32)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"metadata {key}: cannot write {type(value).__name__}")


def copy_metadata(writer: gguf.GGUFWriter, source, skip: Iterable[str] = ()) -> None:
    """Every metadata entry of an open GGUFFile, with its original value types (u64 stays u64), except
    `skip` and general.architecture (the writer's own); general.alignment becomes the writer's."""
    skip = set(skip) | {"general.architecture"}
    for key, value in source.metadata.items():
        if key in skip:
            continue
        if key == "general.alignment":
            writer.add_custom_alignment(int(value))
            continue
        vtype, etype = source.metadata_types[key]
        if isinstance(value, np.ndarray):
            value = value.tolist()
        elif isinstance(value, np.generic):
            value = value.item()
        writer.add_key_value(key, value, GGUFValueType(vtype), None if etype is None else GGUFValueType(etype))


def ensure_room(path: Path, need: int, doing: str, advice: str = "", error: type[Exception] = GGUFError) -> None:
    """Refuse, before anything is written, a file of `need` bytes at `path` that its disk has no room for
    (a disk filled to the last byte by a half-written model helps nobody): one line naming the file, the
    GiB needed and free, and `advice`."""
    try:
        free = shutil.disk_usage(path.parent).free
    except FileNotFoundError:
        raise error(f"{path.parent}: no such folder to write {path.name} into") from None
    except OSError as e:
        raise error(f"{path.parent}: cannot see its free space for {path.name} ({e.strerror or e})") from None
    if free < need:
        raise error(f"{path}: {doing} needs {need / 2**30:.1f} GiB on that disk and {free / 2**30:.1f} GiB are "
                    f"free; free space there{advice}")


@contextlib.contextmanager
def gguf_part(path: Path, arch: str, nbytes: int, doing: str = "writing it", what: str = "it", advice: str = "",
              error: type[Exception] = GGUFError, powerinfer: bool = False) -> Iterator[gguf.GGUFWriter]:
    """A GGUFWriter on `<path>.part` for tensors of `nbytes`, closed (its first four bytes then PowerInfer's `PWRI`
    magic where `powerinfer`) and renamed over `path` when the block ends. Before it, a
    `.part` left by a run cut short is removed and a disk without room for the file refused (ensure_room, `doing`
    and `advice`). On any error the writer is closed (an open handle would keep the deleted copy's blocks in use)
    and the `.part` removed; an OSError (disk full, not writable) becomes one line naming `path`: "cannot write
    {what}". A FileNotFoundError passes as it is: it names a file read, not this one."""
    tmp = path.with_name(path.name + ".part")
    tmp.unlink(missing_ok=True)
    ensure_room(path, nbytes + (1 << 20), doing, advice, error)  # + header and alignment
    writer = None
    try:
        writer = gguf.GGUFWriter(str(tmp), arch)
        yield writer
        writer.close()
        if powerinfer:  # PowerInfer's loader looks for its own magic
            with open(tmp, "r+b") as fh:
                fh.write(b"PWRI")
        os.replace(tmp, path)
    except BaseException as e:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
            raise error(f"{path}: cannot write {what} ({e.strerror or e})") from None
        raise


def write_gguf_stream(path: str | os.PathLike, arch: str, metadata: Callable[[gguf.GGUFWriter], None],
                      tensors: list[PlannedTensor], powerinfer: bool = False, desc: str | None = None) -> Path:
    """Write `tensors` (in order) after the metadata that `metadata(writer)` adds; PowerInfer's `PWRI`
    magic if asked. Atomic (gguf_part): `<path>.part` is renamed at the end and removed on any error."""
    from tqdm import tqdm
    path = Path(path)
    names = set()
    for t in tensors:
        if t.name in names:
            raise GGUFError(f"{path}: tensor {t.name} would be written twice")
        names.add(t.name)
    total = sum(t.nbytes for t in tensors)
    with gguf_part(path, arch, total, powerinfer=powerinfer) as writer:
        metadata(writer)
        for t in tensors:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with tqdm(total=total, unit="B", unit_scale=True, desc=desc or path.name, disable=desc is False,
                  leave=False) as bar:
            for t in tensors:
                arr = np.ascontiguousarray(t.produce())
                if arr.nbytes != t.nbytes:
                    raise GGUFError(f"{path}: tensor {t.name}: produced {arr.nbytes} bytes, expected {t.nbytes} "
                                    f"for {t.qtype.name} {list(t.shape)}")
                writer.write_tensor_data(arr)
                bar.update(arr.nbytes)
                del arr
    return path
