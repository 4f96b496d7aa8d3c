"""Layers every architecture shares: norms, rotary embeddings, attention over the KV cache, the FFN.

Activations are float32 [tokens, features]; weights are `QWeight`s applied through `kernels.linear`.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import kernels
from .weights import QWeight, linear, linear_add, linear_many, linear_t, spanning


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return kernels.rms_norm(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return kernels.layer_norm(x, weight, bias, eps)


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


def gated_act_reference(gate: torch.Tensor, up: torch.Tensor, spec: FFNSpec) -> torch.Tensor:
    act = ACTIVATIONS[spec.activation]
    return act(gate) * (act(up) if spec.act_on_up else up)


def gated_act(gate: torch.Tensor, up: torch.Tensor, spec: FFNSpec) -> torch.Tensor:
    """act(gate) * up (or * act(up)): the compiled op of the tensors' device where there is one."""
    if kernels.use_cpu_op(gate):
        return kernels.cpu.gated_act(gate, up, kernels.ACTIVATION_IDS[spec.activation], spec.act_on_up)
    if kernels.use_cuda_op(gate, up) and gate.dim() == 2 and gate.stride(1) == 1 and up.stride(1) == 1:
        return kernels.ops().gated_act(gate, up, kernels.ACTIVATION_IDS[spec.activation], spec.act_on_up)
    return gated_act_reference(gate, up, spec)


# Set by the profiler: called as probe(weights, x, score, h) for every FFN evaluation, where `score`
# is what the activity criterion looks at (act(gate), or act(up) without a gate) and h the values
# the down projection weighs.
FFN_PROBE = None


def ffn(x: torch.Tensor, w: FFNWeights, spec: FFNSpec, residual: torch.Tensor | None = None,
        norm: kernels.Norm | None = None) -> torch.Tensor:
    """The FFN of x (of norm(x) where `norm` is given: on CUDA folded into the gate/up GEMV), plus
    `residual` where given: added by the down projection's GEMV where it can (kernels.matmul_add: one
    kernel, not two, in a CUDA decode step), else afterwards."""
    if residual is not None:
        if residual is x and norm is not None:
            y = ffn_block(x, w, spec, norm)  # one token on the CPU: one compiled call
            if y is not None:
                return y
        if isinstance(w, FFNWeights) and not w.down_transposed and w.down_bias is None:
            return linear_add(_ffn_hidden(x, w, spec, norm), w.down, residual)
        return residual + ffn(x, w, spec, norm=norm)
    if not isinstance(w, FFNWeights):  # the hybrid runtime's split FFN (runtime/hybrid.py)
        return w(x if norm is None else norm(x))
    h = _ffn_hidden(x, w, spec, norm)
    if w.down_transposed:
        y = linear_t(h, w.down)
        return y + w.down_bias if w.down_bias is not None else y
    return linear(h, w.down, w.down_bias)


def ffn_block(x: torch.Tensor, w: FFNWeights, spec: FFNSpec, norm: kernels.Norm,
              post_norm: torch.Tensor | None = None) -> torch.Tensor | None:
    """x + [rms_norm(., post_norm)](FFN of norm(x)) for one token on the CPU as one compiled call
    (`kernels.cpu.ffn_block`: the norm, gate/up GEMV, activation and down projection the calls below make,
    in their order; a hybrid layer's `token_block` for its CPU-only form); None where neither applies."""
    if x.shape[0] != 1 or not kernels.cpu_block_ok(x, ()) or norm.layer or norm.weight.is_cuda \
            or norm.weight.dtype != torch.float32:
        return None
    if not isinstance(w, FFNWeights):
        token_block = getattr(w, "token_block", None)  # the hybrid runtime's split FFN
        return token_block(x, norm) if token_block is not None and post_norm is None else None
    if not (spec.gated and FFN_PROBE is None and w.up_bias is None and w.down_bias is None
            and kernels.cpu_block_ok(x, (w.gate, w.up))
            and (w.down.qtype in kernels.CPU_AXPY_QTYPES if w.down_transposed else kernels.cpu_block_ok(x, (w.down,)))):
        return None
    return kernels.cpu.ffn_block(x, norm.weight, norm.eps, [w.gate.data, w.up.data], [int(w.gate.qtype), int(w.up.qtype)],
                                 w.down.data, int(w.down.qtype), w.down_transposed,
                                 kernels.ACTIVATION_IDS[spec.activation], spec.act_on_up, post_norm)


