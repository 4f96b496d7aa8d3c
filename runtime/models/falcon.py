"""Falcon (7B / 40B layout) and ReluFalcon: parallel attention and FFN from the same residual,
fused QKV rows ordered [all q; all k; all v] (llama.cpp's converter reorders them), LayerNorm with
bias, NEOX rotary, FFN without gate (GELU, or ReLU for ReluFalcon and PowerInfer files).
Falcon-40B has a second input norm for the FFN (`attn_norm_2`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gguf_file import GGUFFile
from ..layers import FFN_VARIANTS, FFNWeights, KVCache, Rotary, Step, attend, default_scale, ffn_start, layer_norm, rope_qk
from ..weights import QWeight, linear_add, linear_many
from . import register
from .base import CausalLM, LMConfig, NormWeights, load_ffn


@dataclass(slots=True)
class FalconConfig(LMConfig):
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "FalconConfig":
        default_ffn = "relu_nogate" if g.flavor == "powerinfer" else "gelu_nogate"
        return cls(**cls.read(g, "attention.layer_norm_epsilon", default_ffn))


@dataclass(slots=True)
class FalconLayer:
    attn_norm: NormWeights
    ffn_norm: NormWeights | None  # Falcon-40B's ln_mlp; None: the FFN reads attn_norm's output
    q: QWeight
    k: QWeight
    v: QWeight
    o: QWeight
    ffn: FFNWeights


@register("falcon")
class Falcon(CausalLM):
    Config = FalconConfig

    def load_layer(self, i: int) -> FalconLayer:
        c, w, p = self.config, self.weights, f"blk.{i}."
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        qkv = w.matrix(p + "attn_qkv.weight", q_dim + 2 * kv_dim, c.d_model)
        norm2 = None
        if w.has(p + "attn_norm_2.weight"):
            norm2 = NormWeights(w.vector(p + "attn_norm_2.weight", c.d_model),
                                w.vector(p + "attn_norm_2.bias", c.d_model))
        return FalconLayer(
            attn_norm=NormWeights(w.vector(p + "attn_norm.weight", c.d_model),
                                  w.vector(p + "attn_norm.bias", c.d_model)),
            ffn_norm=norm2,
            q=qkv.rows(0, q_dim), k=qkv.rows(q_dim, q_dim + kv_dim), v=qkv.rows(q_dim + kv_dim, q_dim + 2 * kv_dim),
            o=w.matrix(p + "attn_output.weight", c.d_model, q_dim),
            ffn=load_ffn(w, p, c, gated=False),
        )

    def load_head(self) -> NormWeights:
        d = self.config.d_model
        return NormWeights(self.weights.vector("output_norm.weight", d), self.weights.vector("output_norm.bias", d))

    def make_rotary(self, device):
        c = self.config
        return Rotary(c.rope_dim, c.rope_base, max(c.n_ctx_train, 1), "neox").to(device)

    def block(self, i: int, x: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        c, L = self.config, self.layers[i]
        rope = self.rotary(x.device)
        h = layer_norm(x, L.attn_norm.weight, L.attn_norm.bias, c.norm_eps)
        h_ffn = h if L.ffn_norm is None else layer_norm(x, L.ffn_norm.weight, L.ffn_norm.bias, c.norm_eps)
        # attention and FFN both read x: the FFN first, so that a hybrid layer's CPU part runs while
        # the GPU computes the attention (ffn_start)
        f = ffn_start(h_ffn, L.ffn, FFN_VARIANTS[c.ffn_variant])
        q, k, v = linear_many(h, [L.q, L.k, L.v])  # rows of one attn_qkv buffer: one matmul
        q, k = rope_qk(rope, q.reshape(-1, c.n_heads, c.head_dim), k.reshape(-1, c.n_kv_heads, c.head_dim), step)
        v = v.reshape(-1, c.n_kv_heads, c.head_dim)
        return linear_add(attend(q, k, v, cache, step, None, default_scale(c.head_dim)), L.o, x) + f()

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.head.weight, self.head.bias, self.config.norm_eps)
