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

import torch

from gguf import GGMLQuantizationType as Q

from .errors import ModelError
from .gguf_writer import add_metadata, as_written

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
            "rope.freq_base": float(_rope_theta(cfg)), "attention.sliding_window": cfg.sliding_window,
            **_sliding_pattern(cfg)}


def _sliding_pattern(cfg) -> dict:
    """Gemma 3's interleaving (every n-th layer global) from HF's layer_types, as the period n."""
    kinds = getattr(cfg, "layer_types", None)
    if not kinds or "full_attention" not in kinds:
        return {}
    n = kinds.index("full_attention") + 1
    if any((i % n == n - 1) != (k == "full_attention") for i, k in enumerate(kinds)):
        raise ModelError(f"gemma3: config.json layer_types {kinds} is not a sliding/global pattern with one period")
    return {"attention.sliding_window_pattern": n}


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


def _rules(cfg) -> tuple[str, list]:
    model_type = getattr(cfg, "model_type", None)
    if model_type not in ARCHS:
        raise ModelError(f"config.json: model_type {model_type!r} is not supported (supported: {', '.join(sorted(ARCHS))})")
    arch, _, rules_fn = ARCHS[model_type]
    return arch, [(re.compile(pat + "$"), name, fn) for pat, name, fn in rules_fn(cfg, arch)]


_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|\.attn\.masked_bias|\.attn\.bias)$")  # buffers, not weights
_DOWN = re.compile(r"blk\.(\d+)\.ffn_down\.(weight|bias)$")


def _map_name(cfg, rules, hf_name: str, powerinfer: bool) -> tuple[str, Transform | None] | None:
    """HF tensor name -> (GGUF name, transform), None for tensors GGUF does not keep."""
    for pat, name, fn in rules:
        m = pat.match(hf_name)
        if m:
            if name is None:
                return None
            name = name.format(*m.groups())
            d = _DOWN.match(name)
            if powerinfer and d:  # PowerInfer stores W_down transposed: row i = neuron i's output
                name = f"blk.{d.group(1)}.ffn_down_t.{d.group(2)}"
                if d.group(2) == "weight":
                    fn = (lambda w, f=fn: (f(w) if f else w).T.contiguous())
            return name, fn
    if _IGNORED.match(hf_name):
        return None
    raise ModelError(f"{cfg.model_type}: no GGUF name for tensor {hf_name}")


