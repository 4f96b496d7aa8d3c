"""What every architecture shares: weight lookup with checked shapes, placement of layers on
devices (llama.cpp's `-ngl`), the KV cache, and the forward pass over tokens.

An architecture subclasses `CausalLM`, builds its config from GGUF metadata, loads one layer's
weights in `load_layer`, and computes one block in `block`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .. import kernels
from ..errors import ModelError
from ..gguf_file import GGUFFile
from ..layers import KVCache, Step
from ..quants import dequantize
from ..weights import QWeight, linear


@dataclass(slots=True)
class NormWeights:
    weight: torch.Tensor
    bias: torch.Tensor | None = None


class Weights:
    """Named tensors of one GGUF file, checked for presence and shape as they are taken."""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def _info(self, name: str):
        info = self.gguf.tensors.get(name)
        if info is None:
            raise ModelError(f"{self.gguf.path}: tensor {name} is missing")
        return info

    def matrix(self, name: str, out_features: int, in_features: int) -> QWeight:
        info = self._info(name)
        if tuple(info.shape) != (in_features, out_features):
            raise ModelError(f"{self.gguf.path}: tensor {name} has shape {list(info.shape)}, "
                             f"expected [{in_features}, {out_features}]")
        return QWeight.from_raw(self.gguf.raw(name), info.qtype, in_features)

    def vector(self, name: str, n: int) -> torch.Tensor:
        info = self._info(name)
        if tuple(info.shape) != (n,):
            raise ModelError(f"{self.gguf.path}: tensor {name} has shape {list(info.shape)}, expected [{n}]")
        return dequantize(self.gguf.raw(name), info.qtype).reshape(n)

    def optional_vector(self, name: str, n: int) -> torch.Tensor | None:
        return self.vector(name, n) if self.has(name) else None


@dataclass(slots=True)
class Predictor:
    """PowerInfer/Deja Vu activation predictor of one layer: logits = fc2(relu(fc1(x)))."""
    fc1: QWeight
    fc2: QWeight


@dataclass(slots=True)
class Placement:
    """Where each part lives: the embedding, each layer, the output head."""
    embed: torch.device
    layers: list[torch.device]
    head: torch.device
    devices: list[torch.device] = field(default_factory=list)

    @classmethod
    def split(cls, n_layers: int, n_gpu_layers: int, gpu: torch.device | None) -> "Placement":
        """llama.cpp's rule: the last `n_gpu_layers` layers on the GPU; the output head too once
        n_gpu_layers exceeds the layer count; the embedding on the GPU only when everything is."""
        cpu = torch.device("cpu")
        if gpu is None or n_gpu_layers <= 0:
            return cls(cpu, [cpu] * n_layers, cpu, [cpu])
        first_gpu = max(n_layers - n_gpu_layers, 0)
        layers = [cpu if i < first_gpu else gpu for i in range(n_layers)]
        all_gpu = n_gpu_layers > n_layers
        head = gpu if all_gpu else cpu
        embed = gpu if all_gpu else cpu
        devices = sorted({*layers, head, embed}, key=str)
        return cls(embed, layers, head, devices)


class CausalLM:
    """A decoder-only language model read from a GGUF file."""

    arch: ClassVar[str]

    def __init__(self, gguf: GGUFFile, config):
        self.gguf, self.config = gguf, config
        self.weights = Weights(gguf)
        c = config
        self.embedding = self.weights.matrix("token_embd.weight", c.n_vocab, c.d_model)
        self.layers = [self.load_layer(i) for i in range(c.n_layers)]
        self.output = (self.weights.matrix("output.weight", c.n_vocab, c.d_model)
                       if self.weights.has("output.weight") else self.embedding)
        self.head = self.load_head()
        self.predictors = self._load_predictors()
        self.sparse_threshold = float(gguf.get("powerinfer.sparse_threshold", 0.0))
        self.placement = Placement.split(c.n_layers, 0, None)
        self.rotary_by_device: dict[torch.device, object] = {}
        # Most tokens one forward pass takes (None: any): a hybrid model on CUDA runs longer prompts in
        # micro-batches whose activations fit the VRAM its plan left for them (solver.plan.PREFILL_TOKENS).
        self.max_batch_tokens: int | None = None

    # --- to be provided by each architecture ----------------------------------------------------

    def load_layer(self, i: int):
        raise NotImplementedError

    def block(self, i: int, x: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        raise NotImplementedError

    def load_head(self):
        """The final norm's tensors (a dataclass), placed with the output head."""
        raise NotImplementedError

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def make_rotary(self, device: torch.device):
        """Rotary tables for `device` (None for architectures without rotary embeddings)."""
        return None

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows, qtype = self.embedding.data[tokens], self.embedding.qtype
        if not rows.is_cuda and qtype in kernels.CPU_DEQUANT_TYPES and kernels.ops() is not None and len(rows):
            return kernels.cpu.dequantize(rows, int(qtype))  # one compiled call, not the twin's ~10 torch ops
        return dequantize(rows, qtype)

    windows: ClassVar[tuple] = (None,)

    # --- shared machinery -----------------------------------------------------------------------

    def _load_predictors(self) -> list[Predictor] | None:
        if not self.weights.has("blk.0.fc1.weight"):
            return None
        c, out = self.config, []
        for i in range(c.n_layers):
            info = self.weights._info(f"blk.{i}.fc1.weight")
            rank = info.shape[1] if len(info.shape) == 2 else 0
            out.append(Predictor(self.weights.matrix(f"blk.{i}.fc1.weight", rank, c.d_model),
                                 self.weights.matrix(f"blk.{i}.fc2.weight", c.n_ff, rank)))
        return out

    def place(self, n_gpu_layers: int, gpu: torch.device | None) -> None:
        """Move layers to the GPU following llama.cpp's `-ngl` rule."""
        self.apply_placement(Placement.split(self.config.n_layers, n_gpu_layers, gpu))

    def apply_placement(self, p: Placement, ffn_builder=None, progress=None) -> None:
        """Move each part to its device; `ffn_builder(i, ffn, device)`, when given, replaces each
        layer's FFN first (the hybrid runtime's split FFN, which places its own rows)."""
        self.placement = p
        self.embedding = self.embedding.to(p.embed)
        order = range(len(self.layers)) if progress is None else progress(range(len(self.layers)))
        for i in order:
            if ffn_builder is not None:
                self.layers[i].ffn = ffn_builder(i, self.layers[i].ffn, p.layers[i])
            self.layers[i] = self.move_layer(self.layers[i], p.layers[i])
        self.output = self.output.to(p.head)
        self.head = _move(self.head, p.head)
        self.rotary_by_device = {d: self.make_rotary(d) for d in p.devices}

    def move_layer(self, layer, device):
        layer = _move(layer, device)
        if device.type == "cuda":  # one GEMV (one launch) for q/k/v and for gate/up
            fuse_rows(layer, ("q", "k", "v"))
            if hasattr(layer, "ffn"):
                fuse_rows(layer.ffn, ("gate", "up"))
        return layer

    def capturable(self) -> bool:
        """Whether a decode step can be captured in a CUDA graph (no host work inside)."""
        return all(getattr(getattr(layer, "ffn", None), "capturable", True) for layer in self.layers)

    def rotary(self, device: torch.device):
        if device not in self.rotary_by_device:
            self.rotary_by_device[device] = self.make_rotary(device)
        return self.rotary_by_device[device]

    # the KV cache's type on the CPU (the commands' -ctk/-ctv, float16 there as in llama.cpp); GPU
    # layers keep float16, which the VRAM plan counts
    cpu_cache_dtype = torch.float32

    def new_cache(self, n_ctx: int) -> list[KVCache]:
        c = self.config
        return [KVCache(c.n_kv_heads, c.head_dim, n_ctx, dev,
                        self.cpu_cache_dtype if dev.type == "cpu" else torch.float16)
                for dev in self.placement.layers]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: list[KVCache],
                kv_len: int, all_logits: bool = False) -> torch.Tensor:
        """tokens, positions: int64 [T]; returns float32 logits [T or 1, n_vocab] on the head's device."""
        m, n = self.max_batch_tokens, tokens.shape[0]
        if m and n > m:  # consecutive positions: piece k attends over the cache up to its own last token
            outs = [self.forward(tokens[a:a + m], positions[a:a + m], cache, kv_len - n + min(a + m, n), all_logits)
                    for a in range(0, n, m)]
            return torch.cat(outs) if all_logits else outs[-1]
        p = self.placement
        x = self.embed(tokens.to(p.embed), positions.to(p.embed))
        return self.finish(self.run_layers(x, positions, cache, kv_len), all_logits)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, cache: list[KVCache], kv_len: int) -> torch.Tensor:
        """The transformer blocks on embedded tokens x; returns the last hidden state."""
        p = self.placement
        steps: dict[torch.device, Step] = {}
        for i, dev in enumerate(p.layers):
            if dev not in steps:
                steps[dev] = Step.build(positions.to(dev), kv_len, self.windows)
            if dev.type == "cpu" and x.is_cuda:  # from a GPU layer (its host nodes done once x is here)
                x = x.to(dev)
                kernels.pool_rest()  # idle pool threads would spin on the cores this layer's OpenMP team needs
            x = self.block(i, x.to(dev), steps[dev], cache[i])
        return x

    def forward_batch(self, tokens: list[list[int]], starts: list[int], caches: list[list[KVCache]]) -> torch.Tensor:
        """Several sequences in one pass (batched decode): sequence b's tokens at positions
        starts[b]..., its own cache caches[b]; weights are read once for all of them. Returns the
        logits of each sequence's last token [B, n_vocab]."""
        p = self.placement
        flat = [t for seq in tokens for t in seq]
        pos = torch.tensor([s + j for seq, s in zip(tokens, starts) for j in range(len(seq))], dtype=torch.long)
        bounds, at = [], 0
        for seq in tokens:
            bounds.append((at, at + len(seq)))
            at += len(seq)
        kv_lens = [s + len(seq) for seq, s in zip(tokens, starts)]
        x = self.embed(torch.tensor(flat, dtype=torch.long).to(p.embed), pos.to(p.embed))
        steps: dict[torch.device, Step] = {}
        for i, dev in enumerate(p.layers):
            if dev not in steps:
                steps[dev] = Step.batch(pos.to(dev), bounds, kv_lens)
            x = self.block(i, x.to(dev), steps[dev], [c[i] for c in caches])
        last = torch.tensor([b - 1 for _, b in bounds], device=x.device)
        return self.logits(self.final_norm(x.index_select(0, last).to(p.head)))

    def finish(self, x: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Final norm and output head on the last hidden state (of every token with all_logits)."""
        if not all_logits:
            x = x[-1:]
        return self.logits(self.final_norm(x.to(self.placement.head)))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.output)


def fuse_rows(obj, names) -> None:
    """Put the weights `names` of obj into one buffer, each becoming a row slice of it, so
    `linear_many` can run them as one matmul. Skipped unless all exist with one type and width."""
    ws = [getattr(obj, n, None) for n in names]
    if any(w is None for w in ws) or len({(w.qtype, w.in_features, w.data.dtype) for w in ws}) != 1:
        return
    fused = torch.cat([w.data for w in ws])
    start = 0
    for name, w in zip(names, ws):
        setattr(obj, name, QWeight(fused[start:start + w.out_features], w.qtype, w.in_features))
        start += w.out_features


def _move(obj, device):
    """Move every tensor / QWeight field of a layer dataclass (recursively) to `device`."""
    if isinstance(obj, QWeight):
        return obj.to(device)
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            setattr(obj, name, _move(getattr(obj, name), device))
        return obj
    if isinstance(obj, list):
        return [_move(o, device) for o in obj]
    return obj


@dataclass(slots=True)
class LMConfig:
    """Hyper-parameters every architecture has, read from `<arch>.*` GGUF keys."""
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    norm_eps: float
    rope_base: float
    rope_dim: int
    ffn_variant: str

    @classmethod
    def read(cls, g: GGUFFile, eps_key: str, default_ffn: str, **extra) -> dict:
        a = g.architecture
        d_model = g.require(f"{a}.embedding_length")
        n_heads = g.require(f"{a}.attention.head_count")
        n_kv = g.get(f"{a}.attention.head_count_kv", n_heads)
        if not isinstance(n_kv, int):
            raise ModelError(f"{g.path}: metadata {a}.attention.head_count_kv must be one integer")
        if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv:
            raise ModelError(f"{g.path}: metadata {a}.attention.head_count {n_heads} is not a multiple of "
                             f"head_count_kv {n_kv}")
        head_dim = g.get(f"{a}.attention.key_length", d_model // n_heads)
        embd = g.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelError(f"{g.path}: tensor token_embd.weight is missing")
        ffn = g.get("hybridsparse.ffn_activation", default_ffn)
        from ..layers import FFN_VARIANTS
        if ffn not in FFN_VARIANTS:
            raise ModelError(f"{g.path}: metadata hybridsparse.ffn_activation = {ffn!r} "
                             f"(expected one of {sorted(FFN_VARIANTS)})")
        fields = dict(
            arch=a, n_layers=g.require(f"{a}.block_count"), d_model=d_model, n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_dim, n_ff=g.require(f"{a}.feed_forward_length"),
            n_vocab=embd.shape[1], n_ctx_train=g.get(f"{a}.context_length", 2048),
            norm_eps=float(g.require(f"{a}.{eps_key}", float)),
            rope_base=float(g.get(f"{a}.rope.freq_base", 10000.0)),
            rope_dim=g.get(f"{a}.rope.dimension_count", head_dim), ffn_variant=ffn)
        fields.update(extra)
        return fields


def load_ffn(w: Weights, prefix: str, c: LMConfig, gated: bool) -> "FFNWeights":
    """up / gate / down of one layer; PowerInfer files store the down projection transposed
    (`ffn_down_t`, one row per neuron)."""
    from ..layers import FFNWeights
    down_t = w.has(prefix + "ffn_down_t.weight")
    return FFNWeights(
        up=w.matrix(prefix + "ffn_up.weight", c.n_ff, c.d_model),
        gate=w.matrix(prefix + "ffn_gate.weight", c.n_ff, c.d_model) if gated else None,
        down=(w.matrix(prefix + "ffn_down_t.weight", c.n_ff, c.d_model) if down_t
              else w.matrix(prefix + "ffn_down.weight", c.d_model, c.n_ff)),
        down_transposed=down_t,
        up_bias=w.optional_vector(prefix + "ffn_up.bias", c.n_ff),
        down_bias=w.optional_vector(prefix + ("ffn_down_t.bias" if down_t else "ffn_down.bias"), c.d_model),
    )
