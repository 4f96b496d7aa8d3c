"""Bad input gets one clear line naming the file/tensor/field, a non-zero exit, no traceback; a fuzz
over mutated headers never crashes, hangs or allocates more than the file."""

from __future__ import annotations

import random
import struct
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest

from hybridsparse.runtime.convert import add_metadata
from hybridsparse.runtime.errors import GGUFError, ModelError
from hybridsparse.runtime.gguf_file import GGUFFile
from hybridsparse.runtime.models import load_model
from tiny_models import tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("m") / "tiny.gguf")


def _write(path, data):
    path.write_bytes(data)
    return path


def hs_run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hybridsparse.runtime.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_reads_metadata_and_tensors(tiny):
    g = GGUFFile(tiny)
    assert g.flavor == "gguf" and g.version == 3 and g.architecture == "llama"
    assert g.get("llama.block_count") == 2
    emb = g.tensors["token_embd.weight"]
    assert emb.shape[0] == 64 and g.raw("token_embd.weight").shape == (emb.rows, emb.row_bytes)


def test_powerinfer_magic_loads(tiny, tmp_path):
    data = bytearray(tiny.read_bytes())
    data[:4] = b"PWRI"
    g = GGUFFile(_write(tmp_path / "pwri.gguf", bytes(data)))
    assert g.flavor == "powerinfer"
    assert load_model(g).config.ffn_variant == "relu"


@pytest.mark.parametrize("case,needle", [
    ("truncated", "truncated"), ("magic", "not a GGUF file"), ("version", "unsupported GGUF version"),
    ("offset", "outside the file"), ("type", "unsupported tensor type id 77"), ("empty", "truncated"),
    ("counts", "more than a"),
])
def test_corrupt_files(tiny, tmp_path, case, needle):
    data = bytearray(tiny.read_bytes())
    g = GGUFFile(tiny)
    info = g.tensors["blk.1.ffn_down.weight"]
    if case == "truncated":
        data = data[: info.offset + 10]
    elif case == "magic":
        data[:4] = b"GGML"
    elif case == "version":
        data[4:8] = struct.pack("<I", 99)
    elif case == "counts":
        data[8:16] = struct.pack("<Q", 2**40)
    elif case == "empty":
        data = data[:12]
    else:
        # rewrite the tensor info of the last tensor: its type or its offset
        name = info.name.encode()
        pos = bytes(data).rindex(struct.pack("<Q", len(name)) + name) + 8 + len(name)
        n_dims = struct.unpack_from("<I", data, pos)[0]
        field = pos + 4 + 8 * n_dims
        if case == "type":
            data[field:field + 4] = struct.pack("<I", 77)
        else:
            data[field + 4:field + 12] = struct.pack("<Q", 2**33)
    path = _write(tmp_path / f"{case}.gguf", bytes(data))
    with pytest.raises(GGUFError, match=needle) as e:
        GGUFFile(path)
    assert str(path) in str(e.value)
    r = hs_run("-m", str(path), "-n", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and needle in r.stderr


def _rewrite(src, dst, drop=(), arch=None, reshape=None, extra=None):
    """Copy a GGUF with tensors dropped/reshaped or the architecture renamed."""
    g = GGUFFile(src)
    w = gguf.GGUFWriter(str(dst), arch or g.architecture)
    for key, value in g.metadata.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        add_metadata(w, key.replace(g.architecture + ".", (arch or g.architecture) + ".", 1), value)
    for name, info in g.tensors.items():
        if name in drop:
            continue
        arr = g.raw(name).numpy().view(np.float32).reshape(list(reversed(info.shape)))
        if reshape and name == reshape:
            arr = arr[:, :-1].copy()
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("case,needle", [
    ("arch", "unknown architecture 'mamba9'"),
    ("missing", "tensor blk.1.attn_q.weight is missing"),
    ("shape", "tensor blk.0.ffn_up.weight has shape"),
])
def test_model_errors(tiny, tmp_path, case, needle):
    kw = {"arch": {"arch": "mamba9"}, "missing": {"drop": {"blk.1.attn_q.weight"}},
          "shape": {"reshape": "blk.0.ffn_up.weight"}}[case]
    path = _rewrite(tiny, tmp_path / f"{case}.gguf", **kw)
    with pytest.raises(ModelError, match=needle):
        load_model(GGUFFile(path))
    r = hs_run("-m", str(path), "-n", "1")
    assert r.returncode == 1 and needle in r.stderr and "Traceback" not in r.stderr


def test_prompt_longer_than_context(tiny):
    r = hs_run("-m", str(tiny), "-c", "16", "-p", "x" * 40, "-n", "2")
    assert r.returncode == 1 and "does not fit the context of 16 tokens" in r.stderr
    assert "Traceback" not in r.stderr


def test_kv_cache_types_one_line_errors(tiny):
    r = hs_run("-m", str(tiny), "-n", "1", "-ctk", "f16", "-ctv", "f32")
    assert r.returncode == 1 and "-ctk f16 -ctv f32: keys and values must have one cache type" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = hs_run("-m", str(tiny), "-n", "1", "-ctk", "q8_0")
    assert r.returncode == 2 and "invalid choice: 'q8_0'" in r.stderr


def test_missing_file(tmp_path):
    r = hs_run("-m", str(tmp_path / "nope.gguf"))
    assert r.returncode == 1 and "nope.gguf: cannot open" in r.stderr


def test_fuzz_mutated_headers(tiny, tmp_path):
    """Random byte flips, insertions and truncations in the header region: the parser either
    reads the file or raises GGUFError, quickly, without allocating beyond the file."""
    import tracemalloc
    base = tiny.read_bytes()
    header_end = GGUFFile(tiny).data_offset
    rng = random.Random(1234)
    path = tmp_path / "fuzz.gguf"
    tracemalloc.start()
    for i in range(300):
        data = bytearray(base)
        for _ in range(rng.randint(1, 8)):
            if len(data) <= 5:
                break
            op = rng.random()
            pos = rng.randrange(4, min(header_end, len(data)))
            if op < 0.6:
                data[pos] = rng.randrange(256)
            elif op < 0.8:
                data[pos:pos + 8] = struct.pack("<Q", rng.choice([0, 1, 2**31, 2**63 - 1, 2**64 - 1, rng.randrange(2**40)]))
            else:
                data = data[:pos]
        path.write_bytes(bytes(data))
        tracemalloc.reset_peak()
        start = time.perf_counter()
        try:
            GGUFFile(path)
        except GGUFError:
            pass
        assert time.perf_counter() - start < 5, f"iteration {i} took too long"
        assert tracemalloc.get_traced_memory()[1] < 8 * len(data) + (1 << 20), f"iteration {i} allocated too much"
    tracemalloc.stop()
