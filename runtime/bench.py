"""hs-bench: speed measured side by side in one run, JSON out.

  hs-bench run   [-m MODEL] [-t N] [-ngl N] [--reps 3] [--llama-cpp]   decode/prefill tokens/s
  hs-bench synth --shape llama-7b --dtype f16 -o DIR                    a random model of a real shape
  hs-bench kernels [--device cpu|cuda] [-t N] [--shapes ...] --json OUT   sparse ops, GiB/s by density
  hs-bench table FILE.json ...                                          the README's markdown table
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .cli import CACHE_TYPES, add_model_args, cache_dtype, default_threads, run_main
from .errors import InputError

# The environment switches that change what the runtime computes or how fast (the README's table),
# recorded with every benchmark result; the tools' own variables (HS_STAGES, ...) are not.
RUNTIME_SWITCHES = frozenset(
    "HS_ACT_PLANES HS_AXPY_TOKENS HS_COLD_POOL HS_COLD_SKIP HS_COLD_STREAM HS_CPU_GEMM_BF16 HS_CPU_GEMM_TOKENS HS_CPU_PATH HS_CPU_SPARSE_GEMM_TOKENS "
    "HS_CUDA_ATT_FUSE HS_CUDA_ATT_UNROLL HS_CUDA_FUSE HS_CUDA_GEMV HS_CUDA_PDL HS_CUDA_QUANT_X HS_CUDA_STAGED HS_CUDA_STAGED_Q8 HS_CUDA_WANT_WARPS HS_FFN_CHUNK HS_FFN_OVERLAP HS_FFN_ROWS HS_FUSED_FFN HS_GATE_FIRST HS_GEMV_STREAMS HS_GRAPH_WAIT HS_HANDOVER "
    "HS_HOST_NODES HS_HOT_GRAPHS HS_MASKED_DENSE HS_NEXT_ROWS HS_NO_KERNELS HS_POOL_SPIN_US HS_POOL_YIELD_US HS_PREFETCH HS_PROMPT_ROWS16 HS_Q4_AHEAD HS_Q4_PREFETCH HS_Q4_WIDE "
    "HS_RUN_GRAPHS HS_RUN_POOL HS_SANITIZE".split())


def machine() -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "cpu_threads_available": default_threads(),
            "torch": torch.__version__}
    try:
        with open("/proc/cpuinfo") as fh:
            info["cpu"] = next(l.split(":", 1)[1].strip() for l in fh if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from . import kernels
    if kernels.available():
        info["cpu_kernel_path"] = kernels.cpu.cpu_path()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1))
    settings = {k: v for k, v in sorted(os.environ.items()) if k in RUNTIME_SWITCHES and v}
    if settings:  # the runtime's switches in force (HS_HANDOVER, HS_ACT_PLANES, ...): part of what was measured
        info["settings"] = settings
    return info


def measure_bandwidth_gib_s(device: str) -> float:
    """Read bandwidth: a sum over a buffer much larger than the caches, the median of several (the
    best of five sums over 256 MiB gave 79 to 150 GiB/s on machines of one kind, which made the
    roofline fractions swing with it). On the CPU also the compiled float16 GEMV of one token over a
    1 GiB matrix, the faster of the two: torch's sum read 81 GiB/s on an H100 machine whose dense
    layer split then streamed its CPU layers at ~99 GiB/s (121% of a roofline drawn from the sum).
    Since session 24 that GEMV reads each thread's rows as 4 streams (HS_GEMV_STREAMS), ~20% faster on
    the GPU machine's CPU, which raises the CPU bound of every roofline measured after it."""
    n = (2 << 30) // 4 if device == "cuda" else (1 << 30) // 4
    x = torch.ones(n, device=device)

    def median_s(fn) -> float:
        times = []
        for _ in range(8):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    best = n * 4 / median_s(x.sum) / 2**30
    del x
    from . import kernels
    if device == "cpu" and kernels.ops() is not None:
        from .quants import Q
        w = torch.full((1 << 15, 1 << 14), 0.5, dtype=torch.float16)  # 1 GiB of rows
        v = torch.ones(1, 1 << 14)
        best = max(best, w.numel() * 2 / median_s(lambda: kernels.cpu.qmatmul(w, int(Q.F16), v)) / 2**30)
    return best