def gguf_tensors(cfg, tensors: Iterable[tuple[str, torch.Tensor]], powerinfer: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename and transform HF tensors into GGUF ones, lazily."""
    _, rules = _rules(cfg)
    for hf_name, tensor in tensors:
        mapped = _map_name(cfg, rules, hf_name, powerinfer)
        if mapped is not None:
            name, fn = mapped
            yield name, (fn(tensor) if fn else tensor)


def _metadata_fn(cfg, arch: str, extra: dict):
    _, meta_fn, _ = ARCHS[cfg.model_type]

    def add(writer):
        for key, value in {**meta_fn(cfg), **extra}.items():
            full = key if key.startswith(("hybridsparse.", "powerinfer.", "general.", "tokenizer.")) else f"{arch}.{key}"
            if key == "powerinfer.sparse_threshold":
                writer.add_float32(full, float(value))
            else:
                add_metadata(writer, full, value)
    return add


def write_gguf(path: str | os.PathLike, cfg, tensors: Iterable[tuple[str, torch.Tensor]],
               dtype: str = "f32", extra_metadata: dict | None = None, powerinfer: bool = False) -> Path:
    """Write in-memory tensors (a state dict: tests, synthetic models) as GGUF, atomically. `dtype`
    f32/f16 for the 2-D weights; 1-D tensors stay F32. `powerinfer`: PowerInfer's layout (PWRI magic,
    ffn_down_t)."""
    from .gguf_writer import PlannedTensor, write_gguf_stream
    arch, _ = _rules(cfg)
    weight_type = {"f32": Q.F32, "f16": Q.F16}[dtype]
    plan = []
    for name, t in gguf_tensors(cfg, tensors, powerinfer=powerinfer):
        arr = t.detach().float().cpu().numpy()
        qt = Q.F32 if arr.ndim == 1 else weight_type
        plan.append(PlannedTensor(name, arr.shape, qt, (lambda a=arr, q=qt: as_written(a, q))))
    return write_gguf_stream(path, arch, _metadata_fn(cfg, arch, extra_metadata or {}), plan,
                             powerinfer=powerinfer, desc=False)


def byte_level_vocab(n_vocab: int = 259, pair_merges: bool = False) -> dict:
    """Tokenizer metadata for synthetic and test models: a GPT-2 style byte-level BPE with <s>, </s>,
    the 256 byte symbols, one merge, and filler tokens up to n_vocab. With `pair_merges`, as many
    merges of two lower-case letters or digits as fit come before the fillers, so text tokenizes into
    ~1300 distinct tokens (synthetic models: many distinct inputs, as real vocabularies give)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    tokens = ["<s>", "</s>"] + list(bytes_to_unicode().values()) + ["Ġt"]
    if n_vocab < len(tokens):
        raise ValueError(f"a byte-level vocabulary needs at least {len(tokens)} tokens, asked for {n_vocab}")
    merges = ["Ġ t"]
    if pair_merges:
        chars = "abcdefghijklmnopqrstuvwxyz0123456789"
        pairs = [(a, b) for a in "Ġ" + chars for b in chars if (a, b) != ("Ġ", "t")][: n_vocab - len(tokens)]
        tokens += [a + b for a, b in pairs]
        merges += [f"{a} {b}" for a, b in pairs]
    tokens += [f"<filler_{i}>" for i in range(n_vocab - len(tokens))]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2), "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.add_bos_token": True}


# --- hs-convert: a Hugging Face folder to GGUF, streamed ----------------------------------------

OUTTYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}


