"""Layers every architecture shares: norms, rotary embeddings, attention over the KV cache, the FFN.

Activations are float32 [tokens, features]; weights are `QWeight`s applied through `kernels.linear`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .weights import QWeight, linear, linear_t


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


# --- activations: the FFN variant is data, looked up by name -------------------------------------

def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "relu": F.relu, "gelu": _gelu_tanh, "gelu_erf": F.gelu}


@dataclass(slots=True)
class FFNSpec:
    """How an FFN combines its projections: `act(gate) * up`, `act(gate) * act(up)` (dReLU), or
    `act(up)` with no gate (Falcon, OPT)."""
    activation: str  # key of ACTIVATIONS
    gated: bool = True
    act_on_up: bool = False  # dReLU: relu on both gate and up

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown FFN activation {self.activation!r}; known: {sorted(ACTIVATIONS)}")


FFN_VARIANTS = {
    "swiglu": FFNSpec("silu"), "relu": FFNSpec("relu"), "drelu": FFNSpec("relu", act_on_up=True),
    "geglu": FFNSpec("gelu"), "relu_nogate": FFNSpec("relu", gated=False),
    "gelu_nogate": FFNSpec("gelu_erf", gated=False),
}


@dataclass(slots=True)
class FFNWeights:
    up: QWeight
    down: QWeight
    gate: QWeight | None = None
    down_transposed: bool = False  # PowerInfer's ffn_down_t: [n_ff, d_model], one row per neuron
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


def ffn(x: torch.Tensor, w: FFNWeights, spec: FFNSpec) -> torch.Tensor:
    act = ACTIVATIONS[spec.activation]
    up = linear(x, w.up, w.up_bias)
    if spec.gated:
        h = act(linear(x, w.gate)) * (act(up) if spec.act_on_up else up)
    else:
        h = act(up)
    if w.down_transposed:
        y = linear_t(h, w.down)
        return y + w.down_bias if w.down_bias is not None else y
    return linear(h, w.down, w.down_bias)


# --- rotary embeddings ---------------------------------------------------------------------------

class Rotary:
    """cos/sin tables for positions [0, n_ctx); `style` "neox" rotates halves, "norm" adjacent pairs."""

    def __init__(self, dim: int, base: float, n_ctx: int, style: str, scale: float = 1.0,
                 freq_factors: torch.Tensor | None = None):
        if style not in ("neox", "norm"):
            raise ValueError(f"unknown rope style {style!r}")
        self.dim, self.style = dim, style
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.double()
        pos = torch.arange(n_ctx, dtype=torch.float64) / scale
        angles = torch.outer(pos, inv_freq)
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    def to(self, device) -> "Rotary":
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim]; only the first `dim` features rotate."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        rot, rest = x[..., :self.dim], x[..., self.dim:]
        if self.style == "neox":
            a, b = rot.chunk(2, dim=-1)
            out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
        else:
            pairs = rot.unflatten(-1, (-1, 2))
            a, b = pairs[..., 0], pairs[..., 1]
            out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


# --- attention -----------------------------------------------------------------------------------

@dataclass(slots=True)
class Step:
    """What one forward call needs on one device: positions of the new tokens, how many cache slots
    to attend over, and the attention masks (one per sliding-window size, None = full causal)."""
    positions: torch.Tensor  # int64 [T]
    kv_len: int
    masks: dict

    @classmethod
    def build(cls, positions: torch.Tensor, kv_len: int, windows) -> "Step":
        slots = torch.arange(kv_len, device=positions.device)
        causal = slots.unsqueeze(0) <= positions.unsqueeze(1)
        masks = {}
        for window in windows:
            masks[window] = causal if window is None else causal & (
                positions.unsqueeze(1) - slots.unsqueeze(0) < window)
        return cls(positions, kv_len, masks)


class KVCache:
    """Per-layer key/value storage [kv_heads, n_ctx, head_dim], allocated once."""

    def __init__(self, n_kv_heads: int, head_dim: int, n_ctx: int, device, dtype):
        self.k = torch.zeros(n_kv_heads, n_ctx, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros(n_kv_heads, n_ctx, head_dim, device=device, dtype=dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, step: Step,
           window: int | None, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D]: store k/v at their positions, attend over the cache.
    Grouped-query heads share one KV head each without copying the cache."""
    T, n_q, D = q.shape
    n_kv = k.shape[1]
    cache.k.index_copy_(1, step.positions, k.transpose(0, 1).to(cache.k.dtype))
    cache.v.index_copy_(1, step.positions, v.transpose(0, 1).to(cache.v.dtype))
    keys, values = cache.k[:, :step.kv_len], cache.v[:, :step.kv_len]
    group = n_q // n_kv
    qg = q.view(T, n_kv, group, D).permute(1, 2, 0, 3).reshape(n_kv, group * T, D).to(keys.dtype)
    mask = step.masks[window]
    if group > 1:
        mask = mask.repeat(group, 1)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return out.view(n_kv, group, T, D).permute(2, 0, 1, 3).reshape(T, n_q * D).float()


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
