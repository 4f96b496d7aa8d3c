"""A fast, bounds-checked GGUF reader with memory-mapped, zero-copy tensors.

Reads llama.cpp GGUF (magic `GGUF`) and PowerInfer GGUF (magic `PWRI`), versions 2 and 3.
Every length, count and offset is checked against the file size before it is used, so a corrupt
header gives a `GGUFError` naming the field, never an allocation larger than the file.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import GGUFError

MAGICS = {b"GGUF": "gguf", b"PWRI": "powerinfer"}
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4

# GGUF value type id -> (struct code, numpy dtype, byte size); 8 = string, 9 = array.
_SCALARS = {
    0: ("<B", np.uint8, 1), 1: ("<b", np.int8, 1), 2: ("<H", np.uint16, 2), 3: ("<h", np.int16, 2),
    4: ("<I", np.uint32, 4), 5: ("<i", np.int32, 4), 6: ("<f", np.float32, 4), 7: ("<?", np.bool_, 1),
    10: ("<Q", np.uint64, 8), 11: ("<q", np.int64, 8), 12: ("<d", np.float64, 8),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: shape[0] is the contiguous (row) dimension
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def rows(self) -> int:
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[0] // block * size


class _Cursor:
    """Reads little-endian values from a buffer, raising GGUFError past its end."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.end, self.path = buf, 0, len(buf), path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.end:
            raise GGUFError(f"{self.path}: truncated file: {what} needs {n} bytes at offset {self.pos}, "
                            f"file has {self.end}")

    def scalar(self, code: str, size: int, what: str):
        self.need(size, what)
        (v,) = struct.unpack_from(code, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str):
        if vtype in _SCALARS:
            code, _, size = _SCALARS[vtype]
            return self.scalar(code, size, f"value of {key}")
        if vtype == _STRING:
            return self.string(f"value of {key}")
        if vtype == _ARRAY:
            etype = self.u32(f"array type of {key}")
            count = self.u64(f"array length of {key}")
            if etype in _SCALARS:
                _, dtype, size = _SCALARS[etype]
                self.need(count * size, f"array {key}")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * size
                return arr
            if etype == _STRING:
                # Each string takes at least its 8-byte length: bound the count before looping.
                self.need(count * 8, f"array {key}")
                return [self.string(f"{key}[{i}]") for i in range(count)]
            if etype == _ARRAY:
                self.need(count * 12, f"array {key}")
                return [self.value(_ARRAY, f"{key}[{i}]") for i in range(count)]
            raise GGUFError(f"{self.path}: metadata {key}: unknown array element type {etype}")
        raise GGUFError(f"{self.path}: metadata {key}: unknown value type {vtype}")


class GGUFFile:
    """An open GGUF file: `metadata` (dict), `tensors` (name -> TensorInfo), zero-copy `tensor()`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < 24:
                raise GGUFError(f"{self.path}: truncated file: {size} bytes is smaller than a GGUF header")
            # A private copy-on-write mapping: pages are shared with the page cache and never written
            # back, and torch can wrap them without complaining about read-only memory.
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        self.file_size = size
        self._parse()

    def populate(self) -> bool:
        """Map every page of the tensor data now (madvise MADV_POPULATE_READ, Linux 5.14+), as llama.cpp
        maps its models with MAP_POPULATE: otherwise each first touch of a 4 KiB page is a page fault,
        and sparse decoding, which touches new rows for many tokens, pays them for a long time (it
        made a 13B model's CPU side several times slower). Read faults keep the pages shared with the
        page cache (no copy). Returns False where the kernel does not offer it."""
        MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
        start = self.data_offset - self.data_offset % mmap.PAGESIZE
        try:
            self._mm.madvise(MADV_POPULATE_READ, start, self.file_size - start)
            return True
        except (OSError, ValueError, AttributeError):
            return False

    def _parse(self) -> None:
        cur = _Cursor(self._mm, self.path)
        magic = bytes(self._mm[:4])
        if magic not in MAGICS:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF' or b'PWRI')")
        self.flavor = MAGICS[magic]
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{self.path}: unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        # Each metadata entry takes >= 13 bytes and each tensor info >= 24: bound counts by the file.
        if n_kv * 13 > self.file_size or n_tensors * 24 > self.file_size:
            raise GGUFError(f"{self.path}: header claims {n_kv} metadata entries and {n_tensors} tensors, "
                            f"more than a {self.file_size}-byte file can hold")
        self.metadata: dict[str, object] = {}
        self.metadata_types: dict[str, tuple[int, int | None]] = {}  # key -> (value type, array element type)
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.u32(f"type of {key}")
            etype = None
            if vtype == _ARRAY and cur.pos + 4 <= self.file_size:
                etype = struct.unpack_from("<I", self._mm, cur.pos)[0]
            self.metadata[key] = cur.value(vtype, key)
            self.metadata_types[key] = (vtype, etype)

        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name #{i}")
            n_dims = cur.u32(f"tensor {name} dims")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"{self.path}: tensor {name}: {n_dims} dimensions (expected 1 to {MAX_DIMS})")
            shape = tuple(cur.u64(f"tensor {name} shape") for _ in range(n_dims))
            type_id = cur.u32(f"tensor {name} type")
            rel = cur.u64(f"tensor {name} offset")
            infos.append((name, shape, type_id, rel))

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment = {alignment!r} (expected a power of two)")
        self.alignment = alignment
        self.data_offset = (cur.pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, type_id, rel in infos:
            self.tensors[name] = self._check_tensor(name, shape, type_id, rel)

    def _check_tensor(self, name, shape, type_id, rel) -> TensorInfo:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFError(f"{self.path}: tensor {name}: unsupported tensor type id {type_id}") from None
        if qtype not in GGML_QUANT_SIZES:
            raise GGUFError(f"{self.path}: tensor {name}: type {qtype.name} has no known block size")
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if shape[0] % block:  # (an empty tensor is allowed: a GPU index's empty gpu_bucket)
            raise GGUFError(f"{self.path}: tensor {name}: shape {list(shape)} is not a whole number of "
                            f"{qtype.name} blocks of {block}")
        n = 1
        for d in shape:
            n *= d
            if n > self.file_size * 8:  # more elements than bits in the file: certainly out of bounds
                raise GGUFError(f"{self.path}: tensor {name}: shape {list(shape)} is larger than the file")
        nbytes = n // block * block_bytes
        start = self.data_offset + rel
        if rel % self.alignment or start + nbytes > self.file_size:
            raise GGUFError(f"{self.path}: tensor {name}: data at offset {start} (+{nbytes} bytes) is "
                            f"misaligned or outside the file ({self.file_size} bytes)")
        return TensorInfo(name, shape, qtype, start, nbytes)

    # --- access -------------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: metadata general.architecture is missing")
        return arch

    def get(self, key: str, default=None):
        value = self.metadata.get(key, default)
        return value.item() if isinstance(value, np.generic) else value

    def require(self, key: str, kind=int):
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata {key} is missing")
        value = self.get(key)
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise GGUFError(f"{self.path}: metadata {key} = {value!r} (expected {kind.__name__})")
        return value

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor [rows, row_bytes], sharing memory with the mapping."""
        info = self.tensors[name]
        flat = torch.frombuffer(self._mm, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
        return flat.view(info.rows, info.row_bytes)

    def close(self) -> None:
        """Unmap now, unless tensors or metadata arrays still view the mapping (then it goes with them)."""
        try:
            self._mm.close()
        except BufferError:
            pass
