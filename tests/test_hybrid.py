"""The hybrid runtime on the CPU: with an oracle predictor (the true active set) sparse execution gives
the dense model's logits and tokens for every FFN variant, CPU-only and split by neuron between a
'fast' executor (a second CPU executor playing the GPU) and the CPU; `--dense` with a split placement
is exact too; the transposed-down cache is built once; bad input is one clear error."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from hybridsparse.runtime import hybrid, kernels
from hybridsparse.runtime.errors import InputError, ModelError
from hybridsparse.runtime.gguf_file import GGUFFile
from hybridsparse.solver import plan
from hybridsparse.runtime.hybrid import HybridFFN, HybridOptions, down_t_cache_path, setup_hybrid
from hybridsparse.runtime.models import load_model

from test_architectures import VOCAB, batched_vs_alone, build_case, random_prompts
from tiny_models import tiny_llama

PROMPT, STEPS = 6, 6


def greedy_run(model, ids):
    """Prefill, then greedy decode token by token: (logits of every step, tokens)."""
    cache = model.new_cache(32)
    out, tokens = [], []
    with torch.inference_mode():
        logits = model.forward(ids, torch.arange(len(ids)), cache, len(ids), all_logits=True)
        out.append(logits)
        pos = len(ids)
        for _ in range(STEPS):
            tok = int(logits[-1].argmax())
            tokens.append(tok)
            logits = model.forward(torch.tensor([tok]), torch.tensor([pos]), cache, pos + 1)
            out.append(logits)
            pos += 1
    return torch.cat(out), tokens


def _split(model, seed):
    """A random hot set per layer (about half the neurons) and attention on either side."""
    rng = np.random.default_rng(seed)
    c = model.config
    hot = [np.sort(rng.choice(c.n_ff, c.n_ff // 2, replace=False)) for _ in range(c.n_layers)]
    attn = [bool(b) for b in rng.integers(0, 2, c.n_layers)]
    attn[0] = True
    return hot, attn


HYBRID_CASES = ["llama-relu", "llama-swiglu", "llama-drelu", "gemma3", "falcon-40b-relu", "opt", "qwen2"]


@pytest.mark.parametrize("name", HYBRID_CASES)
@pytest.mark.parametrize("masked_dense", [0.0, 2.0])  # a prompt's cold neurons: every pair / each token's own
def test_oracle_sparse_equals_dense(name, masked_dense, tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "CPU_MASKED_DENSE", masked_dense)
    _, dense = build_case(name, tmp_path)
    path = dense.gguf.path
    ids = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(3))
    ref_logits, ref_tokens = greedy_run(dense, ids)
    scale = ref_logits.abs().max().item()
    configs = {
        "cpu-only oracle": HybridOptions(mode="oracle", vram_budget=0),
        "split oracle": HybridOptions(mode="oracle", device="cpu"),
        "split dense": HybridOptions(mode="dense", device="cpu"),
        # the prefill's cold rows copied to the fast executor a few neurons at a time (many chunks
        # through both staging slots) and computed there, as a long prefill on a GPU does
        "split oracle, cold rows streamed": HybridOptions(mode="oracle", device="cpu"),
    }
    for what, opts in configs.items():
        streamed = "streamed" in what
        monkeypatch.setattr(hybrid, "COLD_STREAM", "always" if streamed else "never")
        monkeypatch.setattr(hybrid, "_STREAMERS", {})
        monkeypatch.setattr(plan, "STREAM_BYTES", 16 << 10)
        calls = []
        if streamed:
            real = hybrid.HybridFFN._stream_cold
            monkeypatch.setattr(hybrid.HybridFFN, "_stream_cold", lambda self, *a: (calls.append(1), real(self, *a))[1])
        model = load_model(GGUFFile(path))
        if opts.device == "cpu":
            opts.hot, opts.attn_fast = _split(model, 7)
            opts.head_fast = True
        report = setup_hybrid(model, path, opts, log_line=lambda *_: None)
        assert all(isinstance(layer.ffn, HybridFFN) for layer in model.layers)
        if opts.device == "cpu":
            assert 0 < report["hot_neurons"] < report["neurons"]
        logits, tokens = greedy_run(model, ids)
        err = (logits - ref_logits).abs().max().item()
        assert err <= 1e-4 * max(scale, 1.0), f"{name} {what}: logits differ by {err:.3g} (scale {scale:.3g})"
        assert tokens == ref_tokens, f"{name} {what}"
        if streamed:
            assert len(calls) == model.config.n_layers  # the prefill of each layer, not the decode steps
            assert len(hybrid._STREAMERS) == 1


def test_relu_oracle_computes_only_the_active_neurons(tmp_path, monkeypatch):
    """A ReLU model's oracle active set is the nonzero set: the cold side is asked for those rows only."""
    _, model = build_case("llama-relu", tmp_path)
    path = model.gguf.path
    setup_hybrid(model, path, HybridOptions(mode="oracle", vram_budget=0), log_line=lambda *_: None)
    from hybridsparse.runtime import kernels
    seen = []
    real = kernels.sparse_ffn
    monkeypatch.setattr(kernels, "sparse_ffn", lambda *a, **k: (seen.append(a[7].numel()), real(*a, **k))[1])
    greedy_run(model, torch.arange(1, 3))
    assert seen and max(seen) < model.config.n_ff  # a ReLU layer never needs all its neurons