class HSRunner:
    """hybridsparse on one model: `once()` is one prefill + greedy decode, timed."""

    engine = "hybridsparse"

    def __init__(self, model_path, threads: int, n_gpu_layers: int, prompt_tokens: int, n_gen: int,
                 graphs: bool = True, cache: torch.dtype = torch.float16):
        from .generate import Generator
        from .loader import open_model
        torch.set_num_threads(threads)
        self.lm = lm = open_model(model_path, n_gpu_layers, cache_dtype=cache)
        base = lm.tokenizer.encode("Once upon a time")
        self.prompt = (base * (prompt_tokens // len(base) + 1))[:prompt_tokens]
        self.n_gen, self.threads, self.graphs = n_gen, threads, graphs
        self.n_gpu_layers = n_gpu_layers
        self.gen = Generator(lm.model, lm.tokenizer, prompt_tokens + n_gen + 8, use_graphs=graphs)

    def once(self) -> dict:
        from .sampling import Sampler, SamplingParams
        torch.set_num_threads(self.threads)
        for _piece in self.gen.generate(self.prompt, self.n_gen, Sampler(SamplingParams(temperature=0))):
            pass
        t = self.gen.timings
        return {"prefill_tok_s": t.prompt_tokens / t.prompt_s,
                "decode_tok_s": max(t.gen_tokens - 1, 1) / t.gen_s, "generated": t.gen_tokens}

    def bytes_per_token(self) -> tuple[int, int]:
        """Weight bytes read per decoded token on the CPU and on the GPU, from the placement: every
        weight except the embedding table, of which one row is read (unless it is the tied head)."""
        g, p = self.lm.gguf, self.lm.model.placement
        tied = "output.weight" not in g.tensors
        on = {"cpu": 0, "cuda": 0}
        for name, info in g.tensors.items():
            if name == "token_embd.weight" and not tied:
                continue
            if name.startswith("blk."):
                dev = p.layers[int(name.split(".")[1])]
            else:
                dev = p.head
            on[dev.type] += info.nbytes
        return on["cpu"], on["cuda"]

    def describe(self) -> dict:
        p = self.lm.model.placement
        on_gpu = sum(d.type == "cuda" for d in p.layers) + (p.head.type == "cuda")
        cpu_bytes, gpu_bytes = self.bytes_per_token()
        return {"engine": self.engine, "threads": self.threads, "n_gpu_layers": on_gpu,
                "cuda_graphs": self.graphs, "model": str(self.lm.gguf.path),
                "weights_bytes_per_token": cpu_bytes + gpu_bytes,
                "cpu_bytes_per_token": cpu_bytes, "gpu_bytes_per_token": gpu_bytes}


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python on the same file, same prompt, greedy."""

    engine = "llama.cpp (llama-cpp-python)"

    def __init__(self, model_path, threads: int, n_gpu_layers: int, prompt_tokens: int, n_gen: int):
        from llama_cpp import Llama
        self.llm = Llama(model_path=str(model_path), n_threads=threads, n_gpu_layers=n_gpu_layers,
                         n_ctx=prompt_tokens + n_gen + 8, n_batch=max(512, prompt_tokens + n_gen + 8),
                         verbose=False, seed=0)
        base = self.llm.tokenize(b"Once upon a time", add_bos=True)
        self.prompt = (base * (prompt_tokens // len(base) + 1))[:prompt_tokens]
        self.n_gen, self.threads, self.n_gpu_layers = n_gen, threads, n_gpu_layers

    def once(self) -> dict:
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(self.prompt)
        t1 = time.perf_counter()
        for _ in range(self.n_gen - 1):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        t2 = time.perf_counter()
        return {"prefill_tok_s": len(self.prompt) / (t1 - t0), "decode_tok_s": (self.n_gen - 1) / (t2 - t1)}

    def describe(self) -> dict:
        return {"engine": self.engine, "threads": self.threads, "n_gpu_layers": self.n_gpu_layers}


def measure(runners: list, reps: int) -> list[dict]:
    """Warm each runner up once, then alternate them rep by rep, so drift in a noisy machine hits
    all of them alike; medians per runner, plus the per-rep runs."""
    for r in runners:
        r.once()
    runs = [[] for _ in runners]
    for _ in range(reps):
        for i, r in enumerate(runners):
            runs[i].append(r.once())
    out = []
    for r, rs in zip(runners, runs):
        out.append({**r.describe(), "prefill_tok_s": statistics.median(x["prefill_tok_s"] for x in rs),
                    "decode_tok_s": statistics.median(x["decode_tok_s"] for x in rs), "runs": rs})
    return out


def write_json(path: str | None, result: dict) -> None:
    """A benchmark's result as JSON at `path` (its folder made), when a path is given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))


def _hybrid_args(model, threads: int, budgets: str, n_predict: int, prompt_tokens: int, reps: int, mode: str,
                 no_cpu_only: bool, timeout: float, json_path: str | None, **extra) -> argparse.Namespace:
    """`hs-bench hybrid`'s arguments for `run --vram-budget` and `scenario`: a context of the prompt and
    the generated tokens rounded up to 256 (at least 512)."""
    return argparse.Namespace(model=model, threads=threads, budgets=budgets, n_predict=n_predict,
                              prompt_tokens=prompt_tokens, reps=reps, mode=mode, no_ngl=False, no_cpu_only=no_cpu_only,
                              timeout=timeout, json=json_path,
                              ctx_size=max(512, -(-(prompt_tokens + n_predict + 4) // 256) * 256), **extra)


def _run(args) -> int:
    cache = cache_dtype(args)
    if args.vram_budget is not None:  # the four engines side by side, each in its own process
        return _hybrid(_hybrid_args(args.model, args.threads, str(args.vram_budget), args.n_predict,
                                    args.prompt_tokens, args.reps, args.mode, args.no_cpu_only, args.timeout,
                                    args.json, cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                                    llama_cpp=args.llama_cpp, llama_cpp_model=args.llama_cpp_model))
    from .loader import default_model_path
    model = Path(args.model) if args.model else default_model_path()
    if args.n_gpu_layers is None:
        args.n_gpu_layers = -1
    device = "cuda" if torch.cuda.is_available() and args.n_gpu_layers != 0 else "cpu"
    result = {"machine": machine(), "prompt_tokens": args.prompt_tokens, "generated_tokens": args.n_predict,
              "reps": args.reps, "kv_cache_cpu": str(cache).removeprefix("torch."), "results": []}
    result["machine"]["cpu_read_bandwidth_gib_s"] = round(measure_bandwidth_gib_s("cpu"), 1)
    if device == "cuda":
        result["machine"]["gpu_read_bandwidth_gib_s"] = round(measure_bandwidth_gib_s("cuda"), 1)
    runners = [HSRunner(model, args.threads, args.n_gpu_layers, args.prompt_tokens, args.n_predict, cache=cache)]
    if args.compare_graphs and device == "cuda":
        runners.append(HSRunner(model, args.threads, args.n_gpu_layers, args.prompt_tokens, args.n_predict,
                                graphs=False, cache=cache))
    if args.llama_cpp:
        try:
            runners.append(LlamaCppRunner(model, args.threads, args.n_gpu_layers if device == "cuda" else 0,
                                          args.prompt_tokens, args.n_predict))
        except ImportError:
            print("hs-bench: llama-cpp-python is not installed; skipping llama.cpp", file=sys.stderr)
    result["results"] = measure(runners, args.reps)
    hs = result["results"][0]
    m = result["machine"]
    # the roofline: each device reads its share of the weights at its measured bandwidth, one after
    # the other (the dense layer split does not overlap them)
    bound = hs["cpu_bytes_per_token"] / (m["cpu_read_bandwidth_gib_s"] * 2**30)
    if hs["gpu_bytes_per_token"]:
        bound += hs["gpu_bytes_per_token"] / (m["gpu_read_bandwidth_gib_s"] * 2**30)
    result["bandwidth_bound_decode_tok_s"] = 1.0 / bound
    result["fraction_of_bound"] = hs["decode_tok_s"] * bound
    ref = next((r for r in result["results"] if r["engine"].startswith("llama.cpp")), None)
    if ref is not None:
        idx = result["results"].index(ref)
        pairs = zip(hs["runs"], result["results"][idx]["runs"])
        result["decode_ratio_vs_llama_cpp"] = statistics.median(a["decode_tok_s"] / b["decode_tok_s"] for a, b in pairs)
        result["prefill_ratio_vs_llama_cpp"] = hs["prefill_tok_s"] / ref["prefill_tok_s"]
    write_json(args.json, result)
    print(f"{'engine':32s} {'prefill tok/s':>14s} {'decode tok/s':>13s}  (medians of {args.reps} alternating runs)")
    for r in result["results"]:
        label = r["engine"] + ("" if r.get("cuda_graphs", True) else " (no graphs)")
        print(f"{label:32s} {r['prefill_tok_s']:14.1f} {r['decode_tok_s']:13.1f}")
    bws = ", ".join(f"{k.split('_')[0].upper()} {v} GiB/s" for k, v in m.items() if k.endswith("bandwidth_gib_s"))
    print(f"bandwidth bound: {result['bandwidth_bound_decode_tok_s']:.1f} tok/s ({bws}); "
          f"reached {100 * result['fraction_of_bound']:.1f}%")
    if "decode_ratio_vs_llama_cpp" in result:
        print(f"decode vs llama.cpp: {result['decode_ratio_vs_llama_cpp']:.2f}x (median of per-run ratios), "
              f"prefill: {result['prefill_ratio_vs_llama_cpp']:.2f}x")
    return 0


def write_synthetic_activity(path: Path, layers: int, d: int, ff: int, density: float, hot_share: float,
                             width: int) -> None:
    """Beside a synthetic model: an activation profile with published statistics (`<model>.hs-profile`)
    and random predictors of a realistic width (`<model>.predictors.gguf`, their cost is real; the
    runtime's `sampled` mode draws each token's active set from the profile instead of using them)."""
    from hybridsparse.predictor_training.train import LayerResult, write_predictors
    from hybridsparse.profiler.activations import save_profile
    from .synth import zipf_frequencies
    rng = np.random.default_rng(1)
    tokens = 100_000
    counts = [torch.from_numpy(zipf_frequencies(ff, density, hot_share, rng) * tokens) for _ in range(layers)]
    save_profile(path.with_name(path.stem + ".hs-profile"), counts, tokens,
                 {"criterion": "synthetic", "density": density, "hot_share_80": hot_share})
    g = torch.Generator().manual_seed(0)
    results = [LayerResult(i, width, 0.0, 0.0, 0.0, density, density, width * (d + ff),
                           torch.randn(width, d, generator=g) * 0.02, torch.randn(ff, width, generator=g) * 0.02)
               for i in range(layers)]
    write_predictors(path.with_name(path.stem + ".predictors.gguf"), results, {"synthetic": True})


def _ngl_for_budget(model: Path, budget: int, n_ctx: int) -> int:
    """The most layers llama.cpp's split fits in `budget`, counted as the solver counts VRAM."""
    from hybridsparse.solver.plan import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, margin_bytes
    from .gguf_file import GGUFFile
    g = GGUFFile(model)
    a = g.architecture
    n_layers, d = g.require(f"{a}.block_count"), g.tensors["token_embd.weight"].shape[0]
    n_kv = g.get(f"{a}.attention.head_count_kv", g.get(f"{a}.attention.head_count"))
    hd = g.get(f"{a}.attention.key_length", d // g.get(f"{a}.attention.head_count"))
    per_layer = [sum(t.nbytes for n, t in g.tensors.items() if n.startswith(f"blk.{i}.")) + 4 * n_ctx * n_kv * hd
                 for i in range(n_layers)]
    head = (g.tensors.get("output.weight") or g.tensors["token_embd.weight"]).nbytes
    g.close()
    free = budget - CUDA_CONTEXT_BYTES - CUBLAS_WORKSPACE_BYTES - (64 << 20) - margin_bytes(budget)
    k = 0
    while k < n_layers and sum(per_layer[n_layers - k - 1:]) <= free:
        k += 1
    if k == n_layers and sum(per_layer) + head <= free:  # llama.cpp's -ngl n_layers + 1: the output layer too
        k += 1
    return k


class _GpuMemoryPoller:
    """Peak device memory in use, read from the driver (NVML) every 5 ms while a child runs."""

    def __init__(self, index: int = 0):
        import threading
        from .nvml import device_used_bytes
        self.used = device_used_bytes
        self.index, self.peak, self.stop = index, 0, threading.Event()
        self.ok = device_used_bytes(index) is not None
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def read(self) -> int:
        return self.used(self.index) or 0

    def _loop(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.read())
            self.stop.wait(0.005)

    def __enter__(self):
        if self.ok:
            self.base = self.read()
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.ok:
            self.thread.join()


def _hybrid(args) -> int:
    """Hybrid vs the dense layer split at the same VRAM budgets vs CPU only, each in its own process
    (so each one's device memory is its own), peak device memory read from the driver."""
    import subprocess
    from .loader import default_model_path
    model = Path(args.model) if args.model else default_model_path()
    if args.ctx_size < args.prompt_tokens + args.n_predict + 4:
        raise InputError(f"--ctx-size {args.ctx_size} is too small for a {args.prompt_tokens}-token prompt and "
                         f"-n {args.n_predict}")
    gpu = torch.cuda.is_available()
    torch.set_num_threads(args.threads)  # the CPU bandwidth below is measured with the threads the engines get
    result = {"machine": machine(), "model": str(model), "generated_tokens": args.n_predict, "mode": args.mode,
              "ctx_size": args.ctx_size, "prompt_tokens": args.prompt_tokens, "reps": args.reps,
              "threads": args.threads, "runs": []}
    if getattr(args, "scenario", None):
        result["scenario"] = args.scenario
    m = result["machine"]
    m["cpu_read_bandwidth_gib_s"] = round(measure_bandwidth_gib_s("cpu"), 1)
    if gpu:
        m["gpu_read_bandwidth_gib_s"] = round(measure_bandwidth_gib_s("cuda"), 1)
        torch.cuda.empty_cache()
    configs = []
    for b in ([float(x) for x in args.budgets.split(",") if x.strip()] if gpu else []):
        configs.append({"engine": "hybrid", "vram_budget": b})
        if not args.no_ngl:
            configs.append({"engine": "layer split", "vram_budget": b,
                            "ngl": _ngl_for_budget(model, int(b * 2**30), args.ctx_size)})
    if not args.no_cpu_only:
        configs += [{"engine": "hybrid", "vram_budget": 0.0}, {"engine": "layer split", "vram_budget": 0.0, "ngl": 0}]
    if getattr(args, "llama_cpp", False):  # llama.cpp beside each dense run, at its -ngl
        configs = [c for cfg in configs for c in
                   ([cfg, {**cfg, "engine": "llama.cpp"}] if cfg["engine"] == "layer split" else [cfg])]
    for cfg in configs:
        cfg.update(model=str(model), threads=args.threads, n_predict=args.n_predict, mode=args.mode,
                   fixed_bandwidth=getattr(args, "fixed_bandwidth", False),
                   cache_type=str(cache_dtype(args)).removeprefix("torch."),
                   ctx_size=args.ctx_size, prompt_tokens=args.prompt_tokens, reps=args.reps, cpu_bw=m["cpu_read_bandwidth_gib_s"],
                   gpu_bw=m.get("gpu_read_bandwidth_gib_s", 0.0))
        if cfg["engine"] == "llama.cpp" and getattr(args, "llama_cpp_model", None):
            cfg["model"] = str(args.llama_cpp_model)
        poll = _GpuMemoryPoller() if cfg["vram_budget"] > 0 else None  # CPU only: no NVML reads beside it
        with poll or contextlib.nullcontext():
            p = subprocess.run([sys.executable, "-m", "hybridsparse.runtime.bench", "hybrid-one", json.dumps(cfg)],
                               capture_output=True, text=True, timeout=args.timeout)
        line = next((l for l in p.stdout.splitlines()[::-1] if l.startswith("{")), None)
        if p.returncode != 0 or line is None:
            err = (p.stderr.strip().splitlines() or ["?"])[-1]
            run = {**cfg, "error": err}
        else:
            run = {**cfg, **json.loads(line)}
        if poll and poll.ok:
            run["peak_device_bytes"] = poll.peak - poll.base
            run["within_budget"] = run["peak_device_bytes"] <= cfg["vram_budget"] * 2**30
        result["runs"].append(run)
        print(_hybrid_row(run), file=sys.stderr)
        write_json(args.json, result)  # after each run: a session cut short still leaves its results
    for run in result["runs"]:  # ratios side by side at each budget
        def at_budget(engine):
            return next((r for r in result["runs"] if r["vram_budget"] == run["vram_budget"] and r is not run
                         and r["engine"] == engine and "decode_tok_s" in r), None)
        split, llama = at_budget("layer split"), at_budget("llama.cpp")
        if run["engine"] == "llama.cpp" and split and "decode_tok_s" in run:
            # llama.cpp reads what our dense split reads: the same roofline, at the bandwidth around its runs
            run.update(_bound_fields(run["reps"], lambda bw, _run: _split_bound_s(split, bw), split["cpu_bw"]))
        if run["engine"] == "hybrid" and "decode_tok_s" in run:
            if split:
                run["speedup_vs_layer_split"] = run["decode_tok_s"] / split["decode_tok_s"]
            if llama:
                run["speedup_vs_llama_cpp"] = run["decode_tok_s"] / llama["decode_tok_s"]
    write_json(args.json, result)
    print(hybrid_table(result))
    if args.json and any("decode_tok_s" in r for r in result["runs"]):
        print(f"plot: {plot_hybrid(result, Path(args.json).with_suffix('.png'))}")
    failed = [r for r in result["runs"] if "error" in r]
    if failed:  # the table and plot show what ran; the exit status says that not everything did
        print(f"hs-bench: {len(failed)} of {len(result['runs'])} runs failed", file=sys.stderr)
    return 1 if failed else 0


def _hybrid_row(r: dict) -> str:
    if "error" in r:
        return f"{r['engine']:12s} {r['vram_budget']:5.1f} GiB: error: {r['error']}"
    peak = f", peak {r['peak_device_bytes'] / 2**30:.2f} GiB" if "peak_device_bytes" in r else ""
    around = [x["cpu_bw_gib_s"] for x in r.get("reps", []) if "cpu_bw_gib_s" in x]
    bw = f" (CPU {min(around):.0f}-{max(around):.0f} GiB/s around the runs)" if around else ""
    if r.get("cpu_ffn_bytes_expected"):  # the CPU's FFN rows the tokens fired against the profile's expectation
        bw += f", cold rows fired {r['cpu_ffn_bytes_fired'] / r['cpu_ffn_bytes_expected']:.2f}x the profile's"
    return (f"{r['engine']:12s} {r['vram_budget']:5.1f} GiB: decode {r['decode_tok_s']:.2f} tok/s, "
            f"{100 * r.get('fraction_of_bound', 0):.0f}% of bound{bw}{peak}")


def _engine_label(r: dict) -> str:
    if r["engine"] == "llama.cpp":
        return "llama.cpp, CPU only" if r["vram_budget"] == 0 else "llama.cpp layer split"
    if r["vram_budget"] == 0:
        return "CPU-only sparse" if r["engine"] == "hybrid" else "CPU-only dense"
    return "hybrid sparse" if r["engine"] == "hybrid" else "dense layer split"


def hybrid_table(d: dict) -> str:
    m = d["machine"]
    where = f"{m['gpu']} + {m['cpu']}" if m.get("gpu") else f"{m['cpu']} (no GPU)"
    title = d.get("scenario") or f"{Path(d['model']).name}, {d['mode']} activity"
    lines = [f"{title} on {where}, {d.get('threads', '?')} threads ({Path(d['model']).name}, "
             f"{d.get('prompt_tokens', 8)}-token prompt, {d['generated_tokens']} generated):", "",
             "| VRAM budget GiB | engine | placement | prefill tok/s | decode tok/s | vs dense | of bound | "
             "peak device GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in d["runs"]:
        if "error" in r:
            lines.append(f"| {r['vram_budget']:g} | {_engine_label(r)} | error: {r['error']} | | | | | |")
            continue
        where = (f"-ngl {r['ngl']}" if r["engine"] in ("layer split", "llama.cpp") else r.get("placement", ""))
        peak = f"{r['peak_device_bytes'] / 2**30:.2f}" if "peak_device_bytes" in r else ""
        sp = f"{r['speedup_vs_layer_split']:.2f}x" if "speedup_vs_layer_split" in r else ""
        if "speedup_vs_llama_cpp" in r:
            sp += f" ({r['speedup_vs_llama_cpp']:.2f}x llama.cpp)"
        lines.append(f"| {r['vram_budget']:g} | {_engine_label(r)} | {where} | {r.get('prefill_tok_s', 0):.1f} | "
                     f"{r['decode_tok_s']:.2f} | {sp} | {100 * r.get('fraction_of_bound', 0):.0f}% | {peak} |")
    return "\n".join(lines)


def scenario_table(results: list[dict]) -> str:
    """One row per scenario run (README): hybrid vs the dense engine at the same budget, the roofline."""
    # "CPU reads": the host's read bandwidth as the run measured it at its start, and the range measured around
    # the timed runs (from session 32; each run's roofline uses the figure around it). The GPU machine's hosts
    # differ by up to 2x, and one host's neighbours swing it as much from second to second
    lines = ["| scenario | model | machine | CPU reads GiB/s | threads | VRAM budget | hybrid decode tok/s | "
             "dense decode tok/s | hybrid / dense | hybrid of roofline | dense of roofline | hybrid prefill tok/s | "
             "dense prefill tok/s | peak device GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in sorted(results, key=lambda d: (d["scenario"], -d.get("threads", 0))):
        m = d["machine"]
        where = f"{m['gpu']} + {m['cpu_threads_available']}-thread CPU" if m.get("gpu") else m["cpu"]
        if m.get("settings"):  # switches that change what runs (HS_HANDOVER=poll, ...)
            where += " (" + ", ".join(f"{k}={v}" for k, v in m["settings"].items()) + ")"
        for b in sorted({r["vram_budget"] for r in d["runs"]}, reverse=True):
            h = next((r for r in d["runs"] if r["vram_budget"] == b and r["engine"] == "hybrid"), {})
            s = next((r for r in d["runs"] if r["vram_budget"] == b and r["engine"] == "layer split"), {})

            def cell(r, key, fmt):
                return fmt.format(r[key]) if key in r else ("error" if "error" in r else "")
            ratio = f"{h['decode_tok_s'] / s['decode_tok_s']:.2f}x" if "decode_tok_s" in h and "decode_tok_s" in s else ""
            peak = max((r.get("peak_device_bytes", 0) for r in (h, s)), default=0)
            reads = cell(m, "cpu_read_bandwidth_gib_s", "{:.1f}")
            around = [x["cpu_bw_gib_s"] for r in (h, s) for x in r.get("reps", []) if "cpu_bw_gib_s" in x]
            if around:  # measured around the timed runs too (their rooflines use these)
                reads += f" ({min(around):.0f}-{max(around):.0f} around the runs)"
            lines.append(" | ".join([
                f"| {d['scenario'].split(':')[0]}", Path(d["model"]).name, where,
                reads, str(d.get("threads", "")),
                "CPU only" if b == 0 else f"{b:g} GiB", cell(h, "decode_tok_s", "{:.2f}"),
                cell(s, "decode_tok_s", "{:.2f}"), ratio, cell(h, "fraction_of_bound", "{:.0%}"),
                cell(s, "fraction_of_bound", "{:.0%}"), cell(h, "prefill_tok_s", "{:.1f}"),
                cell(s, "prefill_tok_s", "{:.1f}"), f"{peak / 2**30:.2f} |" if b else " |"]))
    return "\n".join(lines)


README_BEGIN, README_END = "<!-- scenario-table:begin (hs-bench table --readme) -->", "<!-- scenario-table:end -->"


def update_readme(readme: Path, table: str) -> None:
    """Replace the text between the scenario-table markers of `readme` with `table`."""
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise InputError(f"{readme}: no {README_BEGIN} ... {README_END} markers to put the table between")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    tmp = readme.with_name(readme.name + ".part")
    tmp.write_text(f"{head}{README_BEGIN}\n{table}\n{README_END}{tail}")
    tmp.replace(readme)


def _hybrid_one(cfg: dict) -> dict:
    """One configuration, in this process: load, one warm-up, then `reps` runs of a `prompt_tokens`
    prompt and `n_predict` greedy tokens (medians), and the bandwidth bound of what each device must
    read per token for this placement."""
    from .generate import Generator
    from .hybrid import HybridOptions
    from .loader import open_model
    from .sampling import Sampler, SamplingParams
    from hybridsparse.solver.plan import GiB, Hardware
    torch.set_num_threads(cfg["threads"])
    if cfg["engine"] == "llama.cpp":
        return _llama_cpp_one(cfg)
    cache = getattr(torch, cfg.get("cache_type", "float16"))  # the CPU layers' KV cache (-ctk/-ctv)
    t0 = time.perf_counter()
    if cfg["engine"] == "hybrid":
        hw = Hardware(cfg["gpu_bw"] * GiB or 800 * GiB, cfg["cpu_bw"] * GiB, 20e-6)
        opts = HybridOptions(vram_budget=cfg["vram_budget"], mode=cfg["mode"], n_ctx=cfg["ctx_size"], hardware=hw)
        lm = open_model(cfg["model"], hybrid=opts, log_line=lambda line: print(line, file=sys.stderr), cache_dtype=cache)
    else:
        lm = open_model(cfg["model"], cfg["ngl"], cache_dtype=cache)
    load_s = time.perf_counter() - t0
    n_prompt = cfg.get("prompt_tokens", 8)
    base = lm.tokenizer.encode("Once upon a time")
    prompt = (base * (n_prompt // len(base) + 1))[:n_prompt]
    gen = Generator(lm.model, lm.tokenizer, cfg["ctx_size"])  # the KV cache the placement planned for
    sampler = Sampler(SamplingParams(temperature=0))
    for _ in gen.generate(prompt, 4, sampler):  # warm-up (allocator, graphs)
        pass
    from . import kernels
    stats = kernels.cpu.sparse_ffn_stats if cfg["engine"] == "hybrid" and kernels.ops() is not None else None

    def once():
        before = stats() if stats else None
        for _ in gen.generate(prompt, cfg["n_predict"], sampler):
            pass
        t = gen.timings
        run = {"decode_tok_s": max(t.gen_tokens - 1, 1) / t.gen_s, "prefill_tok_s": t.prompt_tokens / t.prompt_s,
               "generated": t.gen_tokens}
        if stats and t.gen_tokens > 1:  # the CPU's one-token FFN calls are the decode steps' (a prompt is batched)
            run["cpu_fired_bytes_per_token"] = (stats()[3] - before[3]) / (t.gen_tokens - 1)
        return run

    runs = _reps_with_bandwidth(once, cfg)
    generated = runs[-1]["generated"]
    for r in runs:
        del r["generated"]
    out = {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
           "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
           "load_s": round(load_s, 1), "generated": generated, "prompt_tokens": len(prompt), "reps": runs}
    cold = []  # the CPU's expected bytes of fired FFN rows per layer, from the profile's frequencies
    layers, head = _placement_bytes(lm, cfg, cold)
    expected = sum(cold)

    def scaled(run):  # the layers with the CPU's FFN rows those of the neurons the run's own tokens fired
        r = run.get("cpu_fired_bytes_per_token") if run else None
        if r is None or not expected:
            return layers
        return [(g, c + e * (r / expected - 1)) for (g, c), e in zip(layers, cold)]

    def bound_s(cpu_bw_gib_s: float, run=None) -> float:
        return roofline_seconds(scaled(run), head, cfg["gpu_bw"] * 2**30, cpu_bw_gib_s * 2**30,
                                overlap=cfg["engine"] == "hybrid")
    out.update(gpu_bytes_per_token=sum(x[0] for x in layers) + head[0],
               cpu_bytes_per_token=sum(x[1] for x in layers) + head[1],
               **_bound_fields(runs, bound_s, cfg["cpu_bw"]))
    if expected and all("cpu_fired_bytes_per_token" in r for r in runs):
        measured = statistics.median(r["cpu_fired_bytes_per_token"] for r in runs)
        out.update(cpu_ffn_bytes_expected=expected, cpu_ffn_bytes_fired=measured,
                   cpu_bytes_per_token_profile=out["cpu_bytes_per_token"],
                   cpu_bytes_per_token=out["cpu_bytes_per_token"] + measured - expected)
    if lm.hybrid_report:
        r = lm.hybrid_report
        out["placement"] = (f"attention {r['attn_fast']}/{lm.model.config.n_layers} layers, "
                            f"{100 * r['hot_neurons'] / r['neurons']:.0f}% of neurons on GPU")
        out["hybrid"] = r
    if torch.cuda.is_available():
        out["torch_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return out


def _llama_cpp_one(cfg: dict) -> dict:
    """llama.cpp (llama-cpp-python) on the configuration's file at its -ngl: load, one warm-up, then `reps`
    runs of the same prompt length and greedy tokens as ours (its own tokenizer, the same text)"""
    try:
        t0 = time.perf_counter()
        runner = LlamaCppRunner(cfg["model"], cfg["threads"], cfg["ngl"], cfg.get("prompt_tokens", 8), cfg["n_predict"])
    except ImportError:
        raise InputError("llama-cpp-python is not installed (pip install llama-cpp-python)") from None
    except ValueError as e:  # what llama-cpp-python raises when llama.cpp cannot load the file
        raise InputError(f"{cfg['model']}: llama.cpp cannot load it ({e}); it reads llama.cpp-layout files only "
                         "(hs-bench synth --layout llama.cpp)") from None
    load_s = time.perf_counter() - t0
    runner.once()  # warm-up
    runs = _reps_with_bandwidth(runner.once, cfg)
    return {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
            "load_s": round(load_s, 1), "generated": cfg["n_predict"], "prompt_tokens": len(runner.prompt), "reps": runs}


def _reps_with_bandwidth(once, cfg: dict) -> list[dict]:
    """`cfg["reps"]` timed runs of `once()`, with the CPU's read bandwidth measured before the first and
    after each (unless cfg["fixed_bandwidth"]): each run's "cpu_bw_gib_s" is the mean of the two around it.
    The GPU machine's hosts share their memory with neighbours: an idle H100 host read 54 to 112 GiB/s
    from one second to the next (bench-results/cpu-bandwidth-series-h100-session32.txt), so a roofline
    drawn from one figure at the start said as much about the neighbours as about the engine."""
    track = not cfg.get("fixed_bandwidth") and cfg.get("cpu_bw", 0) > 0
    bws = [measure_bandwidth_gib_s("cpu")] if track else []
    runs = []
    for _ in range(cfg.get("reps", 1)):
        runs.append(once())
        if track:
            bws.append(measure_bandwidth_gib_s("cpu"))
            runs[-1]["cpu_bw_gib_s"] = round((bws[-2] + bws[-1]) / 2, 1)
    return runs


def _bound_fields(runs: list[dict], bound_s, start_bw: float) -> dict:
    """The roofline of a configuration's runs: each run against its own bound, bound_s(bandwidth, run): at the
    CPU bandwidth measured around it and with the FFN rows its tokens fired (the median of the fractions); and
    the older figure, bound_s(start bandwidth, None): the bandwidth at the start and the profile's rows."""
    at_start = bound_s(start_bw, None)
    out = {"bound_tok_s_start_bw": 1 / at_start,
           "fraction_of_bound_start_bw": statistics.median(r["decode_tok_s"] for r in runs) * at_start}
    each = [bound_s(r.get("cpu_bw_gib_s", start_bw), r) for r in runs]
    out["bound_tok_s"] = 1 / statistics.median(each)
    out["fraction_of_bound"] = statistics.median(r["decode_tok_s"] * b for r, b in zip(runs, each))
    return out


def _split_bound_s(split: dict, cpu_bw_gib_s: float) -> float:
    """The dense split's roofline (no overlap: the devices' times add) at another CPU bandwidth: its bound at
    the start figure with the CPU's bytes re-timed."""
    return 1 / split["bound_tok_s_start_bw"] + split["cpu_bytes_per_token"] * (
        1 / (cpu_bw_gib_s * 2**30) - 1 / (split["cpu_bw"] * 2**30))


SYNC_S = 37e-6  # one device->host plus one host->device hand-over of the hidden state (HARDWARE.md: 17 + 20 us)


def roofline_seconds(layers: list[tuple[float, float]], head: tuple[float, float], gpu_bw: float, cpu_bw: float,
                     overlap: bool, sync_s: float = SYNC_S) -> float:
    """The bandwidth bound of one decoded token: `layers` holds the (GPU, CPU) bytes each layer reads,
    `head` the output head's. With `overlap` (the hybrid) a layer costs the slower device's time, plus
    a sync when both devices work on it; without (the layer split) the two times add. Each change of
    device between consecutive layers (and into the head) costs a sync too."""
    total, prev = 0.0, None
    for gb, cb in list(layers) + [head]:
        g_s, c_s = (gb / gpu_bw if gb else 0.0), (cb / cpu_bw if cb else 0.0)
        total += max(g_s, c_s) if overlap else g_s + c_s
        if overlap and gb and cb:
            total += sync_s
        dev = "gpu" if gb >= cb else "cpu"
        if prev is not None and dev != prev:
            total += sync_s
        prev = dev
    return total


def _placement_bytes(lm, cfg, cold: list | None = None) -> tuple[list[tuple[float, float]], tuple[float, float]]:
    """Expected bytes each device reads per token, per layer (dense blocks whole, FFN neurons by their
    profile frequency when sparse) and for the head: ([(gpu, cpu)] per layer, (gpu, cpu) head).
    A dense FFN of a ReLU model with `ffn_down_t` reads the down row of a neuron only where it fired
    (the transposed down projection skips h = 0 on both devices): with a profile, those rows count
    by the layer's mean firing rate (counted whole, they had the dense split of S1 at 114% of a bound
    drawn from bytes it never read). `cold`, where given, gets each layer's expected bytes of the FFN rows
    the CPU reads for fired neurons (0 where its FFN is not sparse by the profile)."""
    from .hybrid import HybridFFN
    from .layers import FFN_VARIANTS
    model, g = lm.model, lm.gguf
    relu = FFN_VARIANTS[model.config.ffn_variant].activation == "relu"
    freqs = None  # predictor mode: the expected active bytes come from the profile's frequencies
    profile_dir = Path(g.path).with_name(Path(g.path).stem + ".hs-profile")
    if cfg.get("mode") == "predictor" and profile_dir.is_dir():
        from hybridsparse.profiler.activations import load_profile
        freqs = load_profile(profile_dir).frequencies()
    layers = []
    for i, layer in enumerate(model.layers):
        dev = model.placement.layers[i].type
        names = [n for n in g.tensors if n.startswith(f"blk.{i}.")]
        ffn_names = [n for n in names if ".ffn_" in n and ".weight" in n]
        attn = sum(g.tensors[n].nbytes for n in names if n not in ffn_names and ".fc" not in n)
        ffn_bytes = sum(g.tensors[n].nbytes for n in ffn_names)
        gb = attn if dev == "cuda" else 0.0
        cb = attn if dev != "cuda" else 0.0
        f = layer.ffn
        freq, cold_ffn = None, 0.0
        if isinstance(f, HybridFFN):
            freq = f.freq if f.freq is not None else (freqs[i].float() if freqs is not None else None)
        if isinstance(f, HybridFFN) and f.mode != "dense" and freq is not None:
            per = f._neuron_bytes  # the rows it reads: a llama.cpp file's ffn_down as transposed (float16 for blocks)
            hot = torch.zeros(f.n_ff, dtype=torch.bool)
            if f.n_hot:
                hot[f._hot_on[torch.device("cpu")]] = True
            freq = freq.cpu()
            gb += float(freq[hot].sum()) * per * (f.fast is not None and f.fast.type == "cuda")
            cold_ffn = float(freq[~hot].sum()) * per
            cb += cold_ffn
            pred = f.predictor.fc1.nbytes + f.predictor.fc2.nbytes
            gb, cb = (gb + pred, cb) if dev == "cuda" else (gb, cb + pred)
        elif isinstance(f, HybridFFN):
            per = f._neuron_bytes
            gb += f.n_hot * per * (f.fast is not None and f.fast.type == "cuda")
            cb += f.n_cold * per
        else:
            down = f"blk.{i}.ffn_down_t.weight"
            if relu and freqs is not None and getattr(f, "down_transposed", False) and down in g.tensors:
                ffn_bytes -= g.tensors[down].nbytes * (1.0 - float(freqs[i].float().mean()))
            gb, cb = (gb + ffn_bytes, cb) if dev == "cuda" else (gb, cb + ffn_bytes)
        layers.append((gb, cb))
        if cold is not None:  # the CPU's share of those rows, for the benchmark to set against what a run fired
            cold.append(cold_ffn)
    head = g.tensors.get("output.weight") or g.tensors["token_embd.weight"]
    return layers, ((head.nbytes, 0.0) if model.placement.head.type == "cuda" else (0.0, head.nbytes))


def plot_hybrid(d: dict, out: str | Path) -> Path:
    """A PNG of an `hs-bench hybrid` result: decode tok/s per VRAM budget, hybrid beside the layer
    split (log scale), the ratio above each pair, peak device memory against the budget below."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    budgets = sorted({r["vram_budget"] for r in d["runs"]}, key=lambda b: (b == 0, b))
    get = {(r["engine"], r["vram_budget"]): r for r in d["runs"]}
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.38
    for k, (engine, color) in enumerate((("hybrid", "#2a7"), ("layer split", "#999"))):
        xs = [i + (k - 0.5) * width for i in range(len(budgets))]
        ys = [get.get((engine, b), {}).get("decode_tok_s", 0) for b in budgets]
        ax.bar(xs, ys, width, color=color, label=engine if engine == "hybrid" else "dense layer split (-ngl)")
    for i, b in enumerate(budgets):
        h, s = get.get(("hybrid", b)), get.get(("layer split", b))
        if h and s and "decode_tok_s" in h and s.get("decode_tok_s"):
            ax.text(i, max(h["decode_tok_s"], s["decode_tok_s"]) * 1.12, f"{h['decode_tok_s'] / s['decode_tok_s']:.2f}x",
                    ha="center", fontsize=10, weight="bold")
    ax.set_xticks(range(len(budgets)), [("CPU only" if b == 0 else f"{b:g} GiB") for b in budgets])
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.6)
    m = d["machine"]
    ax.set_title(f"{Path(d['model']).name}, {d['mode']} activity: {m.get('gpu', 'no GPU')} + {m['cpu']}", fontsize=10)
    ax.legend(loc="upper left", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)


def _plot(args) -> int:
    d = json.loads(Path(args.file).read_text())
    if not isinstance(d, dict) or "runs" not in d:
        raise ValueError(f"{args.file}: not an `hs-bench hybrid` result (no runs)")
    print(plot_hybrid(d, args.output or str(Path(args.file).with_suffix(".png"))))
    return 0


def _table(args) -> int:
    """A markdown table of `hs-bench run` JSON files (the README's benchmark section)."""
    header = ["| model | machine | engine | threads | -ngl | prefill tok/s | decode tok/s | decode vs llama.cpp | "
              "of bandwidth bound |", "|---|---|---|---|---|---|---|---|---|"]
    kernel_files, hybrid_files = [], []
    for path in args.files:
        d = json.loads(Path(path).read_text())
        if not isinstance(d, dict) or "machine" not in d:  # plans, predictor reports: not benchmark results
            print(f"hs-bench: {path}: not an hs-bench result; skipped", file=sys.stderr)
            continue
        if "runs" in d and "mode" in d:  # an `hs-bench hybrid` file: its own table below
            hybrid_files.append(d)
            continue
        if "prompt_tokens" not in d:  # an `hs-bench kernels` file: its own table below
            kernel_files.append(d)
            continue
        while header:
            print(header.pop(0))
        m = d["machine"]
        where = f"{m['gpu']} + {m['cpu']}" if "gpu" in m and any(r.get("n_gpu_layers", 0) != 0 for r in d["results"]) else m["cpu"]
        for r in d["results"]:
            ours = r["engine"] == "hybridsparse"
            label = r["engine"] + ("" if r.get("cuda_graphs", True) else " (no CUDA graphs)")
            if ours and m.get("settings"):  # the switches it ran with (HS_CUDA_FUSE=0, ...)
                label += "".join(f", {k}={v}" for k, v in m["settings"].items() if v)
            ratio = f"{d['decode_ratio_vs_llama_cpp']:.2f}x" if ours and "decode_ratio_vs_llama_cpp" in d else ""
            frac = f"{100 * d['fraction_of_bound']:.0f}%" if ours and r.get("cuda_graphs", True) else ""
            name = Path(r.get('model', d['results'][0].get('model', '?'))).name
            if d.get("prompt_tokens", 64) != 64:
                name += f" ({d['prompt_tokens']}-token prompt)"
            print(f"| {name} | {where} | {label} | "
                  f"{r['threads']} | {r['n_gpu_layers']} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
                  f"{ratio} | {frac} |")
    scen = [d for d in hybrid_files if d.get("scenario")]
    if scen:
        table = scenario_table(scen)
        print("\n" + table)
        if args.readme:
            update_readme(Path(args.readme), table)
            print(f"hs-bench: {args.readme}: scenario table replaced", file=sys.stderr)
    for d in hybrid_files:
        print("\n" + hybrid_table(d))
    for d in kernel_files:
        m = d["machine"]
        bw = m.get("read_bandwidth_gib_s") or m["cpu_read_bandwidth_gib_s"]
        on_gpu = m.get("device") == "cuda"
        where = f"{m['gpu']}" if on_gpu else f"{m['cpu']}, {d['threads']} threads"
        print(f"\nSparse ops on {where}, read bandwidth {bw} GiB/s (GiB/s on the bytes of the rows each op must "
              "read; % of that bandwidth):\n")
        print("| FFN rows | type | density | row-dot GiB/s | axpy GiB/s | rows only read GiB/s | "
              "torch gather+GEMV GiB/s | torch dense GEMV GiB/s |")
        print("|---|---|---|---|---|---|---|---|")
        for r in d["results"]:
            torch_g = f"{r['torch_gather_gemv_gib_s']:.1f}" if "torch_gather_gemv_gib_s" in r else ""
            torch_d = f"{r['torch_dense_gemv_gib_s']:.1f}" if "torch_dense_gemv_gib_s" in r else ""
            read = f"{r['rows_read_gib_s']:.1f} ({r['rows_read_gib_s'] / bw:.0%})" if "rows_read_gib_s" in r else ""
            print(f"| {r['shape']} | {r['type']} | {r['density']:.0%} | {r['rowdot_gib_s']:.1f} "
                  f"({r['rowdot_gib_s'] / bw:.0%}) | {r['axpy_gib_s']:.1f} ({r['axpy_gib_s'] / bw:.0%}) | {read} | "
                  f"{torch_g} | {torch_d} |")
    return 0


KERNEL_SHAPES = {  # name: (d_model, n_ff): FFN rows of real models
    "llama-2-7b": (4096, 11008), "llama-2-13b": (5120, 13824), "llama-2-70b": (8192, 28672),
    "falcon-40b": (8192, 32768),
}
KERNEL_TYPES = ("F16", "BF16", "Q8_0", "Q4_0")  # the weight types the sparse ops take


def _listed(valid, norm):
    """argparse type: a comma-separated list of names from `valid` (case as `norm` makes it)."""
    def parse(text: str) -> list[str]:
        names = [norm(t.strip()) for t in text.split(",") if t.strip()]
        bad = [n for n in names if n not in valid]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {', '.join(valid)}")
        return names
    return parse


def _numbers(cast, ok, expected: str, one: bool = False):
    """argparse type: comma-separated numbers (or, with one, a single number) that `cast` reads and
    `ok` accepts; otherwise an error naming what was `expected`."""
    def parse(text: str):
        try:
            out = [cast(t) for t in text.split(",")]
        except ValueError:
            out = []
        if not out or (one and len(out) != 1) or not all(ok(v) for v in out):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")
        return out[0] if one else out
    return parse


_densities = _numbers(float, lambda d: 0 < d <= 1, "comma-separated fractions in (0, 1], e.g. 1,0.1")
_positive_ints = _numbers(int, lambda n: n >= 1, "a comma-separated list of positive integers")
_tokens = _numbers(int, lambda n: 1 <= n <= 4096, "a number of tokens in 1..4096", one=True)


def _random_weight(qtype, rows: int, cols: int) -> torch.Tensor:
    """Random valid data of a GGML type (values do not matter for speed; scales are kept finite)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
    if qtype in (Q.F16, Q.BF16):
        return (torch.randn(rows, cols) * 0.02).to(torch.float16 if qtype == Q.F16 else torch.bfloat16)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (rows, cols // block, size), dtype=torch.uint8)
    raw[:, :, 0:2] = torch.tensor([0x00, 0x20], dtype=torch.uint8)  # float16 scale 0.0078
    return raw.reshape(rows, -1)


def _time(f, reps: int, cuda: bool = False, warm=None) -> float:
    """Median seconds per call; on the CPU each call after reading 1 GiB (the GPU machine's H100 host
    reports a 300 MiB L3, which the 256 MiB read until session 26 did not flush), so the
    rows come from memory, and then `warm` (the same op on a small weight of its own): the flush also
    leaves the code, the allocator's structures, the threads and the TLB cold, ~35 us a call on the dev
    VM (one listed 10 KiB row: 40 us timed right after the flush, 6.8 after a call on other rows, 1.9
    warm), which no op of a decode step pays, since they follow one another. On the GPU the calls are
    captured in a CUDA graph (as the runtime runs them) and replayed, so the figure is the kernels'
    time, not Python's launch overhead."""
    f()
    if not cuda:  # rows read from DRAM, not from a cache warmed by the previous call
        flush = torch.ones((1 << 30) // 4)
        times = []
        for _ in range(reps):
            flush.sum()
            if warm is not None:
                warm()
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    calls = 20
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            f()
    graph.replay()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3 / calls)
    return statistics.median(times)


def _kernels(args) -> int:
    """Effective GiB/s of the sparse ops on the bytes they must read, at several densities, next to
    the device's read bandwidth and torch (dense GEMV; gather + GEMV)."""
    from gguf import GGMLQuantizationType as Q
    from . import kernels
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda and not (torch.cuda.is_available() and kernels.available() and kernels._has_cuda_kernels()):
        raise SystemExit("hs-bench kernels --device cuda: no CUDA device or the CUDA kernels did not build")
    dev = torch.device(args.device)
    bw = measure_bandwidth_gib_s(args.device)
    rows_out, densities = [], args.densities
    for shape in args.shapes:
        d_model, n_ff = KERNEL_SHAPES[shape]
        for tname in args.types:
            qtype = Q[tname]
            w = _random_weight(qtype, n_ff, d_model).to(dev)
            row_bytes = w.shape[1] * w.element_size()
            x = torch.randn(1, d_model, device=dev)
            is_float = qtype in (Q.F16, Q.BF16)
            xw = x.to(w.dtype) if is_float else None
            # the CPU's warm-up after each flush: the same ops on 64 rows of another weight (see _time)
            small = _random_weight(qtype, 64, d_model).to(dev)
            small_idx = torch.arange(0, 64, 3, dtype=torch.int32, device=dev)  # < half: rows side by side
            small_h = torch.randn(1, small_idx.numel(), device=dev)
            warm_dense = (lambda: torch.nn.functional.linear(xw, small)) if is_float else None
            t_dense = _time(lambda: torch.nn.functional.linear(xw, w), args.reps, cuda, warm_dense) if is_float else None
            for dens in densities:
                m = max(1, int(n_ff * dens))
                idx = torch.randperm(n_ff)[:m].sort().values.int().to(dev)
                h = torch.randn(1, m, device=dev)
                t_dot = _time(lambda: kernels.sparse_rowdot(w, qtype, x, idx, check=False), args.reps, cuda,
                              lambda: kernels.sparse_rowdot(small, qtype, x, small_idx, check=False))
                t_axpy = _time(lambda: kernels.sparse_axpy(w, qtype, h, idx, check=False), args.reps, cuda,
                               lambda: kernels.sparse_axpy(small, qtype, small_h, small_idx, check=False))
                gib = m * row_bytes / 2**30
                entry = {"shape": shape, "type": tname, "density": dens, "rows": m,
                         "rowdot_gib_s": gib / t_dot, "axpy_gib_s": gib / t_axpy,
                         "rowdot_of_bandwidth": gib / t_dot / bw, "axpy_of_bandwidth": gib / t_axpy / bw}
                if not cuda and kernels.available():
                    # the same rows read as the kernels read them (8 side by side, the next 8 asked for) and
                    # only summed: the memory's ceiling for this pattern, against which the ops' shortfall is
                    # arithmetic (csrc/cpu_probe.cpp)
                    t_read = _time(lambda: kernels.cpu.read_rows(w, idx, 8, 1), args.reps, cuda,
                                   lambda: kernels.cpu.read_rows(small, small_idx, 8, 1))
                    entry["rows_read_gib_s"] = gib / t_read
                if cuda:
                    mask = torch.zeros(n_ff, dtype=torch.bool, device=dev)
                    mask[idx.long()] = True
                    t_mask = _time(lambda: kernels.sparse_rowdot(w, qtype, x, None, mask, check=False), args.reps, cuda)
                    entry["rowdot_mask_gib_s"] = gib / t_mask
                if is_float:
                    t_gather = _time(lambda: torch.nn.functional.linear(xw, w[idx.long()]), args.reps, cuda,
                                     lambda: torch.nn.functional.linear(xw, small[small_idx.long()]))
                    entry["torch_gather_gemv_gib_s"] = gib / t_gather
                    entry["torch_dense_gemv_gib_s"] = n_ff * row_bytes / 2**30 / t_dense
                rows_out.append(entry)
                print(f"{shape:12s} {tname:5s} {dens:5.0%} rowdot {entry['rowdot_gib_s']:7.1f} GiB/s "
                      f"({entry['rowdot_of_bandwidth']:4.0%})  axpy {entry['axpy_gib_s']:7.1f} GiB/s "
                      f"({entry['axpy_of_bandwidth']:4.0%})"
                      + (f"  mask-rowdot {entry['rowdot_mask_gib_s']:7.1f}" if cuda else "")
                      + (f"  rows read {entry['rows_read_gib_s']:7.1f}" if "rows_read_gib_s" in entry else "")
                      + (f"  torch gather+GEMV {entry['torch_gather_gemv_gib_s']:7.1f}  torch dense "
                         f"{entry['torch_dense_gemv_gib_s']:7.1f}" if is_float else ""), flush=True)
    result = {"machine": {**machine(), "device": args.device, "read_bandwidth_gib_s": round(bw, 1)},
              "threads": args.threads, "results": rows_out}
    print(f"read bandwidth {bw:.1f} GiB/s ({args.device}" + (f", {args.threads} threads)" if not cuda else ")"))
    write_json(args.json, result)
    return 0


ATTENTION_SHAPES = {  # name: (query heads, key/value heads, head_dim) of real models
    "llama-2-7b": (32, 32, 128), "llama-3-8b": (32, 8, 128), "llama-2-70b": (64, 8, 128),
    "falcon-40b": (128, 8, 64), "gemma3-270m": (4, 1, 256),
}


def _attention(args) -> int:
    """One decode token's attention (the k/v store and the softmax over the cache), or --tokens of a
    prompt's, as the runtime runs it (layers.attend: the compiled op), next to torch's eager form, at
    several cache lengths: ms per layer and GiB/s of the cache bytes it must read (k and v of every
    position up to the last token)."""
    from .layers import KVCache, Step, attend, attend_reference
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("hs-bench attention --device cuda: no CUDA device")
    dev, dtype = torch.device(args.device), CACHE_TYPES[args.cache_type]
    bw = measure_bandwidth_gib_s(args.device)
    rows_out = []
    for shape in args.shapes:
        hq, hkv, d = ATTENTION_SHAPES[shape]
        for n in args.positions:
            T = args.tokens
            cache = KVCache(hkv, d, n + T, dev, dtype)
            cache.k[:, :n] = torch.randn(hkv, n, d, device=dev).to(dtype)
            cache.v[:, :n] = torch.randn(hkv, n, d, device=dev).to(dtype)
            q, k, v = (torch.randn(T, h, d, device=dev) for h in (hq, hkv, hkv))
            step = Step(torch.arange(n, n + T, device=dev), n + T)
            t_op = _time(lambda: attend(q, k, v, cache, step, None, d ** -0.5), args.reps, cuda)
            t_ref = _time(lambda: attend_reference(q, k, v, cache, step, None, d ** -0.5), args.reps, cuda)
            gib = 2 * hkv * (n + T) * d * cache.k.element_size() / 2**30
            entry = {"shape": shape, "heads": hq, "kv_heads": hkv, "head_dim": d, "tokens": T, "positions": n + T,
                     "ms": t_op * 1e3, "gib_s": gib / t_op, "of_bandwidth": gib / t_op / bw, "torch_ms": t_ref * 1e3}
            rows_out.append(entry)
            print(f"{shape:12s} {hq:3d}/{hkv:<3d} x {d:3d} {T:4d} token(s) {n + T:6d} positions: {entry['ms']:8.3f} ms "
                  f"{entry['gib_s']:7.1f} GiB/s ({entry['of_bandwidth']:4.0%})  torch {entry['torch_ms']:8.3f} ms",
                  flush=True)
    result = {"machine": {**machine(), "device": args.device, "read_bandwidth_gib_s": round(bw, 1)},
              "threads": args.threads, "cache_type": args.cache_type, "results": rows_out}
    print(f"read bandwidth {bw:.1f} GiB/s ({args.device}" + (f", {args.threads} threads)" if not cuda else ")"))
    write_json(args.json, result)
    return 0


SCENARIOS = {  # the issue's S1-S5: a synthetic model, budgets, and which engines
    "S1": {"what": "ReluFalcon-40B F16 at --vram-budget 24 (PowerInfer's 11x demo)", "model": "relu-falcon-40b",
           "dtype": "f16", "budgets": "24", "cpu_only": False, "threads": [16], "n": 32},
    "S2": {"what": "ReluLLaMA-2-70B Q4_0 at --vram-budget 11 (PowerInfer's 2080 Ti setting)",
           "model": "relu-llama-2-70b", "dtype": "q4_0", "budgets": "11", "cpu_only": False, "threads": [16], "n": 32},
    "S3": {"what": "ReluLLaMA-2-13B F16 at --vram-budget 8", "model": "relu-llama-2-13b", "dtype": "f16",
           "budgets": "8", "cpu_only": False, "threads": [16], "n": 64},
    "S4": {"what": "ReluLLaMA-2-7B F16 all on the GPU (dense split with every layer, and the hybrid)",
           "model": "relu-llama-2-7b", "dtype": "f16", "budgets": "24", "cpu_only": False, "threads": [16], "n": 128},
    "S5": {"what": "CPU only, ReluLLaMA-2-7B Q4_0, dense vs sparse, 16 and 2 threads", "model": "relu-llama-2-7b",
           "dtype": "q4_0", "budgets": "", "cpu_only": True, "threads": [16, 2], "n": 64},
}


def _scenario(args) -> int:
    """Write the scenario's model in PowerInfer's layout (no transposition at load), run `hybrid` on it for
    each thread count, remove the model unless --keep."""
    from .synth import synth_path, write_synth
    sc = SCENARIOS[args.name]
    path = synth_path(Path(args.model_dir), sc["model"], sc["dtype"], "powerinfer", args.predictor_type)
    made = not path.exists()
    if made:
        t0 = time.perf_counter()
        write_synth(args.model_dir, sc["model"], sc["dtype"], "powerinfer", predictor_type=args.predictor_type)
        print(f"hs-bench: wrote {path} ({path.stat().st_size / 2**30:.1f} GiB) in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    try:
        for threads in sc["threads"]:
            json_path = args.json or f"scenario-{args.name}.json"
            if len(sc["threads"]) > 1:
                json_path = str(Path(json_path).with_name(Path(json_path).stem + f"-t{threads}.json"))
            n = args.n_predict or sc["n"]
            rc = _hybrid(_hybrid_args(str(path), threads, sc["budgets"], n, 64, args.reps, "predictor",
                                      not sc["cpu_only"], args.timeout, json_path,
                                      scenario=f"{args.name}: {sc['what']}", fixed_bandwidth=args.fixed_bandwidth))
            if rc:
                return rc
    finally:
        if made and not args.keep:  # the model and everything written beside it (profile, GPU index, plan)
            for p in [path, *path.parent.glob(path.stem + ".*")]:
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                elif p.exists():
                    p.unlink()
    return 0


def add_hybrid_bench_args(p) -> None:
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--reps", type=int, default=1, help="timed runs per configuration, after a warm-up (median)")
    p.add_argument("-c", "--ctx-size", type=int, default=512,
                   help="context both engines plan and allocate the KV cache for (llama-bench's habit: "
                        "the prompt and the generated tokens, rounded up)")
    p.add_argument("--mode", choices=["predictor", "sampled", "dense"], default="predictor",
                   help="predictor: the model's predictors choose the rows (synthetic models carry planted "
                        "ones); sampled: active sets drawn from the profile")
    p.add_argument("--no-ngl", action="store_true", help="skip the layer-split runs")
    p.add_argument("--no-cpu-only", action="store_true", help="skip the CPU-only runs")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also run llama.cpp (llama-cpp-python) on the same file at each dense run's -ngl, in a "
                        "process of its own (a llama.cpp-layout file: llama.cpp cannot read PowerInfer's)")
    p.add_argument("--llama-cpp-model", help="with --llama-cpp: the file llama.cpp runs (default: the model's own), "
                   "e.g. the llama.cpp-layout twin of a PowerInfer file (hs-bench synth writes either from one seed)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    p.add_argument("--fixed-bandwidth", action="store_true",
                   help="draw every roofline from the CPU bandwidth measured at the start (default: also measure "
                        "it around each timed run, in the run's process, and set each run against its own: hosts "
                        "whose neighbours share the memory read from one second to the next up to 2x apart)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hs-bench", description="Benchmarks (JSON out); see README.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="decode and prefill tokens/s of hs-run (and llama.cpp with --llama-cpp)")
    add_model_args(run)
    run.add_argument("--prompt-tokens", type=int, default=64)
    run.add_argument("-n", "--n-predict", type=int, default=128)
    run.add_argument("--reps", type=int, default=5,
                     help="timed runs per engine (median), after one warm-up; engines alternate run by run")
    run.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp (llama-cpp-python) on the same file "
                     "(with --vram-budget: beside each dense engine, at its -ngl)")
    run.add_argument("--compare-graphs", action="store_true", help="also run without CUDA graphs")
    run.add_argument("--json", help="write the results here")
    run.add_argument("--vram-budget", type=float, help="GiB: run the four engines side by side instead (hybrid "
                     "sparse and the dense layer split at this budget, CPU-only dense and CPU-only sparse), each in "
                     "its own process, with the roofline (as `hs-bench hybrid --budgets B`)")
    run.add_argument("--mode", choices=["predictor", "sampled", "dense"], default="predictor",
                     help="with --vram-budget: how the hybrid chooses active rows (default: %(default)s)")
    run.add_argument("--no-cpu-only", action="store_true", help="with --vram-budget: skip the CPU-only engines")
    run.add_argument("--llama-cpp-model", help="with --vram-budget --llama-cpp: the file llama.cpp runs (default: -m), "
                     "e.g. the llama.cpp-layout twin of a PowerInfer file")
    run.add_argument("--timeout", type=float, default=600, help="with --vram-budget: seconds per engine")
    run.set_defaults(func=_run)
    kern = sub.add_parser("kernels", help="sparse ops: effective GiB/s at several densities, vs bandwidth and torch")
    kern.add_argument("-t", "--threads", type=int, default=default_threads())
    kern.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    kern.add_argument("--shapes", default="llama-2-7b,llama-2-13b,llama-2-70b,falcon-40b",
                      type=_listed(KERNEL_SHAPES, str.lower), help="comma-separated, of: " + ", ".join(KERNEL_SHAPES))
    kern.add_argument("--types", default="F16,Q8_0,Q4_0", type=_listed(KERNEL_TYPES, str.upper),
                      help="comma-separated weight types, of: " + ", ".join(KERNEL_TYPES))
    kern.add_argument("--densities", default="1.0,0.25,0.1,0.03", type=_densities,
                      help="comma-separated fractions of the rows in (0, 1]")
    kern.add_argument("--reps", type=int, default=5)
    kern.add_argument("--json")
    kern.add_argument("--verbose", action="store_true")
    kern.set_defaults(func=_kernels)
    att = sub.add_parser("attention", help="one decode token's attention over caches of several lengths: ms, "
                         "GiB/s of the cache read, vs torch")
    att.add_argument("-t", "--threads", type=int, default=default_threads())
    att.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    att.add_argument("--shapes", default="llama-2-7b,llama-3-8b,gemma3-270m", type=_listed(ATTENTION_SHAPES, str.lower),
                     help="comma-separated head layouts, of: " + ", ".join(ATTENTION_SHAPES))
    att.add_argument("--positions", default="256,4000", type=_positive_ints,
                     help="comma-separated cache lengths before the token")
    att.add_argument("--tokens", type=_tokens, default=1,
                     help="query tokens after the cache, 1..4096 (1: decode; more: a prompt's chunk)")
    att.add_argument("-ctk", "--cache-type", choices=CACHE_TYPES, default="f16")
    att.add_argument("--reps", type=int, default=20)
    att.add_argument("--json")
    att.add_argument("--verbose", action="store_true")
    att.set_defaults(func=_attention)
    table = sub.add_parser("table", help="print a markdown table of `run` JSON files")
    table.add_argument("files", nargs="+")
    table.add_argument("--readme", help="also put the scenario table (files from `hs-bench scenario`) into this "
                       "README, between its scenario-table markers")
    table.add_argument("--verbose", action="store_true")
    table.set_defaults(func=_table)
    plot = sub.add_parser("plot", help="a PNG bar chart of an `hs-bench hybrid` JSON file")
    plot.add_argument("file")
    plot.add_argument("-o", "--output", help="PNG path (default: the JSON's name with .png)")
    plot.add_argument("--verbose", action="store_true")
    plot.set_defaults(func=_plot)
    hyb = sub.add_parser("hybrid", help="hybrid vs the dense layer split at the same VRAM budgets vs CPU only")
    hyb.add_argument("-m", "--model")
    hyb.add_argument("-t", "--threads", type=int, default=default_threads())
    hyb.add_argument("--budgets", default="4,8,11,24", help="VRAM budgets, GiB (default: %(default)s)")
    add_hybrid_bench_args(hyb)
    hyb.add_argument("--json")
    hyb.add_argument("--verbose", action="store_true")
    hyb.set_defaults(func=_hybrid)
    from .synth import add_parser as add_synth
    add_synth(sub)
    scen = sub.add_parser("scenario", help="one of the README's benchmark scenarios S1-S5: write the synthetic model "
                          "(if missing) and run it side by side")
    scen.add_argument("name", choices=sorted(SCENARIOS), help="; ".join(f"{k}: {v['what']}" for k, v in SCENARIOS.items()))
    scen.add_argument("-o", "--model-dir", default="/dev/shm", help="where the model is written (default: %(default)s)")
    scen.add_argument("--json", help="result file (default: scenario-NAME.json; one per thread count for S5)")
    scen.add_argument("--keep", action="store_true", help="keep the model file afterwards (default: removed)")
    scen.add_argument("--predictor-type", choices=["f16", "q8_0", "q4_0"], default="f16",
                      help="the synthetic model's predictors' stored type (default: %(default)s, as PowerInfer "
                           "keeps them; the file name says when it is not f16)")
    scen.add_argument("-n", "--n-predict", type=int, help="generated tokens (default: the scenario's)")
    scen.add_argument("--reps", type=int, default=1)
    scen.add_argument("--timeout", type=float, default=540, help="seconds per configuration")
    scen.add_argument("--verbose", action="store_true")
    scen.add_argument("--fixed-bandwidth", action="store_true",
                      help="rooflines from the CPU bandwidth measured at the start only (default: also around each run)")
    scen.set_defaults(func=_scenario)
    from .bench_serve import add_parser as add_serve
    add_serve(sub, default_threads())
    return ap


def main(argv=None) -> int:
    return run_main("hs-bench", lambda a: a.func(a), argv, build_parser())


if __name__ == "__main__":
    if sys.argv[1:2] == ["hybrid-one"]:  # one configuration of `hs-bench hybrid`, in its own process
        print(json.dumps(_hybrid_one(json.loads(sys.argv[2]))))
        sys.exit(0)
    sys.exit(main())
