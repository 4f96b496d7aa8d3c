"""The placement ILP against brute force, its budgets, the GPU index file (PowerInfer's layout),
stale-index detection, --reset-gpu-index and bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridsparse.profiler.activations import load_profile, save_profile
from hybridsparse.runtime.errors import InputError
from hybridsparse.solver import cli
from hybridsparse.solver.gpuidx import read_index, stale_reason, write_index
from hybridsparse.solver.plan import (GiB, Hardware, LayerShape, Problem, evaluate, solve, solve_brute_force,
                                      solve_greedy, solve_ilp)

MiB = 1 << 20


def tiny_problem(seed, budget_extra_mib, sync_us=20.0, pcie_budget=None):
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(2):
        freq = np.sort(rng.pareto(1.5, 12) / 10).clip(0, 1)  # power law
        layers.append(LayerShape(n_ff=12, neuron_bytes=int(rng.integers(2, 6)) * MiB, attn_bytes=int(rng.integers(5, 40)) * MiB,
                                 kv_bytes=4 * MiB, predictor_bytes=MiB, freq=freq))
    hw = Hardware(gpu_bw=900e9, cpu_bw=60e9, sync_s=sync_us * 1e-6, pcie_budget=pcie_budget)
    p = Problem(layers, head_bytes=30 * MiB, d_model=1024, vram_budget=0, hw=hw, group=4)
    p.vram_budget = p.fixed_vram() + budget_extra_mib * MiB
    p.vram_budget = int((p.fixed_vram() + budget_extra_mib * MiB) / 0.97)  # the margin is 3% of the budget (below its cap)
    return p


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("extra", [0, 20, 60, 200])
def test_ilp_equals_brute_force_and_respects_the_budget(seed, extra):
    p = tiny_problem(seed, extra, sync_us=[0, 20, 500][seed % 3])
    ilp, brute = solve_ilp(p), solve_brute_force(p)
    r_ilp, r_brute = evaluate(p, ilp), evaluate(p, brute)
    assert ilp.status == "Optimal"
    assert r_ilp["ms_per_token"] == pytest.approx(r_brute["ms_per_token"], rel=1e-6, abs=1e-9)
    assert r_ilp["vram_bytes"] <= p.vram_budget
    greedy = evaluate(p, solve_greedy(p))
    assert greedy["vram_bytes"] <= p.vram_budget
    assert r_ilp["ms_per_token"] <= greedy["ms_per_token"] + 1e-9


@pytest.mark.parametrize("eager_us", [0.0, 250.0, 5000.0])
def test_cost_of_losing_the_decode_graph(eager_us):
    """A plan with any attention on the CPU pays eager_layer_s per layer (no CUDA graph); the ILP still
    equals brute force, and a large enough price keeps every attention on the GPU when it fits."""
    p = tiny_problem(3, 60)
    p.hw.eager_layer_s = eager_us * 1e-6
    ilp, brute = solve_ilp(p), solve_brute_force(p)
    r = evaluate(p, ilp)
    assert r["ms_per_token"] == pytest.approx(evaluate(p, brute)["ms_per_token"], rel=1e-6, abs=1e-9)
    assert r["eager_ms_per_token"] == (0.0 if all(ilp.attn_gpu) else pytest.approx(2 * eager_us / 1e3))
    if eager_us >= 5000:
        assert all(ilp.attn_gpu)


def test_predictor_is_timed_on_its_attention_device():
    """Hand-checked: a layer whose attention is on the CPU runs its predictor there too, so its CPU time
    is (attention + predictor + active neuron bytes) / B_cpu; on the GPU both come off the CPU's time.
    A predictor as large as the attention makes the GPU's attention worth twice the VRAM it takes."""
    freq = np.array([1.0, 0.5, 0.0, 0.0])
    layer = LayerShape(n_ff=4, neuron_bytes=MiB, attn_bytes=30 * MiB, kv_bytes=0, predictor_bytes=20 * MiB, freq=freq)
    hw = Hardware(gpu_bw=1e12, cpu_bw=50e9, sync_s=0.0, eager_layer_s=0.0)
    p = Problem([layer], head_bytes=0, d_model=64, vram_budget=8 * GiB, hw=hw, group=2)
    from hybridsparse.solver.plan import Plan
    cpu_attn = evaluate(p, Plan([0], [False], False, "hand"))["layers"][0]
    assert cpu_attn["cpu_ms"] == pytest.approx((30 + 20 + 1.5) * MiB / 50e9 * 1e3)
    gpu_attn = evaluate(p, Plan([0], [True], False, "hand"))["layers"][0]
    assert gpu_attn["cpu_ms"] == pytest.approx(1.5 * MiB / 50e9 * 1e3)
    assert gpu_attn["gpu_ms"] == pytest.approx(50 * MiB / 1e12 * 1e3)


