"""`hs-bench synth`: random-weight GGUF models with the exact shapes of real sparse models and planted
activation statistics, in llama.cpp's layout or PowerInfer's.

The speed of sparse inference depends on shapes, weight types and which neurons fire, not on the
weight values, so these stand in for the 13B-70B ReLU models that cannot be downloaded here.

Planting. Each layer gets a per-neuron probability of firing f_i: a power law whose mean is the
model's published per-token active fraction and whose hottest `hot_share` of neurons carries 80% of
the activations, varied from layer to layer. Both halves of the runtime then see it:

- The FFN itself (what `hs-profile` measures): neuron i fires when its pre-activation w_i . x is
  positive, x being the normalised FFN input. Over tokens, w_i . x over the random part of x is a
  zero-mean Gaussian of known spread, so a constant term t_i = spread * Phi^-1(f_i) makes it fire with
  probability f_i. The constant comes from a channel of x that never varies (dimension 0): Falcon's and
  OPT's FFN LayerNorm have bias a and weight 0 there; Llama's token embeddings carry a constant C in
  column 0 that no layer writes to (row 0 of attn_output and ffn_down are zero), so RMSNorm leaves it
  at about a = C / rms(x). Then w_i[0] = t_i / a.
- The predictors (what the runtime uses to choose rows) are exact: the random part of the planted
  rows has rank R (w_i = G_i B, B: R x d_model), so fc1 = [B; -B; e_0] and fc2_i = [G_i, -G_i, w_i[0]]
  give fc2 relu(fc1 x) = G_i B x + w_i[0] x_0 = w_i . x: a neuron is predicted active exactly when
  it fires (up to rounding of the stored weights), as a well-trained predictor of a ReLU model is.
  Width 2R + 1 (512 by default).

Weights are a pool of random rows tiled down each matrix (quantised once for Q4_0), so tens of GB are
written in a minute or two; one tensor is in memory at a time (streaming, atomic writer).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from .errors import InputError

POOL_ROWS = 1024


@dataclass(frozen=True)
class SynthShape:
    arch: str  # llama | falcon | opt
    d: int
    ff: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    density: float  # mean per-token share of active neurons
    hot_share: float  # share of neurons carrying 80% of the activations
    source: str


_LLAMA_HOT = "hot share: Llama(ReGLU)-70B 43% (PowerInfer paper)"
_SEQ = ("per-token density ~10% assumed for ReLU models without a gate (Deja Vu measures >85% MLP sparsity "
        "on OPT); hot share: OPT-30B 26% (PowerInfer paper)")
MODELS = {
    "relu-llama-2-7b": SynthShape("llama", 4096, 11008, 32, 32, 32, 32000, 0.33, 0.43,
                                  "density: ReluLLaMA-7B 67% sparsity (ProSparse paper, Table 1); " + _LLAMA_HOT),
    "relu-llama-2-13b": SynthShape("llama", 5120, 13824, 40, 40, 40, 32000, 0.28, 0.43,
                                   "density: ReluLLaMA-13B 72% sparsity (ProSparse paper, Table 1); " + _LLAMA_HOT),
    "relu-llama-2-70b": SynthShape("llama", 8192, 28672, 80, 64, 8, 32000, 0.28, 0.43,
                                   "density: 13B's 72% sparsity assumed (no 70B figure published); " + _LLAMA_HOT),
    "prosparse-llama-2-7b": SynthShape("llama", 4096, 11008, 32, 32, 32, 32000, 0.11, 0.43,
                                       "density: ProSparse-7B 89% sparsity (ProSparse paper); " + _LLAMA_HOT),
    "relu-falcon-40b": SynthShape("falcon", 8192, 32768, 60, 128, 8, 65024, 0.10, 0.26, _SEQ),
    "opt-30b": SynthShape("opt", 7168, 28672, 48, 56, 56, 50272, 0.10, 0.26, _SEQ),
    "opt-66b": SynthShape("opt", 9216, 36864, 64, 72, 72, 50272, 0.10, 0.26, _SEQ),
    # tiny shapes for tests and quick checks
    "tiny": SynthShape("llama", 256, 704, 4, 8, 4, 2048, 0.11, 0.3, "test shape"),
    "tiny-falcon": SynthShape("falcon", 256, 1024, 4, 8, 2, 2048, 0.10, 0.26, "test shape"),
    "tiny-opt": SynthShape("opt", 256, 1024, 4, 8, 8, 2048, 0.10, 0.26, "test shape"),
}
ALIASES = {"llama-7b": "relu-llama-2-7b", "llama-13b": "relu-llama-2-13b", "llama-70b": "relu-llama-2-70b"}
DTYPES = {"f16": Q.F16, "f32": Q.F32, "q4_0": Q.Q4_0, "q8_0": Q.Q8_0}
PREDICTOR_DTYPES = {"f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}  # the types the runtime computes them in
N_CTX = 4096


def resolve(name: str) -> tuple[str, SynthShape]:
    name = ALIASES.get(name, name)
    if name not in MODELS:
        raise InputError(f"unknown synthetic model {name!r} (expected one of {', '.join(sorted(MODELS))})")
    return name, MODELS[name]


def synth_path(out_dir: Path, name: str, dtype: str, layout: str, predictor_type: str = "f16") -> Path:
    """The file name says the shape, type and layout, and the predictors' type unless float16."""
    name = ALIASES.get(name, name)
    pred = "" if predictor_type == "f16" else f"-pred-{predictor_type}"
    return Path(out_dir) / f"{name}-{dtype}{'-powerinfer' if layout == 'powerinfer' else ''}{pred}.gguf"


