"""hs-solve: place a model's neurons under a VRAM budget (ILP, CBC) and write the GPU index.

  hs-solve --vram-budget 11 [-m MODEL] [--profile DIR] [--measure] [--reset-gpu-index]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from hybridsparse.profiler.activations import Profile, load_profile, profile_hash
from hybridsparse.runtime.cli import run_main
from hybridsparse.runtime.errors import InputError, ModelError
from hybridsparse.runtime.hybrid import DEFAULT_DOWN_T_TYPE

from .gpuidx import default_index_path, model_fingerprint, read_index, stale_reason, write_index
from .plan import (GiB, PREFILL_TOKENS, SOLVER_VERSION, Hardware, LayerShape, Problem, activation_bytes,
                   check_ubatch, solve)

FFN_PARTS = ("ffn_up", "ffn_gate", "ffn_down")


def model_problem(model_path: Path, profile_dir: Path, profile: Profile, vram_budget: int, hw: Hardware,
                  n_ctx: int, group: int, ubatch: int = PREFILL_TOKENS, down_t_type: str = DEFAULT_DOWN_T_TYPE) -> Problem:
    """Shapes and stored sizes from the GGUF (nothing read but its header), frequencies from the profile."""
    from hybridsparse.runtime.gguf_file import GGUFFile
    g = GGUFFile(model_path)
    side_path = model_path.with_name(model_path.stem + ".predictors.gguf")
    side = GGUFFile(side_path) if side_path.is_file() else None  # predictors kept beside the model
    try:
        arch = g.architecture
        n_layers = g.require(f"{arch}.block_count")
        if "token_embd.weight" not in g.tensors:
            raise ModelError(f"{model_path}: tensor token_embd.weight is missing")
        d_model = g.tensors["token_embd.weight"].shape[0]
        n_heads = g.get(f"{arch}.attention.head_count", 1) or 1
        n_kv = g.get(f"{arch}.attention.head_count_kv", n_heads) or n_heads
        head_dim = g.get(f"{arch}.attention.key_length", d_model // n_heads)
        if len(profile.counts) != n_layers:
            raise InputError(f"{profile_dir}: the profile has {len(profile.counts)} layers, {model_path.name} has "
                             f"{n_layers}: it was made for another model")
        freqs = profile.frequencies()
        layers = []
        for i in range(n_layers):
            prefix = f"blk.{i}."
            ffn = {n: t for n, t in g.tensors.items() if n.startswith(prefix) and n[len(prefix):].split(".")[0] in
                   (*FFN_PARTS, "ffn_down_t") and n.endswith(".weight")}
            down = ffn.get(prefix + "ffn_down.weight")
            if down is not None and prefix + "ffn_down_t.weight" not in ffn:
                ffn[down.name] = transposed_down_info(down, down_t_type)
            up = g.tensors.get(prefix + "ffn_up.weight")
            if up is None:
                raise ModelError(f"{model_path}: tensor {prefix}ffn_up.weight is missing")
            n_ff = up.rows
            if len(freqs[i]) != n_ff:
                raise InputError(f"{profile_dir}: layer {i} of the profile has {len(freqs[i])} neurons, the model "
                                 f"{n_ff}: it was made for another model")
            pred = sum(t.nbytes for n, t in g.tensors.items() if n.startswith(prefix + "fc"))
            if not pred and side is not None:
                pred = sum(t.nbytes for n, t in side.tensors.items() if n.startswith(prefix + "fc"))
            attn = [t for n, t in g.tensors.items() if n.startswith(prefix) and n not in ffn
                    and not n.startswith(prefix + "fc")]
            layers.append(LayerShape(n_ff, sum(t.nbytes for t in ffn.values()) // n_ff, sum(t.nbytes for t in attn),
                                     2 * n_ctx * n_kv * head_dim * 2, pred, freqs[i].numpy(),
                                     vram_neuron_bytes=sum(_gpu_nbytes(t) for t in ffn.values()) // n_ff,
                                     vram_attn_bytes=sum(_gpu_nbytes(t) for t in attn)))
        head = g.tensors.get("output.weight") or g.tensors["token_embd.weight"]
        norms = [t for n, t in g.tensors.items() if n.startswith("output_norm")]
        return Problem(layers, head.nbytes + sum(t.nbytes for t in norms), d_model, vram_budget, hw, group,
                       activation_bytes=activation_bytes(d_model, max(l.n_ff for l in layers), ubatch),
                       vram_head_bytes=_gpu_nbytes(head) + sum(_gpu_nbytes(t) for t in norms))
    finally:
        g.close()
        if side is not None:
            side.close()


def transposed_down_info(down, down_t_type: str = DEFAULT_DOWN_T_TYPE):
    """A llama.cpp-layout ffn_down as the hybrid runtime reads it: transposed once into rows of
    runtime.hybrid._transposed_type (Q8_0 or float16 for block formats, whose blocks cannot be transposed: 1.9x /
    3.6x the bytes of Q4_0 rows), read by the CPU for cold neurons and gathered onto the GPU for hot ones. The plan counts
    those bytes, not the file's (which undercounted a Q4_0 file's hot neurons' VRAM by ~1.8x)."""
    from gguf import GGML_QUANT_SIZES

    from hybridsparse.runtime.gguf_file import TensorInfo
    from hybridsparse.runtime.hybrid import _transposed_type
    n_ff, d_model = down.shape[0], down.rows  # ffn_down: d_model rows of n_ff
    qt = _transposed_type(down.qtype, d_model, down_t_type)
    block, size = GGML_QUANT_SIZES[qt]
    return TensorInfo(down.name.replace("ffn_down", "ffn_down_t"), (d_model, n_ff), qt, down.offset,
                      n_ff * d_model // block * size)


def transposes_block_down(model) -> bool:
    """Whether the runtime transposes a block-quantized ffn_down for this file (a llama.cpp-layout file whose
    ffn_down is not a float type): the one case where --down-t-type decides the bytes of its down rows.
    `model`: a path, or a GGUFFile already open (as model_fingerprint)."""
    from hybridsparse.runtime.gguf_file import GGUFFile
    from hybridsparse.runtime.quants import FLOAT_TYPES
    g = model if isinstance(model, GGUFFile) else GGUFFile(model)
    try:
        downs = [t for n, t in g.tensors.items() if n.endswith(".ffn_down.weight")]
        return any(t.qtype not in FLOAT_TYPES for t in downs) and not any(
            n.endswith(".ffn_down_t.weight") for n in g.tensors)
    finally:
        if g is not model:
            g.close()


def _gpu_nbytes(t) -> int:
    """Bytes a tensor takes on the GPU: as stored where the CUDA kernels read its format, else float16
    (the runtime dequantizes those once when it places them); 1-D tensors (norms, biases) as float32."""
    from hybridsparse.runtime import kernels
    from hybridsparse.runtime.quants import FLOAT_TYPES
    n = 1
    for d in t.shape:
        n *= d
    if len(t.shape) == 1:
        return 4 * n
    if t.qtype in FLOAT_TYPES or t.qtype in kernels.CUDA_SPARSE_QTYPES:
        return t.nbytes
    return 2 * n


def measure_hardware(args) -> Hardware:
    """Read bandwidths measured here (--measure) or given; PCIe hand-over latency measured if CUDA."""
    import time

    import torch

    from hybridsparse.runtime.bench import measure_bandwidth_gib_s
    gpu_bw = args.gpu_bandwidth * GiB
    cpu_bw = args.cpu_bandwidth * GiB
    sync = args.sync_us * 1e-6
    pcie_bw = args.pcie_bandwidth * GiB
    if args.measure:
        cpu_bw = measure_bandwidth_gib_s("cpu") * GiB
        if torch.cuda.is_available():
            gpu_bw = measure_bandwidth_gib_s("cuda") * GiB
            x = torch.zeros(args.d_model_probe, device="cuda")
            host = torch.zeros(args.d_model_probe, pin_memory=True)
            for _ in range(3):
                host.copy_(x)
            times = []
            for _ in range(50):
                t = time.perf_counter()
                host.copy_(x)
                x.copy_(host, non_blocking=False)
                times.append(time.perf_counter() - t)
            sync = float(np.median(times))
        print(f"hs-solve: measured CPU {cpu_bw / GiB:.1f} GiB/s, GPU {gpu_bw / GiB:.1f} GiB/s, "
              f"hand-over {sync * 1e6:.1f} us", file=sys.stderr)
    budget = args.pcie_budget * (1 << 20) if args.pcie_budget else None
    return Hardware(gpu_bw, cpu_bw, sync, pcie_bw, budget)


def default_budget_gib() -> float:
    import torch
    if not torch.cuda.is_available():
        raise InputError("--vram-budget is required without a CUDA GPU (it is the GPU memory to plan for, GiB)")
    free, _ = torch.cuda.mem_get_info()
    return max(0.0, free / GiB - 0.5)


def print_plan(plan, problem: Problem, out=None) -> None:
    out = out or sys.stdout
    r = plan.report
    print(f"{'layer':>5} {'GPU neurons':>15} {'attn':>5} {'GPU ms':>8} {'CPU ms':>8}  split", file=out)
    for L in r["layers"]:
        print(f"{L['layer']:>5} {L['gpu_neurons']:>7}/{L['n_ff']:<7} {'GPU' if L['attn_gpu'] else 'CPU':>5} "
              f"{L['gpu_ms']:8.3f} {L['cpu_ms']:8.3f}  {'yes' if L['split'] else ''}", file=out)
    graph = "one CUDA graph per decode step" if not r["eager_ms_per_token"] else \
        f"no CUDA graph (attention on the CPU): +{r['eager_ms_per_token']:.2f} ms/token"
    print(f"head on {'GPU' if r['head_gpu'] else 'CPU'}; {r['syncs_per_token']} CPU<->GPU hand-overs per token, "
          f"{r['pcie_bytes_per_token'] / 1024:.1f} KiB over PCIe; {graph}", file=out)
    print(f"solver: {plan.method} ({plan.status}, {plan.solve_s:.2f} s); predicted {r['ms_per_token']:.2f} ms/token "
          f"= {r['tokens_per_s']:.1f} tokens/s; VRAM {r['vram_bytes'] / GiB:.2f} of {problem.vram_budget / GiB:.2f} GiB",
          file=out)
    print(f"activation mass served by the GPU (PowerInfer's objective): {100 * r['gpu_activation_share']:.1f}%; "
          f"greedy plan: {r['greedy_ms_per_token']:.2f} ms/token, {100 * r['greedy_gpu_activation_share']:.1f}%",
          file=out)


# Figures a solve uses unless told or --measure: GPU and CPU read GiB/s, PCIe GiB/s, one hand-over in us.
DEFAULT_GPU_GIB_S, DEFAULT_CPU_GIB_S, DEFAULT_PCIE_GIB_S, DEFAULT_SYNC_US = 800.0, 50.0, 25.0, 20.0


def ensure_index(model: Path, profile_dir: Path, budget: int, n_ctx: int = 4096, group: int = 64,
                 ubatch: int = PREFILL_TOKENS, reset: bool = False, hw=None, time_limit: float = 30.0, greedy: bool = False,
                 index_path: Path | None = None, json_out: str | None = None, out=None, plan_out=None,
                 tag: str = "hs-solve", down_t_type: str = DEFAULT_DOWN_T_TYPE):
    """The GPU index for (model, profile, budget): the cached one if it matches, else solved and written.
    `hw`: a Hardware, or a function giving one (called only when a solve is needed: measuring takes
    seconds); None: the default figures. Messages go to `out` (stderr), the plan to `plan_out` (stdout).
    Returns (GpuIndex, solved: bool)."""
    out = out or sys.stderr
    index_path = index_path or default_index_path(model)
    profile = load_profile(profile_dir)
    from hybridsparse.runtime.gguf_file import GGUFFile
    g = GGUFFile(model)  # one header parse for both questions
    try:
        expect = {"model_fingerprint": model_fingerprint(g), "profile_hash": profile_hash(profile),
                  "vram_budget": budget, "solver_version": SOLVER_VERSION, "group": group, "n_ctx": n_ctx,
                  "ubatch": ubatch}
        if transposes_block_down(g):  # only then does --down-t-type change what the plan counts
            expect["down_t_type"] = down_t_type
    finally:
        g.close()
    if index_path.exists() and not reset:
        index = read_index(index_path)
        reason = stale_reason(index, expect, budget)
        if reason is None:
            print(f"{tag}: {index_path} matches this model, profile and budget; reusing it "
                  "(--reset-gpu-index solves again)", file=out)
            return index, False
        print(f"{tag}: {index_path} is stale ({reason}); solving again", file=out)
    hw = hw() if callable(hw) else hw
    hw = hw or Hardware(DEFAULT_GPU_GIB_S * GiB, DEFAULT_CPU_GIB_S * GiB, DEFAULT_SYNC_US * 1e-6,
                        DEFAULT_PCIE_GIB_S * GiB)
    problem = model_problem(model, profile_dir, profile, budget, hw, n_ctx, group, ubatch, down_t_type)
    plan = solve(problem, time_limit, "greedy" if greedy else "ilp")
    print_plan(plan, problem, out=plan_out)
    meta = {**expect, "attn_gpu": plan.attn_gpu, "head_gpu": plan.head_gpu, "method": plan.method,
            "predicted_tokens_per_s": plan.report["tokens_per_s"], "gpu_bandwidth": hw.gpu_bw,
            "cpu_bandwidth": hw.cpu_bw, "sync_s": hw.sync_s, "model": str(model)}
    write_index(index_path, plan.gpu_neurons(problem), [l.n_ff for l in problem.layers], budget, meta)
    print(f"{tag}: wrote {index_path}", file=out)
    if json_out:
        Path(json_out).write_text(json.dumps({"plan": plan.report, "meta": meta}, indent=2, default=float))
    return read_index(index_path), True


def _main(args) -> int:
    from hybridsparse.runtime.loader import default_model_path
    model = Path(args.model) if args.model else default_model_path()
    if not model.is_file():
        raise InputError(f"{model}: no such model file")
    profile_dir = Path(args.profile) if args.profile else model.with_name(model.stem + ".hs-profile")
    budget_gib = args.vram_budget if args.vram_budget is not None else default_budget_gib()
    check_ubatch(args.ubatch_size)
    ensure_index(model, profile_dir, int(budget_gib * GiB), args.ctx_size, args.group, args.ubatch_size, args.reset_gpu_index,
                 lambda: measure_hardware(args), args.time_limit, args.greedy,
                 Path(args.index) if args.index else None, args.json,
                 down_t_type=args.down_t_type)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hs-solve", description="Place hot neurons on the GPU under a VRAM budget "
                                 "(ILP solved by CBC) and write <model>.generated.gpuidx.")
    ap.add_argument("-m", "--model", help="GGUF model (default: the embedded Gemma 3 270M)")
    ap.add_argument("--profile", help="activation profile directory from hs-profile (default: <model>.hs-profile)")
    ap.add_argument("--vram-budget", type=float, help="GiB of GPU memory to use, everything counted "
                    "(default: free VRAM minus 0.5 GiB)")
    ap.add_argument("-c", "--ctx-size", type=int, default=4096, help="context for the KV cache (default: %(default)s)")
    ap.add_argument("-ub", "--ubatch-size", type=int, default=PREFILL_TOKENS, help="prompt tokens per pass on the "
                    "GPU that the plan keeps VRAM for (hs-run -ub; default: %(default)s)")
    ap.add_argument("--down-t-type", default=DEFAULT_DOWN_T_TYPE, choices=["f16", "q8_0"],
                    help="llama.cpp files with block-quantized ffn_down: the type of its transposed copy, which the "
                         "plan counts (as hs-run --down-t-type; default: %(default)s)")
    ap.add_argument("--group", type=int, default=64, help="neurons per placement unit (default: %(default)s)")
    ap.add_argument("--measure", action="store_true", help="measure CPU/GPU read bandwidth and the CPU<->GPU "
                    "hand-over here instead of the given figures")
    ap.add_argument("--gpu-bandwidth", type=float, default=DEFAULT_GPU_GIB_S, help="GPU read GiB/s (default: %(default)s)")
    ap.add_argument("--cpu-bandwidth", type=float, default=DEFAULT_CPU_GIB_S, help="CPU read GiB/s (default: %(default)s)")
    ap.add_argument("--pcie-bandwidth", type=float, default=DEFAULT_PCIE_GIB_S, help="PCIe GiB/s (default: %(default)s)")
    ap.add_argument("--sync-us", type=float, default=DEFAULT_SYNC_US, help="one CPU<->GPU hand-over, microseconds "
                    "(default: %(default)s)")
    ap.add_argument("--pcie-budget", type=float, help="MiB per token allowed over PCIe (default: no limit)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="CBC time limit, s; the best plan found by "
                    "then is used (default: %(default)s)")
    ap.add_argument("--greedy", action="store_true", help="skip the ILP: the greedy plan")
    ap.add_argument("-o", "--index", help="GPU index to write (default: <model>.generated.gpuidx)")
    ap.add_argument("--reset-gpu-index", action="store_true", help="solve again even if a matching index exists "
                    "(after an out-of-memory error, say)")
    ap.add_argument("--json", help="also write the plan as JSON here")
    ap.add_argument("--verbose", action="store_true")
    ap.set_defaults(d_model_probe=4096)
    return ap


def main(argv=None) -> int:
    return run_main("hs-solve", _main, argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
