"""hs-bench synth / scenario / the roofline: the planted activation statistics are what the real profiler
measures on the written model, and its predictors choose exactly the neurons that fire; both layouts (and Q4_0) load and run;
the roofline's arithmetic on a hand-checked case; bad input is one clear error."""

from __future__ import annotations

import random
import statistics

import numpy as np
import pytest
import torch

from hybridsparse.predictor_training.train import load_predictors, load_samples
from hybridsparse.profiler import profile as P
from hybridsparse.profiler.activations import load_profile
from hybridsparse.runtime import bench
from hybridsparse.runtime.gguf_file import GGUFFile
from hybridsparse.runtime.errors import InputError
from hybridsparse.runtime.synth import layer_statistics, resolve, write_synth, zipf_frequencies


def share80(f: np.ndarray) -> float:
    f = np.sort(f)[::-1]
    cum = np.cumsum(f) / f.sum()
    return (np.searchsorted(cum, 0.8) + 1) / len(f)


def _corpus(path):
    rng = random.Random(0)
    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    text = "\n\n".join(" ".join("".join(rng.choice(chars) for _ in range(rng.randint(2, 8))) for _ in range(60))
                       for _ in range(700))
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["tiny", "tiny-falcon", "tiny-opt"])
def test_planted_statistics_are_what_the_profiler_measures_and_the_predictors_choose(tmp_path, name):
    model = write_synth(tmp_path, name, "f16", predictor_width=257)
    planted = [f.numpy() for f in load_profile(model.with_name(model.stem + ".hs-profile")).frequencies()]
    out = tmp_path / "measured"
    assert P.main(["-m", str(model), "--corpus", str(_corpus(tmp_path / "c.txt")), "--tokens", "16000", "-b", "256",
                   "--samples", "3000", "-o", str(out), "-ngl", "0"]) == 0
    measured = [f.numpy() for f in load_profile(out).frequencies()]
    pairs, thresholds, _ = load_predictors(model.with_name(model.stem + ".predictors.gguf"))
    for i, (p, m) in enumerate(zip(planted, measured)):
        # the FFN's own activity (what hs-profile counts on a dense forward pass)
        assert abs(m.mean() - p.mean()) < 0.006, (i, m.mean(), p.mean())
        assert abs(share80(m) - share80(p)) < 0.04, (i, share80(m), share80(p))
        assert np.corrcoef(m, p)[0, 1] > 0.97
        # the predictors' choice on the same inputs (what the hybrid runtime computes): the neurons that
        # fire, as a well-trained predictor of a ReLU model chooses them
        x, packed = load_samples(out, i)
        fired = torch.from_numpy(np.unpackbits(packed.numpy(), axis=1)[:, :len(p)].astype(bool))
        fc1, fc2 = pairs[i]
        predicted = (torch.relu(x.float() @ fc1.T) @ fc2.T) >= thresholds[i]
        both = (predicted & fired).sum().item()
        assert both / fired.sum().item() > 0.998 and both / predicted.sum().item() > 0.998
        chosen = predicted.float().mean(0).numpy()
        assert abs(chosen.mean() - p.mean()) < 0.006, (i, chosen.mean(), p.mean())
        assert abs(share80(chosen) - share80(p)) < 0.04, (i, share80(chosen), share80(p))
    # the layers differ (layer-to-layer variation is planted too)
    assert np.ptp([p.mean() for p in planted]) > 0.01


def test_frequencies_have_the_asked_mean_and_head():
    rng = np.random.default_rng(0)
    for density, hot in [(0.11, 0.3), (0.10, 0.26), (0.28, 0.43)]:
        f = zipf_frequencies(20000, density, hot, rng)
        assert f.max() <= 1.0 and f.min() > 0
        assert abs(f.mean() - density) < 1e-9
        assert abs(share80(f) - hot) < 0.002
    shape = resolve("relu-llama-2-70b")[1]
    layers = layer_statistics(shape, shape.density, shape.hot_share)
    assert len(layers) == 80 and abs(np.mean([f.mean() for f in layers]) - shape.density) < 0.01