# --- planted statistics ----------------------------------------------------------------------------

def check_statistics(density: float, hot_share: float) -> None:
    if not 0 < density < 1 or not 0 < hot_share < 1:
        raise InputError(f"density {density} and hot share {hot_share} must be in (0, 1)")
    if hot_share < 0.8 * density:
        raise InputError(f"hot share {hot_share} cannot carry 80% of a density of {density}: every neuron fires "
                         "at most once per token (need hot share >= 0.8 x density)")


def zipf_frequencies(n: int, density: float, hot_share: float, rng) -> np.ndarray:
    """P(active) per neuron following a power law f_r = min(1, c r^-a) over the rank r, with mean
    `density` and the hottest `hot_share` of the neurons carrying 80% of the activations, in a random
    neuron order."""
    check_statistics(density, hot_share)
    r = np.arange(1, n + 1, dtype=np.float64)
    target = density * n

    def curve(a):  # the c with mean(min(1, c r^-a)) = density, exactly: the first k ranks capped at 1
        q = r ** -a  # descending
        tail = np.cumsum(q[::-1])[::-1]  # tail[k] = sum of q[k:]
        k = np.arange(n)
        c = (target - k) / tail
        ok = (c * q <= 1.0) & ((k == 0) | (c * np.concatenate([[np.inf], q[:-1]]) >= 1.0)) & (c > 0)
        return np.minimum(1.0, c[np.argmax(ok)] * q)

    lo, hi = 0.0, 4.0
    for _ in range(60):
        a = (lo + hi) / 2
        f = curve(a)
        if f[: int(hot_share * n)].sum() / f.sum() < 0.8:
            lo = a
        else:
            hi = a
    return rng.permutation(curve((lo + hi) / 2))


def layer_statistics(shape: SynthShape, density: float, hot_share: float, seed: int = 1) -> list[np.ndarray]:
    """Per-layer frequencies: the density varies from layer to layer by a log-normal factor (sd 0.2,
    renormalised to the mean), the hot share by +-0.03 (kept feasible)."""
    rng = np.random.default_rng(seed)
    m = np.exp(rng.normal(0, 0.2, shape.layers))
    dens = np.clip(density * m / m.mean(), 0.01, 0.9)
    hots = np.clip(hot_share + rng.normal(0, 0.03, shape.layers), 0.8 * dens + 0.01, 0.95)
    return [zipf_frequencies(shape.ff, float(dl), float(hl), rng) for dl, hl in zip(dens, hots)]


def _ndtri(f: np.ndarray) -> np.ndarray:
    return torch.special.ndtri(torch.from_numpy(np.clip(f, 1e-4, 1 - 1e-4))).numpy()


