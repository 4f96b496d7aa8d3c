"""The offline pipeline on a real sparse model: a small ReLU Llama trained here on English text
(its sparsity and skew are learned, not planted), profiled, given predictors and a placement."""

from __future__ import annotations

import json

import numpy as np
import torch

from hybridsparse.predictor_training import train as T
from hybridsparse.profiler import profile as P
from hybridsparse.profiler.activations import load_profile
from hybridsparse.solver import cli as S
from hybridsparse.solver.gpuidx import read_index


def test_trained_relu_model_through_profile_predictors_and_placement(trained_relu):
    torch.set_num_threads(2)
    model = trained_relu
    tmp_path = model.parent
    prof = tmp_path / "relu.hs-profile"
    assert P.main(["-m", str(model), "--tokens", "20000", "--samples", "20000", "-ngl", "0", "--plot"]) == 0
    counts = load_profile(prof)
    freqs = [np.sort(c.numpy())[::-1] for c in counts.frequencies()]
    # learned: sparse (ReLU at initialisation fires ~50%) and skewed (the hottest fifth of a layer's
    # neurons carries well over a fifth of its activations); the first layer is the densest
    assert np.mean([f.mean() for f in freqs]) < 0.4
    assert max(f[: len(f) // 5].sum() / f.sum() for f in freqs) > 0.35
    assert T.main(["-m", str(model), "--widths", "32,64,128", "--budget", "0.25"]) == 0
    report = json.loads((tmp_path / "relu.predictors.json").read_text())
    assert report["summary"]["share_of_ffn_params"] <= 0.25  # the budget is a total over the layers
    for row in report["layers"]:
        assert row["recall"] >= 0.98
        assert row["predicted_density"] <= 1.5 * row["true_density"]
    assert S.main(["-m", str(model), "--vram-budget", "1", "--group", "32"]) == 0
    assert len(read_index(tmp_path / "relu.generated.gpuidx").gpu_neurons) == 2

    # the hybrid runtime with the trained predictors, CPU only: teacher-forced top-1 agreement with
    # dense execution on held-out text (reported), and the predictor-driven run must stay close to it
    from hybridsparse.profiler.corpus import load_documents, split
    from hybridsparse.runtime.hybrid import HybridOptions
    from hybridsparse.runtime.loader import open_model
    dense = open_model(model, 0)
    sparse = open_model(model, hybrid=HybridOptions(vram_budget=0), log_line=lambda *_: None)
    _, heldout = split(load_documents(None))
    ids = dense.tokenizer.encode(" ".join(heldout[:3]))[:200]
    with torch.inference_mode():
        a = dense.model.forward(torch.tensor(ids), torch.arange(len(ids)), dense.model.new_cache(256), len(ids), True)
        b = sparse.model.forward(torch.tensor(ids), torch.arange(len(ids)), sparse.model.new_cache(256), len(ids), True)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"trained predictors: top-1 agreement with dense {agree:.3f} over {len(ids)} held-out tokens")
    assert agree >= 0.9