def _ffn_hidden(x: torch.Tensor, w: FFNWeights, spec: FFNSpec, norm: kernels.Norm | None = None) -> torch.Tensor:
    """act(gate . x) * (up . x), or act(up . x), of norm(x) where `norm` is given: what the down
    projection reads. On CUDA with decode-sized x the norm, both GEMVs and the activation are one kernel
    when gate and up are rows of one buffer (`kernels.matmul_fused`)."""
    probe = FFN_PROBE
    if spec.gated and probe is None and w.up_bias is None and x.is_cuda:
        span = spanning([w.gate, w.up])
        if span is not None and kernels.fused_ok(x, span.data, span.qtype, norm):
            return kernels.matmul_fused(x, span.data, span.qtype, norm, spec.activation, spec.act_on_up)
    if norm is not None:
        x = norm(x)
    if spec.gated:
        gate, up = linear_many(x, [w.gate, w.up])
        if w.up_bias is not None:
            up = up + w.up_bias
        if probe is not None:  # the profiler needs act(gate) on its own
            act = ACTIVATIONS[spec.activation]
            score = act(gate)
            h = score * (act(up) if spec.act_on_up else up)
        else:
            h = gated_act(gate, up, spec)
    else:
        h = score = ACTIVATIONS[spec.activation](linear(x, w.up, w.up_bias))
    if probe is not None:
        probe(w, x, score, h)
    return h


# Falcon's parallel attention: a hybrid layer's CPU part overlaps the GPU's attention (ffn_start);
# HS_FFN_OVERLAP=0 joins it before the attention is queued (side-by-side measurements).
FFN_OVERLAP = os.environ.get("HS_FFN_OVERLAP", "1") != "0"


def ffn_start(x: torch.Tensor, w: FFNWeights, spec: FFNSpec):
    """The FFN of x as a function giving its output, for blocks whose attention reads the same input
    (Falcon's parallel attention): a hybrid layer decoding on CUDA queues its CPU part now and joins it
    when the function is called, so the GPU computes the attention while the CPU computes the cold
    neurons; everything else is computed now."""
    start = getattr(w, "start", None)
    if start is not None and FFN_OVERLAP:
        return start(x)
    y = ffn(x, w, spec)
    return lambda: y


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

    def tables(self, step: "Step") -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, dim / 2] at the step's positions: gathered once per step, shared by every layer."""
        key = id(self)
        if key not in step.rope:
            step.rope[key] = (self.cos[step.positions], self.sin[step.positions])
        return step.rope[key]

    def apply(self, x: torch.Tensor, step: "Step") -> torch.Tensor:
        """x [T, heads, head_dim] at the step's positions; only the first `dim` features rotate."""
        cos, sin = self.tables(step)
        if kernels.use_cpu_op(x) and x.is_contiguous():
            kernels.cpu.rope_(x, cos, sin, self.style == "neox")
            return x
        if kernels.use_cuda_op(x, cos) and x.dim() == 3 and x.stride(-1) == 1:
            kernels.ops().rope_(x, cos, sin, self.style == "neox")
            return x
        return self.apply_reference(x, cos.unsqueeze(1), sin.unsqueeze(1))

    def apply_reference(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :self.dim], x[..., self.dim:]
        if self.style == "neox":
            a, b = rot.chunk(2, dim=-1)
            out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
        else:
            pairs = rot.unflatten(-1, (-1, 2))
            a, b = pairs[..., 0], pairs[..., 1]
            out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def rope_qk(rope: Rotary, q: torch.Tensor, k: torch.Tensor, step: "Step") -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hk, D] rotated at the step's positions: one kernel for both when k's heads
    follow q's in one buffer, as in the fused q/k/v projection's output (a decode step's launches: one
    fewer a layer)."""
    T, hq, d = q.shape
    adjacent = (k.shape[0] == T and k.shape[2] == d and q.dtype == k.dtype and q.stride()[1:] == (d, 1)
                and k.stride()[1:] == (d, 1) and (T == 1 or k.stride(0) == q.stride(0))
                and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
                and k.data_ptr() == q.data_ptr() + hq * d * q.element_size())
    if not adjacent:
        return rope.apply(q, step), rope.apply(k, step)
    qk = q.as_strided((T, hq + k.shape[1], d), q.stride())
    out = rope.apply(qk, step)
    return (q, k) if out is qk else (out[:, :hq], out[:, hq:])


# --- attention -----------------------------------------------------------------------------------

@dataclass(slots=True)
class Step:
    """What one forward call needs on one device: positions of the new tokens, how many cache slots
    to attend over; additive attention masks and rotary tables are built once here and shared by
    every layer of the step."""
    positions: torch.Tensor  # int64 [T]
    kv_len: int
    masks: dict = field(default_factory=dict)  # (window, group) -> float [group*T, kv_len]
    rope: dict = field(default_factory=dict)  # id(Rotary) -> (cos, sin)
    seqs: list | None = None  # batched sequences: (first token, end, the sequence's own Step)

    @classmethod
    def build(cls, positions: torch.Tensor, kv_len: int, windows=()) -> "Step":
        return cls(positions, kv_len)

    @classmethod
    def batch(cls, positions: torch.Tensor, bounds: list[tuple[int, int]], kv_lens: list[int]) -> "Step":
        """Tokens of several sequences in one pass: linear layers see them all, attention runs per
        sequence over its own cache (`attend` with a list of caches)."""
        return cls(positions, max(kv_lens), seqs=[(a, b, cls(positions[a:b], n)) for (a, b), n in zip(bounds, kv_lens)])

    def mask(self, window: int | None, group: int) -> torch.Tensor:
        key = (window, group)
        if key not in self.masks:
            slots = torch.arange(self.kv_len, device=self.positions.device)
            allowed = slots.unsqueeze(0) <= self.positions.unsqueeze(1)
            if window is not None:
                allowed &= self.positions.unsqueeze(1) - slots.unsqueeze(0) < window
            bias = torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))
            self.masks[key] = bias.repeat(group, 1) if group > 1 else bias
        return self.masks[key]


class KVCache:
    """Per-layer key/value storage [kv_heads, n_ctx, head_dim], allocated once, zero-filled."""

    def __init__(self, n_kv_heads: int, head_dim: int, n_ctx: int, device, dtype):
        shape = (n_kv_heads, n_ctx, head_dim)
        self.k, self.v = lazy_zeros(shape, device, dtype), lazy_zeros(shape, device, dtype)


def lazy_zeros(shape: tuple[int, ...], device, dtype) -> torch.Tensor:
    """torch.zeros, but in host memory an anonymous mapping whose pages stay the kernel's zero page
    until written: a 7B model's float32 cache at -c 4096 (4.3 GB, [heads, n_ctx, head_dim]) no
    longer costs seconds of memset at start, and RAM grows with the positions used, 4 KiB pages a
    head at a time (numpy's calloc would ask for huge pages, and one position per head then commits
    2 MiB of each head's slice)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, n), dtype=dtype).view(shape)  # the tensor keeps the mapping


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, step: Step,
           window: int | None, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D]: store k/v at their positions, attend over the cache.
    Grouped-query heads share one KV head each without copying the cache. With a list of caches
    (a batch of sequences, `Step.batch`), each sequence's tokens attend over their own cache."""
    if isinstance(cache, list):
        return torch.cat([attend(q[a:b], k[a:b], v[a:b], c, sub, window, scale)
                          for (a, b, sub), c in zip(step.seqs, cache)])
    if kernels.use_cpu_op(q) and cache.k.dtype in (torch.float32, torch.float16):
        # decode and prompts alike (CPU_ATTENTION below)
        return kernels.cpu.attention(q, k, v, cache.k, cache.v, step.positions, step.kv_len, window or 0, scale)
    if q.shape[0] <= CUDA_ATTENTION_MAX_TOKENS and kernels.use_cuda_op(q, k, v) \
            and cache.k.dtype in (torch.float16, torch.float32) and q.shape[2] <= 256 \
            and 1 <= step.kv_len <= CUDA_ATTENTION_MAX_KV \
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and step.positions.is_cuda:
        # decode: one kernel stores k/v, one attends (prefill keeps SDPA's tiled kernels)
        return kernels.ops().attention(q, k, v, cache.k, cache.v, step.positions, step.kv_len, window or 0, scale)
    return attend_reference(q, k, v, cache, step, window, scale)


