"""Where a hybrid decode step goes (tool): load MODEL in hybrid form at a budget and decode side by side
  - graphs: the step as one CUDA graph, each layer's cold FFN a host node (the default),
  - host nodes: the same queued op by op (no graph),
  - events: the event-synchronised path (HS_HOST_NODES=0), with host time per part (HS_HYBRID_TIMING),
  - events-nohg: the same with the hot parts of CPU-attention layers op by op (HS_HOT_GRAPHS=0),
  - graphs with the CPU FFN unfused (HS_FUSED_FFN=0: row-dots, activation and axpy as three passes),
  - skip: graphs with the host nodes doing no work (HS_COLD_SKIP=1: the GPU's part and the hand-overs),
  - poll / poll-skip: graphs and skip with the polled hand-over instead of host nodes (HS_HANDOVER=poll),
  - serial: graphs with a parallel-attention block's FFN joined before its attention is queued
    (HS_FFN_OVERLAP=0: Falcon's CPU part no longer overlaps the GPU's attention),
  - one-plane / poll-one-plane: graphs / poll with one-plane 8-bit activations for Q4_0/Q5_0/Q8_0 rows
    (HS_ACT_PLANES=1),
  - events-s1 / poll-s1: events / poll with a dense GEMV's rows as one stream a thread instead of 4
    (HS_GEMV_STREAMS=1: the CPU's attention and predictors),
  - poll-nonext: poll with listed Q4_0 rows side by side not asking for the next group's rows (HS_NEXT_ROWS=0),
  - poll-ahead2 / poll-ahead2-c128: poll with them asking for the rows two groups on (HS_NEXT_ROWS=2), and so with
    the FFN's threads claiming up to 128 neurons at a time instead of 64 (HS_FFN_CHUNK=128),
  - poll-c16: poll with the FFN's threads claiming up to 16 neurons at a time (HS_FFN_CHUNK=16, the default until
    session 29),
  - poll-runpool: poll where some attention is on the CPU, the GPU runs' CPU parts on the spinning pool
    instead of the OpenMP team of the CPU layers (HS_RUN_POOL=1),
  - poll-narrow / poll-one-narrow: poll (two-plane / one-plane activations) with one token's Q4_0 dots
    in the 256-bit form instead of four blocks at a time (HS_Q4_WIDE=0),
  - static: graphs with the CPU FFN's threads on fixed shares of the neurons (HS_FFN_CHUNK=0),
  - t-1: graphs with the host nodes on one thread less than HS_THREADS,
  - noyield / sleep: the pool's idle threads spin without yielding / sleep at once,
  - omp / spin / omp-spin: graphs with the host nodes' threads from OpenMP (HS_COLD_POOL=0) instead of
    the spinning pool, and/or this thread spinning while a step runs (HS_GRAPH_WAIT=spin),
  - layers: eager steps synchronised after every layer, the time per layer grouped by where its
    attention runs and whether it has hot (GPU) and cold (CPU) neurons, with the host time per part
    (HS_HYBRID_TIMING) of each group,
  - generate: what `hs-bench hybrid` times: a 64-token prompt, then 32 greedy tokens one graph replay
    each with argmax in between (the steps above feed fixed tokens after a 4-token prompt),
  - trace: three graphed steps under torch's profiler (CUDA activity: the kernels inside the graph):
    the GPU's busy time, its idle gaps grouped by the kernels around them, the kernels by device time
    (HS_TRACE_SKIP=0: with the CPU work; default without it, the GPU's part alone; HS_TRACE_OUT=FILE:
    the Chrome trace),
and torch's profile of two eager steps. HS_PROFILE_MODES=graphs (a comma list of graphs, unfused, eager,
events, events-nohg, events-s1, layers, generate, trace, poll, poll-s1, poll-runpool, poll-nonext, poll-ahead2, poll-ahead2-c128, poll-c16, poll-skip, poll-one-plane, poll-narrow, poll-one-narrow, serial, one-plane, omp, spin, omp-spin, skip, static, t-1, noyield, sleep) runs only those, in that order
(a mode named twice runs twice: graphs,poll,graphs,poll alternates them), and skips torch's profile
(unless HS_PROFILE_TORCH=1; HS_PROFILE_ROWS rows of it, by device time on a GPU or by HS_PROFILE_SORT,
e.g. self_cpu_time_total); HS_THREADS sets the
thread count (default 16).
  HS_HYBRID_TIMING=1 python tests/gpu/profile_hybrid.py MODEL BUDGET_GIB [MODE] [N]"""

