"""The offline pipeline on a real GPU (skipped without CUDA): a small ReLU Llama trained here is
profiled on the GPU, its predictors trained on the GPU, the placement solved with bandwidths measured
on this machine (hs-solve --measure), and the hybrid runtime runs it split between GPU and CPU with
the trained predictors, agreeing with dense execution."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")

from hybridsparse.predictor_training import train as T  # noqa: E402
from hybridsparse.predictor_training.relu_model import make_relu_model  # noqa: E402
from hybridsparse.profiler import profile as P  # noqa: E402
from hybridsparse.solver import cli as S  # noqa: E402
from hybridsparse.solver.gpuidx import read_index  # noqa: E402


def test_pipeline_on_cuda(tmp_path, capsys):
    model = make_relu_model(tmp_path / "relu.gguf", steps=150, d_model=128, n_layers=2, n_ff=512, log=lambda *a: None)
    assert P.main(["-m", str(model), "--tokens", "20000", "--samples", "20000", "-ngl", "99"]) == 0
    assert T.main(["-m", str(model), "--widths", "32,64,128", "--budget", "0.25", "--device", "cuda"]) == 0
    report = json.loads((tmp_path / "relu.predictors.json").read_text())
    for row in report["layers"]:
        assert row["recall"] >= 0.98
    capsys.readouterr()
    assert S.main(["-m", str(model), "--vram-budget", "1", "--measure"]) == 0
    err = capsys.readouterr().err
    print(err)
    m = re.search(r"measured CPU ([0-9.]+) GiB/s, GPU ([0-9.]+) GiB/s, hand-over ([0-9.]+) us", err)
    assert m, err
    assert float(m.group(2)) > 100 and float(m.group(1)) > 1 and float(m.group(3)) > 0
    idx = read_index(tmp_path / "relu.generated.gpuidx")
    assert len(idx.gpu_neurons) == 2

    from hybridsparse.profiler.corpus import load_documents, split
    from hybridsparse.runtime.generate import Generator
    from hybridsparse.runtime.hybrid import HybridOptions
    from hybridsparse.runtime.loader import open_model
    dense = open_model(model, 99)
    # from the GPU index hs-solve wrote (the tiny model fits whole), then a forced split: the first
    # half of each layer's neurons on the GPU, the rest on the CPU through host nodes
    planned = open_model(model, hybrid=HybridOptions(vram_budget=1), log_line=print)
    assert planned.hybrid_report["source"].startswith("cached")
    sparse = open_model(model, hybrid=HybridOptions(mode="predictor", device="cuda", hot=[list(range(256))] * 2,
                                                    attn_fast=[True, True], head_fast=True), log_line=print)
    _, heldout = split(load_documents(None))
    ids = dense.tokenizer.encode(" ".join(heldout[:3]))[:120]
    with torch.inference_mode():
        a = dense.model.forward(torch.tensor(ids), torch.arange(len(ids)), dense.model.new_cache(256), len(ids), True)
        b = sparse.model.forward(torch.tensor(ids), torch.arange(len(ids)), sparse.model.new_cache(256), len(ids), True)
    agree = (a.argmax(-1).cpu() == b.argmax(-1).cpu()).float().mean().item()
    print(f"trained predictors on CUDA: top-1 agreement with dense {agree:.3f} over {len(ids)} tokens")
    assert agree >= 0.9
    # greedy decode through the Generator (graphs + host nodes) gives text, no host errors
    gen = Generator(sparse.model, sparse.tokenizer, 128)
    from hybridsparse.runtime.sampling import Sampler, SamplingParams
    text = "".join(gen.generate(ids[:8], 16, Sampler(SamplingParams(temperature=0))))
    assert gen.timings.gen_tokens > 0 and isinstance(text, str)
