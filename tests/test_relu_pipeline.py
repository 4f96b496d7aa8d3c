"""The offline pipeline on a real sparse model: a small ReLU Llama trained here on English text
(its sparsity and skew are learned, not planted), profiled, given predictors and a placement."""

from __future__ import annotations

import json

import numpy as np
import torch

from hybridsparse.predictor_training import train as T
from hybridsparse.predictor_training.relu_model import make_relu_model
from hybridsparse.profiler import profile as P
from hybridsparse.profiler.activations import load_profile
from hybridsparse.solver import cli as S
from hybridsparse.solver.gpuidx import read_index


def test_trained_relu_model_through_profile_predictors_and_placement(tmp_path):
    torch.set_num_threads(2)
    model = make_relu_model(tmp_path / "relu.gguf", steps=150, d_model=128, n_layers=2, n_ff=512, log=lambda *a: None)
    prof = tmp_path / "relu.hs-profile"
    assert P.main(["-m", str(model), "--tokens", "20000", "--samples", "20000", "-ngl", "0", "--plot"]) == 0
    counts = load_profile(prof)
    freqs = [np.sort(c.numpy())[::-1] for c in counts.frequencies()]
    # learned: sparse (ReLU at initialisation fires ~50%) and skewed (the hottest fifth of a layer's
    # neurons carries well over a fifth of its activations); the first layer is the densest
    assert np.mean([f.mean() for f in freqs]) < 0.4
    assert max(f[: len(f) // 5].sum() / f.sum() for f in freqs) > 0.35
    assert T.main(["-m", str(model), "--widths", "64,128"]) == 0
    report = json.loads((tmp_path / "relu.predictors.json").read_text())
    for row in report["layers"]:
        assert row["recall"] >= 0.98
        assert row["predicted_density"] <= 1.5 * row["true_density"]
    assert S.main(["-m", str(model), "--vram-budget", "0.7", "--group", "32"]) == 0
    assert len(read_index(tmp_path / "relu.generated.gpuidx").gpu_neurons) == 2