import os
import sys
import time

import torch

from hybridsparse.runtime import hybrid, kernels, layers
from hybridsparse.runtime.generate import Generator
from hybridsparse.runtime.hybrid import HybridOptions
from hybridsparse.runtime.loader import open_model
from rows_bench import mapped_kib  # this folder's

kernels.ops()  # built or loaded now: kernels.cpu below
model, budget = sys.argv[1], float(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else "sampled"
n = int(sys.argv[4]) if len(sys.argv) > 4 else 16
torch.set_num_threads(int(os.environ.get("HS_THREADS", "16")))
# the plan `hs-bench hybrid` / `scenario` solves: this machine's read bandwidths as measured now (the
# solver's default figures, 800 / 50 GiB/s, kept S3's attention on the CPU in 14 layers where the
# scenario puts all 40 on the GPU); HS_PROFILE_DEFAULT_HW=1: the default figures
hw = None
if os.environ.get("HS_PROFILE_DEFAULT_HW") != "1":
    from hybridsparse.runtime.bench import measure_bandwidth_gib_s
    from hybridsparse.solver.plan import GiB, Hardware
    bw = {d: measure_bandwidth_gib_s(d) for d in ("cpu", "cuda")}
    print(f"read bandwidth: CPU {bw['cpu']:.1f} GiB/s, GPU {bw['cuda']:.1f} GiB/s (the plan's figures)")
    hw = Hardware(bw["cuda"] * GiB, bw["cpu"] * GiB, 20e-6)
lm = open_model(model, hybrid=HybridOptions(vram_budget=budget, mode=mode, n_ctx=512, hardware=hw), log_line=print)
m = lm.model
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def decode(use_graphs: bool, host_nodes: bool, on_start=None) -> float:
    kernels.HOST_NODES = host_nodes
    gen = Generator(m, lm.tokenizer, 512, use_graphs=use_graphs)
    with torch.inference_mode():
        gen.eval([1, 2, 3, 4])
        for i in range(4):  # warm-up: buffers, tasks, graph capture
            gen.eval([5 + i])
        sync()
        if hybrid.TIMING is not None:
            hybrid.TIMING.clear()
        if on_start is not None:
            on_start()
        t = time.perf_counter()
        for i in range(n):
            out = gen.eval([10 + i])
        float(out[0])
        sync()
        kernels.raise_host_errors()
        return (time.perf_counter() - t) / n


ffn0 = next(l.ffn for l in m.layers if getattr(l.ffn, "n_cold", 0))
neuron_bytes = ffn0._neuron_bytes  # up, gate and down rows of one neuron
modes = os.environ.get("HS_PROFILE_MODES", "graphs,unfused,eager,events").split(",")
# key, label, graphs, host nodes, environment (the compiled code reads these per call)
VARIANTS = (("graphs", "graphs + host nodes", True, True, {}),
            ("omp", "the same, OpenMP threads", True, True, {"HS_COLD_POOL": "0"}),
            ("spin", "the same, spinning wait", True, True, {"HS_GRAPH_WAIT": "spin"}),
            ("omp-spin", "OpenMP + spinning wait", True, True, {"HS_COLD_POOL": "0", "HS_GRAPH_WAIT": "spin"}),
            ("skip", "the same, no CPU work", True, True, {"HS_COLD_SKIP": "1"}),
            ("poll", "the same, polled hand-over", True, True, {}),
            ("serial", "the same, FFN joined first", True, True, {}),
            ("one-plane", "the same, one-plane act.", True, True, {"HS_ACT_PLANES": "1"}),
            ("poll-skip", "polled, no CPU work", True, True, {"HS_COLD_SKIP": "1"}),
            ("poll-one-plane", "polled, one-plane act.", True, True, {"HS_ACT_PLANES": "1"}),
            ("poll-narrow", "polled, 256-bit Q4_0 dots", True, True, {"HS_Q4_WIDE": "0"}),
            ("poll-one-narrow", "polled, one-plane, 256-bit", True, True, {"HS_ACT_PLANES": "1", "HS_Q4_WIDE": "0"}),
            ("static", "the same, fixed shares", True, True, {"HS_FFN_CHUNK": "0"}),
            ("t-1", "the same, one thread less", True, True, {}),
            ("noyield", "the same, pool never yields", True, True, {}),
            ("sleep", "the same, pool sleeps at once", True, True, {}),
            ("unfused", "the same, HS_FUSED_FFN=0", True, True, {"HS_FUSED_FFN": "0"}),
            ("eager", "host nodes, no graph", False, True, {}),
            ("events", "events (HS_HOST_NODES=0)", False, False, {}),
            ("events-nohg", "the same, HS_HOT_GRAPHS=0", False, False, {}),
            ("events-s1", "events, 1 GEMV stream", False, False, {"HS_GEMV_STREAMS": "1"}),
            ("poll-s1", "polled, 1 GEMV stream", True, True, {"HS_GEMV_STREAMS": "1"}),
            ("poll-runpool", "polled, run graphs' pool", True, True, {"HS_RUN_POOL": "1"}),
            ("poll-nonext", "polled, no next-rows ask", True, True, {"HS_NEXT_ROWS": "0"}),
            ("poll-ahead2", "polled, rows 2 groups on", True, True, {"HS_NEXT_ROWS": "2"}),
            ("poll-ahead2-c128", "polled, 2 on, 128-neuron chunks", True, True, {"HS_NEXT_ROWS": "2", "HS_FFN_CHUNK": "128"}),
            ("poll-c16", "polled, 16-neuron chunks", True, True, {"HS_FFN_CHUNK": "16"}))
by_key = {v[0]: v for v in VARIANTS}
default_handover = kernels.HANDOVER  # the runtime's (HS_HANDOVER or its default), for generate / trace below
for key, label, graphs, nodes, env in (by_key[k] for k in modes if k in by_key):  # in the order asked, repeats too
    saved = {k: os.environ.get(k) for k in ("HS_COLD_POOL", "HS_GRAPH_WAIT", "HS_FUSED_FFN", "HS_COLD_SKIP",
                                      "HS_FFN_CHUNK", "HS_ACT_PLANES", "HS_Q4_WIDE", "HS_GEMV_STREAMS", "HS_RUN_POOL",
                                      "HS_NEXT_ROWS")}
    kernels.cpu.cold_ffn_set_threads(torch.get_num_threads() - (key == "t-1"))
    kernels.cpu.pool_configure(*{"noyield": (2000, 2000), "sleep": (0, 0)}.get(key, (2000, 50)))
    os.environ.update(env)
    hybrid.HOT_GRAPHS = key != "events-nohg"
    kernels.HANDOVER = "poll" if key.startswith("poll") else "node"  # graphs/skip/serial...: host nodes
    layers.FFN_OVERLAP = key != "serial" and os.environ.get("HS_FFN_OVERLAP", "1") != "0"
    before = kernels.cpu.cold_ffn_stats()
    dt = decode(graphs, nodes)
    runs, busy, rows = (a - b for a, b in zip(kernels.cpu.cold_ffn_stats(), before))
    steps = n + 5  # the timed steps and the warm-up ones (cold_ffn_stats counts both)
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    cpu = ""
    if runs:
        rate = rows * neuron_bytes / (busy / 1e9) / 2**30 if busy else 0.0
        cpu = (f"; host nodes {busy / 1e6 / steps:6.1f} ms of it ({runs / steps:.0f} a token, "
               f"{rows / steps:.0f} cold rows: {rate:5.1f} GiB/s)")
    print(f"{label:26s} {dt * 1e3:7.1f} ms per token ({1 / dt:6.2f} tok/s){cpu}")
hybrid.HOT_GRAPHS = True
kernels.HANDOVER = default_handover
if "layers" in modes:  # eager steps, synchronised after every layer: where a step's time goes by layer kind
    kernels.HOST_NODES = True
    groups: dict[str, list[float]] = {}
    parts: dict[str, dict[str, float]] = {}
    block, events_timing, recording = m.block, dict(hybrid.TIMING or {}), []

    def timed_block(i, x, step, cache):
        if not recording:
            return block(i, x, step, cache)
        sync()
        before = dict(hybrid.TIMING or {})
        t0 = time.perf_counter()
        y = block(i, x, step, cache)
        sync()
        dt = time.perf_counter() - t0
        f = m.layers[i].ffn
        key = (f"attn {m.placement.layers[i].type}, " + ("hot+cold" if f.n_hot and f.n_cold else
                                                         "hot only" if f.n_hot else "cold only"))
        groups.setdefault(key, []).append(dt)
        g = parts.setdefault(key, {})
        for k, v in (hybrid.TIMING or {}).items():
            g[k] = g.get(k, 0.0) + v - before.get(k, 0.0)
        return y
    m.block = timed_block
    dt = decode(False, True, on_start=lambda: recording.append(True))
    m.block = block
    if hybrid.TIMING is not None:
        hybrid.TIMING.clear()
        hybrid.TIMING.update(events_timing)
    steps = n
    total = sum(sum(v) for v in groups.values()) / steps
    print(f"synchronised per layer    {dt * 1e3:7.1f} ms per token, layers {total * 1e3:.1f} ms of it")
    for key, v in sorted(groups.items()):
        per = len(v) / steps
        line = ", ".join(f"{k} {t / len(v) * 1e3:.2f}" for k, t in sorted(parts[key].items(), key=lambda kv: -kv[1]))
        print(f"  {key:26s} {per:3.0f} layers x {sum(v) / len(v) * 1e3:6.2f} ms = {sum(v) / steps * 1e3:6.1f} ms"
              f"  (per layer: {line})")
if "generate" in modes:  # the benchmark's loop (runtime/bench.py _hybrid_one), cold rows counted in decode only
    kernels.HOST_NODES = True
    gen = Generator(m, lm.tokenizer, 512)
    base = lm.tokenizer.encode("Once upon a time")
    prompt = (base * (64 // len(base) + 1))[:64]
    with torch.inference_mode():
        for rep in range(2):  # the first is the warm-up (graph capture for this context length)
            t0 = time.perf_counter()
            logits = gen.eval(prompt) if rep == 0 else (gen.reset(), gen.eval(prompt))[1]
            sync()
            t1 = time.perf_counter()
            before = kernels.cpu.cold_ffn_stats()
            for _ in range(32 if rep else 4):
                logits = gen.eval([int(torch.argmax(logits))])
            float(logits[0])
            sync()
            dt = (time.perf_counter() - t1) / (32 if rep else 4)
            runs, busy, rows = (a - b for a, b in zip(kernels.cpu.cold_ffn_stats(), before))
        steps = 32
        rate = rows * neuron_bytes / (busy / 1e9) / 2**30 if busy else 0.0
        print(f"{'generate (bench loop)':26s} {dt * 1e3:7.1f} ms per token ({1 / dt:6.2f} tok/s); host nodes "
              f"{busy / 1e6 / steps:6.1f} ms of it ({runs / steps:.0f} a token, {rows / steps:.0f} cold rows: "
              f"{rate:5.1f} GiB/s); prefill {64 / (t1 - t0):.1f} tok/s")
if "trace" in modes and torch.cuda.is_available():  # the graphed step's GPU timeline
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    kernels.HOST_NODES = True
    skip = os.environ.get("HS_TRACE_SKIP", "1") == "1"
    if skip:
        os.environ["HS_COLD_SKIP"] = "1"
    gen = Generator(m, lm.tokenizer, 512)
    with torch.inference_mode():
        gen.eval([1, 2, 3, 4])
        for i in range(4):
            gen.eval([5 + i])
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for i in range(3):
                gen.eval([10 + i])
            sync()
            wall = (time.perf_counter() - t) / 3
    os.environ.pop("HS_COLD_SKIP", None)
    if os.environ.get("HS_TRACE_OUT"):
        prof.export_chrome_trace(os.environ["HS_TRACE_OUT"])
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    if not spans:
        print("trace: no CUDA activity recorded (kernels inside graphs not reported by this CUPTI)")
    else:
        busy, gaps, end, prev = 0.0, {}, spans[0][0], spans[0][2]
        for s0, s1, name in spans:
            if s0 > end:
                key = (prev[:48], name[:48])
                g = gaps.setdefault(key, [0, 0.0])
                g[0] += 1
                g[1] += s0 - end
            busy += max(0.0, s1 - max(s0, end))
            if s1 > end:
                end, prev = s1, name
        span = (end - spans[0][0]) / 3
        print(f"trace ({'no CPU work' if skip else 'with CPU work'}): {wall * 1e3:.1f} ms a step, the GPU's timeline "
              f"{span / 1e3:.1f} ms of it, busy {busy / 3 / 1e3:.1f} ms, idle {(span - busy / 3) / 1e3:.1f} ms; "
              f"{len(spans) / 3:.0f} GPU activities a step")
        print("  idle gaps by the activities around them (per step: count, ms):")
        for (a, b), (c, tot) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:14]:
            print(f"  {c / 3:6.0f} {tot / 3 / 1e3:7.2f}  {a}  ->  {b}")
        kinds: dict[str, list] = {}
        for s0, s1, name in spans:
            k = kinds.setdefault(name[:72], [0, 0.0])
            k[0] += 1
            k[1] += s1 - s0
        print("  activities by device time (per step: count, ms, us each):")
        for name, (c, tot) in sorted(kinds.items(), key=lambda kv: -kv[1][1])[:16]:
            print(f"  {c / 3:6.0f} {tot / 3 / 1e3:7.2f} {tot / c:7.1f}  {name}")
real = os.path.realpath(model)
pmd_kib, rss_kib = mapped_kib(lambda header: header.endswith(real))  # 2 MiB pages where the page cache has large folios
print(f"model mapping: {rss_kib / 2**20:.1f} GiB resident, {pmd_kib / max(rss_kib, 1):.0%} of it in 2 MiB pages")
if hybrid.TIMING:
    print("host time per token by part (events path):")
    for k, v in sorted(hybrid.TIMING.items(), key=lambda kv: -kv[1]):
        print(f"  {k:14s} {v / n * 1e3:8.2f} ms")
if "HS_PROFILE_MODES" in os.environ and not os.environ.get("HS_PROFILE_TORCH"):
    sys.exit(0)
kernels.HOST_NODES = True
cache = m.new_cache(128)
from torch.profiler import ProfilerActivity, profile  # noqa: E402
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
with torch.inference_mode():
    for i in range(3):
        m.forward(torch.tensor([5]), torch.tensor([i]), cache, i + 1)
    sync()
    with profile(activities=acts) as p:
        for i in range(3, 5):
            m.forward(torch.tensor([5]), torch.tensor([i]), cache, i + 1)
        sync()
by = os.environ.get("HS_PROFILE_SORT") or ("self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total")
print(p.key_averages().table(sort_by=by, row_limit=int(os.environ.get("HS_PROFILE_ROWS", "15"))))
