"""hs-quantize: every quantized tensor bit-exact with gguf's numpy `quants.quantize` (ggml's reference),
llama.cpp's type rules, metadata / predictors / PWRI kept, atomic output, one-line errors; and the
project's trained ReLU model keeps its perplexity (Q8_0 within 0.5% of F16, Q4_0 within 5%)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from hybridsparse.runtime import quantize as hq
from hybridsparse.runtime.gguf_file import GGUFFile
from hybridsparse.runtime.models import load_model
from hybridsparse.runtime.perplexity import perplexity
from hybridsparse.runtime.quants import dequantize
from hybridsparse.runtime.tokenizer import Tokenizer
from cli_checks import one_line_error
from tiny_models import tiny_llama


@pytest.fixture
def powerinfer_f16(tmp_path):
    """A tiny ReLU llama in PowerInfer layout with predictors inside, F16 (rows of 64 = 2 blocks)."""
    import gguf
    src = tiny_llama(tmp_path / "f32.gguf")
    g = GGUFFile(src)
    w = gguf.GGUFWriter(str(tmp_path / "pi.gguf"), g.architecture)
    from hybridsparse.runtime.gguf_writer import copy_metadata
    copy_metadata(w, g)
    w.add_float32("powerinfer.sparse_threshold", 0.0)
    for name, info in g.tensors.items():
        arr = dequantize(g.raw(name), info.qtype).numpy().reshape(tuple(reversed(info.shape)))
        w.add_tensor(name, arr if arr.ndim == 1 else arr.astype(np.float16))
    rng = np.random.default_rng(0)
    for i in range(2):
        w.add_tensor(f"blk.{i}.fc1.weight", rng.standard_normal((16, 64)).astype(np.float16))
        w.add_tensor(f"blk.{i}.fc2.weight", rng.standard_normal((128, 16)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = tmp_path / "pi.gguf"
    with open(path, "r+b") as fh:
        fh.write(b"PWRI")
    return path


@pytest.mark.parametrize("target", ["Q8_0", "Q4_0"])
def test_quantized_tensors_are_bit_exact_and_the_rest_is_kept(powerinfer_f16, tmp_path, target):
    out = tmp_path / f"{target}.gguf"
    assert hq.main([str(powerinfer_f16), str(out), target, "-t", "2"]) == 0
    src, dst = GGUFFile(powerinfer_f16), GGUFFile(out)
    assert out.read_bytes()[:4] == b"PWRI" and list(dst.tensors) == list(src.tensors)
    qt = Q[target]
    for name, info in src.tensors.items():
        got = dst.tensors[name]
        assert got.shape == info.shape
        if ".fc1." in name or ".fc2." in name or info.shape[1:] == ():
            assert got.qtype == info.qtype and torch.equal(dst.raw(name), src.raw(name)), name  # kept as they were
            continue
        want_type = Q.Q8_0 if name == "output.weight" else qt
        assert got.qtype == want_type, name
        ref = quants.quantize(dequantize(src.raw(name), info.qtype).numpy(), want_type)
        assert bytes(dst.raw(name).numpy()) == bytes(ref), name
    for key, value in src.metadata.items():
        if key != "general.file_type":
            assert np.array_equal(dst.metadata[key], value) if isinstance(value, np.ndarray) else dst.metadata[key] == value
            assert dst.metadata_types[key] == src.metadata_types[key]
    assert dst.get("general.file_type") == hq.FILE_TYPE[qt]
    assert Tokenizer(dst).encode("hello there") == Tokenizer(src).encode("hello there")
    ids = torch.tensor([1, 72, 101, 108, 108, 111, 32, 119])
    with torch.inference_mode():
        a = load_model(src).forward(ids, torch.arange(8), load_model(src).new_cache(16), 8, all_logits=True)
        m = load_model(dst)
        b = m.forward(ids, torch.arange(8), m.new_cache(16), 8, all_logits=True)
    assert (a - b).abs().max() <= (0.05 if target == "Q8_0" else 0.25) * a.abs().max()


def test_pure_and_predictor_options(powerinfer_f16, tmp_path):
    out = tmp_path / "pure.gguf"
    assert hq.main([str(powerinfer_f16), str(out), "Q4_0", "--pure", "--quantize-predictors"]) == 0
    g = GGUFFile(out)
    assert g.tensors["output.weight"].qtype == Q.Q4_0 and g.tensors["blk.1.fc1.weight"].qtype == Q.Q4_0
    assert g.tensors["blk.0.attn_norm.weight"].qtype == Q.F32


def _fails(capsys, argv, *needles):
    return one_line_error(capsys, hq.main, "hs-quantize", argv, *needles)


def test_bad_inputs(powerinfer_f16, tmp_path, capsys):
    q8 = tmp_path / "q8.gguf"
    assert hq.main([str(powerinfer_f16), str(q8), "Q8_0"]) == 0
    out = tmp_path / "out.gguf"
    _fails(capsys, [str(q8), str(out), "Q4_0"], "already Q8_0", "--allow-requantize")
    _fails(capsys, [str(powerinfer_f16), str(out), "Q3_X"], "Q3_X", "Q8_0, Q4_0")
    _fails(capsys, [str(powerinfer_f16), str(powerinfer_f16), "Q8_0"], "overwrite the input")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(powerinfer_f16.read_bytes()[:3000])
    _fails(capsys, [str(cut), str(out), "Q8_0"], "cut.gguf")
    _fails(capsys, [str(powerinfer_f16), str(out), "Q8_0", "-t", "0"], "-t 0")
    _fails(capsys, [str(powerinfer_f16), str(tmp_path / "nope" / "out.gguf"), "Q8_0"], "nope: no such folder")
    assert not out.exists() and not list(tmp_path.glob("*.part"))
    assert hq.main([str(q8), str(out), "Q4_0", "--allow-requantize"]) == 0
    assert GGUFFile(out).tensors["blk.0.ffn_up.weight"].qtype == Q.Q4_0


def test_a_disk_without_room_is_refused_and_a_failed_write_leaves_nothing(powerinfer_f16, tmp_path, capsys,
                                                                          monkeypatch):
    """An output its disk has no room for is refused before a byte is written (naming it, the GiB needed and
    free); a write that fails midway (the disk filling under it) names the file in one line and leaves neither
    the output nor a .part behind."""
    import errno
    import shutil

    from hybridsparse.runtime import gguf_writer
    out = tmp_path / "out.gguf"
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    _fails(capsys, [str(powerinfer_f16), str(out), "Q8_0"], f"{out}: writing it needs", "GiB are free; free space there")
    assert not out.exists() and not list(tmp_path.glob("*.part"))
    monkeypatch.setattr(shutil, "disk_usage", real)
    done = []

    class Full(gguf_writer.gguf.GGUFWriter):
        def write_tensor_data(self, tensor, *a, **k):
            if done:
                raise OSError(errno.ENOSPC, "No space left on device")
            done.append(1)
            return super().write_tensor_data(tensor, *a, **k)
    monkeypatch.setattr(gguf_writer.gguf, "GGUFWriter", Full)
    _fails(capsys, [str(powerinfer_f16), str(out), "Q8_0"], f"{out}: cannot write it (No space left on device)")
    assert done and not out.exists() and not list(tmp_path.glob("*.part"))


def test_trained_relu_model_keeps_its_perplexity(trained_relu, tmp_path, threads):
    """F16 -> Q8_0 within 0.5% of F16's perplexity, Q4_0 within 5% (held-out text, llama.cpp's method)."""
    from hybridsparse.profiler.corpus import load_documents, split
    torch.set_num_threads(2)
    text = "\n\n".join(split(load_documents(None))[1])
    f16 = tmp_path / "f16.gguf"
    assert hq.main([str(trained_relu), str(f16), "F16"]) == 0
    ppl = {}
    for target in ("F16", "Q8_0", "Q4_0"):
        path = f16 if target == "F16" else tmp_path / f"{target}.gguf"
        if target != "F16":
            assert hq.main([str(f16), str(path), target]) == 0
        g = GGUFFile(path)
        ppl[target] = perplexity(load_model(g), Tokenizer(g), text, n_ctx=128, max_chunks=24)["perplexity"]
    print("perplexity:", json.dumps(ppl))
    assert ppl["Q8_0"] <= ppl["F16"] * 1.005
    assert ppl["Q4_0"] <= ppl["F16"] * 1.05
    assert ppl["F16"] < 40  # a trained model, not noise (a uniform guess over its 259 tokens would be 259)


def test_quantized_predictors_run_in_their_stored_type(powerinfer_f16, tmp_path):
    """`--quantize-predictors` pays at run time: the hybrid runtime computes a Q8_0 predictor in Q8_0
    (the bytes the solver counts), not widened back to float16, and it chooses what the float16
    predictor chooses up to the quantization's flips near the threshold."""
    from hybridsparse.runtime.hybrid import HybridOptions
    from hybridsparse.runtime.loader import open_model
    out = tmp_path / "q8p.gguf"
    assert hq.main([str(powerinfer_f16), str(out), "Q8_0", "--quantize-predictors"]) == 0
    assert GGUFFile(out).tensors["blk.0.fc1.weight"].qtype == Q.Q8_0
    opts = HybridOptions(vram_budget=0.0, mode="predictor", n_ctx=64)
    ref = open_model(powerinfer_f16, hybrid=opts, log_line=lambda s: None)
    lm = open_model(out, hybrid=opts, log_line=lambda s: None)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    for a, b in zip(ref.model.layers, lm.model.layers):
        pa, pb = a.ffn.predictor, b.ffn.predictor
        assert pa.fc1.qtype == Q.F16 and pb.fc1.qtype == Q.Q8_0
        assert pb.fc2.qtype == GGUFFile(out).tensors["blk.0.fc2.weight"].qtype  # rows of 16: not quantizable, kept
        agree = (pa.mask(x) == pb.mask(x)).float().mean().item()
        assert agree >= 0.97, agree
    ids = lm.tokenizer.encode("hello")
    with torch.inference_mode():
        logits = lm.model.forward(torch.tensor(ids), torch.arange(len(ids)), lm.model.new_cache(64), len(ids))
    assert torch.isfinite(logits).all()