@pytest.mark.parametrize("all_cold,dtype", [(False, "f32"), (True, "f32"), (True, "f16")])
def test_predictor_mode_uses_predicted_sets(tmp_path, all_cold, dtype):
    """Predictors that say 'everything' reproduce dense output; predictors that say 'nothing' leave the
    FFN out (output = attention only), so the predictor is what decides. All neurons cold (CPU-only):
    with weights the compiled ops read (F16), each layer decodes one token through its bound calls
    (HybridFFN._cpu_token_fn: the active ids straight from the scores, select_ids with the threshold);
    with others (F32) through the general path."""
    _, dense = build_case("llama-relu", tmp_path, dtype)
    path = dense.gguf.path
    ids = torch.arange(1, 6)
    ref_logits, _ = greedy_run(dense, ids)
    c = dense.config
    for thr, same in ((-1e9, True), (1e9, False)):
        from hybridsparse.predictor_training.train import LayerResult, write_predictors
        results = [LayerResult(i, 4, thr, 1.0, 1.0, 0.5, 0.5, 0, torch.randn(4, c.d_model), torch.randn(c.n_ff, 4))
                   for i in range(c.n_layers)]
        pred = write_predictors(tmp_path / "p.gguf", results, {})
        model = load_model(GGUFFile(path))
        hot, attn = _split(model, 1)
        if all_cold:
            hot = [np.zeros(0, dtype=np.int64) for _ in hot]
        setup_hybrid(model, path, HybridOptions(predictors=str(pred), device="cpu", hot=hot, attn_fast=attn),
                     log_line=lambda *_: None)
        logits, _ = greedy_run(model, ids)
        close = torch.allclose(logits, ref_logits, atol=1e-4 * ref_logits.abs().max().item())
        assert close == same
        bound = [callable(L.ffn._cpu_token) for L in model.layers]
        assert bound == [all_cold and dtype == "f16" and kernels.available()] * c.n_layers