def test_both_layouts_and_q4_0_load_and_run(tmp_path):
    from hybridsparse.runtime.generate import Generator
    from hybridsparse.runtime.hybrid import HybridOptions
    from hybridsparse.runtime.loader import open_model
    from hybridsparse.runtime.sampling import Sampler, SamplingParams
    a = write_synth(tmp_path, "tiny-opt", "f16", "llama.cpp", predictor_width=64)
    b = write_synth(tmp_path, "tiny-opt", "f16", "powerinfer", predictor_width=64)
    q = write_synth(tmp_path, "tiny", "q4_0", "powerinfer", predictor_width=64)
    assert a.read_bytes()[:4] == b"GGUF" and b.read_bytes()[:4] == b"PWRI"
    ga, gb = GGUFFile(a), GGUFFile(b)
    assert "blk.0.ffn_down.weight" in ga.tensors and "blk.0.ffn_down_t.weight" in gb.tensors
    assert "blk.0.ffn_down_t.bias" in gb.tensors and "blk.0.fc1.weight" not in ga.tensors
    assert gb.get("powerinfer.sparse_threshold") == 0.0
    # the same planted neurons in both: identical up rows and biases, identical predictors
    for n in ("blk.1.ffn_up.weight", "blk.1.ffn_up.bias", "token_embd.weight"):
        assert bytes(ga.raw(n).numpy().tobytes()) == bytes(gb.raw(n).numpy().tobytes()), n
    side, _, _ = load_predictors(a.with_name(a.stem + ".predictors.gguf"))
    inside, _, _ = load_predictors(b)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(side, inside))
    assert GGUFFile(q).tensors["blk.0.ffn_gate.weight"].qtype.name == "Q4_0"
    for path in (a, b, q):
        lm = open_model(path, hybrid=HybridOptions(vram_budget=0.0, mode="predictor", n_ctx=64), log_line=lambda s: None)
        gen = Generator(lm.model, lm.tokenizer, 64)
        out = list(gen.generate(lm.tokenizer.encode("ab cd"), 6, Sampler(SamplingParams(temperature=0))))
        assert gen.timings.gen_tokens == 6 and out


def test_roofline_hand_checked():
    GB = 1e9
    layers = [(2 * GB, 0.0), (1 * GB, 0.5 * GB), (0.0, 1 * GB)]
    head = (0.5 * GB, 0.0)
    gbw, cbw, sync = 1000 * GB, 50 * GB, 40e-6
    # hybrid (overlap): layer 0 GPU 2 ms; layer 1 max(1 ms, 10 ms) + sync; layer 2 CPU 20 ms, a device change
    # (GPU -> CPU) + sync; head 0.5 ms after a change back to the GPU + sync
    expect = 2e-3 + (10e-3 + sync) + (20e-3 + sync) + (0.5e-3 + sync)
    assert bench.roofline_seconds(layers, head, gbw, cbw, overlap=True, sync_s=sync) == pytest.approx(expect)
    # the layer split (no overlap): the two devices' times add
    expect = 2e-3 + (1e-3 + 10e-3) + (20e-3 + sync) + (0.5e-3 + sync)
    assert bench.roofline_seconds(layers, head, gbw, cbw, overlap=False, sync_s=sync) == pytest.approx(expect)


@pytest.mark.parametrize("name", ["tiny", "tiny-falcon"])
def test_dense_bytes_count_the_down_rows_relu_leaves_unread(tmp_path, name):
    """The dense engine's bytes per token (the roofline's): a ReLU model with ffn_down_t reads the down
    row of a neuron only where it fired (the transposed down projection skips h = 0), so those rows
    count by the profile's mean firing rate; with ffn_down (llama.cpp layout) every row counts."""
    from hybridsparse.runtime.loader import open_model
    for layout in ("powerinfer", "llama.cpp"):
        path = write_synth(tmp_path / layout, name, "f16", layout, predictor_width=64)
        g = GGUFFile(path)
        freqs = load_profile(path.with_name(path.stem + ".hs-profile")).frequencies()
        lm = open_model(path, 0)
        layers, head = bench._placement_bytes(lm, {"mode": "predictor"})
        for i, (gb, cb) in enumerate(layers):
            names = [n for n in g.tensors if n.startswith(f"blk.{i}.") and ".fc" not in n]
            whole = sum(g.tensors[n].nbytes for n in names)
            down = f"blk.{i}.ffn_down_t.weight"
            unread = g.tensors[down].nbytes * (1 - float(freqs[i].mean())) if layout == "powerinfer" else 0.0
            assert gb == 0.0 and cb == pytest.approx(whole - unread, rel=1e-6), (layout, i)
            assert layout == "llama.cpp" or unread > 0.5 * g.tensors[down].nbytes  # ReLU: most rows unread
        assert head[0] == 0.0 and head[1] > 0


