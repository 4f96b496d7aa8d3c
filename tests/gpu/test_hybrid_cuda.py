"""The hybrid runtime on a real GPU (skipped without CUDA): oracle-sparse with a neuron split between the
GPU and the CPU gives the all-GPU dense model's logits and tokens; hs-run solves, reuses and resets the
GPU index; peak device memory (read from the driver) stays within --vram-budget; a budget below what
the CUDA context takes is one clear error."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")

from hybridsparse.runtime.bench import _GpuMemoryPoller, write_synthetic_activity  # noqa: E402
from hybridsparse.runtime.gguf_file import GGUFFile  # noqa: E402
from hybridsparse.runtime.hybrid import HybridOptions, setup_hybrid  # noqa: E402
from hybridsparse.runtime.models import load_model  # noqa: E402
from test_architectures import VOCAB, build_case  # noqa: E402
from test_hybrid import greedy_run  # noqa: E402
from tiny_models import tiny_llama  # noqa: E402


@pytest.mark.parametrize("cold", ["never", "always"])
@pytest.mark.parametrize("name", ["llama-relu", "llama-swiglu", "llama-drelu", "gemma3", "opt", "falcon-40b-relu"])
def test_oracle_hybrid_on_cuda_equals_dense_on_cuda(name, cold, tmp_path, monkeypatch):
    """cold="always": the prefill's cold rows are streamed to the GPU (a few neurons per chunk, so
    both staging slots and their events are reused many times) instead of computed by the CPU."""
    from hybridsparse.runtime import hybrid
    from hybridsparse.solver import plan
    monkeypatch.setattr(hybrid, "COLD_STREAM", cold)
    monkeypatch.setattr(hybrid, "_STREAMERS", {})
    monkeypatch.setattr(plan, "STREAM_BYTES", 16 << 10)
    _, dense = build_case(name, tmp_path)
    path = dense.gguf.path
    dense.place(dense.config.n_layers + 1, torch.device("cuda"))
    # 12 prompt tokens: the prefill takes the batched path (more than the 8 tokens of the GEMV kernels)
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3))
    ref_logits, ref_tokens = greedy_run(dense, ids)
    rng = np.random.default_rng(5)
    for attn in ([True] * dense.config.n_layers, [bool(i % 2) for i in range(dense.config.n_layers)]):
        model = load_model(GGUFFile(path))
        c = model.config
        hot = [np.sort(rng.choice(c.n_ff, c.n_ff // 3, replace=False)) for _ in range(c.n_layers)]
        setup_hybrid(model, path, HybridOptions(mode="oracle", device="cuda", hot=hot, attn_fast=attn,
                                                head_fast=True), log_line=lambda *_: None)
        logits, tokens = greedy_run(model, ids)
        scale = ref_logits.abs().max().item()
        err = (logits.cpu() - ref_logits.cpu()).abs().max().item()
        assert err <= 2e-3 * max(scale, 1.0), f"{name}: {err:.3g} vs scale {scale:.3g}"
        assert tokens == ref_tokens


def _generator_run(model, ids, feed, graphs=True):
    """Prefill, then decode the tokens `feed` one by one through the Generator (CUDA graphs when every
    layer is on the GPU, unless graphs=False; teacher-forced, so a near tie between two logits of a
    random model cannot send two runs down different paths): the logits of each decode step, and
    whether graphs ran."""
    from hybridsparse.runtime import kernels
    from hybridsparse.runtime.generate import Generator
    gen = Generator(model, None, 64, use_graphs=graphs)
    with torch.inference_mode():
        gen.eval(ids.tolist())
        out = [gen.eval([tok]).float().cpu() for tok in feed]
        torch.cuda.synchronize()
        kernels.raise_host_errors()
    return torch.stack(out), gen._graphs is not None


@pytest.mark.parametrize("name", ["llama-swiglu", "gemma3", "opt", "falcon-40b-relu"])
@pytest.mark.parametrize("head_fast", [True, False])
@pytest.mark.parametrize("handover", ["node", "poll"])
@pytest.mark.parametrize("pdl", ["0", "1"])
def test_host_node_decode_in_cuda_graphs_equals_dense_on_cuda(name, head_fast, handover, pdl, tmp_path, monkeypatch):
    """Dense mode with a neuron split, every attention on the GPU: each layer's cold part runs as a
    host node of the stream (or through the polled hand-over) and the whole step is replayed as a CUDA
    graph (head inside or outside); the logits match the all-GPU dense model's, and the
    event-synchronised path's; also with programmatic dependent launch (HS_CUDA_PDL=1: kernels that
    start before the one before them ends, beside host nodes, hand-over kernels and copies)."""
    from hybridsparse.runtime import kernels
    monkeypatch.setattr(kernels, "HANDOVER", handover)
    monkeypatch.setenv("HS_CUDA_PDL", pdl)
    _, dense = build_case(name, tmp_path, dtype="f16")  # a type the compiled CPU FFN reads (F32: the twins)
    path = dense.gguf.path
    dense.place(dense.config.n_layers + 1, torch.device("cuda"))
    ids = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(4))
    feed = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(6)).tolist()
    ref, _ = _generator_run(dense, ids, feed)
    rng = np.random.default_rng(8)
    runs = []
    for host_nodes in (True, False):
        monkeypatch.setattr(kernels, "HOST_NODES", host_nodes)
        model = load_model(GGUFFile(path))
        c = model.config
        hot = [np.sort(rng.choice(c.n_ff, c.n_ff // 3, replace=False)) for _ in range(c.n_layers)]
        setup_hybrid(model, path, HybridOptions(mode="dense", device="cuda", hot=hot, attn_fast=[True] * c.n_layers,
                                                head_fast=head_fast), log_line=lambda *_: None)
        logits, graphed = _generator_run(model, ids, feed)
        assert graphed == host_nodes, f"{name}: graphs {graphed} with host nodes {host_nodes}"
        scale = ref.abs().max().item()
        err = (logits - ref).abs().max().item()
        assert err <= 2e-3 * max(scale, 1.0), f"{name} host nodes {host_nodes}: {err:.3g} vs scale {scale:.3g}"
        runs.append(logits)
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-4, atol=1e-4 * max(1.0, ref.abs().max().item()))


@pytest.mark.parametrize("name", ["llama-swiglu", "gemma3", "opt", "falcon-40b-relu"])
@pytest.mark.parametrize("mode,run_graphs,handover", [("dense", "1", "poll"), ("dense", "1", "node"),
                                                      ("dense", "auto", "poll"), ("dense", "0", "poll"),
                                                      ("oracle", "1", "poll")])
def test_mixed_placement_decode_equals_dense_on_cuda(name, mode, run_graphs, handover, tmp_path, monkeypatch):
    """Attention of every other layer on the CPU: each run of GPU layers is a CUDA graph of its own
    (generate._RunGraphs; the GPU layers' cold parts handed over inside it by polling or host nodes), the
    CPU layers run op by op in between, each CPU layer's hot part replayed as its own CUDA graph from the
    second token on (oracle mode, which cannot be captured, and HS_RUN_GRAPHS=auto / 0: no run graphs for
    a hybrid step, the GPU layers' cold parts by the event path); the logits match the all-GPU dense model's."""
    from hybridsparse.runtime import generate, kernels
    monkeypatch.setattr(generate, "RUN_GRAPHS", run_graphs)
    monkeypatch.setattr(kernels, "HANDOVER", handover)
    _, dense = build_case(name, tmp_path, dtype="f16")
    path = dense.gguf.path
    dense.place(dense.config.n_layers + 1, torch.device("cuda"))
    ids = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(4))
    feed = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(6)).tolist()
    ref, _ = _generator_run(dense, ids, feed)
    model = load_model(GGUFFile(path))
    c = model.config
    rng = np.random.default_rng(9)
    hot = [np.sort(rng.choice(c.n_ff, c.n_ff // 3, replace=False)) for _ in range(c.n_layers)]
    attn = [bool(i % 2) for i in range(c.n_layers)]
    setup_hybrid(model, path, HybridOptions(mode=mode, device="cuda", hot=hot, attn_fast=attn, head_fast=True),
                 log_line=lambda *_: None)
    logits, graphed = _generator_run(model, ids, feed)
    runs = mode == "dense" and run_graphs == "1"
    assert graphed == runs, f"run graphs {graphed}, expected {runs}"
    assert [l.ffn._host_nodes() for l in model.layers] == [runs and a for a in attn]
    assert all(bool(l.ffn._hot_graph) != a for l, a in zip(model.layers, attn)), "a CPU layer's hot part not graphed"
    scale = ref.abs().max().item()
    err = (logits - ref).abs().max().item()
    assert err <= 2e-3 * max(scale, 1.0), f"{name} {mode}: {err:.3g} vs scale {scale:.3g}"


def hs_run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "hybridsparse.runtime.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ})


@pytest.fixture(scope="module")
def tiny_profiled(tmp_path_factory):
    """A tiny ReLU model with a profile (power-law frequencies) and predictors beside it."""
    d = tmp_path_factory.mktemp("hyb")
    path = tiny_llama(d / "tiny.gguf", act="relu", layers=3)
    write_synthetic_activity(path, 3, 64, 128, 0.2, 0.3, 16)
    return path


@pytest.mark.parametrize("handover", ["node", "poll"])
def test_falcon_ffn_overlapping_attention_on_cuda(handover, tmp_path, monkeypatch):
    """Falcon's parallel attention: the hybrid layer's CPU part queued before the attention and joined
    after it (layers.ffn_start) gives the logits of joining it first (HS_FFN_OVERLAP=0) and of the
    all-GPU dense model, in CUDA graphs."""
    from hybridsparse.runtime import kernels, layers
    monkeypatch.setattr(kernels, "HANDOVER", handover)
    _, dense = build_case("falcon-40b-relu", tmp_path, dtype="f16")
    path = dense.gguf.path
    dense.place(dense.config.n_layers + 1, torch.device("cuda"))
    ids = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(4))
    feed = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(6)).tolist()
    ref, _ = _generator_run(dense, ids, feed)
    runs = []
    for overlap in (True, False):
        monkeypatch.setattr(layers, "FFN_OVERLAP", overlap)
        model = load_model(GGUFFile(path))
        c = model.config
        rng = np.random.default_rng(8)
        hot = [np.sort(rng.choice(c.n_ff, c.n_ff // 3, replace=False)) for _ in range(c.n_layers)]
        setup_hybrid(model, path, HybridOptions(mode="dense", device="cuda", hot=hot, attn_fast=[True] * c.n_layers,
                                                head_fast=True), log_line=lambda *_: None)
        logits, graphed = _generator_run(model, ids, feed)
        assert graphed
        runs.append(logits)
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-4, atol=1e-4 * scale)
    assert (runs[0] - ref).abs().max().item() <= 2e-3 * scale


def test_polled_handover_equals_host_nodes_and_events(tmp_path, monkeypatch):
    """Predictor mode (a cold mask per token) with a neuron split, every attention on the GPU: the
    captured step's polled hand-over (csrc/cuda_handover.cu, one task per layer served by this thread)
    gives the logits of host nodes in the graph and of the event path. A graph replayed without anyone
    serving it does not hang: the GPU gives up after one time-out and the next serve says so."""
    from hybridsparse.runtime import kernels
    from hybridsparse.runtime.generate import Generator
    path = tiny_llama(tmp_path / "tiny-f16.gguf", act="relu", layers=3, dtype="f16")  # F16: the compiled CPU FFN
    write_synthetic_activity(path, 3, 64, 128, 0.2, 0.3, 16)
    ids = torch.randint(0, 64, (5,), generator=torch.Generator().manual_seed(4)).tolist()
    feed = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(6)).tolist()
    runs = {}
    for handover, host_nodes in (("poll", True), ("node", True), ("poll", False)):
        monkeypatch.setattr(kernels, "HANDOVER", handover)
        monkeypatch.setattr(kernels, "HOST_NODES", host_nodes)
        model = load_model(GGUFFile(path))
        c = model.config
        rng = np.random.default_rng(8)
        hot = [np.sort(rng.choice(c.n_ff, c.n_ff // 3, replace=False)) for _ in range(c.n_layers)]
        setup_hybrid(model, path, HybridOptions(mode="predictor", device="cuda", hot=hot,
                                                        attn_fast=[True] * c.n_layers, head_fast=True),
                     log_line=lambda *_: None)
        gen = Generator(model, None, 64)
        with torch.inference_mode():
            gen.eval(ids)
            out = torch.stack([gen.eval([tok]).float().cpu() for tok in feed])
            torch.cuda.synchronize()
            kernels.raise_host_errors()
        graphs = gen._graphs.graphs if gen._graphs is not None else {}
        assert bool(graphs) == host_nodes
        tasks = [t for _, _, t in graphs.values()]
        assert all(len(t) == (c.n_layers if handover == "poll" else 0) for t in tasks), (handover, tasks)
        runs[(handover, host_nodes)] = out
    ref = runs[("poll", False)]
    for key, out in runs.items():
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * max(1.0, ref.abs().max().item()), msg=str(key))

    monkeypatch.setattr(kernels, "HANDOVER", "poll")
    monkeypatch.setattr(kernels, "HOST_NODES", True)
    monkeypatch.setattr(kernels, "HANDOVER_TIMEOUT_S", 0.2)  # baked into the graph at capture
    with torch.inference_mode():
        gen = Generator(model, None, 64)
        gen.eval(ids)
        gen.eval([feed[0]])  # eager warm-up, capture, one served replay
        graph, _, tasks = next(iter(gen._graphs.graphs.values()))
        t0 = time.perf_counter()
        graph.replay()  # nobody serves: the first layer's wait gives up after 0.2 s, the others at once
        torch.cuda.synchronize()
        assert time.perf_counter() - t0 < 0.2 * len(tasks), "every layer waited out its own time-out"
        with pytest.raises(RuntimeError, match="GPU stopped waiting"):
            kernels.serve_polled(tasks)


def test_hs_run_oracle_tokens_identical_cpu_hybrid_all_gpu(tiny_profiled):
    base = ["-m", str(tiny_profiled), "-p", "Hello there", "-n", "12", "--temp", "0", "-t", "4",
            "--no-display-prompt"]
    all_gpu = hs_run(*base, "-ngl", "99")
    hybrid = hs_run(*base, "--oracle", "--vram-budget", "2", "--reset-gpu-index")
    cpu = hs_run(*base, "--oracle", "--vram-budget", "0")
    for r in (all_gpu, hybrid, cpu):
        assert r.returncode == 0, r.stderr
    assert "solved now" in hybrid.stderr and "FFN neurons on cuda" in hybrid.stderr
    assert hybrid.stdout == all_gpu.stdout == cpu.stdout


def test_prompt_in_micro_batches_on_cuda(tiny_profiled):
    """-ub 3: the hybrid model on CUDA runs the prompt three tokens a pass (the plan keeps VRAM for
    three tokens' activations) and still generates what the whole model on the GPU does."""
    base = ["-m", str(tiny_profiled), "-p", "a prompt a good deal longer than one micro-batch", "-n", "8",
            "--temp", "0", "-t", "4", "--no-display-prompt"]
    all_gpu = hs_run(*base, "-ngl", "99")
    pieces = hs_run(*base, "--oracle", "--vram-budget", "2", "-ub", "3")
    for r in (all_gpu, pieces):
        assert r.returncode == 0, r.stderr
    assert "FFN neurons on cuda" in pieces.stderr
    assert pieces.stdout == all_gpu.stdout


def test_hs_run_gpu_index_reuse_stale_reset(tiny_profiled):
    base = ["-m", str(tiny_profiled), "-p", "Hi", "-n", "4", "--temp", "0", "--dense"]
    first = hs_run(*base, "--vram-budget", "1.5", "--reset-gpu-index")
    again = hs_run(*base, "--vram-budget", "1.5")
    other = hs_run(*base, "--vram-budget", "1.25")
    for r in (first, again, other):
        assert r.returncode == 0, r.stderr
    assert "solved now" in first.stderr
    assert "reusing it" in again.stderr and "cached GPU index" in again.stderr
    assert "stale" in other.stderr
    off = hs_run(*base, "--vram-budget", "1.5", "--disable-gpu-index")
    assert off.returncode == 0 and " 0/" in off.stderr.split("FFN neurons")[0].split("layers and")[-1], off.stderr


def test_budget_below_the_cuda_context_is_one_clear_error(tiny_profiled):
    r = hs_run("-m", str(tiny_profiled), "-p", "Hi", "-n", "2", "--dense", "--vram-budget", "0.05")
    assert r.returncode == 1
    assert "--vram-budget" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("budget", [1.0, 1.5])
def test_peak_device_memory_within_budget(tiny_profiled, budget):
    with _GpuMemoryPoller() as poll:
        r = hs_run("-m", str(tiny_profiled), "-p", "Hello", "-n", "16", "--temp", "0", "--dense",
                   "--vram-budget", str(budget), "--reset-gpu-index")
    assert r.returncode == 0, r.stderr
    assert poll.ok, "NVML (libnvidia-ml) is not readable on this GPU machine"
    assert poll.peak - poll.base <= budget * 2**30, f"peak {(poll.peak - poll.base) / 2**20:.0f} MiB"
