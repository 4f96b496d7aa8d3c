"""Weight matrices kept in their stored GGML format, and the one `linear` every layer calls.

A `QWeight` is [out_features, in_features] with one row per output feature, exactly as GGUF stores
it (`data` is uint8 [rows, row_bytes] for block formats, a float tensor for F32/F16/BF16). Rows are
independent in every format, so slicing and gathering rows works on quantized data too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q

from . import kernels
from .quants import FLOAT_TYPES, dequantize


@dataclass(slots=True)
class QWeight:
    data: torch.Tensor
    qtype: Q
    in_features: int

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def row_bytes(self) -> int:
        return self.data.shape[1] * self.data.element_size()

    @classmethod
    def from_raw(cls, raw: torch.Tensor, qtype: Q, in_features: int) -> "QWeight":
        if qtype in FLOAT_TYPES:
            raw = raw.view(FLOAT_TYPES[qtype])
        return cls(raw, qtype, in_features)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "QWeight":
        return cls(w.float().contiguous(), Q.F32, w.shape[1])

    def rows(self, start: int, end: int) -> "QWeight":
        return QWeight(self.data[start:end], self.qtype, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.data, self.qtype)

    def to(self, device: torch.device) -> "QWeight":
        """On CUDA, float weights move as they are; block formats the CUDA kernels do not cover are
        dequantized once to float16."""
        device = torch.device(device)
        if device.type == "cpu" or self.data.device == device:
            return self if self.data.device == device else QWeight(self.data.cpu(), self.qtype, self.in_features)
        if self.qtype in FLOAT_TYPES:
            return QWeight(self.data.to(device), self.qtype, self.in_features)
        if kernels.cuda_supports(self.qtype):
            return QWeight(self.data.to(device), self.qtype, self.in_features)
        return QWeight(self.dequantize().half().to(device), Q.F16, self.in_features)


def linear(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in_features] float32 -> [T, out_features] float32."""
    y = kernels.matmul(x, w.data, w.qtype)
    return y + bias if bias is not None else y


def linear_add(x: torch.Tensor, w: QWeight, res: torch.Tensor) -> torch.Tensor:
    """res + x . W^T: a projection into the residual stream (one kernel on CUDA, see kernels.matmul_add)."""
    return kernels.matmul_add(x, w.data, w.qtype, res)


def linear_t(h: torch.Tensor, w_t: QWeight) -> torch.Tensor:
    """h [T, rows] @ w_t [rows, in_features] -> [T, in_features]: the down projection over rows that
    are neurons (`ffn_down_t`)."""
    return kernels.matmul_t(h, w_t.data, w_t.qtype)


def linear_many(x: torch.Tensor, ws: list[QWeight], norm: kernels.Norm | None = None) -> list[torch.Tensor]:
    """Several projections of one input (q/k/v, gate/up): on the CPU one compiled call for all; on
    the GPU one matmul when the weights are consecutive rows of one buffer (see `fuse_rows`). With
    `norm`, of norm(x): folded into that matmul on CUDA where it can (`kernels.matmul_fused`)."""
    span = None  # found once: the fused GEMV's rows, else the one matmul's
    if norm is not None:
        span = spanning(ws) if x.is_cuda else None
        if span is not None and kernels.fused_ok(x, span.data, span.qtype, norm):
            return list(kernels.matmul_fused(x, span.data, span.qtype, norm).split([w.out_features for w in ws], dim=-1))
        x = norm(x)
    if kernels.use_cpu_op(x) and all(w.qtype in kernels.CPU_QTYPES and x.shape[0] < kernels.cpu_gemm_tokens(w.qtype)
                                     for w in ws):
        return kernels.cpu.qmatmul_multi([w.data for w in ws], [int(w.qtype) for w in ws], x.contiguous())
    if span is None:
        span = spanning(ws)
    if span is not None:
        return list(linear(x, span).split([w.out_features for w in ws], dim=-1))
    return [linear(x, w) for w in ws]


def spanning(ws: list[QWeight]) -> QWeight | None:
    """One QWeight over all of ws when they are consecutive rows of one buffer, else None."""
    first = ws[0].data
    if len(ws) < 2 or not first.is_contiguous():
        return None
    row_bytes = first.shape[1] * first.element_size()
    storage = first.untyped_storage().data_ptr()
    expected, rows = first.data_ptr(), 0
    for w in ws:
        if (w.qtype != ws[0].qtype or w.data.dtype != first.dtype or w.data.shape[1] != first.shape[1]
                or w.data.data_ptr() != expected or not w.data.is_contiguous()
                or w.data.untyped_storage().data_ptr() != storage):
            return None
        expected += w.out_features * row_bytes
        rows += w.out_features
    return QWeight(torch.as_strided(first, (rows, first.shape[1]), first.stride()), ws[0].qtype, ws[0].in_features)
