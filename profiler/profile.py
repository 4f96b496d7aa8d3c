"""hs-profile: how often each FFN neuron fires, on a calibration corpus.

  hs-profile [-m MODEL] [--corpus PATH] [--tokens 200000] [--sparsity 0.5] [--plot] [-o DIR]

"Active" follows the activation: ReLU family (ReLU-gated, dReLU, ReLU without gate): the neuron's
value is not zero; others (SwiGLU, GeGLU, GELU): |act(gate)| (or |act(up)| without a gate) above a
per-layer threshold calibrated on the first tokens so that `--sparsity` of the neurons are inactive
on average (CATS/TEAL style); the thresholds are stored with the profile so the runtime applies the
same rule. Writes DIR/activation/activation_N.pt (PowerInfer's layout), DIR/profile.json, and with
--samples, the predictor-training set (FFN input, active mask) in shards under DIR/samples/ plus a
tenth as many from the held-out documents under DIR/samples_heldout/ (the predictors' test set).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from hybridsparse.runtime import layers as L
from hybridsparse.runtime.cli import add_model_args, run_main
from hybridsparse.runtime.errors import InputError
from hybridsparse.solver.gpuidx import model_fingerprint

from .activations import save_profile
from .corpus import load_documents, split

RELU_FAMILY = {"relu"}
SHARD_TOKENS = 4096


class Counter:
    """The FFN probe: per layer counts, optional threshold samples, optional training samples."""

    def __init__(self, model, thresholds: list[float] | None, sample_dir: Path | None, max_samples: int):
        self.index = {id(layer.ffn): i for i, layer in enumerate(model.layers)}
        n = len(model.layers)
        self.counts: list[torch.Tensor | None] = [None] * n
        self.thresholds = thresholds
        self.score_samples: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.sample_dir, self.max_samples = sample_dir, max_samples
        self.buffers: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n)]
        self.saved = [0] * n
        self.shards = [0] * n

    def __call__(self, w, x, score, h):
        i = self.index[id(w)]
        if self.thresholds is None:  # calibration pass: keep a sample of |score|
            flat = score.detach().abs().float().flatten().cpu()
            self.score_samples[i].append(flat[torch.randint(0, flat.numel(), (20000,))])
            return
        active = (h != 0) if self.thresholds[i] is None else (score.abs() > self.thresholds[i])
        c = active.sum(0, dtype=torch.float64).cpu()
        self.counts[i] = c if self.counts[i] is None else self.counts[i] + c
        if self.sample_dir is not None and self.saved[i] < self.max_samples:
            take = min(x.shape[0], self.max_samples - self.saved[i])
            self.buffers[i].append((x[:take].detach().half().cpu(), np.packbits(active[:take].cpu().numpy(), axis=1)))
            self.saved[i] += take
            if sum(b[0].shape[0] for b in self.buffers[i]) >= SHARD_TOKENS:
                self.flush(i)

    def flush(self, i: int) -> None:
        if not self.buffers[i]:
            return
        d = self.sample_dir / f"layer_{i}"
        d.mkdir(parents=True, exist_ok=True)
        x = torch.cat([b[0] for b in self.buffers[i]])
        m = torch.from_numpy(np.concatenate([b[1] for b in self.buffers[i]]))
        torch.save({"x": x, "mask": m}, d / f"shard_{self.shards[i]:05d}.pt")
        self.shards[i] += 1
        self.buffers[i] = []


def run_tokens(lm, texts: list[str], budget: int, ctx: int, desc: str) -> int:
    """Feed the texts as windows of `ctx` tokens (fresh context each) until `budget` tokens."""
    from tqdm import tqdm
    model, tok = lm.model, lm.tokenizer
    cache = model.new_cache(ctx)
    done = 0
    bar = tqdm(total=budget, desc=desc, unit="tok", unit_scale=True, file=sys.stderr, dynamic_ncols=True)
    with torch.inference_mode():
        for text in texts:
            ids = tok.encode(text)
            for start in range(0, len(ids), ctx):
                chunk = ids[start:start + ctx][: budget - done]
                if len(chunk) < 2:
                    continue
                model.forward(torch.tensor(chunk), torch.arange(len(chunk)), cache, len(chunk))
                done += len(chunk)
                bar.update(len(chunk))
                if done >= budget:
                    bar.close()
                    return done
    bar.close()
    return done


SPARSITY_GRID = [round(0.05 * i, 2) for i in range(1, 20)]  # 0.05 ... 0.95


def profile(lm, texts: list[str], tokens: int, ctx: int, sparsity: float, calib_tokens: int,
            sample_dir: Path | None = None, max_samples: int = 0,
            heldout: list[str] | None = None) -> tuple[list[torch.Tensor], int, list]:
    relu = lm.model.config.ffn_variant in ("relu", "drelu", "relu_nogate")
    profile.threshold_table = None
    thresholds: list[float | None]
    try:
        if relu:
            thresholds = [None] * len(lm.model.layers)
        else:
            probe = Counter(lm.model, None, None, 0)
            L.FFN_PROBE = probe
            run_tokens(lm, texts, calib_tokens, ctx, "calibrating thresholds")
            samples = [torch.cat(s)[:1_000_000] for s in probe.score_samples]
            thresholds = [float(torch.quantile(s, sparsity)) for s in samples]
            # |act| quantiles on a grid, so runs can choose another sparsity (hs-run --sparsity)
            grid = torch.tensor(SPARSITY_GRID, dtype=samples[0].dtype)
            profile.threshold_table = {"sparsity": SPARSITY_GRID,
                                       "thresholds": [torch.quantile(s, grid).tolist() for s in samples]}
        probe = Counter(lm.model, thresholds, sample_dir, max_samples)
        L.FFN_PROBE = probe
        n = run_tokens(lm, texts, tokens, ctx, "profiling")
        for i in range(len(probe.buffers)):
            probe.flush(i)
        if sample_dir is not None and heldout:  # samples of text the predictors never train on
            extra = Counter(lm.model, thresholds, sample_dir.with_name("samples_heldout"), max(1, max_samples // 10))
            L.FFN_PROBE = extra
            run_tokens(lm, heldout, max(1, max_samples // 10), ctx, "held-out samples")
            for i in range(len(extra.buffers)):
                extra.flush(i)
    finally:
        L.FFN_PROBE = None
    if n == 0:
        raise InputError("the corpus gave no tokens to profile")
    return probe.counts, n, thresholds


def plot(counts: list[torch.Tensor], tokens: int, path: Path) -> None:
    """Per layer: activation frequency by neuron rank (log-log), with the share of neurons that
    carries 80% of the activations."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5.5))
    cmap = plt.get_cmap("viridis")
    shares = []
    for i, c in enumerate(counts):
        f = np.sort(c.numpy() / tokens)[::-1]
        cum = np.cumsum(f) / max(f.sum(), 1e-12)
        share = (np.searchsorted(cum, 0.8) + 1) / len(f)
        shares.append(share)
        ax.loglog(np.arange(1, len(f) + 1), np.maximum(f, 1e-7), color=cmap(i / max(1, len(counts) - 1)),
                  lw=1, label=f"layer {i}: 80% in {100 * share:.0f}%" if len(counts) <= 12 or i % 4 == 0 else None)
    ax.set_xlabel("neuron rank (hottest first)")
    ax.set_ylabel("activation frequency (per token)")
    ax.set_title(f"FFN activation frequency over {tokens} tokens\n80% of activations come from "
                 f"{100 * float(np.mean(shares)):.0f}% of the neurons (mean over layers)", fontsize=11)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _main(args) -> int:
    from hybridsparse.runtime.loader import default_model_path, open_model
    model_path = Path(args.model) if args.model else default_model_path()
    if not 0.0 < args.sparsity < 1.0:
        raise InputError(f"--sparsity {args.sparsity}: expected a fraction between 0 and 1")
    if args.tokens <= 0:
        raise InputError(f"--tokens {args.tokens}: expected a positive number")
    torch.set_num_threads(args.threads)
    out = Path(args.output) if args.output else model_path.with_name(model_path.stem + ".hs-profile")
    docs = load_documents(args.corpus, args.text_field)
    calib, heldout = split(docs)
    if not calib:
        raise InputError(f"{args.corpus or 'the default corpus'}: no calibration text")
    lm = open_model(model_path, args.n_gpu_layers, args.device)
    t0 = time.perf_counter()
    sample_dir = out / "samples" if args.samples else None
    counts, n, thresholds = profile(lm, calib, args.tokens, args.batch, args.sparsity, args.calib_tokens,
                                    sample_dir, args.samples, heldout)
    dt = time.perf_counter() - t0
    relu = thresholds[0] is None
    density = [float(c.sum()) / (n * len(c)) for c in counts]
    meta = {"model": str(model_path), "model_fingerprint": model_fingerprint(model_path),
            "corpus": args.corpus or "python-stdlib-docstrings", "calibration_documents": len(calib),
            "heldout_documents": len(heldout), "criterion": "nonzero" if relu else "threshold",
            "target_sparsity": None if relu else args.sparsity, "thresholds": thresholds,
            "density_per_layer": density, "samples_per_layer": args.samples if args.samples else 0,
            "threshold_table": profile.threshold_table,
            "seconds": round(dt, 1)}
    save_profile(out, counts, n, meta)
    print(f"hs-profile: {n} tokens in {dt:.1f} s ({n / dt:.0f} tokens/s); mean density "
          f"{100 * float(np.mean(density)):.1f}% ({'values != 0' if relu else f'|act| above per-layer thresholds'})")
    if args.plot:
        png = out / "activation-frequency.png"
        plot(counts, n, png)
        print(f"hs-profile: plot {png}")
    print(f"hs-profile: wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hs-profile", description="Count how often each FFN neuron is active on a "
                                 "calibration corpus (PowerInfer's activation files + our metadata).")
    add_model_args(ap)
    ap.add_argument("--corpus", help="a text file, a folder, .jsonl or .parquet (default: Python's standard "
                    "library docstrings, available offline)")
    ap.add_argument("--text-field", default="text", help="field holding the text in jsonl/parquet (default: text)")
    ap.add_argument("--tokens", type=int, default=200_000, help="tokens to count (default: %(default)s)")
    ap.add_argument("-b", "--batch", type=int, default=512, help="tokens per forward window (default: %(default)s)")
    ap.add_argument("--sparsity", type=float, default=0.5, help="target share of inactive neurons for non-ReLU "
                    "models (default: %(default)s)")
    ap.add_argument("--calib-tokens", type=int, default=8192, help="tokens for the threshold calibration "
                    "(default: %(default)s)")
    ap.add_argument("--samples", type=int, default=0, help="also keep this many (input, mask) pairs per layer for "
                    "predictor training (default: 0)")
    ap.add_argument("--plot", action="store_true", help="write activation-frequency.png")
    ap.add_argument("-o", "--output", help="profile directory (default: <model>.hs-profile)")
    return ap


def main(argv=None) -> int:
    return run_main("hs-profile", _main, argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
