"""The llama family: Llama-2/3, Mistral (SwiGLU), ReluLLaMA / ProSparse (ReLU-gated), TurboSparse and
Bamboo (dReLU), Qwen2 (attention biases, NEOX rotary).

Traps handled: llama.cpp's converter permutes the Q/K rows of `llama` files so that rotary pairs are
adjacent (NORM style; qwen2 keeps NEOX); `rope_freqs` divides the frequencies (Llama 3); no
`output.weight` means the output head is the token embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gguf_file import GGUFFile
from .. import kernels
from ..kernels import Norm
from ..layers import FFN_VARIANTS, FFNWeights, KVCache, Rotary, Step, attend, default_scale, ffn, rms_norm, rope_qk
from ..weights import QWeight, linear_add, linear_many
from . import register
from .base import CausalLM, LMConfig, NormWeights, load_ffn


@dataclass(slots=True)
class LlamaConfig(LMConfig):
    rope_style: str = "norm"
    rope_scale: float = 1.0

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "LlamaConfig":
        arch = g.architecture
        # PowerInfer's llama files are ReluLLaMA / ProSparse; Bamboo is dReLU.
        default_ffn = {"bamboo": "drelu"}.get(arch, "relu" if g.flavor == "powerinfer" else "swiglu")
        scale = 1.0
        if g.get(f"{arch}.rope.scaling.type") == "linear":
            scale = float(g.get(f"{arch}.rope.scaling.factor", 1.0))
        return cls(**cls.read(g, "attention.layer_norm_rms_epsilon", default_ffn,
                              rope_style="neox" if arch == "qwen2" else "norm", rope_scale=scale))


@dataclass(slots=True)
class LlamaLayer:
    attn_norm: torch.Tensor
    q: QWeight
    k: QWeight
    v: QWeight
    o: QWeight
    ffn_norm: torch.Tensor
    ffn: FFNWeights
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None


@register("llama", "bamboo", "qwen2")
class Llama(CausalLM):
    Config = LlamaConfig

    def load_layer(self, i: int) -> LlamaLayer:
        c, w, p = self.config, self.weights, f"blk.{i}."
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        return LlamaLayer(
            attn_norm=w.vector(p + "attn_norm.weight", c.d_model),
            q=w.matrix(p + "attn_q.weight", q_dim, c.d_model),
            k=w.matrix(p + "attn_k.weight", kv_dim, c.d_model),
            v=w.matrix(p + "attn_v.weight", kv_dim, c.d_model),
            o=w.matrix(p + "attn_output.weight", c.d_model, q_dim),
            ffn_norm=w.vector(p + "ffn_norm.weight", c.d_model),
            ffn=load_ffn(w, p, c, gated=FFN_VARIANTS[c.ffn_variant].gated),
            q_bias=w.optional_vector(p + "attn_q.bias", q_dim),
            k_bias=w.optional_vector(p + "attn_k.bias", kv_dim),
            v_bias=w.optional_vector(p + "attn_v.bias", kv_dim),
        )

    def make_rotary(self, device):
        c = self.config
        factors = None
        if self.weights.has("rope_freqs.weight"):
            factors = self.weights.vector("rope_freqs.weight", c.rope_dim // 2)
        return Rotary(c.rope_dim, c.rope_base, max(c.n_ctx_train, 1), c.rope_style, c.rope_scale,
                      factors).to(device)

    def block(self, i: int, x: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        c, L = self.config, self.layers[i]
        rope = self.rotary(x.device)
        if x.shape[0] == 1 and L.q_bias is None and kernels.cpu_block_ok(x, (L.q, L.k, L.v, L.o), cache):
            # one token on the CPU: the attention half as one compiled call (the same ops as below)
            cos, sin = rope.tables(step)
            x = kernels.cpu.attention_block(x, L.attn_norm, c.norm_eps, [L.q.data, L.k.data, L.v.data],
                                            [int(L.q.qtype), int(L.k.qtype), int(L.v.qtype)], L.o.data,
                                            int(L.o.qtype), c.n_heads, c.n_kv_heads, cos, sin,
                                            c.rope_style == "neox", cache.k, cache.v, step.positions,
                                            step.kv_len, default_scale(c.head_dim))
            return ffn(x, L.ffn, FFN_VARIANTS[c.ffn_variant], residual=x, norm=Norm(L.ffn_norm, c.norm_eps))
        q, k, v = linear_many(x, [L.q, L.k, L.v], Norm(L.attn_norm, c.norm_eps))
        if L.q_bias is not None:
            q, k, v = q + L.q_bias, k + L.k_bias, v + L.v_bias
        q = q.reshape(-1, c.n_heads, c.head_dim)
        k = k.reshape(-1, c.n_kv_heads, c.head_dim)
        v = v.reshape(-1, c.n_kv_heads, c.head_dim)
        q, k = rope_qk(rope, q, k, step)
        # the residual adds ride on the projections' GEMVs (linear_add, ffn's residual)
        x = linear_add(attend(q, k, v, cache, step, None, default_scale(c.head_dim)), L.o, x)
        return ffn(x, L.ffn, FFN_VARIANTS[c.ffn_variant], residual=x, norm=Norm(L.ffn_norm, c.norm_eps))

    def load_head(self) -> NormWeights:
        return NormWeights(self.weights.vector("output_norm.weight", self.config.d_model))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.head.weight, self.config.norm_eps)
