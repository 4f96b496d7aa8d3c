"""Hugging Face checkpoints to GGUF with llama.cpp's canonical names and metadata.

Per architecture: a metadata function and a tensor map (HF name -> GGUF name, transform). The
transforms are llama.cpp's: Q/K rows permuted for `llama` (NORM rotary), Gemma norms stored as 1+w,
Falcon's fused QKV reordered to [all q; all k; all v], OPT's 2-row position offset dropped.
Tensors are written one at a time, so a checkpoint never has to be whole in memory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from .errors import ModelError

Transform = Callable[[torch.Tensor], torch.Tensor]


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's permutation: HF's rotate-half order -> adjacent rotary pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _hp(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


# --- per architecture: (GGUF arch, metadata, tensor map) ---------------------------------------

def _llama_meta(cfg) -> dict:
    n_head = cfg.num_attention_heads
    head_dim = _hp(cfg, "head_dim", default=cfg.hidden_size // n_head)
    act = {"silu": "swiglu", "relu": "relu"}.get(cfg.hidden_act)
    if act is None:
        raise ModelError(f"llama: unsupported hidden_act {cfg.hidden_act!r}")
    return {"context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
            "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": n_head,
            "attention.head_count_kv": _hp(cfg, "num_key_value_heads", default=n_head),
            "attention.key_length": head_dim, "attention.value_length": head_dim,
            "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
            "rope.freq_base": float(_rope_theta(cfg)), "rope.dimension_count": head_dim,
            "hybridsparse.ffn_activation": act}


def _rope_theta(cfg, layer_type: str = "full_attention") -> float:
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict):
        if layer_type in params and isinstance(params[layer_type], dict):
            params = params[layer_type]
        if "rope_theta" in params:
            return params["rope_theta"]
    return _hp(cfg, "rope_theta", default=10000.0)


def _llama_tensors(cfg, arch: str) -> list[tuple[str, str, Transform | None]]:
    n_head = cfg.num_attention_heads
    n_kv = _hp(cfg, "num_key_value_heads", default=n_head)
    permute = arch == "llama"
    rules = [
        (r"model\.embed_tokens\.weight", "token_embd.weight", None),
        (r"model\.norm\.weight", "output_norm.weight", None),
        (r"lm_head\.weight", "output.weight", None),
        (r"model\.layers\.(\d+)\.input_layernorm\.weight", "blk.{}.attn_norm.weight", None),
        (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "blk.{}.ffn_norm.weight", None),
        (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "blk.{}.attn_q.weight",
         (lambda w: permute_qk(w, n_head)) if permute else None),
        (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "blk.{}.attn_k.weight",
         (lambda w: permute_qk(w, n_kv)) if permute else None),
        (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", "blk.{}.attn_v.weight", None),
        (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "blk.{}.attn_output.weight", None),
        (r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias", "blk.{}.attn_q.bias", None),
        (r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias", "blk.{}.attn_k.bias", None),
        (r"model\.layers\.(\d+)\.self_attn\.v_proj\.bias", "blk.{}.attn_v.bias", None),
        (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "blk.{}.ffn_gate.weight", None),
        (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "blk.{}.ffn_up.weight", None),
        (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "blk.{}.ffn_down.weight", None),
    ]
    return rules


def _gemma3_meta(cfg) -> dict:
    return {"context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
            "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
            "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
            "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
            "rope.freq_base": float(_rope_theta(cfg)), "attention.sliding_window": cfg.sliding_window}


def _plus_one(w: torch.Tensor) -> torch.Tensor:
    return w + 1.0


def _gemma3_tensors(cfg, arch: str):
    p = r"model\.layers\.(\d+)\."
    return [
        (r"model\.embed_tokens\.weight", "token_embd.weight", None),
        (r"model\.norm\.weight", "output_norm.weight", _plus_one),
        (p + r"input_layernorm\.weight", "blk.{}.attn_norm.weight", _plus_one),
        (p + r"post_attention_layernorm\.weight", "blk.{}.post_attention_norm.weight", _plus_one),
        (p + r"pre_feedforward_layernorm\.weight", "blk.{}.ffn_norm.weight", _plus_one),
        (p + r"post_feedforward_layernorm\.weight", "blk.{}.post_ffw_norm.weight", _plus_one),
        (p + r"self_attn\.q_norm\.weight", "blk.{}.attn_q_norm.weight", _plus_one),
        (p + r"self_attn\.k_norm\.weight", "blk.{}.attn_k_norm.weight", _plus_one),
        (p + r"self_attn\.q_proj\.weight", "blk.{}.attn_q.weight", None),
        (p + r"self_attn\.k_proj\.weight", "blk.{}.attn_k.weight", None),
        (p + r"self_attn\.v_proj\.weight", "blk.{}.attn_v.weight", None),
        (p + r"self_attn\.o_proj\.weight", "blk.{}.attn_output.weight", None),
        (p + r"mlp\.gate_proj\.weight", "blk.{}.ffn_gate.weight", None),
        (p + r"mlp\.up_proj\.weight", "blk.{}.ffn_up.weight", None),
        (p + r"mlp\.down_proj\.weight", "blk.{}.ffn_down.weight", None),
        (r"lm_head\.weight", None, None),  # tied to the embedding
    ]


def _falcon_kv_heads(cfg) -> int:
    if cfg.new_decoder_architecture:
        return cfg.num_kv_heads
    return 1 if cfg.multi_query else cfg.num_attention_heads


def _falcon_meta(cfg) -> dict:
    act = {"relu": "relu_nogate", "gelu": "gelu_nogate"}.get(cfg.activation)
    if act is None:
        raise ModelError(f"falcon: unsupported activation {cfg.activation!r}")
    if cfg.alibi or not cfg.parallel_attn:
        raise ModelError("falcon: only rotary, parallel-attention Falcon models are supported")
    return {"context_length": _hp(cfg, "max_position_embeddings", default=2048),
            "embedding_length": cfg.hidden_size, "block_count": cfg.num_hidden_layers,
            "feed_forward_length": _hp(cfg, "ffn_hidden_size", default=4 * cfg.hidden_size),
            "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": _falcon_kv_heads(cfg),
            "attention.layer_norm_epsilon": float(cfg.layer_norm_epsilon),
            "rope.freq_base": float(_rope_theta(cfg)), "hybridsparse.ffn_activation": act}


def _falcon_tensors(cfg, arch: str):
    n_head, n_kv = cfg.num_attention_heads, _falcon_kv_heads(cfg)
    head_dim = cfg.hidden_size // n_head

    def qkv(w):
        g = w.view(n_kv, n_head // n_kv + 2, head_dim, w.shape[-1])
        q = g[:, :-2].reshape(n_head * head_dim, -1)
        k = g[:, [-2]].reshape(n_kv * head_dim, -1)
        v = g[:, [-1]].reshape(n_kv * head_dim, -1)
        return torch.cat([q, k, v])

    p = r"transformer\.h\.(\d+)\."
    two_norms = cfg.new_decoder_architecture
    return [
        (r"transformer\.word_embeddings\.weight", "token_embd.weight", None),
        (r"transformer\.ln_f\.weight", "output_norm.weight", None),
        (r"transformer\.ln_f\.bias", "output_norm.bias", None),
        (r"lm_head\.weight", "output.weight", None),
        (p + (r"ln_attn\.weight" if two_norms else r"input_layernorm\.weight"), "blk.{}.attn_norm.weight", None),
        (p + (r"ln_attn\.bias" if two_norms else r"input_layernorm\.bias"), "blk.{}.attn_norm.bias", None),
        (p + r"ln_mlp\.weight", "blk.{}.attn_norm_2.weight", None),
        (p + r"ln_mlp\.bias", "blk.{}.attn_norm_2.bias", None),
        (p + r"self_attention\.query_key_value\.weight", "blk.{}.attn_qkv.weight", qkv),
        (p + r"self_attention\.dense\.weight", "blk.{}.attn_output.weight", None),
        (p + r"mlp\.dense_h_to_4h\.weight", "blk.{}.ffn_up.weight", None),
        (p + r"mlp\.dense_4h_to_h\.weight", "blk.{}.ffn_down.weight", None),
    ]


def _opt_meta(cfg) -> dict:
    if not cfg.do_layer_norm_before or cfg.word_embed_proj_dim != cfg.hidden_size:
        raise ModelError("opt: only pre-LayerNorm OPT models without an embedding projection are supported")
    if cfg.activation_function != "relu":
        raise ModelError(f"opt: unsupported activation {cfg.activation_function!r}")
    return {"context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
            "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.ffn_dim,
            "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_attention_heads,
            "attention.layer_norm_epsilon": 1e-5}


def _opt_tensors(cfg, arch: str):
    p = r"model\.decoder\.layers\.(\d+)\."
    rules = [
        (r"model\.decoder\.embed_tokens\.weight", "token_embd.weight", None),
        (r"model\.decoder\.embed_positions\.weight", "position_embd.weight", lambda w: w[2:]),
        (r"model\.decoder\.final_layer_norm\.weight", "output_norm.weight", None),
        (r"model\.decoder\.final_layer_norm\.bias", "output_norm.bias", None),
        (r"lm_head\.weight", None, None),  # tied
    ]
    for hf, gg in [("self_attn_layer_norm", "attn_norm"), ("self_attn.q_proj", "attn_q"),
                   ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                   ("self_attn.out_proj", "attn_output"), ("final_layer_norm", "ffn_norm"),
                   ("fc1", "ffn_up"), ("fc2", "ffn_down")]:
        for kind in ("weight", "bias"):
            rules.append((p + re.escape(f"{hf}.{kind}"), f"blk.{{}}.{gg}.{kind}", None))
    return rules


ARCHS = {  # HF model_type -> (GGUF arch, metadata, tensor rules)
    "llama": ("llama", _llama_meta, _llama_tensors),
    "mistral": ("llama", _llama_meta, _llama_tensors),
    "qwen2": ("qwen2", _llama_meta, _llama_tensors),
    "gemma3_text": ("gemma3", _gemma3_meta, _gemma3_tensors),
    "falcon": ("falcon", _falcon_meta, _falcon_tensors),
    "opt": ("opt", _opt_meta, _opt_tensors),
}


def gguf_tensors(cfg, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename and transform HF tensors into GGUF ones, lazily."""
    model_type = cfg.model_type
    if model_type not in ARCHS:
        raise ModelError(f"unknown architecture {model_type!r} (supported: {', '.join(sorted(ARCHS))})")
    arch, _, rules_fn = ARCHS[model_type]
    rules = [(re.compile(pat + "$"), name, fn) for pat, name, fn in rules_fn(cfg, arch)]
    for hf_name, tensor in tensors:
        for pat, name, fn in rules:
            m = pat.match(hf_name)
            if m:
                if name is not None:
                    yield name.format(*m.groups()), (fn(tensor) if fn else tensor)
                break
        else:
            raise ModelError(f"{model_type}: no GGUF name for tensor {hf_name}")