CUDA_ATTENTION_MAX_TOKENS = 8
# CPU_ATTENTION: the compiled op takes prompts too. Since session 19 it reads each cache row once per
# pass of up to 8 query vectors (a prompt's tokens times a group's heads) and skips the causally
# masked rows, and so beat torch's batched GEMMs (attend_reference), which it used to lose to from 16
# tokens: dev VM, 2 threads, float16 cache, per layer, `hs-bench attention -t 2 --tokens 512 --positions
# 1`: Llama-2-7B's heads 28.8 ms against 75.7, Llama-3-8B's 21.7 against 73.5, Gemma 3 270M's 5.9
# against 12.0.
CUDA_ATTENTION_MAX_KV = 8192  # csrc/cuda_layers.cu: ATT_MAX_KV (scores in shared memory)


def attend_reference(q, k, v, cache: KVCache, step: Step, window: int | None, scale: float) -> torch.Tensor:
    T, n_q, D = q.shape
    n_kv = k.shape[1]
    cache.k.index_copy_(1, step.positions, k.transpose(0, 1).to(cache.k.dtype))
    cache.v.index_copy_(1, step.positions, v.transpose(0, 1).to(cache.v.dtype))
    keys, values = cache.k[:, :step.kv_len], cache.v[:, :step.kv_len]
    group = n_q // n_kv
    qg = q.view(T, n_kv, group, D).permute(1, 2, 0, 3).reshape(n_kv, group * T, D)
    if keys.dtype != torch.float32 and not keys.is_cuda:  # a half-precision host cache: float32 arithmetic
        keys, values = keys.float(), values.float()
    if keys.dtype != torch.float32:  # CUDA: half-precision cache
        out = F.scaled_dot_product_attention(qg.to(keys.dtype), keys, values,
                                             attn_mask=step.mask(window, group).to(keys.dtype), scale=scale)
    else:  # three ops instead of SDPA's many: what a decode step on the CPU spends its time on
        scores = torch.baddbmm(step.mask(window, group), qg, keys.transpose(1, 2), alpha=scale)
        out = torch.bmm(torch.softmax(scores, dim=-1), values)
    return out.view(n_kv, group, T, D).permute(2, 0, 1, 3).reshape(T, n_q * D).float()


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
