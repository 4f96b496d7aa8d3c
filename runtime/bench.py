"""hs-bench: speed measured side by side in one run, JSON out.

  hs-bench run   [-m MODEL] [-t N] [-ngl N] [--reps 3] [--llama-cpp]   decode/prefill tokens/s
  hs-bench synth --shape llama-7b --dtype f16 -o DIR                    a random model of a real shape
  hs-bench kernels [--device cpu|cuda] [-t N] [--shapes ...] --json OUT   sparse ops, GiB/s by density
  hs-bench table FILE.json ...                                          the README's markdown table
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .cli import add_model_args, default_threads, run_main
from .errors import InputError

SHAPES = {  # name: (d_model, n_ff, n_layers, n_heads, n_kv_heads, n_vocab)
    "llama-7b": (4096, 11008, 32, 32, 32, 32000),
    "llama-13b": (5120, 13824, 40, 40, 40, 32000),
    "llama-70b": (8192, 28672, 80, 64, 8, 32000),
    "tiny": (256, 704, 4, 8, 4, 512),
}


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
    return info


def measure_bandwidth_gib_s(device: str) -> float:
    """Read bandwidth: a sum over a buffer much larger than the caches."""
    n = (2 << 30) // 4 if device == "cuda" else (256 << 20) // 4
    x = torch.ones(n, device=device)
    times = []
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        x.sum()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return n * 4 / min(times[1:]) / 2**30


class HSRunner:
    """hybridsparse on one model: `once()` is one prefill + greedy decode, timed."""

    engine = "hybridsparse"

    def __init__(self, model_path, threads: int, n_gpu_layers: int, prompt_tokens: int, n_gen: int,
                 graphs: bool = True):
        from .generate import Generator
        from .loader import open_model
        torch.set_num_threads(threads)
        self.lm = lm = open_model(model_path, n_gpu_layers)
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


def _run(args) -> int:
    from .loader import default_model_path
    model = Path(args.model) if args.model else default_model_path()
    if args.n_gpu_layers is None:
        args.n_gpu_layers = -1
    device = "cuda" if torch.cuda.is_available() and args.n_gpu_layers != 0 else "cpu"
    result = {"machine": machine(), "prompt_tokens": args.prompt_tokens, "generated_tokens": args.n_predict,
              "reps": args.reps, "results": []}
    result["machine"]["cpu_read_bandwidth_gib_s"] = round(measure_bandwidth_gib_s("cpu"), 1)
    if device == "cuda":
        result["machine"]["gpu_read_bandwidth_gib_s"] = round(measure_bandwidth_gib_s("cuda"), 1)
    runners = [HSRunner(model, args.threads, args.n_gpu_layers, args.prompt_tokens, args.n_predict)]
    if args.compare_graphs and device == "cuda":
        runners.append(HSRunner(model, args.threads, args.n_gpu_layers, args.prompt_tokens, args.n_predict,
                                graphs=False))
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


def _synth(args) -> int:
    """A llama-shaped model with random F16/F32 weights, written fast (one random block tiled)."""
    import gguf
    from tqdm import tqdm

    d, ff, layers, heads, kv, vocab = SHAPES[args.shape]
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.shape}-{args.dtype}.gguf"
    rng = np.random.default_rng(0)
    dtype = {"f16": np.float16, "f32": np.float32}[args.dtype]
    pool = (rng.standard_normal(1 << 22) * 0.02).astype(dtype)

    def rand(rows, cols):
        n = rows * cols
        reps = -(-n // pool.size)
        return np.tile(pool, reps)[:n].reshape(rows, cols)

    w = gguf.GGUFWriter(str(path) + ".part", "llama")
    hd = d // heads
    for key, value in {"context_length": 4096, "embedding_length": d, "block_count": layers,
                       "feed_forward_length": ff, "attention.head_count": heads, "attention.head_count_kv": kv,
                       "rope.dimension_count": hd}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("hybridsparse.ffn_activation", "relu")
    from .convert import add_metadata, byte_level_vocab
    for key, value in byte_level_vocab(vocab).items():
        add_metadata(w, key, value)
    tensors = [("token_embd.weight", vocab, d), ("output.weight", vocab, d)]
    for i in range(layers):
        tensors += [(f"blk.{i}.attn_q.weight", d, d), (f"blk.{i}.attn_k.weight", kv * hd, d),
                    (f"blk.{i}.attn_v.weight", kv * hd, d), (f"blk.{i}.attn_output.weight", d, d),
                    (f"blk.{i}.ffn_gate.weight", ff, d), (f"blk.{i}.ffn_up.weight", ff, d),
                    (f"blk.{i}.ffn_down_t.weight", ff, d) if args.layout == "powerinfer" else
                    (f"blk.{i}.ffn_down.weight", d, ff)]
    norms = ["output_norm.weight"] + [f"blk.{i}.{n}.weight" for i in range(layers) for n in ("attn_norm", "ffn_norm")]
    for name in norms:
        w.add_tensor(name, np.ones(d, dtype=np.float32))
    for name, rows, cols in tensors:
        w.add_tensor_info(name, (rows, cols), np.dtype(dtype), rows * cols * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name in norms:
        w.write_tensor_data(np.ones(d, dtype=np.float32))
    for name, rows, cols in tqdm(tensors, desc=f"writing {path.name}", unit="tensor", file=sys.stderr):
        w.write_tensor_data(rand(rows, cols))
    w.close()
    Path(str(path) + ".part").replace(path)
    if args.activity == "zipf":
        write_synthetic_activity(path, layers, d, ff, args.density, args.hot_share, args.predictor_width)
    print(path)
    return 0


def zipf_frequencies(n: int, density: float, hot_share: float, rng) -> np.ndarray:
    """P(active) per neuron following a power law f_r = min(1, c r^-a) over the rank r, with mean
    `density` and the hottest `hot_share` of the neurons carrying 80% of the activations (the
    published statistics: OPT-30B 26%, Llama(ReGLU)-70B 43%; ProSparse/TurboSparse ~10% density),
    in a random neuron order."""
    r = np.arange(1, n + 1, dtype=np.float64)

    def curve(a):
        lo, hi = 1e-12, 1e12
        for _ in range(200):
            c = (lo * hi) ** 0.5
            if np.minimum(1.0, c * r ** -a).mean() < density:
                lo = c
            else:
                hi = c
        return np.minimum(1.0, c * r ** -a)

    lo, hi = 0.0, 4.0
    for _ in range(60):
        a = (lo + hi) / 2
        f = curve(a)
        if f[: int(hot_share * n)].sum() / f.sum() < 0.8:
            lo = a
        else:
            hi = a
    return rng.permutation(curve((lo + hi) / 2))


def write_synthetic_activity(path: Path, layers: int, d: int, ff: int, density: float, hot_share: float,
                             width: int) -> None:
    """Beside a synthetic model: an activation profile with published statistics (`<model>.hs-profile`)
    and random predictors of a realistic width (`<model>.predictors.gguf`, their cost is real; the
    runtime's `sampled` mode draws each token's active set from the profile instead of using them)."""
    from hybridsparse.predictor_training.train import LayerResult, write_predictors
    from hybridsparse.profiler.activations import save_profile
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
    from hybridsparse.solver.plan import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, MARGIN
    from .gguf_file import GGUFFile
    g = GGUFFile(model)
    a = g.architecture
    n_layers, d = g.require(f"{a}.block_count"), g.tensors["token_embd.weight"].shape[0]
    n_kv = g.get(f"{a}.attention.head_count_kv", g.get(f"{a}.attention.head_count"))
    hd = g.get(f"{a}.attention.key_length", d // g.get(f"{a}.attention.head_count"))
    per_layer = [sum(t.nbytes for n, t in g.tensors.items() if n.startswith(f"blk.{i}.")) + 4 * n_ctx * n_kv * hd
                 for i in range(n_layers)]
    g.close()
    free = budget - CUDA_CONTEXT_BYTES - CUBLAS_WORKSPACE_BYTES - (64 << 20) - int(MARGIN * budget)
    k = 0
    while k < n_layers and sum(per_layer[n_layers - k - 1:]) <= free:
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
    if args.ctx_size < 8 + args.n_predict:
        raise InputError(f"--ctx-size {args.ctx_size} is too small for an 8-token prompt and -n {args.n_predict}")
    gpu = torch.cuda.is_available()
    result = {"machine": machine(), "model": str(model), "generated_tokens": args.n_predict, "mode": args.mode,
              "ctx_size": args.ctx_size,
              "runs": []}
    m = result["machine"]
    m["cpu_read_bandwidth_gib_s"] = round(measure_bandwidth_gib_s("cpu"), 1)
    if gpu:
        m["gpu_read_bandwidth_gib_s"] = round(measure_bandwidth_gib_s("cuda"), 1)
        torch.cuda.empty_cache()
    configs = []
    for b in ([float(x) for x in args.budgets.split(",")] if gpu else []):
        configs.append({"engine": "hybrid", "vram_budget": b})
        if not args.no_ngl:
            configs.append({"engine": "layer split", "vram_budget": b,
                            "ngl": _ngl_for_budget(model, int(b * 2**30), args.ctx_size)})
    if not args.no_cpu_only:
        configs += [{"engine": "hybrid", "vram_budget": 0.0}, {"engine": "layer split", "vram_budget": 0.0, "ngl": 0}]
    for cfg in configs:
        cfg.update(model=str(model), threads=args.threads, n_predict=args.n_predict, mode=args.mode,
                   ctx_size=args.ctx_size, cpu_bw=m["cpu_read_bandwidth_gib_s"],
                   gpu_bw=m.get("gpu_read_bandwidth_gib_s", 0.0))
        with _GpuMemoryPoller() as poll:
            p = subprocess.run([sys.executable, "-m", "hybridsparse.runtime.bench", "hybrid-one", json.dumps(cfg)],
                               capture_output=True, text=True, timeout=args.timeout)
        line = next((l for l in p.stdout.splitlines()[::-1] if l.startswith("{")), None)
        if p.returncode != 0 or line is None:
            err = (p.stderr.strip().splitlines() or ["?"])[-1]
            run = {**cfg, "error": err}
        else:
            run = {**cfg, **json.loads(line)}
        if poll.ok and cfg["vram_budget"] > 0:
            run["peak_device_bytes"] = poll.peak - poll.base
            run["within_budget"] = run["peak_device_bytes"] <= cfg["vram_budget"] * 2**30
        result["runs"].append(run)
        print(_hybrid_row(run), file=sys.stderr)
        write_json(args.json, result)  # after each run: a session cut short still leaves its results
    for run in result["runs"]:  # ratios side by side at each budget
        same = [r for r in result["runs"] if r["vram_budget"] == run["vram_budget"] and r is not run
                and r["engine"] == "layer split" and "decode_tok_s" in r]
        if run["engine"] == "hybrid" and same and "decode_tok_s" in run:
            run["speedup_vs_layer_split"] = run["decode_tok_s"] / same[0]["decode_tok_s"]
    write_json(args.json, result)
    print(hybrid_table(result))
    if args.json and any("decode_tok_s" in r for r in result["runs"]):
        print(f"plot: {plot_hybrid(result, Path(args.json).with_suffix('.png'))}")
    return 0


def _hybrid_row(r: dict) -> str:
    if "error" in r:
        return f"{r['engine']:12s} {r['vram_budget']:5.1f} GiB: error: {r['error']}"
    peak = f", peak {r['peak_device_bytes'] / 2**30:.2f} GiB" if "peak_device_bytes" in r else ""
    return (f"{r['engine']:12s} {r['vram_budget']:5.1f} GiB: decode {r['decode_tok_s']:.2f} tok/s, "
            f"{100 * r.get('fraction_of_bound', 0):.0f}% of bound{peak}")


def hybrid_table(d: dict) -> str:
    m = d["machine"]
    where = f"{m['gpu']} + {m['cpu']}" if m.get("gpu") else f"{m['cpu']} (no GPU)"
    lines = [f"Hybrid vs layer split on {where} ({Path(d['model']).name}, {d['mode']} "
             "activity):", "", "| VRAM budget GiB | engine | placement | decode tok/s | vs layer split | "
             "of bound | peak device GiB |", "|---|---|---|---|---|---|---|"]
    for r in d["runs"]:
        if "error" in r:
            lines.append(f"| {r['vram_budget']:g} | {r['engine']} | error: {r['error']} | | | | |")
            continue
        where = (f"-ngl {r['ngl']}" if r["engine"] == "layer split" else r.get("placement", ""))
        peak = f"{r['peak_device_bytes'] / 2**30:.2f}" if "peak_device_bytes" in r else ""
        sp = f"{r['speedup_vs_layer_split']:.2f}x" if "speedup_vs_layer_split" in r else ""
        lines.append(f"| {r['vram_budget']:g} | {r['engine']} | {where} | {r['decode_tok_s']:.2f} | {sp} | "
                     f"{100 * r.get('fraction_of_bound', 0):.0f}% | {peak} |")
    return "\n".join(lines)


def _hybrid_one(cfg: dict) -> dict:
    """One configuration, in this process: load, prefill 8 tokens, decode, and the bandwidth bound of
    what each device must read per token for this placement."""
    from .generate import Generator
    from .hybrid import HybridOptions
    from .loader import open_model
    from .sampling import Sampler, SamplingParams
    from hybridsparse.solver.plan import GiB, Hardware
    torch.set_num_threads(cfg["threads"])
    t0 = time.perf_counter()
    if cfg["engine"] == "hybrid":
        hw = Hardware(cfg["gpu_bw"] * GiB or 800 * GiB, cfg["cpu_bw"] * GiB, 20e-6)
        opts = HybridOptions(vram_budget=cfg["vram_budget"], mode=cfg["mode"], n_ctx=cfg["ctx_size"], hardware=hw)
        lm = open_model(cfg["model"], hybrid=opts, log_line=lambda line: print(line, file=sys.stderr))
    else:
        lm = open_model(cfg["model"], cfg["ngl"])
    load_s = time.perf_counter() - t0
    prompt = lm.tokenizer.encode("Once upon a time")[:8]
    gen = Generator(lm.model, lm.tokenizer, cfg["ctx_size"])  # the KV cache the placement planned for
    sampler = Sampler(SamplingParams(temperature=0))
    for _ in gen.generate(prompt, 4, sampler):  # warm-up (allocator, graphs)
        pass
    for _ in gen.generate(prompt, cfg["n_predict"], sampler):
        pass
    t = gen.timings
    out = {"decode_tok_s": max(t.gen_tokens - 1, 1) / t.gen_s, "prefill_tok_s": t.prompt_tokens / t.prompt_s,
           "load_s": round(load_s, 1), "generated": t.gen_tokens}
    gpu_bytes, cpu_bytes, bound_s = _placement_bytes(lm, cfg)
    out.update(gpu_bytes_per_token=gpu_bytes, cpu_bytes_per_token=cpu_bytes, bound_tok_s=1 / bound_s,
               fraction_of_bound=out["decode_tok_s"] * bound_s)
    if lm.hybrid_report:
        r = lm.hybrid_report
        out["placement"] = (f"attention {r['attn_fast']}/{lm.model.config.n_layers} layers, "
                            f"{100 * r['hot_neurons'] / r['neurons']:.0f}% of neurons on GPU")
        out["hybrid"] = r
    if torch.cuda.is_available():
        out["torch_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return out


def _placement_bytes(lm, cfg) -> tuple[float, float, float]:
    """Expected bytes each device reads per token (dense blocks whole, FFN neurons by their profile
    frequency when sparse) and the bound: per layer max(GPU, CPU) time for the hybrid (they overlap),
    their sum for the layer split (they do not)."""
    from .hybrid import HybridFFN
    model, g = lm.model, lm.gguf
    gbw, cbw = cfg["gpu_bw"] * 2**30 or 1.0, cfg["cpu_bw"] * 2**30
    freqs = None  # predictor mode: the expected active bytes come from the profile's frequencies
    profile_dir = Path(g.path).with_name(Path(g.path).stem + ".hs-profile")
    if cfg.get("mode") == "predictor" and profile_dir.is_dir():
        from hybridsparse.profiler.activations import load_profile
        freqs = load_profile(profile_dir).frequencies()
    total_g = total_c = bound = 0.0
    for i, layer in enumerate(model.layers):
        dev = model.placement.layers[i].type
        names = [n for n in g.tensors if n.startswith(f"blk.{i}.")]
        ffn_names = [n for n in names if ".ffn_" in n and ".weight" in n]
        attn = sum(g.tensors[n].nbytes for n in names if n not in ffn_names and ".fc" not in n)
        ffn_bytes = sum(g.tensors[n].nbytes for n in ffn_names)
        gb = attn if dev == "cuda" else 0.0
        cb = attn if dev != "cuda" else 0.0
        f = layer.ffn
        freq = None
        if isinstance(f, HybridFFN):
            freq = f.freq if f.freq is not None else (freqs[i].float() if freqs is not None else None)
        if isinstance(f, HybridFFN) and f.mode != "dense" and freq is not None:
            per = ffn_bytes / f.n_ff
            hot = torch.zeros(f.n_ff, dtype=torch.bool)
            if f.n_hot:
                hot[f._hot_on[torch.device("cpu")]] = True
            freq = freq.cpu()
            gb += float(freq[hot].sum()) * per * (f.fast is not None and f.fast.type == "cuda")
            cb += float(freq[~hot].sum()) * per
            pred = f.predictor.fc1.nbytes + f.predictor.fc2.nbytes
            gb, cb = (gb + pred, cb) if dev == "cuda" else (gb, cb + pred)
        elif isinstance(f, HybridFFN):
            per = ffn_bytes / f.n_ff
            gb += f.n_hot * per * (f.fast is not None and f.fast.type == "cuda")
            cb += f.n_cold * per
        else:
            gb, cb = (gb + ffn_bytes, cb) if dev == "cuda" else (gb, cb + ffn_bytes)
        total_g, total_c = total_g + gb, total_c + cb
        bound += max(gb / gbw, cb / cbw) if cfg["engine"] == "hybrid" else gb / gbw + cb / cbw
    head = g.tensors.get("output.weight") or g.tensors["token_embd.weight"]
    if model.placement.head.type == "cuda":
        total_g += head.nbytes
        bound += head.nbytes / gbw
    else:
        total_c += head.nbytes
        bound += head.nbytes / cbw
    return total_g, total_c, bound


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
        if h and s and s["decode_tok_s"]:
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
    print("| model | machine | engine | threads | -ngl | prefill tok/s | decode tok/s | decode vs llama.cpp | "
          "of bandwidth bound |")
    print("|---|---|---|---|---|---|---|---|---|")
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
        m = d["machine"]
        where = f"{m['gpu']} + {m['cpu']}" if "gpu" in m and any(r.get("n_gpu_layers", 0) != 0 for r in d["results"]) else m["cpu"]
        for r in d["results"]:
            ours = r["engine"] == "hybridsparse"
            label = r["engine"] + ("" if r.get("cuda_graphs", True) else " (no CUDA graphs)")
            ratio = f"{d['decode_ratio_vs_llama_cpp']:.2f}x" if ours and "decode_ratio_vs_llama_cpp" in d else ""
            frac = f"{100 * d['fraction_of_bound']:.0f}%" if ours and r.get("cuda_graphs", True) else ""
            name = Path(r.get('model', d['results'][0].get('model', '?'))).name
            if d.get("prompt_tokens", 64) != 64:
                name += f" ({d['prompt_tokens']}-token prompt)"
            print(f"| {name} | {where} | {label} | "
                  f"{r['threads']} | {r['n_gpu_layers']} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
                  f"{ratio} | {frac} |")
    for d in hybrid_files:
        print("\n" + hybrid_table(d))
    for d in kernel_files:
        m = d["machine"]
        bw = m.get("read_bandwidth_gib_s") or m["cpu_read_bandwidth_gib_s"]
        on_gpu = m.get("device") == "cuda"
        where = f"{m['gpu']}" if on_gpu else f"{m['cpu']}, {d['threads']} threads"
        print(f"\nSparse ops on {where}, read bandwidth {bw} GiB/s (GiB/s on the bytes of the rows each op must "
              "read; % of that bandwidth):\n")
        print("| FFN rows | type | density | row-dot GiB/s | axpy GiB/s | torch gather+GEMV GiB/s | torch dense GEMV GiB/s |")
        print("|---|---|---|---|---|---|---|")
        for r in d["results"]:
            torch_g = f"{r['torch_gather_gemv_gib_s']:.1f}" if "torch_gather_gemv_gib_s" in r else ""
            torch_d = f"{r['torch_dense_gemv_gib_s']:.1f}" if "torch_dense_gemv_gib_s" in r else ""
            print(f"| {r['shape']} | {r['type']} | {r['density']:.0%} | {r['rowdot_gib_s']:.1f} "
                  f"({r['rowdot_gib_s'] / bw:.0%}) | {r['axpy_gib_s']:.1f} ({r['axpy_gib_s'] / bw:.0%}) | "
                  f"{torch_g} | {torch_d} |")
    return 0


KERNEL_SHAPES = {  # name: (d_model, n_ff): FFN rows of real models
    "llama-2-7b": (4096, 11008), "llama-2-13b": (5120, 13824), "llama-2-70b": (8192, 28672),
    "falcon-40b": (8192, 32768),
}


def _random_weight(qtype, rows: int, cols: int) -> torch.Tensor:
    """Random valid data of a GGML type (values do not matter for speed; scales are kept finite)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
    if qtype in (Q.F16, Q.BF16):
        return (torch.randn(rows, cols) * 0.02).to(torch.float16 if qtype == Q.F16 else torch.bfloat16)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (rows, cols // block, size), dtype=torch.uint8)
    raw[:, :, 0:2] = torch.tensor([0x00, 0x20], dtype=torch.uint8)  # float16 scale 0.0078
    return raw.reshape(rows, -1)


def _time(f, reps: int, cuda: bool = False) -> float:
    """Median seconds per call; on the CPU each call after reading 256 MiB (more than any L3), so the
    rows come from memory. On the GPU the calls are captured in a CUDA graph (as the runtime
    runs them) and replayed, so the figure is the kernels' time, not Python's launch overhead."""
    f()
    if not cuda:  # rows read from DRAM, not from a cache warmed by the previous call
        flush = torch.ones((256 << 20) // 4)
        times = []
        for _ in range(reps):
            flush.sum()
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
    rows_out, densities = [], [float(d) for d in args.densities.split(",")]
    for shape in args.shapes.split(","):
        d_model, n_ff = KERNEL_SHAPES[shape]
        for tname in args.types.split(","):
            qtype = Q[tname]
            w = _random_weight(qtype, n_ff, d_model).to(dev)
            row_bytes = w.shape[1] * w.element_size()
            x = torch.randn(1, d_model, device=dev)
            is_float = qtype in (Q.F16, Q.BF16)
            xw = x.to(w.dtype) if is_float else None
            t_dense = _time(lambda: torch.nn.functional.linear(xw, w), args.reps, cuda) if is_float else None
            for dens in densities:
                m = max(1, int(n_ff * dens))
                idx = torch.randperm(n_ff)[:m].sort().values.int().to(dev)
                h = torch.randn(1, m, device=dev)
                t_dot = _time(lambda: kernels.sparse_rowdot(w, qtype, x, idx, check=False), args.reps, cuda)
                t_axpy = _time(lambda: kernels.sparse_axpy(w, qtype, h, idx, check=False), args.reps, cuda)
                gib = m * row_bytes / 2**30
                entry = {"shape": shape, "type": tname, "density": dens, "rows": m,
                         "rowdot_gib_s": gib / t_dot, "axpy_gib_s": gib / t_axpy,
                         "rowdot_of_bandwidth": gib / t_dot / bw, "axpy_of_bandwidth": gib / t_axpy / bw}
                if cuda:
                    mask = torch.zeros(n_ff, dtype=torch.bool, device=dev)
                    mask[idx.long()] = True
                    t_mask = _time(lambda: kernels.sparse_rowdot(w, qtype, x, None, mask, check=False), args.reps, cuda)
                    entry["rowdot_mask_gib_s"] = gib / t_mask
                if is_float:
                    t_gather = _time(lambda: torch.nn.functional.linear(xw, w[idx.long()]), args.reps, cuda)
                    entry["torch_gather_gemv_gib_s"] = gib / t_gather
                    entry["torch_dense_gemv_gib_s"] = n_ff * row_bytes / 2**30 / t_dense
                rows_out.append(entry)
                print(f"{shape:12s} {tname:5s} {dens:5.0%} rowdot {entry['rowdot_gib_s']:7.1f} GiB/s "
                      f"({entry['rowdot_of_bandwidth']:4.0%})  axpy {entry['axpy_gib_s']:7.1f} GiB/s "
                      f"({entry['axpy_of_bandwidth']:4.0%})"
                      + (f"  mask-rowdot {entry['rowdot_mask_gib_s']:7.1f}" if cuda else "")
                      + (f"  torch gather+GEMV {entry['torch_gather_gemv_gib_s']:7.1f}  torch dense "
                         f"{entry['torch_dense_gemv_gib_s']:7.1f}" if is_float else ""), flush=True)
    result = {"machine": {**machine(), "device": args.device, "read_bandwidth_gib_s": round(bw, 1)},
              "threads": args.threads, "results": rows_out}
    print(f"read bandwidth {bw:.1f} GiB/s ({args.device}" + (f", {args.threads} threads)" if not cuda else ")"))
    write_json(args.json, result)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hs-bench", description="Benchmarks (JSON out); see README.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="decode and prefill tokens/s of hs-run (and llama.cpp with --llama-cpp)")
    add_model_args(run)
    run.add_argument("--prompt-tokens", type=int, default=64)
    run.add_argument("-n", "--n-predict", type=int, default=128)
    run.add_argument("--reps", type=int, default=5,
                     help="timed runs per engine (median), after one warm-up; engines alternate run by run")
    run.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp (llama-cpp-python) on the same file")
    run.add_argument("--compare-graphs", action="store_true", help="also run without CUDA graphs")
    run.add_argument("--json", help="write the results here")
    run.set_defaults(func=_run)
    kern = sub.add_parser("kernels", help="sparse ops: effective GiB/s at several densities, vs bandwidth and torch")
    kern.add_argument("-t", "--threads", type=int, default=default_threads())
    kern.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    kern.add_argument("--shapes", default="llama-2-7b,llama-2-13b,llama-2-70b,falcon-40b")
    kern.add_argument("--types", default="F16,Q8_0,Q4_0")
    kern.add_argument("--densities", default="1.0,0.25,0.1,0.03")
    kern.add_argument("--reps", type=int, default=5)
    kern.add_argument("--json")
    kern.add_argument("--verbose", action="store_true")
    kern.set_defaults(func=_kernels)
    table = sub.add_parser("table", help="print a markdown table of `run` JSON files")
    table.add_argument("files", nargs="+")
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
    hyb.add_argument("-n", "--n-predict", type=int, default=32)
    hyb.add_argument("-c", "--ctx-size", type=int, default=512,
                     help="context both engines plan and allocate the KV cache for (llama-bench's habit: "
                          "the prompt and the generated tokens, rounded up)")
    hyb.add_argument("--mode", choices=["predictor", "sampled", "dense"], default="predictor",
                     help="sampled: active sets drawn from the profile (synthetic models)")
    hyb.add_argument("--no-ngl", action="store_true", help="skip the layer-split runs")
    hyb.add_argument("--no-cpu-only", action="store_true", help="skip the CPU-only runs")
    hyb.add_argument("--timeout", type=float, default=600)
    hyb.add_argument("--json")
    hyb.add_argument("--verbose", action="store_true")
    hyb.set_defaults(func=_hybrid)
    synth = sub.add_parser("synth", help="write a random model with a real model's shape")
    synth.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    synth.add_argument("--dtype", choices=["f16", "f32"], default="f16")
    synth.add_argument("-o", "--output", required=True)
    synth.add_argument("--layout", choices=["llama.cpp", "powerinfer"], default="llama.cpp",
                       help="powerinfer: ffn_down stored transposed (ffn_down_t), as PowerInfer's converter does")
    synth.add_argument("--activity", choices=["none", "zipf"], default="none", help="zipf: also write an activation "
                       "profile with published statistics and random predictors beside the model")
    synth.add_argument("--density", type=float, default=0.11, help="mean share of active neurons (default: "
                       "%(default)s, ProSparse/TurboSparse)")
    synth.add_argument("--hot-share", type=float, default=0.3, help="share of neurons carrying 80%% of the "
                       "activations (default: %(default)s; OPT-30B 0.26, Llama(ReGLU)-70B 0.43)")
    synth.add_argument("--predictor-width", type=int, default=512)
    synth.add_argument("--verbose", action="store_true")
    synth.set_defaults(func=_synth)
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