class Checkpoint:
    """The tensors of a Hugging Face folder by name, read one at a time: safetensors (one file or
    shards listed in model.safetensors.index.json), else pytorch_model*.bin loaded with
    weights_only=True and memory-mapped (no pickle code runs)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._open: dict[Path, object] = {}
        files = self._listed("model.safetensors.index.json") or sorted(folder.glob("*.safetensors"))
        if files:
            for f in files:
                h = self._handle(f)
                for name in h.keys():
                    self.where[name] = f
                    self.shapes[name] = tuple(h.get_slice(name).get_shape())
        else:
            files = self._listed("pytorch_model.bin.index.json") or sorted(folder.glob("pytorch_model*.bin"))
            if not files:
                raise ModelError(f"{folder}: no weights (expected *.safetensors or pytorch_model*.bin)")
            for f in files:
                for name, t in self._handle(f).items():
                    self.where[name] = f
                    self.shapes[name] = tuple(t.shape)
        if self._index is not None:
            for name, fname in self._index.items():
                if self.where.get(name) != folder / fname:
                    raise ModelError(f"{folder / fname}: tensor {name} listed in the index is not in this shard")

    def _listed(self, index_name: str) -> list[Path]:
        self._index = None
        path = self.folder / index_name
        if not path.is_file():
            return []
        import json
        try:
            self._index = json.loads(path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ModelError(f"{path}: not a shard index (weight_map expected: {e})") from None
        files = sorted({self.folder / f for f in self._index.values()})
        for f in files:
            if not f.is_file():
                raise ModelError(f"{f}: shard listed in {index_name} is missing")
        return files

    def _handle(self, f: Path):
        if f not in self._open:
            try:
                if f.suffix == ".safetensors":
                    from safetensors import safe_open
                    self._open[f] = safe_open(str(f), framework="pt")
                else:
                    self._open[f] = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # truncated or not the format its name says
                raise ModelError(f"{f}: not a readable checkpoint file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        return self._open[f]

    def load(self, name: str) -> torch.Tensor:
        f = self.where[name]
        h = self._handle(f)
        try:
            return h.get_tensor(name) if f.suffix == ".safetensors" else h[name]
        except Exception as e:
            raise ModelError(f"{f}: tensor {name} cannot be read ({e})") from None


def load_hf_config(folder: Path, model_type: str | None = None, activation: str | None = None):
    """config.json through transformers. `model_type` reads a custom-code config (Bamboo, TurboSparse,
    ProSparse ship their own classes) as one of the supported families; `activation` sets the FFN
    activation the checkpoint's code applies (relu, drelu = ReLU on gate and up, swiglu)."""
    import json

    import transformers as tf
    path = folder / "config.json"
    if not path.is_file():
        raise ModelError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    try:
        raw = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: not a JSON object")
    hint = " (a custom-code model of a supported family: pass --model-type llama and --ffn-activation)"
    if model_type is not None and model_type not in ARCHS:
        raise ModelError(f"--model-type {model_type}: expected one of {', '.join(sorted(ARCHS))}")
    if activation is not None:
        if activation not in ACTIVATIONS:
            raise ModelError(f"--ffn-activation {activation}: expected one of {', '.join(ACTIVATIONS)}")
        key = "activation" if (model_type or raw.get("model_type")) == "falcon" else "hidden_act"
        raw[key] = ACTIVATIONS[activation]
    try:
        if model_type is not None:
            fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "architectures")}
            cfg = tf.AutoConfig.for_model(model_type, **fields)
        else:
            cfg = tf.AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"}) \
                if "model_type" in raw else tf.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise ModelError(f"{path}: model_type {raw.get('model_type')!r} cannot be read "
                         f"(supported: {', '.join(sorted(ARCHS))}){hint}: {str(e).splitlines()[0]}") from None
    if cfg.model_type not in ARCHS:
        raise ModelError(f"{path}: model_type {cfg.model_type!r} is not supported "
                         f"(supported: {', '.join(sorted(ARCHS))}){hint}")
    return cfg


ACTIVATIONS = {"relu": "relu", "drelu": "relu", "swiglu": "silu", "gelu": "gelu"}  # --ffn-activation -> HF hidden_act