# --- weights ---------------------------------------------------------------------------------------

class _Pool:
    """A block of random rows of one width and spread, tiled down a matrix, in the stored type."""

    def __init__(self, cols: int, std: float, qtype: Q, rng, zero_col0: bool = False, rows: np.ndarray | None = None):
        if rows is None:
            rows = (rng.standard_normal((POOL_ROWS, cols)) * std).astype(np.float32)
        if zero_col0:
            rows[:, 0] = 0.0
        self.floats, self.qtype, self.n = rows, qtype, len(rows)
        self.norm_rest = np.linalg.norm(rows[:, 1:], axis=1)  # spread of each row's random part
        self.stored = _store(rows, qtype)

    def tile(self, n: int) -> np.ndarray:
        """A fresh [n, row] array (callers may write to it)."""
        out = np.tile(self.stored, (-(-n // self.n), 1))
        return out if len(out) == n else out[:n].copy()

    def norms(self, n: int) -> np.ndarray:
        return np.tile(self.norm_rest, -(-n // self.n))[:n]

    def with_col0(self, col0: np.ndarray) -> np.ndarray:
        """The tiled matrix with column 0 set per row (re-quantising only each row's first block)."""
        n = len(col0)
        out = self.tile(n)
        if self.qtype in (Q.F16, Q.F32):
            out[:, 0] = col0
            return out
        block, nbytes = GGML_QUANT_SIZES[self.qtype]
        first = np.tile(self.floats[:, :block], (-(-n // self.n), 1))[:n].copy()
        first[:, 0] = col0
        out[:, :nbytes] = _store(first, self.qtype)
        return out


class _PlantedPool(_Pool):
    """Rows G B of rank R (column 0 zero, set per neuron later) and the exact predictor of w . x."""

    def __init__(self, d: int, rank: int, radius: float, qtype: Q, rng, n_rows: int = 4 * POOL_ROWS):
        b = rng.standard_normal((rank, d))
        b[:, 0] = 0.0
        b *= (math.sqrt(d - 1) / radius) / np.linalg.norm(b, axis=1, keepdims=True)  # b_j . x ~ N(0, 1)
        g = rng.standard_normal((n_rows, rank)) * (0.02 * radius / math.sqrt(rank))  # rows of ~0.02 per weight
        self.b, self.g = b.astype(np.float32), g.astype(np.float32)
        super().__init__(d, 0.0, qtype, rng, zero_col0=True, rows=self.g @ self.b)

    @property
    def predictor_width(self) -> int:
        return 2 * self.b.shape[0] + 1

    def fc1(self) -> np.ndarray:
        """[2R + 1, d]: the same for every layer (the layers differ in their column 0 only)."""
        e0 = np.zeros((1, self.b.shape[1]), np.float32)
        e0[0, 0] = 1.0
        return np.vstack([self.b, -self.b, e0])

    def fc2(self, col0: np.ndarray) -> np.ndarray:
        """[n, 2R + 1] with fc2 relu(fc1 x) = w . x for w = the rows with `col0`."""
        g = np.tile(self.g, (-(-len(col0) // self.n), 1))[: len(col0)]
        return np.hstack([g, -g, col0[:, None].astype(np.float32)])


def _store(arr: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return arr.astype(np.float32)
    if qtype == Q.F16:
        return arr.astype(np.float16)
    from gguf import quants
    return quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)


def _pad_rows(arr: np.ndarray, n: int) -> np.ndarray:
    return arr if len(arr) == n else np.vstack([arr, np.zeros((n - len(arr), arr.shape[1]), arr.dtype)])


def _pad_cols(arr: np.ndarray, n: int) -> np.ndarray:
    return arr if arr.shape[1] == n else np.hstack([arr, np.zeros((len(arr), n - arr.shape[1]), arr.dtype)])


def _zero_row0(arr: np.ndarray) -> np.ndarray:
    arr[0] = 0  # zero bytes are zeros in every type (a zero scale for the block formats)
    return arr


def write_synth(out_dir: str | Path, name: str, dtype: str = "f16", layout: str = "llama.cpp",
                density: float | None = None, hot_share: float | None = None, predictor_width: int = 512,
                seed: int = 0, predictor_type: str = "f16") -> Path:
    """Write the model, its activation profile (`<model>.hs-profile`, PowerInfer's activation/ layout
    inside) and its predictors (in the file for PowerInfer's layout, `<model>.predictors.gguf` beside
    it otherwise; `predictor_type` f16, q8_0 or q4_0, the block formats with the width padded to whole
    blocks by zero units). Returns the model's path."""
    from hybridsparse.predictor_training.train import write_predictor_file
    from hybridsparse.profiler.activations import save_profile
    from .convert import byte_level_vocab
    from .gguf_writer import PlannedTensor, add_metadata, write_gguf_stream

    name, s = resolve(name)
    if dtype not in DTYPES:
        raise InputError(f"unknown type {dtype!r} for a synthetic model (expected one of {', '.join(DTYPES)})")
    if layout not in ("llama.cpp", "powerinfer"):
        raise InputError(f"unknown layout {layout!r} (expected llama.cpp or powerinfer)")
    density = s.density if density is None else density
    hot_share = s.hot_share if hot_share is None else hot_share
    check_statistics(density, hot_share)
    if predictor_type not in PREDICTOR_DTYPES:
        raise InputError(f"unknown predictor type {predictor_type!r} (expected one of {', '.join(PREDICTOR_DTYPES)})")
    pq = PREDICTOR_DTYPES[predictor_type]
    qtype = DTYPES[dtype]
    big = Q.Q8_0 if qtype == Q.Q4_0 else qtype  # the output head: llama.cpp keeps it at higher precision
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = synth_path(out_dir, name, dtype, layout, predictor_type)
    rng = np.random.default_rng(seed)
    freqs = layer_statistics(s, density, hot_share, seed + 1)
    d, ff, hd = s.d, s.ff, s.d // s.heads
    kv_dim = s.kv_heads * hd
    pi = layout == "powerinfer"

    # the FFN input: its constant channel a, the norm of its random part r
    if s.arch == "llama":
        C = math.sqrt((d - 1) / 3)  # RMSNorm then gives a = C / rms = sqrt(d) / 2, r = sqrt(3 d) / 2
        a, r = math.sqrt(d) / 2, math.sqrt(3 * d) / 2
    else:
        C, a, r = 0.0, math.sqrt(d) / 2, math.sqrt(d)  # Falcon, OPT: the FFN LayerNorm's bias sets channel 0
    # what attention and the FFN add to the residual is kept small (their input norms scale by k; a
    # neuron's firing and the predictors' logits' signs do not depend on that scale), so the residual
    # stays close to the embedding and a and r hold in every layer
    k = 0.1
    s_o, s_down = min(0.02, 2.0 / d), min(0.02, 100.0 / d ** 1.5)
    pools = {
        "embd": _Pool(d, 1.0, qtype, rng, zero_col0=True),
        "q": _Pool(d, 0.02, qtype, rng), "o": _Pool(d, s_o, qtype, rng),
        "w_in": _PlantedPool(d, (predictor_width - 1) // 2, r, qtype, rng),  # gate (llama) or up: planted
        "up": _Pool(d, 0.02, qtype, rng),
        "down": _Pool(ff, s_down, qtype, rng), "down_t": _Pool(d, s_down, qtype, rng, zero_col0=True),
        "head": _Pool(d, 0.02, big, rng),
    }
    if s.arch == "opt":
        pools["pos"] = _Pool(d, 0.5, qtype, rng, zero_col0=True)

    def col0(i):  # w_i[0]: times the channel's value a, the constant that fires neuron i with f_i
        t = _ndtri(freqs[i])  # in units of the pre-activation's spread over tokens
        spread = pools["w_in"].norms(ff) * r / math.sqrt(d - 1)
        return (t * spread / a).astype(np.float32)

    def embd():
        e = pools["embd"].tile(s.vocab)
        if C == 0.0:
            return e
        return pools["embd"].with_col0(np.full(s.vocab, C, dtype=np.float32))

    ones, zeros = (lambda: np.ones(d, np.float32)), (lambda: np.zeros(d, np.float32))
    small = lambda: np.full(d, k, np.float32)  # noqa: E731
    # Falcon's and OPT's FFN LayerNorm: channel 0 held at k a, the rest normalised and scaled by k
    w2 = lambda: np.concatenate([[0.0], np.full(d - 1, k)]).astype(np.float32)  # noqa: E731
    b2 = lambda: np.concatenate([[k * a], np.zeros(d - 1)]).astype(np.float32)  # noqa: E731
    T = PlannedTensor
    tensors = [T("token_embd.weight", (s.vocab, d), qtype, embd)]
    if s.arch == "opt":
        tensors.append(T("position_embd.weight", (2048, d), qtype, lambda: pools["pos"].tile(2048)))
    tensors.append(T("output_norm.weight", (d,), Q.F32, ones))
    if s.arch != "llama":
        tensors.append(T("output_norm.bias", (d,), Q.F32, zeros))
    if s.arch != "opt":  # OPT ties its head to the embedding
        tensors.append(T("output.weight", (s.vocab, d), big, lambda: pools["head"].tile(s.vocab)))
    predictors = []  # made when written, like the weights, in the file (PowerInfer) or beside it
    width = pools["w_in"].predictor_width
    block = GGML_QUANT_SIZES[pq][0]
    pwidth = -(-width // block) * block  # fc2's rows in whole blocks: extra units with zero weights
    for i in range(s.layers):
        p = f"blk.{i}."
        if s.arch == "llama":
            tensors += [T(p + "attn_norm.weight", (d,), Q.F32, small),
                        T(p + "attn_q.weight", (d, d), qtype, lambda: pools["q"].tile(d)),
                        T(p + "attn_k.weight", (kv_dim, d), qtype, lambda: pools["q"].tile(kv_dim)),
                        T(p + "attn_v.weight", (kv_dim, d), qtype, lambda: pools["q"].tile(kv_dim)),
                        T(p + "attn_output.weight", (d, d), qtype, lambda: _zero_row0(pools["o"].tile(d))),
                        T(p + "ffn_norm.weight", (d,), Q.F32, small),
                        T(p + "ffn_gate.weight", (ff, d), qtype, lambda i=i: pools["w_in"].with_col0(col0(i))),
                        T(p + "ffn_up.weight", (ff, d), qtype, lambda: pools["up"].tile(ff))]
        elif s.arch == "falcon":
            tensors += [T(p + "attn_norm.weight", (d,), Q.F32, small), T(p + "attn_norm.bias", (d,), Q.F32, zeros),
                        T(p + "attn_norm_2.weight", (d,), Q.F32, w2), T(p + "attn_norm_2.bias", (d,), Q.F32, b2),
                        T(p + "attn_qkv.weight", (d + 2 * kv_dim, d), qtype, lambda: pools["q"].tile(d + 2 * kv_dim)),
                        T(p + "attn_output.weight", (d, d), qtype, lambda: _zero_row0(pools["o"].tile(d))),
                        T(p + "ffn_up.weight", (ff, d), qtype, lambda i=i: pools["w_in"].with_col0(col0(i)))]
        else:
            for n in ("attn_q", "attn_k", "attn_v"):
                tensors += [T(p + n + ".weight", (d, d), qtype, lambda: pools["q"].tile(d)),
                            T(p + n + ".bias", (d,), Q.F32, zeros)]
            tensors += [T(p + "attn_norm.weight", (d,), Q.F32, small), T(p + "attn_norm.bias", (d,), Q.F32, zeros),
                        T(p + "attn_output.weight", (d, d), qtype, lambda: _zero_row0(pools["o"].tile(d))),
                        T(p + "attn_output.bias", (d,), Q.F32, zeros),
                        T(p + "ffn_norm.weight", (d,), Q.F32, w2), T(p + "ffn_norm.bias", (d,), Q.F32, b2),
                        T(p + "ffn_up.weight", (ff, d), qtype, lambda i=i: pools["w_in"].with_col0(col0(i))),
                        T(p + "ffn_up.bias", (ff,), Q.F32, lambda: np.zeros(ff, np.float32))]
        if pi:
            tensors.append(T(p + "ffn_down_t.weight", (ff, d), qtype, lambda: pools["down_t"].tile(ff)))
        else:
            tensors.append(T(p + "ffn_down.weight", (d, ff), qtype, lambda: _zero_row0(pools["down"].tile(d))))
        if s.arch == "opt":
            tensors.append(T(p + ("ffn_down_t.bias" if pi else "ffn_down.bias"), (d,), Q.F32, zeros))
        predictors += [T(p + "fc1.weight", (pwidth, d), pq, lambda: _store(_pad_rows(pools["w_in"].fc1(), pwidth), pq)),
                       T(p + "fc2.weight", (ff, pwidth), pq,
                         lambda i=i: _store(_pad_cols(pools["w_in"].fc2(col0(i)), pwidth), pq))]
    if pi:
        tensors += predictors

    def metadata(w):
        keys = {"context_length": N_CTX if s.arch != "opt" else 2048, "embedding_length": d, "block_count": s.layers,
                "feed_forward_length": ff, "attention.head_count": s.heads, "attention.head_count_kv": s.kv_heads}
        if s.arch == "llama":
            keys["rope.dimension_count"] = hd
        for k, v in keys.items():
            w.add_uint32(f"{s.arch}.{k}", v)
        if s.arch == "llama":
            w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        else:
            w.add_float32(f"{s.arch}.attention.layer_norm_epsilon", 1e-5)
        w.add_string("general.name", f"synthetic {name} ({dtype}, random weights)")
        w.add_string("hybridsparse.ffn_activation", "relu" if s.arch == "llama" else "relu_nogate")
        w.add_string("hybridsparse.synthetic", json.dumps({"model": name, "density": density, "hot_share": hot_share,
                                                           "source": s.source, "seed": seed}))
        if pi:
            w.add_float32("powerinfer.sparse_threshold", 0.0)
        for k, v in byte_level_vocab(s.vocab, pair_merges=True).items():
            add_metadata(w, k, v)

    write_gguf_stream(path, s.arch, metadata, tensors, powerinfer=pi, desc=f"writing {path.name}")
    tokens = 1_000_000
    save_profile(path.with_name(path.stem + ".hs-profile"), [torch.from_numpy(f * tokens) for f in freqs], tokens,
                 {"criterion": "synthetic", "density": density, "hot_share_80": hot_share, "source": s.source})
    if not pi:
        write_predictor_file(path.with_name(path.stem + ".predictors.gguf"), [0.0] * s.layers, {"synthetic": True},
                             predictors)
    return path


def add_parser(sub) -> None:
    p = sub.add_parser("synth", help="write a random model with a real model's shape and planted activation statistics")
    p.add_argument("--shape", "--model", dest="shape", default="relu-llama-2-7b",
                   help=f"one of {', '.join(sorted(MODELS))} (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="f16")
    p.add_argument("-o", "--output", required=True, help="folder (e.g. /dev/shm)")
    p.add_argument("--layout", choices=["llama.cpp", "powerinfer"], default="llama.cpp",
                   help="powerinfer: PWRI magic, ffn_down_t, predictors fc1/fc2 in the file")
    p.add_argument("--density", type=float, help="mean share of active neurons per token (default: the model's)")
    p.add_argument("--hot-share", type=float, help="share of neurons carrying 80%% of the activations (default: the model's)")
    p.add_argument("--predictor-width", type=int, default=512)
    p.add_argument("--predictor-type", choices=sorted(PREDICTOR_DTYPES), default="f16",
                   help="the predictors' stored type (q8_0 / q4_0: a half / a quarter of the bytes per token; "
                        "default: %(default)s, as PowerInfer keeps them)")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=_synth)


def _synth(args) -> int:
    path = write_synth(args.output, args.shape, args.dtype, args.layout, args.density, args.hot_share,
                       args.predictor_width, predictor_type=args.predictor_type)
    s = resolve(args.shape)[1]
    print(f"{s.arch} d={s.d} ff={s.ff} layers={s.layers}; planted {args.density or s.density:.0%} active per token, "
          f"80% of activations in {args.hot_share or s.hot_share:.0%} of neurons ({s.source})", file=sys.stderr)
    print(path)
    return 0