@pytest.mark.skipif(not kernels.available(), reason="compiled CPU kernels not built")
@pytest.mark.parametrize("name,dtype", [("llama-relu", "f16"), ("llama-swiglu", "q8_0"), ("llama-drelu", "f16")])
def test_cpu_ffn_block_equals_its_calls(name, dtype, tmp_path, monkeypatch):
    """CPU-only sparse decode: a token's FFN half as one compiled call (HybridFFN.token_block,
    kernels.cpu.sparse_ffn_block: norm, predictor, ids from its scores, fused FFN, residual) gives the
    same logits, bit for bit, as the same ops called one by one; and that call is what decoding takes."""
    from hybridsparse.predictor_training.train import LayerResult, write_predictors
    _, dense = build_case(name, tmp_path, "f16")
    if dtype != "f16":
        from hybridsparse.runtime.quantize import quantize_gguf
        quantize_gguf(tmp_path / f"{name}.gguf", tmp_path / f"{name}-{dtype}.gguf", dtype, log=lambda *a: None)
        dense = load_model(GGUFFile(tmp_path / f"{name}-{dtype}.gguf"))
    path, c = dense.gguf.path, dense.config
    monkeypatch.setenv("HS_FFN_CHUNK", "0")  # fixed shares: the same float sums in both runs
    g = torch.Generator().manual_seed(5)
    results = [LayerResult(i, 8, 0.5, 1.0, 1.0, 0.5, 0.5, 0, torch.randn(8, c.d_model, generator=g),
                           torch.randn(c.n_ff, 8, generator=g)) for i in range(c.n_layers)]
    pred = write_predictors(tmp_path / "p.gguf", results, {})
    ids = torch.arange(1, 6)
    taken = []
    real = HybridFFN.token_block
    monkeypatch.setattr(HybridFFN, "token_block", lambda self, x, norm: (lambda y: (
        taken.append(y is not None) if x.shape[0] == 1 else None, y)[1])(real(self, x, norm)))
    runs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(HybridFFN, "token_block", lambda self, x, norm: None)
        model = load_model(GGUFFile(path))
        setup_hybrid(model, path, HybridOptions(predictors=str(pred), vram_budget=0), log_line=lambda *_: None)
        runs[fused] = greedy_run(model, ids)
    assert taken and all(taken) and len(taken) == STEPS * c.n_layers
    assert torch.equal(runs[True][0], runs[False][0]) and runs[True][1] == runs[False][1]
    dense_logits, _ = greedy_run(dense, ids)
    assert not torch.equal(runs[True][0][-1], dense_logits[-1])  # the predictor left neurons out


def test_a_prompt_computes_the_fast_devices_rows_dense(tmp_path, monkeypatch):
    """More tokens than the GEMV kernels take (a prompt): the fast executor's rows are computed dense and a
    layer with no cold part runs no predictor, so even predictors that say 'nothing' leave a prompt over
    all-hot layers exact, while one token follows them; a cold part still follows its predictor."""
    _, dense = build_case("llama-relu", tmp_path)
    path = dense.gguf.path
    c = dense.config
    ids = torch.arange(1, hybrid.DENSE_BATCH_TOKENS + 5)
    cache = dense.new_cache(32)
    with torch.inference_mode():
        ref = dense.forward(ids, torch.arange(len(ids)), cache, len(ids), all_logits=True)
    from hybridsparse.predictor_training.train import LayerResult, write_predictors
    results = [LayerResult(i, 4, 1e9, 1.0, 1.0, 0.5, 0.5, 0, torch.randn(4, c.d_model), torch.randn(c.n_ff, 4))
               for i in range(c.n_layers)]
    pred = write_predictors(tmp_path / "p.gguf", results, {})
    calls = []
    real = hybrid.LayerPredictor.mask
    monkeypatch.setattr(hybrid.LayerPredictor, "mask", lambda self, x: (calls.append(x.shape[0]), real(self, x))[1])
    scale = max(ref.abs().max().item(), 1.0)
    for hot_share, exact in ((1.0, True), (0.5, False)):
        calls.clear()
        model = load_model(GGUFFile(path))
        rng = np.random.default_rng(2)
        hot = [np.sort(rng.choice(c.n_ff, int(c.n_ff * hot_share), replace=False)) for _ in range(c.n_layers)]
        setup_hybrid(model, path, HybridOptions(predictors=str(pred), device="cpu", hot=hot,
                                                attn_fast=[True] * c.n_layers, head_fast=True), log_line=lambda *_: None)
        cache = model.new_cache(32)
        with torch.inference_mode():
            logits = model.forward(ids, torch.arange(len(ids)), cache, len(ids), all_logits=True)
            assert calls == ([] if exact else [len(ids)] * c.n_layers)
            one = model.forward(ids[:1], torch.arange(1), model.new_cache(32), 1, all_logits=True)
        err = (logits - ref).abs().max().item()
        assert (err <= 1e-4 * scale) == exact, f"hot share {hot_share}: prompt logits differ by {err:.3g}"
        assert (one - ref[:1]).abs().max().item() > 1e-3 * scale  # one token: the predictor's (empty) set