def test_pcie_budget_limits_hand_overs():
    p = tiny_problem(1, 60, sync_us=0.0, pcie_budget=0)
    plan = solve_ilp(p)
    assert evaluate(p, plan)["syncs_per_token"] == 0
    assert evaluate(p, plan)["ms_per_token"] == pytest.approx(evaluate(p, solve_brute_force(p))["ms_per_token"])


def test_budget_below_the_fixed_buffers_is_refused():
    p = tiny_problem(0, 0)
    p.vram_budget = 100 * MiB
    with pytest.raises(InputError, match=r"--vram-budget 0.10 GiB is below .* use at least"):
        solve(p)


def test_ilp_failure_falls_back_to_greedy_and_says_so(monkeypatch):
    import pulp
    p = tiny_problem(2, 60)
    monkeypatch.setattr(pulp, "PULP_CBC_CMD", lambda **kw: (_ for _ in ()).throw(RuntimeError("no cbc")))
    plan = solve(p)
    assert plan.method == "greedy" and "greedy fallback" in plan.status and "no cbc" in plan.status


def test_index_round_trip_in_powerinfer_layout(tmp_path):
    import gguf
    ids = [np.array([5, 1, 7]), np.array([], dtype=np.int64), np.arange(10)]
    path = write_index(tmp_path / "m.generated.gpuidx", ids, [10, 10, 10], 3 * GiB, {"profile_hash": "x"})
    assert path.read_bytes()[:4] == b"PWRI"
    idx = read_index(path)
    assert [list(a) for a in idx.gpu_neurons] == [[1, 5, 7], [], list(range(10))]
    assert idx.vram_capacity == 3 * GiB and idx.meta == {"profile_hash": "x"}
    # as PowerInfer's exporter writes it (no hybridsparse keys): gguf's writer, magic patched
    w = gguf.GGUFWriter(str(tmp_path / "pi.gpuidx"), "generic.gpu_index")
    w.add_uint32("generic.gpu_index.block_count", 1)
    w.add_uint64("split.vram_capacity", 5 * GiB)
    w.add_tensor("blk.0.gpu_idx", np.array([0, 1, 1, 0], dtype=np.int32))
    w.add_tensor("blk.0.gpu_bucket", np.array([1, 2], dtype=np.int32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with open(tmp_path / "pi.gpuidx", "r+b") as fh:
        fh.write(b"PWRI")
    pi = read_index(tmp_path / "pi.gpuidx")
    assert [list(a) for a in pi.gpu_neurons] == [[1, 2]] and pi.meta == {}


def test_corrupt_index_is_one_clear_error(tmp_path):
    path = write_index(tmp_path / "x.gpuidx", [np.array([1])], [4], GiB, {})
    data = path.read_bytes()
    (tmp_path / "t.gpuidx").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"t.gpuidx: corrupt GPU index .* --reset-gpu-index"):
        read_index(tmp_path / "t.gpuidx")


def test_activation_files_sorted_by_layer_number(tmp_path):
    counts = [torch.full((4,), float(i)) for i in range(12)]
    save_profile(tmp_path, counts, tokens=100, meta={})
    prof = load_profile(tmp_path)
    assert [int(c[0]) for c in prof.counts] == list(range(12))  # not 0, 1, 10, 11, 2, ...
    (tmp_path / "activation" / "activation_3.pt").unlink()
    with pytest.raises(InputError, match=r"layers \[3\] are missing"):
        load_profile(tmp_path)
    with pytest.raises(InputError, match="no activation profile"):
        load_profile(tmp_path / "nowhere")


@pytest.fixture
def relu_model(tmp_path):
    from tiny_models import tiny_llama
    path = tiny_llama(tmp_path / "relu.gguf", act="relu", layers=3)
    from hybridsparse.runtime.gguf_file import GGUFFile
    g = GGUFFile(path)
    n_ff = g.tensors["blk.0.ffn_up.weight"].rows
    g.close()
    gen = torch.Generator().manual_seed(0)
    save_profile(tmp_path / "relu.hs-profile", [torch.rand(n_ff, generator=gen) ** 3 * 1000 for _ in range(3)],
                 tokens=1000, meta={})
    return path


def test_hs_solve_end_to_end_caches_and_resets(relu_model, capsys):
    args = ["-m", str(relu_model), "--vram-budget", "1", "--group", "8"]
    assert cli.main(args) == 0
    out = capsys.readouterr()
    assert "predicted" in out.out and "wrote" in out.err
    index = relu_model.with_name("relu.generated.gpuidx")
    idx = read_index(index)
    assert len(idx.gpu_neurons) == 3 and idx.vram_capacity == int(1 * GiB)
    assert cli.main(args) == 0
    assert "reusing it" in capsys.readouterr().err
    assert cli.main(args + ["--reset-gpu-index"]) == 0
    assert "wrote" in capsys.readouterr().err
    # a different budget or profile makes the cached index stale: solved again, said so
    assert cli.main(["-m", str(relu_model), "--vram-budget", "1.1", "--group", "8"]) == 0
    assert "stale" in capsys.readouterr().err
    # so does another prefill micro-batch (-ub): the VRAM its activations need is not the weights'
    assert cli.main(["-m", str(relu_model), "--vram-budget", "1.1", "--group", "8", "-ub", "512"]) == 0
    assert "its ubatch is 128, now 512" in capsys.readouterr().err
    assert read_index(index).meta["ubatch"] == 512
    # a float ffn_down is transposed as it is: --down-t-type changes nothing the plan counts, nor the index
    assert cli.main(["-m", str(relu_model), "--vram-budget", "1.1", "--group", "8", "-ub", "512", "--down-t-type",
                     "f16"]) == 0
    assert "reusing it" in capsys.readouterr().err and "down_t_type" not in read_index(index).meta
    assert cli.main(["-m", str(relu_model), "--vram-budget", "1.1", "-ub", "0"]) == 1
    assert "-ub 0: expected at least 1" in capsys.readouterr().err
    torch.save(torch.ones(5), relu_model.with_name("relu.hs-profile") / "activation" / "activation_0.pt")
    assert cli.main(args) == 1
    assert "layer 0 of the profile has 5 neurons" in capsys.readouterr().err


def test_hs_solve_bad_inputs(relu_model, tmp_path, capsys):
    assert cli.main(["-m", str(relu_model), "--vram-budget", "0.1"]) == 1
    assert "is below" in capsys.readouterr().err
    assert cli.main(["-m", str(relu_model), "--vram-budget", "4", "--profile", str(tmp_path / "none")]) == 1
    assert "no activation profile" in capsys.readouterr().err
    relu_model.with_name("relu.generated.gpuidx").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    assert cli.main(["-m", str(relu_model), "--vram-budget", "4"]) == 1
    assert "corrupt GPU index" in capsys.readouterr().err


def test_index_is_stale_when_the_transposed_down_type_changes(tmp_path, capsys):
    """A llama.cpp file with a Q4_0 ffn_down: the plan counts its transposed rows at --down-t-type's size, so an
    index solved for the other type is stale (Q8_0 planned, F16 run: over the budget); one solved before the key
    existed counted F16 rows."""
    from hybridsparse.runtime.synth import write_synth
    model = write_synth(tmp_path, "tiny", "q4_0", "llama.cpp", predictor_width=64)
    assert cli.transposes_block_down(model)
    args = ["-m", str(model), "--vram-budget", "1", "--group", "8"]
    assert cli.main(args) == 0
    index = read_index(model.with_name(model.stem + ".generated.gpuidx"))
    assert index.meta["down_t_type"] == "q8_0"
    capsys.readouterr()
    assert cli.main(args + ["--down-t-type", "f16"]) == 0
    assert "its down_t_type is 'q8_0', now 'f16'" in capsys.readouterr().err
    old = read_index(model.with_name(model.stem + ".generated.gpuidx"))
    assert old.meta["down_t_type"] == "f16"
    old.meta.pop("down_t_type")
    assert stale_reason(old, {"down_t_type": "f16"}, old.vram_capacity) is None
    assert "down_t_type is 'f16', now 'q8_0'" in stale_reason(old, {"down_t_type": "q8_0"}, old.vram_capacity)
    assert not cli.transposes_block_down(write_synth(tmp_path, "tiny", "q4_0", "powerinfer", predictor_width=64))
    assert not cli.transposes_block_down(write_synth(tmp_path, "tiny", "f16", "llama.cpp", predictor_width=64))


@pytest.mark.parametrize("dtype,down_t_type", [("q4_0", "q8_0"), ("q4_0", "f16"), ("q8_0", "q8_0"), ("f16", "q8_0")])
def test_plan_counts_the_transposed_down_rows_the_runtime_reads(tmp_path, dtype, down_t_type):
    """A llama.cpp-layout file's ffn_down is read by the hybrid runtime as rows transposed once (Q8_0 for block
    formats by default, F16 with --down-t-type f16, float formats as stored; runtime/hybrid.py transposed_down):
    the plan counts those bytes per neuron, on the CPU and on the GPU, not the file's (a Q4_0 file's hot neurons
    took ~1.8x the VRAM the plan gave them); a PowerInfer file of the same weights is counted as stored."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    from hybridsparse.runtime.gguf_file import GGUFFile
    from hybridsparse.runtime.hybrid import transposed_down
    from hybridsparse.runtime.synth import write_synth
    hw = Hardware(gpu_bw=900e9, cpu_bw=60e9, sync_s=20e-6)
    got = {}
    for layout in ("llama.cpp", "powerinfer"):
        model = write_synth(tmp_path / layout, "tiny", dtype, layout, predictor_width=64)
        prof_dir = model.with_name(model.stem + ".hs-profile")
        p = cli.model_problem(model, prof_dir, load_profile(prof_dir), int(GiB), hw, 256, 8, down_t_type=down_t_type)
        got[layout] = p.layers[0]
        g = GGUFFile(model)
        d_model, n_ff = g.tensors["blk.0.ffn_up.weight"].shape[0], g.tensors["blk.0.ffn_up.weight"].rows
        row = g.tensors["blk.0.ffn_up.weight"].row_bytes
        if layout == "llama.cpp":
            down_t = transposed_down(g, 1, down_t_type=down_t_type)[0]  # what the runtime reads
            down_row = down_t.data.numel() * down_t.data.element_size() // n_ff
            want = Q.F16 if dtype == "f16" or down_t_type == "f16" else Q.Q8_0
            assert down_t.qtype == want
            assert down_row == d_model // GGML_QUANT_SIZES[want][0] * GGML_QUANT_SIZES[want][1]
        else:
            down_row = g.tensors["blk.0.ffn_down_t.weight"].row_bytes
            assert down_row == d_model // GGML_QUANT_SIZES[Q[dtype.upper()]][0] * GGML_QUANT_SIZES[Q[dtype.upper()]][1]
        assert got[layout].neuron_bytes == 2 * row + down_row, layout
        assert got[layout].gpu_neuron_bytes == 2 * row + down_row, layout  # formats the CUDA kernels read
        g.close()
    if dtype == "q4_0":  # Q4_0 rows transposed into a wider type
        assert got["llama.cpp"].neuron_bytes > got["powerinfer"].neuron_bytes
    else:  # Q8_0 stays Q8_0, F16 F16
        assert got["llama.cpp"].neuron_bytes == got["powerinfer"].neuron_bytes
