"""Dequantization of GGML block formats in torch: the pure-torch twin of the compiled kernels.

Each function takes the raw bytes as uint8 [rows, row_bytes] and returns float32 [rows, row_elems].
Layouts follow ggml-quants.c; tests check them against gguf's numpy `quants.dequantize`.
Types without a torch routine here are dequantized with gguf's numpy code (slow, exact).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gguf_quants

FLOAT_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Two bytes per value, little-endian f16, to float32."""
    return raw.contiguous().view(torch.float16).float()


def _blocks(raw: torch.Tensor, qtype: Q) -> torch.Tensor:
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _q4_0(b):
    d = _f16(b[..., :2])
    return (_nibbles(b[..., 2:18]).float() - 8) * d


def _q4_1(b):
    d, m = _f16(b[..., :2]), _f16(b[..., 2:4])
    return _nibbles(b[..., 4:20]).float() * d + m


def _high_bits(qh: torch.Tensor, n: int) -> torch.Tensor:
    """[..., n/8] bytes of little-endian bit flags -> [..., n] of 0/1."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(*qh.shape[:-1], n)


def _q5_0(b):
    d = _f16(b[..., :2])
    q = _nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6], 32) << 4)
    return (q.float() - 16) * d


def _q5_1(b):
    d, m = _f16(b[..., :2]), _f16(b[..., 2:4])
    q = _nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8], 32) << 4)
    return q.float() * d + m


def _q8_0(b):
    d = _f16(b[..., :2])
    return b[..., 2:34].contiguous().view(torch.int8).float() * d


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins."""
    s = scales.to(torch.int32)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1).float(), torch.cat([lo_m, hi_m], -1).float()


def _q4_k(b):
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scale_min(b[..., 4:16])
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)
    q = torch.stack([qs & 0xF, qs >> 4], dim=-2).reshape(*b.shape[:-1], 8, 32).float()
    return (d * sc).unsqueeze(-1) * q - (dmin * m).unsqueeze(-1)


def _q5_k(b):
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scale_min(b[..., 4:16])
    qh = b[..., 16:48]  # 32 bytes: bit j of qh[l] is the high bit of element l of sub-block j
    qs = b[..., 48:176].reshape(*b.shape[:-1], 4, 32)
    low = torch.stack([qs & 0xF, qs >> 4], dim=-2).reshape(*b.shape[:-1], 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).unsqueeze(-1)
    high = (qh.unsqueeze(-2) >> shifts) & 1
    q = (low | (high << 4)).float()
    return (d * sc).unsqueeze(-1) * q - (dmin * m).unsqueeze(-1)


def _q6_k(b):
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 2, 32)  # [half, ql pair (l, l+32), 32]
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
    scales = b[..., 192:208].contiguous().view(torch.int8).float().reshape(*lead, 2, 8)
    d = _f16(b[..., 208:210]).unsqueeze(-1)
    # Within each half of 128: quarter 0 = ql[l]&F + qh bits 0-1, 1 = ql[l+32]&F + bits 2-3,
    # 2 = ql[l]>>4 + bits 4-5, 3 = ql[l+32]>>4 + bits 6-7.
    low = torch.cat([ql & 0xF, ql >> 4], dim=-2)  # [half, 4, 32]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(4, 1)
    high = (qh >> shifts) & 3
    q = (low | (high << 4)).float() - 32  # [half, 4, 32]
    q = q.reshape(*lead, 2, 4, 2, 16)  # scale index = quarter * 2 + l // 16
    s = scales.reshape(*lead, 2, 4, 2, 1)
    return (d.unsqueeze(-1).unsqueeze(-1) * s * q).reshape(*lead, 256)


_TORCH_DEQUANT = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
                  Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}


def dequantize(raw: torch.Tensor, qtype: Q) -> torch.Tensor:
    """uint8 [rows, row_bytes] (or a float tensor for float types) -> float32 [rows, row_elems]."""
    if qtype in FLOAT_TYPES:
        if raw.dtype == torch.uint8:
            raw = raw.view(FLOAT_TYPES[qtype])
        return raw.float()
    rows = raw.shape[0]
    if rows == 0:
        return torch.zeros((0, row_elements(qtype, raw.shape[1])), device=raw.device)
    if qtype in _TORCH_DEQUANT:
        out = _TORCH_DEQUANT[qtype](_blocks(raw, qtype))
        return out.reshape(rows, -1)
    values = gguf_quants.dequantize(raw.cpu().numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(rows, -1)


def row_elements(qtype: Q, row_bytes: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return row_bytes // size * block