@pytest.mark.parametrize("run_graphs", ["auto", "1", "0"])
def test_layer_runs_and_which_layers_hand_over_in_graphs(run_graphs, tmp_path, monkeypatch):
    """A step with layers on both devices is cut into runs of consecutive layers on one device (the GPU's
    runs then replay as CUDA graphs, generate._RunGraphs); with HS_RUN_GRAPHS=1 a hybrid plan's layers whose
    attention is on the fast device are made to hand over inside such graphs (host nodes or polling), by
    default (auto) and with 0 they keep the event path; a plan with every attention on the fast device
    hands over in every layer either way."""
    from hybridsparse.runtime import generate
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert generate.layer_runs([gpu, gpu, cpu, cpu, gpu]) == [(0, 2, gpu), (2, 4, cpu), (4, 5, gpu)]
    assert generate.layer_runs([cpu]) == [(0, 1, cpu)] and generate.layer_runs([]) == []
    monkeypatch.setattr(generate, "RUN_GRAPHS", run_graphs)
    _, dense = build_case("llama-relu", tmp_path)
    path, c = dense.gguf.path, dense.config
    for attn in ([bool(i % 2) for i in range(c.n_layers)], [True] * c.n_layers):
        model = load_model(GGUFFile(path))
        hot = [np.arange(0, c.n_ff, 3) for _ in range(c.n_layers)]
        setup_hybrid(model, path, HybridOptions(mode="dense", device="cpu", hot=hot, attn_fast=attn, head_fast=True),
                     log_line=lambda *_: None)
        want = [a and (all(attn) or run_graphs == "1") for a in attn]
        assert [l.ffn.host_nodes for l in model.layers] == want, f"attention {attn}"


def test_transposed_down_is_cached_once(tmp_path):
    _, model = build_case("llama-relu", tmp_path)
    path = model.gguf.path
    cache = down_t_cache_path(path)
    assert not cache.exists()
    setup_hybrid(model, path, HybridOptions(mode="dense", vram_budget=0), log_line=lambda *_: None)
    assert cache.exists()
    stamp = cache.stat().st_mtime_ns
    model = load_model(GGUFFile(path))
    setup_hybrid(model, path, HybridOptions(mode="dense", vram_budget=0), log_line=lambda *_: None)
    assert cache.stat().st_mtime_ns == stamp  # reused
    cache.write_bytes(b"GGUF" + b"\0" * 40)  # damaged: rebuilt, not trusted
    model = load_model(GGUFFile(path))
    setup_hybrid(model, path, HybridOptions(mode="dense", vram_budget=0), log_line=lambda *_: None)
    assert GGUFFile(cache).tensors


