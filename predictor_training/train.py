"""hs-train-predictor: one activation predictor per layer, `fc2(relu(fc1(x)))`, no biases.

Trained on the (FFN input, active mask) samples hs-profile --samples wrote (and reported on the
samples of held-out documents it wrote beside them, when there are some): class-weighted BCE,
AdamW, batch 1024, up to --epochs epochs, early stop when the predicted density at the recall
target stops improving on the held-out tenth (Deja Vu's recipe). Adaptive width: for each layer the
smallest hidden width r (from --widths) whose predicted density at the recall target is within
--density-slack of the true density, all within --budget of the model's FFN parameters. The decision
threshold of each layer is the largest logit cut that keeps recall >= --recall on held-out samples.

Writes `<model>.predictors.gguf` (PowerInfer's tensor layout: blk.N.fc1.weight [r, d_model],
blk.N.fc2.weight [n_ff, r]; per-layer thresholds under hybridsparse.predictor.thresholds) and a JSON
report. PowerInfer's own predictor directories (model_N.pt + config.json) load with
`load_powerinfer_dir`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hybridsparse.runtime.cli import run_main
from hybridsparse.runtime.errors import InputError


@dataclass
class LayerResult:
    layer: int
    width: int
    threshold: float
    recall: float
    precision: float
    predicted_density: float
    true_density: float
    params: int
    fc1: torch.Tensor
    fc2: torch.Tensor
    heldout: bool = False  # the figures are on held-out documents (else on the held-out tenth of samples)

    def row(self) -> dict:
        return {k: getattr(self, k) for k in ("layer", "width", "threshold", "recall", "precision",
                                              "predicted_density", "true_density", "params", "heldout")}


def load_samples(profile_dir: Path, layer: int, part: str = "samples") -> tuple[torch.Tensor, torch.Tensor]:
    d = profile_dir / part / f"layer_{layer}"
    shards = sorted(d.glob("shard_*.pt"))
    if not shards:
        raise InputError(f"{d}: no training samples (run hs-profile with --samples N first)")
    xs, ms = [], []
    for s in shards:
        try:
            data = torch.load(s, map_location="cpu", weights_only=True)
            xs.append(data["x"])
            ms.append(data["mask"])
        except Exception as e:
            raise InputError(f"{s}: unreadable sample shard ({type(e).__name__})") from None
    return torch.cat(xs), torch.cat(ms)


def threshold_for_recall(logits: torch.Tensor, target: torch.Tensor, recall: float) -> float:
    """The largest cut t with recall(logits >= t) >= `recall`: the (1 - recall) quantile of the
    logits of the truly active entries."""
    pos = logits[target]
    if pos.numel() == 0:
        return float("inf")
    k = int(np.floor((1.0 - recall) * pos.numel()))
    return float(torch.kthvalue(pos.float(), max(1, k + 1)).values) if k > 0 else float(pos.min())


def evaluate(fc1, fc2, x, target, thr) -> dict:
    with torch.no_grad():
        pred = F.linear(F.relu(F.linear(x, fc1)), fc2) >= thr
    tp = (pred & target).sum().item()
    return {"recall": tp / max(1, target.sum().item()), "precision": tp / max(1, pred.sum().item()),
            "predicted_density": pred.float().mean().item(), "true_density": target.float().mean().item()}


def train_layer(x: torch.Tensor, mask: torch.Tensor, width: int, recall: float, epochs: int, lr: float,
                seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, float, dict]:
    g = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    perm = torch.randperm(n, generator=g)
    n_val = max(1, n // 10)
    val, tr = perm[:n_val], perm[n_val:]
    x = x.float().to(device)
    mask = mask.to(device)
    d, n_ff = x.shape[1], mask.shape[1]
    torch.manual_seed(seed)
    fc1 = torch.nn.Linear(d, width, bias=False).to(device)
    fc2 = torch.nn.Linear(width, n_ff, bias=False).to(device)
    opt = torch.optim.AdamW(list(fc1.parameters()) + list(fc2.parameters()), lr=lr, weight_decay=0.01)
    density = mask[tr].float().mean(0).clamp(1e-4, 1 - 1e-4)
    pos_weight = ((1 - density) / density).clamp(max=50.0)  # class weights per neuron
    best, best_density, stale = None, float("inf"), 0
    for _ in range(epochs):
        order = tr[torch.randperm(tr.numel(), generator=g)]
        for s in range(0, order.numel(), 1024):
            b = order[s:s + 1024]
            logits = fc2(F.relu(fc1(x[b])))
            loss = F.binary_cross_entropy_with_logits(logits, mask[b].float(), pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        with torch.no_grad():
            logits = fc2(F.relu(fc1(x[val])))
        thr = threshold_for_recall(logits, mask[val], recall)
        dens = (logits >= thr).float().mean().item()
        if dens < best_density - 1e-4:
            best = (fc1.weight.detach().clone(), fc2.weight.detach().clone(), thr)
            best_density, stale = dens, 0
        else:
            stale += 1
            if stale >= 2:  # early stop: the density at the recall target stopped improving
                break
    w1, w2, thr = best
    return w1.cpu(), w2.cpu(), thr, evaluate(w1, w2, x[val], mask[val], thr)


def train(profile_dir: Path, n_layers: int, d_model: int, n_ff: list[int], widths: list[int], recall: float,
          budget_params: int, slack: float, epochs: int, lr: float, device: torch.device,
          log=print) -> list[LayerResult]:
    from tqdm import tqdm
    results = []
    remaining = budget_params  # a total: what a layer leaves unused, later layers may use
    for layer in tqdm(range(n_layers), desc="training predictors", unit="layer", file=sys.stderr):
        per_layer_budget = remaining // (n_layers - layer)
        x, packed = load_samples(profile_dir, layer)
        mask = torch.from_numpy(np.unpackbits(packed.numpy(), axis=1)[:, :n_ff[layer]].astype(bool))
        if x.shape[1] != d_model:
            raise InputError(f"{profile_dir}: samples of layer {layer} have {x.shape[1]} features, the model {d_model}")
        true_density = mask.float().mean().item()
        chosen = None
        for w in widths:
            params = w * (d_model + n_ff[layer])
            if params > per_layer_budget and chosen is not None:
                break
            w1, w2, thr, m = train_layer(x, mask, w, recall, epochs, lr, layer, device)
            r = LayerResult(layer, w, thr, m["recall"], m["precision"], m["predicted_density"], m["true_density"],
                            params, w1, w2)
            if chosen is None or r.predicted_density < chosen.predicted_density:
                chosen = r
            if r.predicted_density <= slack * max(true_density, 1e-6) or params > per_layer_budget:
                break  # the smallest width that is good enough (or the largest the budget allows)
        if chosen.params > per_layer_budget:
            log(f"layer {layer:3d}: even the smallest width ({chosen.width}) is over this layer's share of the "
                f"predictor budget ({chosen.params} > {per_layer_budget} parameters): add a smaller --widths")
        remaining -= chosen.params
        if (profile_dir / "samples_heldout" / f"layer_{layer}").is_dir():  # text never trained on
            hx, hpacked = load_samples(profile_dir, layer, "samples_heldout")
            hmask = torch.from_numpy(np.unpackbits(hpacked.numpy(), axis=1)[:, :n_ff[layer]].astype(bool))
            m = evaluate(chosen.fc1, chosen.fc2, hx.float(), hmask, chosen.threshold)
            chosen.recall, chosen.precision = m["recall"], m["precision"]
            chosen.predicted_density, chosen.true_density = m["predicted_density"], m["true_density"]
            chosen.heldout = True
        results.append(chosen)
        log(f"layer {layer:3d}: width {chosen.width:5d}  recall {chosen.recall:.3f}  precision {chosen.precision:.3f}  "
            f"predicted density {chosen.predicted_density:.3f} vs true {chosen.true_density:.3f}")
    return results


def write_predictors(path: Path, results: list[LayerResult], meta: dict) -> Path:
    from hybridsparse.runtime.gguf_writer import PlannedTensor
    from gguf import GGMLQuantizationType as Q
    tensors = []
    for r in results:
        tensors += [PlannedTensor(f"blk.{r.layer}.fc1.weight", tuple(r.fc1.shape), Q.F16, lambda r=r: r.fc1.half().numpy()),
                    PlannedTensor(f"blk.{r.layer}.fc2.weight", tuple(r.fc2.shape), Q.F16, lambda r=r: r.fc2.half().numpy())]
    return write_predictor_file(path, [float(r.threshold) for r in results], meta, tensors)


def write_predictor_file(path: Path, thresholds: list[float], meta: dict, tensors: list) -> Path:
    """Our predictor side file: per-layer thresholds, metadata, and `tensors` (gguf_writer.PlannedTensor:
    blk.N.fc1/fc2 in F16, made one at a time as they are written), atomically."""
    from hybridsparse.runtime.gguf_writer import write_gguf_stream

    def metadata(w):
        w.add_uint32("hybridsparse.predictor.block_count", len(thresholds))
        w.add_array("hybridsparse.predictor.thresholds", [float(t) for t in thresholds])
        w.add_string("hybridsparse.meta", json.dumps(meta, sort_keys=True))
    return write_gguf_stream(path, "hybridsparse.predictors", metadata, tensors, desc=False)


def load_predictors(path: str | Path) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[float], dict]:
    """(fc1, fc2) float32 per layer, thresholds, metadata: from our side file or a PowerInfer GGUF
    (blk.N.fc1/fc2 inside the model; threshold powerinfer.sparse_threshold, default 0)."""
    from hybridsparse.runtime.gguf_file import GGUFFile
    from hybridsparse.runtime.quants import dequantize
    g = GGUFFile(path)
    layers, i = [], 0
    while f"blk.{i}.fc1.weight" in g.tensors:
        pair = []
        for name in (f"blk.{i}.fc1.weight", f"blk.{i}.fc2.weight"):
            if name not in g.tensors:
                raise InputError(f"{path}: tensor {name} is missing")
            pair.append(dequantize(g.raw(name), g.tensors[name].qtype).float().clone())
        layers.append(tuple(pair))
        i += 1
    if not layers:
        raise InputError(f"{path}: no predictor tensors (blk.N.fc1.weight)")
    thr = g.get("hybridsparse.predictor.thresholds")
    thresholds = [float(t) for t in thr] if thr is not None else [float(g.get("powerinfer.sparse_threshold", 0.0))] * len(layers)
    meta = json.loads(g.get("hybridsparse.meta", "{}"))
    return layers, thresholds, meta


def load_powerinfer_dir(path: str | Path) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[float]]:
    """PowerInfer's released predictors: model_N.pt (state dicts with fc1.weight, fc2.weight) and
    an optional config.json with sparse_threshold."""
    path = Path(path)
    files = {int(p.stem.split("_")[1]): p for p in path.glob("model_*.pt") if p.stem.split("_")[1].isdigit()}
    if not files or sorted(files) != list(range(len(files))):
        raise InputError(f"{path}: expected model_0.pt ... model_N.pt (PowerInfer's predictor layout)")
    thr = 0.0
    if (path / "config.json").is_file():
        thr = float(json.loads((path / "config.json").read_text()).get("sparse_threshold", 0.0))
    layers = []
    for i in range(len(files)):
        sd = torch.load(files[i], map_location="cpu", weights_only=True)
        if "fc1.weight" not in sd or "fc2.weight" not in sd:
            raise InputError(f"{files[i]}: missing fc1.weight / fc2.weight")
        layers.append((sd["fc1.weight"].float(), sd["fc2.weight"].float()))
    return layers, [thr] * len(layers)


def _main(args) -> int:
    from hybridsparse.runtime.gguf_file import GGUFFile
    from hybridsparse.runtime.loader import default_model_path
    from hybridsparse.solver.gpuidx import model_fingerprint
    model = Path(args.model) if args.model else default_model_path()
    profile_dir = Path(args.profile) if args.profile else model.with_name(model.stem + ".hs-profile")
    if not 0.5 <= args.recall < 1.0:
        raise InputError(f"--recall {args.recall}: expected a fraction in [0.5, 1)")
    g = GGUFFile(model)
    arch = g.architecture
    n_layers = g.require(f"{arch}.block_count")
    d_model = g.tensors["token_embd.weight"].shape[0]
    n_ff = [g.tensors[f"blk.{i}.ffn_up.weight"].rows for i in range(n_layers)]
    ffn_params = sum(3 * d_model * n for n in n_ff)
    widths = sorted(int(w) for w in args.widths.split(","))
    device = torch.device(args.device if args.device else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if not 0.0 <= args.recall_margin < 1.0 - args.recall:
        raise InputError(f"--recall-margin {args.recall_margin}: expected >= 0 and below 1 - --recall")
    results = train(profile_dir, n_layers, d_model, n_ff, widths, args.recall + args.recall_margin,
                    int(args.budget * ffn_params),
                    args.density_slack, args.epochs, args.lr, device)
    total = sum(r.params for r in results)
    summary = {"recall_min": min(r.recall for r in results), "recall_mean": float(np.mean([r.recall for r in results])),
               "precision_mean": float(np.mean([r.precision for r in results])),
               "predicted_over_true_density": float(np.mean([r.predicted_density / max(r.true_density, 1e-9)
                                                             for r in results])),
               "params": total, "share_of_ffn_params": total / ffn_params, "seconds": round(time.perf_counter() - t0, 1)}
    print(f"hs-train-predictor: recall >= {summary['recall_min']:.3f} (mean {summary['recall_mean']:.3f}), precision "
          f"{summary['precision_mean']:.3f}, predicted/true density {summary['predicted_over_true_density']:.2f}x, "
          f"{total / 1e6:.2f} M parameters = {100 * summary['share_of_ffn_params']:.1f}% of the FFN's")
    out = Path(args.output) if args.output else model.with_name(model.stem + ".predictors.gguf")
    meta = {"model_fingerprint": model_fingerprint(model), "recall_target": args.recall,
            "recall_margin": args.recall_margin, "profile": str(profile_dir)}
    write_predictors(out, results, meta)
    report = out.with_suffix(".json")
    report.write_text(json.dumps({"summary": summary, "layers": [r.row() for r in results]}, indent=2))
    print(f"hs-train-predictor: wrote {out} and {report}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hs-train-predictor", description="Train the per-layer activation predictors "
                                 "from hs-profile's samples.")
    ap.add_argument("-m", "--model", help="GGUF model (default: the embedded Gemma 3 270M)")
    ap.add_argument("--profile", help="profile directory with samples/ (default: <model>.hs-profile)")
    ap.add_argument("--recall", type=float, default=0.99, help="recall target per layer (default: %(default)s)")
    ap.add_argument("--recall-margin", type=float, default=0.004, help="thresholds are set for recall + this on "
                    "the validation samples, since text the predictors never saw costs some recall "
                    "(default: %(default)s)")
    ap.add_argument("--widths", default="32,64,128,256,512,1024", help="hidden widths to try, smallest first")
    ap.add_argument("--budget", type=float, default=0.10, help="predictor parameters as a share of the FFN's "
                    "(default: %(default)s)")
    ap.add_argument("--density-slack", type=float, default=1.5, help="accept a width once predicted density <= "
                    "this times the true density (default: %(default)s)")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("-t", "--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    ap.add_argument("-o", "--output", help="predictor file (default: <model>.predictors.gguf)")
    ap.add_argument("--verbose", action="store_true")
    return ap


def main(argv=None) -> int:
    return run_main("hs-train-predictor", _main, argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