def test_bad_input_is_one_clear_error(tmp_path, capsys):
    assert bench.main(["synth", "--shape", "llama-9b", "-o", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown synthetic model 'llama-9b'" in err[0] and "relu-falcon-40b" in err[0]
    assert bench.main(["synth", "--shape", "tiny", "--density", "0.5", "--hot-share", "0.2", "-o", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hot share 0.2 cannot carry 80% of a density of 0.5" in err[0]
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-written
    with pytest.raises(SystemExit):
        bench.main(["scenario", "S9"])
    capsys.readouterr()
    for cmd, flag, value, expected in [("kernels", "--types", "q5", "F16, BF16, Q8_0, Q4_0"),
                                       ("kernels", "--densities", "0,2", "(0, 1]"),
                                       ("kernels", "--shapes", "llama-9b", "llama-2-7b"),
                                       ("attention", "--positions", "0,3", "positive integers"),
                                       ("attention", "--shapes", "llama-9b", "llama-3-8b"),
                                       ("attention", "--tokens", "0", "1..4096")]:
        with pytest.raises(SystemExit) as exit_:
            bench.main([cmd, flag, value])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: {value!r}" in err and expected in err


def test_run_benchmark_takes_the_kv_cache_type(tmp_path):
    """hs-bench run passes -ctk/-ctv to the engine it loads (it parsed them and used float16 before)."""
    import json
    from tiny_models import tiny_llama
    model = tiny_llama(tmp_path / "tiny.gguf")
    for flag, expect in (("f32", "float32"), ("f16", "float16")):
        out = tmp_path / f"{flag}.json"
        assert bench.main(["run", "-m", str(model), "-t", "1", "-n", "4", "--reps", "1", "-ngl", "0",
                           "-ctk", flag, "-ctv", flag, "--json", str(out)]) == 0
        assert json.loads(out.read_text())["kv_cache_cpu"] == expect


def test_hybrid_benchmark_cpu_only_runs_both_engines_side_by_side(tmp_path, capsys):
    """`hs-bench hybrid` with no VRAM budget (all a machine without a GPU runs): the CPU-only sparse and
    dense runs, each in its own process, the ratio between them, the roofline, a plot, and no
    device-memory figures (nothing is on a GPU, so nothing polls the driver beside them)."""
    import json
    model = write_synth(tmp_path, "tiny", "q4_0", "powerinfer", predictor_width=64)
    out = tmp_path / "h.json"
    assert bench.main(["hybrid", "-m", str(model), "-t", "1", "--budgets", "", "--prompt-tokens", "4", "-n", "4",
                       "-c", "16", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["engine"], r["vram_budget"]) for r in runs] == [("hybrid", 0.0), ("layer split", 0.0)]
    assert all(r["decode_tok_s"] > 0 and 0 < r["fraction_of_bound"] and "error" not in r for r in runs)
    assert not any("peak_device_bytes" in r for r in runs)
    assert runs[0]["speedup_vs_layer_split"] == pytest.approx(runs[0]["decode_tok_s"] / runs[1]["decode_tok_s"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each timed run's roofline is drawn at the CPU bandwidth measured around it; the dense split's, re-timed
    # from its bound at the start figure, is what its own roofline gives at that bandwidth
    split = runs[1]
    assert all(x["cpu_bw_gib_s"] > 0 for r in runs for x in r["reps"])
    err = capsys.readouterr().err
    assert err.count("GiB/s around the runs)") == 2  # each run's line says what it ran at
    fired = runs[0]["cpu_ffn_bytes_fired"] / runs[0]["cpu_ffn_bytes_expected"]
    assert f"cold rows fired {fired:.2f}x the profile's" in err  # and the sparse one what its tokens fired
    assert split["fraction_of_bound"] == pytest.approx(statistics.median(
        x["decode_tok_s"] * bench._split_bound_s(split, x["cpu_bw_gib_s"]) for x in split["reps"]))
    assert bench._split_bound_s(split, split["cpu_bw"]) == pytest.approx(1 / split["bound_tok_s_start_bw"])
    fixed = tmp_path / "f.json"  # --fixed-bandwidth: the start figure only, as before session 32
    assert bench.main(["hybrid", "-m", str(model), "-t", "1", "--budgets", "", "--prompt-tokens", "4", "-n", "4",
                       "-c", "16", "--fixed-bandwidth", "--json", str(fixed)]) == 0
    hybrid, split = json.loads(fixed.read_text())["runs"]
    assert not any("cpu_bw_gib_s" in x for r in (hybrid, split) for x in r["reps"])
    assert split["fraction_of_bound"] == pytest.approx(split["fraction_of_bound_start_bw"])
    # the hybrid's run is set against the rows its own tokens fired (the profile's expectation: the start figure's
    # bound); the CPU-only bound is the CPU's bytes over its bandwidth, so the two fractions stand in their ratio
    assert hybrid["fraction_of_bound"] / hybrid["fraction_of_bound_start_bw"] == pytest.approx(
        hybrid["cpu_bytes_per_token"] / hybrid["cpu_bytes_per_token_profile"])


def test_hybrid_benchmark_runs_llama_cpp_beside_the_dense_engine(tmp_path):
    """`hs-bench hybrid --llama-cpp`: llama.cpp in a process of its own beside each dense run, at its -ngl, on
    the llama.cpp-layout twin of the PowerInfer file (--llama-cpp-model), the hybrid's ratio to it and its share
    of the dense roofline; without llama-cpp-python that run fails with a one-line reason and the others stand.
    llama.cpp on a PowerInfer file is refused by name."""
    import importlib.util
    import json
    model = write_synth(tmp_path / "p", "tiny", "q4_0", "powerinfer", predictor_width=64)
    twin = write_synth(tmp_path / "l", "tiny", "q4_0", "llama.cpp", predictor_width=64)
    out = tmp_path / "h.json"
    args = ["hybrid", "-m", str(model), "-t", "1", "--budgets", "", "--prompt-tokens", "4", "-n", "4", "-c", "16",
            "--llama-cpp", "--json", str(out)]
    have = importlib.util.find_spec("llama_cpp") is not None
    assert bench.main(args + ["--llama-cpp-model", str(twin)]) == (0 if have else 1)
    runs = json.loads(out.read_text())["runs"]
    assert [(r["engine"], r.get("ngl")) for r in runs] == [("hybrid", None), ("layer split", 0), ("llama.cpp", 0)]
    hybrid, split, llama = runs
    assert llama["model"] == str(twin) and split["model"] == str(model)
    if have:
        assert llama["decode_tok_s"] > 0 and llama["fraction_of_bound"] == pytest.approx(statistics.median(
            x["decode_tok_s"] * bench._split_bound_s(split, x["cpu_bw_gib_s"]) for x in llama["reps"]))
        assert hybrid["speedup_vs_llama_cpp"] == pytest.approx(hybrid["decode_tok_s"] / llama["decode_tok_s"])
        assert "(%.2fx llama.cpp)" % hybrid["speedup_vs_llama_cpp"] in bench.hybrid_table(json.loads(out.read_text()))
        assert bench.main(args) == 1  # llama.cpp cannot read the PowerInfer file itself
        assert "reads llama.cpp-layout files only" in json.loads(out.read_text())["runs"][2]["error"]
    else:
        assert "llama-cpp-python is not installed" in llama["error"] and "speedup_vs_llama_cpp" not in hybrid
    assert "error" not in hybrid and "error" not in split


def test_kernel_benchmark_takes_types_and_shapes_in_any_case(tmp_path):
    out = tmp_path / "k.json"
    assert bench.main(["kernels", "-t", "1", "--shapes", "LLAMA-2-7B", "--types", "q8_0,f16", "--densities", "0.01",
                       "--reps", "1", "--json", str(out)]) == 0
    import json
    rows = json.loads(out.read_text())["results"]
    assert [(r["shape"], r["type"]) for r in rows] == [("llama-2-7b", "Q8_0"), ("llama-2-7b", "F16")]


def test_attention_benchmark_writes_json(tmp_path):
    import json
    out = tmp_path / "a.json"
    assert bench.main(["attention", "-t", "1", "--shapes", "LLAMA-3-8B,gemma3-270m", "--positions", "40",
                       "--reps", "1", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["cache_type"] == "f16" and [(r["shape"], r["positions"]) for r in d["results"]] == \
        [("llama-3-8b", 41), ("gemma3-270m", 41)]
    assert all(r["ms"] > 0 and r["torch_ms"] > 0 for r in d["results"])
    assert bench.main(["attention", "-t", "1", "--shapes", "llama-2-7b", "--positions", "20", "--tokens", "9",
                       "--reps", "1", "--json", str(out)]) == 0
    assert [(r["tokens"], r["positions"]) for r in json.loads(out.read_text())["results"]] == [(9, 29)]


def test_scenario_table_goes_into_the_readme(tmp_path):
    run = {"machine": {"cpu": "X", "gpu": "G", "cpu_threads_available": 16, "cpu_read_bandwidth_gib_s": 83.14},
           "model": "/m/relu-falcon-40b-f16.gguf",
           "mode": "predictor", "generated_tokens": 32, "threads": 16, "scenario": "S1: Falcon",
           "runs": [{"engine": "hybrid", "vram_budget": 24.0, "decode_tok_s": 22.0, "fraction_of_bound": 0.8,
                     "prefill_tok_s": 31.25, "peak_device_bytes": 23 << 30},
                    {"engine": "layer split", "vram_budget": 24.0, "ngl": 17, "decode_tok_s": 2.0,
                     "fraction_of_bound": 0.9, "prefill_tok_s": 4.0, "peak_device_bytes": 22 << 30}]}
    table = bench.scenario_table([run])
    assert "| S1 | relu-falcon-40b-f16.gguf | G + 16-thread CPU | 83.1 | 16 | 24 GiB | 22.00 | 2.00 | 11.00x | 80% | 90% | 31.2 | 4.0 | 23.00 |" in table
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench.README_BEGIN}\nold\n{bench.README_END}\nrest\n")
    bench.update_readme(readme, table)
    text = readme.read_text()
    assert "old" not in text and "11.00x" in text and text.startswith("intro\n") and text.endswith("rest\n")
    run["machine"]["settings"] = {"HS_HANDOVER": "poll"}  # a switch in force is part of the row
    assert "| G + 16-thread CPU (HS_HANDOVER=poll) |" in bench.scenario_table([run])
    run["runs"][0]["reps"] = [{"cpu_bw_gib_s": 61.4}, {"cpu_bw_gib_s": 97.6}]  # measured around the timed runs
    run["runs"][1]["reps"] = [{"cpu_bw_gib_s": 55.2}]
    assert "| 83.1 (55-98 around the runs) | 16 |" in bench.scenario_table([run])


def test_machine_records_runtime_switches_not_tool_variables(monkeypatch):
    monkeypatch.setenv("HS_ACT_PLANES", "1")
    monkeypatch.setenv("HS_STAGES", "scenario")
    monkeypatch.delenv("HS_HANDOVER", raising=False)
    settings = bench.machine()["settings"]
    assert settings["HS_ACT_PLANES"] == "1" and "HS_STAGES" not in settings


def test_every_switch_in_the_readme_table_is_recorded_with_results():
    """The README's table of environment switches and the set a benchmark records with its results
    (RUNTIME_SWITCHES) name the same switches, except those that change neither what is computed nor
    its speed (where files are cached, a time-out, a timing printout)."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = text[text.index("Environment switches (defaults are what"):].split("\n\n")[1]
    named = set()
    for line in table.splitlines():
        if line.startswith("| `HS_"):
            named |= set(re.findall(r"HS_[A-Z0-9_]+", re.split(r"(?<!\\)\|", line)[1]))
    assert named - bench.RUNTIME_SWITCHES == {"HS_CACHE", "HS_HANDOVER_TIMEOUT_S", "HS_HYBRID_TIMING"}
    assert bench.RUNTIME_SWITCHES <= named


@pytest.mark.parametrize("ptype,agree", [("q8_0", 0.99), ("q4_0", 0.93)])  # measured 0.998, 0.962 (47% active)
def test_quantized_predictors_pick_nearly_the_same_neurons(tmp_path, ptype, agree):
    """--predictor-type: fc1/fc2 stored in a block format (width padded to whole blocks by zero units)
    choose nearly the neurons the float16 ones choose, and the model runs with them in that type."""
    from hybridsparse.runtime.generate import Generator
    from hybridsparse.runtime.hybrid import HybridOptions
    from hybridsparse.runtime.loader import open_model
    from hybridsparse.runtime.sampling import Sampler, SamplingParams
    f = write_synth(tmp_path, "tiny", "q4_0", "powerinfer", predictor_width=64)
    q = write_synth(tmp_path, "tiny", "q4_0", "powerinfer", predictor_width=64, predictor_type=ptype)
    assert q.name.endswith(f"-pred-{ptype}.gguf") and q != f
    t1, t2 = GGUFFile(q).tensors["blk.0.fc1.weight"], GGUFFile(q).tensors["blk.0.fc2.weight"]
    assert t1.qtype.name == t2.qtype.name == ptype.upper() and t2.shape[0] % 32 == 0
    (fa, fb), = load_predictors(f)[0][:1]
    (qa, qb), = load_predictors(q)[0][:1]
    x = torch.randn(400, fa.shape[1], generator=torch.Generator().manual_seed(0)) * 2
    want = (torch.relu(x @ fa.T) @ fb.T) >= 0
    got = (torch.relu(x @ qa.T) @ qb.T) >= 0
    assert (got == want).float().mean().item() > agree
    lm = open_model(q, hybrid=HybridOptions(vram_budget=0.0, mode="predictor", n_ctx=64), log_line=lambda s: None)
    assert lm.model.layers[0].ffn.predictor.fc2.qtype.name == ptype.upper()
    gen = Generator(lm.model, lm.tokenizer, 64)
    assert list(gen.generate(lm.tokenizer.encode("ab cd"), 4, Sampler(SamplingParams(temperature=0))))
    with pytest.raises(InputError, match="predictor type"):
        write_synth(tmp_path, "tiny", "q4_0", "powerinfer", predictor_width=64, predictor_type="q5_k")


def test_hybrid_roofline_counts_the_rows_the_hybrid_reads(tmp_path):
    """The roofline's bytes for a hybrid FFN are the rows it reads: a llama.cpp-layout Q4_0 file's ffn_down as
    the Q8_0 rows it is transposed into (--down-t-type's default), so the same weights in that layout read more
    than in PowerInfer's (Q4_0 ffn_down_t) by exactly the cold neurons' expected down bytes in Q8_0 less Q4_0."""
    import json
    got = {}
    for layout in ("llama.cpp", "powerinfer"):
        model = write_synth(tmp_path / layout, "tiny", "q4_0", layout, predictor_width=64)
        out = tmp_path / f"{layout}.json"
        assert bench.main(["hybrid", "-m", str(model), "-t", "1", "--budgets", "", "--prompt-tokens", "4", "-n", "2",
                           "-c", "16", "--no-ngl", "--json", str(out)]) == 0
        got[layout] = json.loads(out.read_text())["runs"][0]
        profile = load_profile(model.with_name(model.stem + ".hs-profile"))
        d_model = GGUFFile(model).tensors["blk.0.ffn_up.weight"].shape[0]
    active = sum(float(f.sum()) for f in profile.frequencies())  # expected neurons a token, all cold (CPU only)
    extra = active * (d_model // 32 * 34 - d_model // 32 * 18)
    assert got["llama.cpp"]["cpu_bytes_per_token_profile"] - got["powerinfer"]["cpu_bytes_per_token_profile"] == \
        pytest.approx(extra, rel=1e-6)
    for layout, run in got.items():  # what the run's own token fired, in the rows of that layout
        per = d_model // 32 * 18 * 2 + d_model // 32 * (34 if layout == "llama.cpp" else 18)
        fired = run["cpu_ffn_bytes_fired"] / per
        assert fired == int(fired) and 0 < fired <= profile.frequencies()[0].numel() * len(profile.frequencies())
        assert run["cpu_bytes_per_token"] == pytest.approx(run["cpu_bytes_per_token_profile"] - run["cpu_ffn_bytes_expected"]
                                                           + run["cpu_ffn_bytes_fired"])
