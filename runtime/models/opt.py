"""OPT (PowerInfer's `opt` architecture): pre-LayerNorm blocks with biases everywhere, learned
absolute positions, ReLU FFN without gate, queries scaled by head_dim^-0.5, tied output head.

`position_embd` row i is position i; a file that kept Hugging Face's offset of 2 rows says so with
`opt.position_offset`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gguf_file import GGUFFile
from ..layers import FFN_VARIANTS, FFNWeights, KVCache, Step, attend, default_scale, ffn, layer_norm
from ..weights import QWeight, linear
from . import register
from .base import CausalLM, LMConfig, NormWeights, load_ffn


@dataclass(slots=True)
class OPTConfig(LMConfig):
    position_offset: int = 0

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "OPTConfig":
        return cls(**cls.read(g, "attention.layer_norm_epsilon", "relu_nogate",
                              position_offset=g.get("opt.position_offset", 0)))


@dataclass(slots=True)
class OPTLayer:
    attn_norm: NormWeights
    q: QWeight
    k: QWeight
    v: QWeight
    o: QWeight
    q_bias: torch.Tensor
    k_bias: torch.Tensor
    v_bias: torch.Tensor
    o_bias: torch.Tensor
    ffn_norm: NormWeights
    ffn: FFNWeights


@register("opt")
class OPT(CausalLM):
    Config = OPTConfig

    def __init__(self, gguf, config):
        super().__init__(gguf, config)
        n_pos = gguf.tensors["position_embd.weight"].shape[1] if "position_embd.weight" in gguf.tensors else 0
        self.positions = self.weights.matrix("position_embd.weight", n_pos, config.d_model)

    def load_layer(self, i: int) -> OPTLayer:
        c, w, p = self.config, self.weights, f"blk.{i}."
        d = c.d_model

        def norm(name):
            return NormWeights(w.vector(p + name + ".weight", d), w.vector(p + name + ".bias", d))

        return OPTLayer(
            attn_norm=norm("attn_norm"),
            q=w.matrix(p + "attn_q.weight", d, d), k=w.matrix(p + "attn_k.weight", d, d),
            v=w.matrix(p + "attn_v.weight", d, d), o=w.matrix(p + "attn_output.weight", d, d),
            q_bias=w.vector(p + "attn_q.bias", d), k_bias=w.vector(p + "attn_k.bias", d),
            v_bias=w.vector(p + "attn_v.bias", d), o_bias=w.vector(p + "attn_output.bias", d),
            ffn_norm=norm("ffn_norm"),
            ffn=load_ffn(w, p, c, gated=False),
        )

    def load_head(self) -> NormWeights:
        d = self.config.d_model
        return NormWeights(self.weights.vector("output_norm.weight", d), self.weights.vector("output_norm.bias", d))

    def apply_placement(self, p, ffn_builder=None, progress=None):
        super().apply_placement(p, ffn_builder, progress)
        self.positions = self.positions.to(self.placement.embed)

    def embed(self, tokens, positions):
        pos_rows = self.positions.data[positions + self.config.position_offset]
        return super().embed(tokens, positions) + QWeight(pos_rows, self.positions.qtype, 0).dequantize()

    def block(self, i: int, x: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        c, L = self.config, self.layers[i]
        h = layer_norm(x, L.attn_norm.weight, L.attn_norm.bias, c.norm_eps)
        q = linear(h, L.q, L.q_bias).view(-1, c.n_heads, c.head_dim)
        k = linear(h, L.k, L.k_bias).view(-1, c.n_kv_heads, c.head_dim)
        v = linear(h, L.v, L.v_bias).view(-1, c.n_kv_heads, c.head_dim)
        x = x + linear(attend(q, k, v, cache, step, None, default_scale(c.head_dim)), L.o, L.o_bias)
        h = layer_norm(x, L.ffn_norm.weight, L.ffn_norm.bias, c.norm_eps)
        return x + ffn(h, L.ffn, FFN_VARIANTS[c.ffn_variant])

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.head.weight, self.head.bias, self.config.norm_eps)