def test_transposed_down_refuses_a_full_disk_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    """Transposing a llama.cpp file's ffn_down needs room beside the model: too little free space is refused
    before anything is written, naming the file, the GiB needed and free; a write that fails midway (the
    disk filling under it) or is interrupted leaves no .part copy and reports the path in one line; a .part
    left by a run that was killed is replaced, and the next run makes the copy."""
    import shutil
    from hybridsparse.runtime import quantize
    from hybridsparse.runtime.synth import write_synth
    path = write_synth(tmp_path, "tiny", "q4_0", "llama.cpp", predictor_width=64)
    cache = down_t_cache_path(path)
    part = cache.with_name(cache.name + ".part")

    def setup():
        setup_hybrid(load_model(GGUFFile(path)), path, HybridOptions(mode="oracle", vram_budget=0),
                     log_line=lambda *_: None)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 19))
    with pytest.raises(ModelError, match=rf"{re.escape(str(cache))}: transposing ffn_down once needs 0.0 GiB on "
                                         r"that disk and 0.0 GiB are free; free space there"):
        setup()
    assert not cache.exists() and not part.exists()
    monkeypatch.setattr(shutil, "disk_usage", real)
    calls = []

    def full(*a, **k):  # the disk fills after the first layer's rows
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_rows(*a, **k)
    real_rows = quantize.quantize_rows
    monkeypatch.setattr(quantize, "quantize_rows", full)
    with pytest.raises(ModelError, match=rf"^{re.escape(str(cache))}: cannot write the transposed ffn_down "
                                         r"\(No space left on device\)$"):
        setup()
    assert len(calls) == 2 and not cache.exists() and not part.exists()

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(quantize, "quantize_rows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        setup()
    assert not part.exists()
    monkeypatch.setattr(quantize, "quantize_rows", real_rows)
    part.write_bytes(b"left by a killed run")
    setup()
    assert cache.exists() and not part.exists() and GGUFFile(cache).tensors


def test_down_t_type_of_a_quantized_llama_cpp_file(tmp_path, caplog):
    """A llama.cpp file's Q4_0 ffn_down transposed into Q8_0 rows (the default) or F16 (--down-t-type f16), each
    cached under its own name: the oracle with F16 rows equals dense execution, with Q8_0 rows it is within the
    second rounding's reach, and both give dense's greedy tokens on this model."""
    from hybridsparse.runtime.synth import write_synth
    path = write_synth(tmp_path, "tiny", "q4_0", "llama.cpp", predictor_width=64)
    ids = torch.randint(0, 200, (PROMPT,), generator=torch.Generator().manual_seed(3))
    ref_logits, ref_tokens = greedy_run(load_model(GGUFFile(path)), ids)
    scale = max(ref_logits.abs().max().item(), 1.0)
    errs = {}
    for t, qtype, tol in (("f16", "F16", 1e-4), ("q8_0", "Q8_0", 2e-2)):
        model = load_model(GGUFFile(path))
        setup_hybrid(model, path, HybridOptions(mode="oracle", vram_budget=0, down_t_type=t), log_line=lambda *_: None)
        cache = GGUFFile(down_t_cache_path(path, t))
        assert cache.tensors["blk.0.ffn_down_t.weight"].qtype.name == qtype
        assert model.layers[0].ffn.down_t.qtype.name == qtype
        logits, tokens = greedy_run(model, ids)
        errs[t] = (logits - ref_logits).abs().max().item() / scale
        assert errs[t] <= tol, (t, errs[t])
        assert tokens == ref_tokens, t
    assert errs["q8_0"] > errs["f16"]  # the Q8_0 rows were rounded again: not the F16 rows under another name
    # the Q8_0 copy was made while the F16 one lay beside the model: said so, once, naming it
    said = [r.getMessage() for r in caplog.records if "read only with --down-t-type" in r.getMessage()]
    assert len(said) == 1 and str(down_t_cache_path(path, "f16")) in said[0] and "F16 copy" in said[0], said
    assert down_t_cache_path(path) == down_t_cache_path(path, "q8_0") != down_t_cache_path(path, "f16")
    with pytest.raises(InputError, match="--down-t-type: expected one of f16, q8_0, got 'q4_0'"):
        setup_hybrid(load_model(GGUFFile(path)), path, HybridOptions(mode="oracle", vram_budget=0, down_t_type="q4_0"),
                     log_line=lambda *_: None)


def hs_run(*args, timeout=180):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "hybridsparse.runtime.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_hs_run_hybrid_flags(tmp_path):
    model = tiny_llama(tmp_path / "tiny.gguf", act="relu")
    base = ["-m", str(model), "-p", "Hello", "-n", "8", "--temp", "0", "-t", "1"]
    plain = hs_run(*base)
    assert plain.returncode == 0, plain.stderr
    for extra in (["--dense", "--vram-budget", "0"], ["--oracle", "--vram-budget", "0"], ["--dense", "-ub", "3", "--vram-budget", "2"]):
        r = hs_run(*base, *extra)
        assert r.returncode == 0, r.stderr
        assert r.stdout == plain.stdout, extra
        assert "hybrid:" in r.stderr
        assert ("does not apply" in r.stderr) == (extra[-1] == "2")  # no GPU here: said, then CPU only
    bad = {
        ("--vram-budget", "0"): "no predictors",
        ("--predictors", str(tmp_path / "nope.gguf")): "no such predictor file",
        ("--dense", "-ngl", "2"): "pass one or the other",
        ("--dense", "--oracle"): "exclude each other",
        ("--vram-budget", "-1"): "must be >= 0",
        ("--dense", "-ub", "0"): "-ub 0: expected at least 1",
    }
    r = hs_run(*base, "--down-t-type", "q4_0")  # argparse's own message: usage, then the error
    assert r.returncode == 2 and "--down-t-type: invalid choice: 'q4_0'" in r.stderr, r.stderr
    for extra, needle in bad.items():
        r = hs_run(*base, *extra)
        assert r.returncode == 1 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, (extra, r.stderr)


def test_predictors_of_another_model_are_one_clear_error(tmp_path):
    """Predictors whose shapes do not fit the model, or a damaged predictor file: one line naming the file."""
    from hybridsparse.predictor_training.train import LayerResult, write_predictors
    model = tiny_llama(tmp_path / "tiny.gguf", act="relu")
    base = ["-m", str(model), "-p", "Hi", "-n", "2", "-t", "1", "--vram-budget", "0"]
    wrong = [LayerResult(i, 4, 0.0, 1.0, 1.0, 0.5, 0.5, 0, torch.randn(4, 32), torch.randn(128, 4)) for i in range(2)]
    bad = write_predictors(tmp_path / "other.gguf", wrong, {})
    r = hs_run(*base, "--predictors", str(bad))
    assert r.returncode == 1 and "other.gguf" in r.stderr and "expected [rank, 64]" in r.stderr, r.stderr
    few = write_predictors(tmp_path / "few.gguf", wrong[:1], {})
    r = hs_run(*base, "--predictors", str(few))
    assert r.returncode == 1 and "1 layers of predictors, the model has 2" in r.stderr, r.stderr
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(bad.read_bytes()[:200])
    r = hs_run(*base, "--predictors", str(damaged))
    assert r.returncode == 1 and "damaged.gguf" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("name", ["llama-relu", "opt"])
def test_batched_sequences_through_the_split_ffn(name, tmp_path):
    """The server's batched decode on a neuron-split oracle model (per-token active sets, attention on
    either side): each sequence's logits equal its dense forward."""
    _, dense = build_case(name, tmp_path)
    model = load_model(GGUFFile(dense.gguf.path))
    opts = HybridOptions(mode="oracle", device="cpu")
    opts.hot, opts.attn_fast = _split(model, 5)
    opts.head_fast = True
    setup_hybrid(model, dense.gguf.path, opts, log_line=lambda *_: None)
    [(got, want)] = batched_vs_alone(model, random_prompts(4, (4, 7, 3)), [[[9], [10], [11]]], ref=dense)
    assert (got - want).abs().max() <= 1e-4 * max(want.abs().max().item(), 1.0)


def test_hybrid_benchmark_plot(tmp_path):
    """`hs-bench plot` on an `hs-bench hybrid` result (the session's merged H200 runs) writes a PNG."""
    from pathlib import Path

    from hybridsparse.runtime import bench
    src = Path(__file__).parent.parent / "bench-results" / "hybrid-h200-llama13b-f16-sampled-session5.json"
    out = tmp_path / "h.png"
    assert bench.main(["plot", str(src), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert bench.main(["plot", str(Path(__file__))]) == 1  # not JSON: one-line error


def test_hybrid_benchmark_plot_with_a_failed_run(tmp_path):
    """A run that failed (an out-of-memory error, say) leaves an error row: the plot is still drawn from
    the runs that finished, without a ratio for the failed pair."""
    import json
    from pathlib import Path

    from hybridsparse.runtime import bench
    d = json.loads((Path(__file__).parent.parent / "bench-results" / "hybrid-h200-llama13b-f16-sampled-session5.json").read_text())
    hybrid = next(r for r in d["runs"] if r["engine"] == "hybrid")
    for k in ("decode_tok_s", "prefill_tok_s", "speedup_vs_layer_split"):
        hybrid.pop(k, None)
    hybrid["error"] = "torch.OutOfMemoryError: CUDA out of memory"
    src = tmp_path / "failed.json"
    src.write_text(json.dumps(d))
    assert bench.main(["plot", str(src), "-o", str(tmp_path / "f.png")]) == 0
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert "error: torch.OutOfMemoryError" in bench.hybrid_table(d)