def _expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The state dict transformers builds from this config (on the meta device: no memory)."""
    import transformers as tf
    try:
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(cfg)
    except (KeyError, ValueError, TypeError) as e:  # e.g. an activation only the checkpoint's own code knows
        raise ModelError(f"config.json: transformers cannot build a {cfg.model_type} model from it ({type(e).__name__}: "
                         f"{e}); for an activation of the checkpoint's own code pass --ffn-activation") from None
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def convert_hf(src: str | Path, out: str | Path | None = None, outtype: str = "f16", *, powerinfer: bool = False,
               predictors: str | Path | None = None, activation: str | Path | None = None, threads: int = 1,
               pure: bool = False, model_type: str | None = None, ffn_activation: str | None = None,
               log=print) -> Path:
    """A Hugging Face folder (config.json + safetensors/bin + tokenizer files) to one GGUF file:
    llama.cpp's names and metadata, or PowerInfer's layout; optionally PowerInfer predictors and
    activation counts. Streamed tensor by tensor; written atomically."""
    from .gguf_writer import PlannedTensor, write_gguf_stream
    from .hf_vocab import tokenizer_metadata
    from .quantize import FILE_TYPE, quantize_rows, tensor_type
    src = Path(src)
    if not src.is_dir():
        raise ModelError(f"{src}: not a folder (expected a Hugging Face model folder)")
    if outtype.lower() not in OUTTYPES:
        raise ModelError(f"--outtype {outtype}: expected one of {', '.join(OUTTYPES)}")
    qt = OUTTYPES[outtype.lower()]
    out = Path(out) if out else src / f"{src.name}-{outtype.upper()}.gguf"
    cfg = load_hf_config(src, model_type, ffn_activation)
    arch, rules = _rules(cfg)
    ckpt = Checkpoint(src)
    expected = _expected_shapes(cfg)
    names = {}
    for name in ckpt.shapes:
        key = name if name in expected or f"model.{name}" not in expected else f"model.{name}"
        names[key] = name
        if key in expected and ckpt.shapes[name] != expected[key]:
            raise ModelError(f"{ckpt.where[name]}: tensor {name} has shape {list(ckpt.shapes[name])}, "
                             f"config.json implies {list(expected[key])}")
    tied = getattr(cfg, "tie_word_embeddings", False)
    missing = [k for k in expected if k not in names and not (tied and k == "lm_head.weight")]
    if missing:
        raise ModelError(f"{src}: {len(missing)} tensors missing from the checkpoint (first: {missing[0]}); "
                         f"a shard may be absent or of another model")

    weight_float = {Q.F32: Q.F32, Q.BF16: Q.BF16}.get(qt, Q.F16)
    plan: list[PlannedTensor] = []
    mapped = []
    for key, name in names.items():
        m = _map_name(cfg, rules, key, powerinfer)
        if m is not None:
            mapped.append((m[0], m[1], name))
    has_output = any(g == "output.weight" for g, _, _ in mapped)
    for gname, fn, name in mapped:
        shape = tuple(fn(torch.empty(ckpt.shapes[name], device="meta")).shape) if fn else ckpt.shapes[name]
        out_q = tensor_type(gname, shape, weight_float, qt, has_output=has_output, pure=pure)

        def produce(name=name, fn=fn, out_q=out_q):
            t = ckpt.load(name)
            t = fn(t) if fn else t
            return quantize_rows(t.float().numpy(), out_q, threads)
        plan.append(PlannedTensor(gname, shape, out_q, produce))

    extra = {"general.name": src.name, "general.file_type": FILE_TYPE[qt]}
    if ffn_activation == "drelu":  # the checkpoint's own code applies ReLU to gate and up (Bamboo, TurboSparse)
        extra["hybridsparse.ffn_activation"] = "drelu"
    if qt not in (Q.F32, Q.F16, Q.BF16):
        extra["general.quantization_version"] = 2
    extra.update(tokenizer_metadata(src, getattr(cfg, "vocab_size", None)))
    n_layers, n_ff, d_model = cfg.num_hidden_layers, _ffn_width(cfg), cfg.hidden_size
    if predictors is not None:
        plan += _predictor_tensors(Path(predictors), n_layers, n_ff, d_model, weight_float, extra)
    if activation is not None:
        _check_activation(Path(activation), n_layers, n_ff)
    write_gguf_stream(out, arch, _metadata_fn(cfg, arch, extra), plan, powerinfer=powerinfer,
                      desc=f"converting to {qt.name}")
    if activation is not None:
        _copy_activation(Path(activation), out.with_name(out.stem + ".hs-profile"))
    log(f"hs-convert: {out} ({arch}, {'PowerInfer' if powerinfer else 'llama.cpp'} layout, {qt.name}, "
        f"{len(plan)} tensors, {out.stat().st_size / 2**20:.1f} MiB)")
    return out


def _ffn_width(cfg) -> int:
    return int(_hp(cfg, "intermediate_size", "ffn_dim", "ffn_hidden_size", default=4 * cfg.hidden_size))


def _predictor_tensors(folder: Path, n_layers: int, n_ff: int, d_model: int, qtype: Q, extra: dict) -> list:
    from hybridsparse.predictor_training.train import load_powerinfer_dir

    from .gguf_writer import PlannedTensor
    layers, thresholds = load_powerinfer_dir(folder)
    if len(layers) != n_layers:
        raise ModelError(f"{folder}: {len(layers)} predictors (model_N.pt) for a model of {n_layers} layers")
    plan = []
    for i, (fc1, fc2) in enumerate(layers):
        if fc1.dim() != 2 or fc2.dim() != 2 or fc1.shape[1] != d_model or fc2.shape != (n_ff, fc1.shape[0]):
            raise ModelError(f"{folder / f'model_{i}.pt'}: fc1 {list(fc1.shape)} / fc2 {list(fc2.shape)}, expected "
                             f"[r, {d_model}] / [{n_ff}, r]")
        for name, w in ((f"blk.{i}.fc1.weight", fc1), (f"blk.{i}.fc2.weight", fc2)):
            plan.append(PlannedTensor(name, tuple(w.shape), qtype, (lambda w=w: as_written(w.numpy(), qtype))))
    extra["powerinfer.sparse_threshold"] = float(thresholds[0])
    return plan


def _check_activation(folder: Path, n_layers: int, n_ff: int) -> None:
    from hybridsparse.profiler.activations import load_profile
    prof = load_profile(folder)
    if len(prof.counts) != n_layers:
        raise ModelError(f"{folder}: activation counts for {len(prof.counts)} layers, the model has {n_layers}")
    for i, c in enumerate(prof.counts):
        if c.numel() != n_ff:
            raise ModelError(f"{folder}: activation_{i}.pt has {c.numel()} counts, the model has {n_ff} neurons per layer")


def _copy_activation(folder: Path, profile_dir: Path) -> None:
    """PowerInfer's activation/ folder becomes the converted model's profile (<model>.hs-profile/activation)."""
    import shutil

    from hybridsparse.profiler.activations import activation_dir
    src = activation_dir(folder)
    tmp = profile_dir.with_name(profile_dir.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp / "activation")
    if profile_dir.exists():
        shutil.rmtree(profile_dir)
    tmp.replace(profile_dir)


def build_parser():
    import argparse

    from .cli import default_threads
    ap = argparse.ArgumentParser(prog="hs-convert", description="Convert a Hugging Face model folder to GGUF "
                                 "(llama.cpp names and tokenizer metadata, or PowerInfer's layout).")
    ap.add_argument("model", help="Hugging Face model folder (config.json, *.safetensors or pytorch_model*.bin, tokenizer files)")
    ap.add_argument("-o", "--outfile", help="output GGUF (default: MODEL/<name>-<OUTTYPE>.gguf)")
    ap.add_argument("--outtype", default="f16", choices=sorted(OUTTYPES), help="weight type (default f16)")
    ap.add_argument("--powerinfer", action="store_true",
                    help="PowerInfer layout: PWRI magic, ffn_down_t (W_down transposed), predictors inside")
    ap.add_argument("--predictors", help="PowerInfer predictor folder (model_N.pt with fc1/fc2, config.json with sparse_threshold)")
    ap.add_argument("--activation", help="PowerInfer activation folder (activation_N.pt), copied to <out>.hs-profile/")
    ap.add_argument("--pure", action="store_true", help="quantized output: the output head at the same type too")
    ap.add_argument("--model-type", choices=sorted(ARCHS), help="read a custom-code config.json (its own "
                    "model_type) as this supported family, e.g. llama for Bamboo / TurboSparse")
    ap.add_argument("--ffn-activation", dest="ffn_activation", choices=sorted(ACTIVATIONS),
                    help="the FFN activation the checkpoint's code applies (drelu: ReLU on gate and up)")
    ap.add_argument("-t", "--threads", type=int, default=default_threads(),
                    help="quantization threads (default: %(default)s, the cores available)")
    ap.add_argument("--verbose", action="store_true", help="tracebacks instead of one-line errors")
    return ap


def _run(args) -> int:
    from .cli import use_threads
    convert_hf(args.model, args.outfile, args.outtype, powerinfer=args.powerinfer, predictors=args.predictors,
               activation=args.activation, threads=use_threads(args.threads), pure=args.pure, model_type=args.model_type,
               ffn_activation=args.ffn_activation)
    return 0


def main(argv=None) -> int:
    from .cli import run_main
    return run_main("hs-convert", _run, argv, build_parser())
