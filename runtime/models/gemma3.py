"""Gemma 3 (text): GeGLU FFN, QK-norm, norms before and after both attention and FFN, sliding-window
attention on five layers of six (local rotary base 10000), tied embeddings scaled by sqrt(d_model).

GGUF files store every RMSNorm weight as (1 + w) of the Hugging Face checkpoint, so the weights
multiply directly here, as in llama.cpp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..gguf_file import GGUFFile
from .. import kernels
from ..kernels import Norm
from ..layers import FFN_VARIANTS, FFNWeights, KVCache, Rotary, Step, attend, ffn, ffn_block, rms_norm
from ..weights import QWeight, linear, linear_many
from . import register
from .base import CausalLM, LMConfig, NormWeights, load_ffn

LOCAL_ROPE_BASE = 10000.0


@dataclass(slots=True)
class Gemma3Config(LMConfig):
    sliding_window: int = 512
    sliding_pattern: int = 6
    rope_scale: float = 1.0
    attn_scale: float = 1.0

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Gemma3Config":
        a = g.architecture
        scale = 1.0
        if g.get(f"{a}.rope.scaling.type") == "linear":
            scale = float(g.get(f"{a}.rope.scaling.factor", 1.0))
        fields = cls.read(g, "attention.layer_norm_rms_epsilon", "geglu",
                          sliding_window=g.get(f"{a}.attention.sliding_window", 512),
                          sliding_pattern=g.get(f"{a}.attention.sliding_window_pattern", 6),
                          rope_scale=scale)
        # llama.cpp: the 27B model scales queries by d_model / n_heads, the others by head_dim.
        query_pre_attn = fields["d_model"] // fields["n_heads"] if fields["n_layers"] == 62 else fields["head_dim"]
        fields["attn_scale"] = 1.0 / math.sqrt(query_pre_attn)
        return cls(**fields)

    def is_sliding(self, i: int) -> bool:
        return (i + 1) % self.sliding_pattern != 0


@dataclass(slots=True)
class Gemma3Layer:
    attn_norm: torch.Tensor
    q: QWeight
    k: QWeight
    v: QWeight
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: QWeight
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    ffn: FFNWeights
    post_ffn_norm: torch.Tensor


@register("gemma3")
class Gemma3(CausalLM):
    Config = Gemma3Config

    @property
    def windows(self):
        return (None, self.config.sliding_window)

    def load_layer(self, i: int) -> Gemma3Layer:
        c, w, p = self.config, self.weights, f"blk.{i}."
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        return Gemma3Layer(
            attn_norm=w.vector(p + "attn_norm.weight", c.d_model),
            q=w.matrix(p + "attn_q.weight", q_dim, c.d_model),
            k=w.matrix(p + "attn_k.weight", kv_dim, c.d_model),
            v=w.matrix(p + "attn_v.weight", kv_dim, c.d_model),
            q_norm=w.vector(p + "attn_q_norm.weight", c.head_dim),
            k_norm=w.vector(p + "attn_k_norm.weight", c.head_dim),
            o=w.matrix(p + "attn_output.weight", c.d_model, q_dim),
            post_attn_norm=w.vector(p + "post_attention_norm.weight", c.d_model),
            ffn_norm=w.vector(p + "ffn_norm.weight", c.d_model),
            ffn=load_ffn(w, p, c, gated=True),
            post_ffn_norm=w.vector(p + "post_ffw_norm.weight", c.d_model),
        )

    def load_head(self) -> NormWeights:
        return NormWeights(self.weights.vector("output_norm.weight", self.config.d_model))

    def make_rotary(self, device):
        c, n_ctx = self.config, max(self.config.n_ctx_train, 1)
        return (Rotary(c.head_dim, c.rope_base, n_ctx, "neox", c.rope_scale).to(device),
                Rotary(c.head_dim, LOCAL_ROPE_BASE, n_ctx, "neox").to(device))

    def embed(self, tokens, positions):
        return super().embed(tokens, positions) * math.sqrt(self.config.d_model)

    def block(self, i: int, x: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        c, L = self.config, self.layers[i]
        sliding = c.is_sliding(i)
        rope = self.rotary(x.device)[1 if sliding else 0]
        spec, ffn_norm = FFN_VARIANTS[c.ffn_variant], Norm(L.ffn_norm, c.norm_eps)
        if x.shape[0] == 1 and kernels.cpu_block_ok(x, (L.q, L.k, L.v, L.o), cache):
            # one token on the CPU: the attention half as one compiled call (the same ops as below)
            cos, sin = rope.tables(step)
            x = kernels.cpu.attention_block(x, L.attn_norm, c.norm_eps, [L.q.data, L.k.data, L.v.data],
                                            [int(L.q.qtype), int(L.k.qtype), int(L.v.qtype)], L.o.data,
                                            int(L.o.qtype), c.n_heads, c.n_kv_heads, cos, sin, rope.style == "neox",
                                            cache.k, cache.v, step.positions, step.kv_len, c.attn_scale,
                                            c.sliding_window if sliding else 0, L.q_norm, L.k_norm, L.post_attn_norm)
        else:
            q, k, v = linear_many(x, [L.q, L.k, L.v], Norm(L.attn_norm, c.norm_eps))
            q = rms_norm(q.reshape(-1, c.n_heads, c.head_dim), L.q_norm, c.norm_eps)
            k = rms_norm(k.reshape(-1, c.n_kv_heads, c.head_dim), L.k_norm, c.norm_eps)
            v = v.reshape(-1, c.n_kv_heads, c.head_dim)
            q, k = rope.apply(q, step), rope.apply(k, step)
            a = attend(q, k, v, cache, step, c.sliding_window if sliding else None, c.attn_scale)
            x = x + rms_norm(linear(a, L.o), L.post_attn_norm, c.norm_eps)
        y = ffn_block(x, L.ffn, spec, ffn_norm, L.post_ffn_norm)  # one token on the CPU: one compiled call
        if y is not None:
            return y
        return x + rms_norm(ffn(x, L.ffn, spec, norm=ffn_norm), L.post_ffn_norm, c.norm_eps)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.head.weight, self.config.norm_eps)