def write_gguf(path: str | os.PathLike, cfg, tensors: Iterable[tuple[str, torch.Tensor]],
               dtype: str = "f32", extra_metadata: dict | None = None, powerinfer: bool = False) -> Path:
    """Write a GGUF file (atomically: to a temporary name, renamed at the end)."""
    arch, meta_fn, _ = ARCHS[cfg.model_type]
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, value in {**meta_fn(cfg), **(extra_metadata or {})}.items():
        full = key if key.startswith(("hybridsparse.", "powerinfer.", "general.", "tokenizer.")) else f"{arch}.{key}"
        add_metadata(writer, full, value)
    np_dtype = {"f32": np.float32, "f16": np.float16}[dtype]
    for name, t in gguf_tensors(cfg, tensors):
        arr = t.detach().float().cpu().numpy()
        keep_f32 = arr.ndim == 1 or dtype == "f32"
        writer.add_tensor(name, arr.astype(np.float32 if keep_f32 else np_dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if powerinfer:
        with open(tmp, "r+b") as fh:
            fh.write(b"PWRI")
    os.replace(tmp, path)
    return path


def byte_level_vocab(n_vocab: int = 259) -> dict:
    """Tokenizer metadata for synthetic and test models: a GPT-2 style byte-level BPE with <s>, </s>,
    the 256 byte symbols, one merge, and filler tokens up to n_vocab."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    tokens = ["<s>", "</s>"] + list(bytes_to_unicode().values()) + ["Ġt"]
    if n_vocab < len(tokens):
        raise ValueError(f"a byte-level vocabulary needs at least {len(tokens)} tokens, asked for {n_vocab}")
    tokens += [f"<filler_{i}>" for i in range(n_vocab - len(tokens))]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2), "tokenizer.ggml.merges": ["Ġ t"],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.add_bos_token": True}


def add_metadata(writer: gguf.GGUFWriter, key: str, value) -> None:
    """One metadata entry, its GGUF type chosen from the Python value (ints as u32)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"metadata {key}: cannot write {type(value).__name__}")
