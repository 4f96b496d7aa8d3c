"""Helpers shared by the kernel and quantization tests: random valid blocks of any GGML type, and
the activation quantization the compiled CPU kernels apply (to build exact references)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

# byte offsets of the float16 scale fields inside one block
_SCALE_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
                 Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_rows(qtype: Q, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, row_bytes] (or a float tensor for float types) of random, valid data."""
    rng = np.random.default_rng(seed)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        dtype = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype]
        return torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32)).to(dtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in _SCALE_FIELDS[qtype]:
        scales = (rng.random((rows, cols // block)) * 0.02 + 0.001).astype(np.float16)
        raw[:, :, off:off + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def _round_away(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def quantize_activations(x: torch.Tensor, block: int, planes: int = 2) -> torch.Tensor:
    """x [T, K] -> the two-plane 8-bit approximation the compiled kernels compute:
    x ~= d0 * q0 + d0 / 128 * q1 per block, d0 = amax / 127 (planes=1: d0 * q0 alone, llama.cpp's
    Q8_0 activations, HS_ACT_PLANES=1)."""
    xb = x.float().reshape(x.shape[0], -1, block)
    d0 = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d0 > 0, 1.0 / d0, torch.zeros_like(d0))
    q0 = _round_away(xb * inv)
    q1 = _round_away((xb - d0 * q0) * (inv * 128)) if planes == 2 else torch.zeros_like(q0)
    return (d0.double() / 128 * (128 * q0.double() + q1.double())).reshape(x.shape)
