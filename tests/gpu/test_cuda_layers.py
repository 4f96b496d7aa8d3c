"""The fused CUDA layer ops (csrc/cuda_layers.cu) against their pure-torch twins: rotary (NEOX and
NORM, partial rotary dims, strided views), attention over float16 and float32 caches (GQA, sliding
window, several tokens), RMSNorm, every gated activation."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")

from hybridsparse.runtime import kernels  # noqa: E402
from hybridsparse.runtime.layers import (ACTIVATIONS, FFNSpec, KVCache, Rotary, Step, attend_reference,  # noqa: E402
                                         gated_act_reference)


@pytest.fixture(autouse=True)
def _kernels_built():
    if not kernels._has_cuda_kernels():
        pytest.fail("the CUDA kernels did not build on a machine with CUDA")


@pytest.mark.parametrize("style", ["neox", "norm"])
@pytest.mark.parametrize("rot_dim", [64, 32])
def test_rope_on_a_strided_view(style, rot_dim):
    rope = Rotary(rot_dim, 10000.0, 64, style).to("cuda")
    qkv = torch.randn(3, (4 + 2 + 2) * 64, device="cuda")
    q = qkv[:, :4 * 64].view(3, 4, 64)  # a view into the fused projection output, as the models have it
    positions = torch.tensor([5, 6, 40], device="cuda")
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    ref = rope.apply_reference(q.clone(), cos, sin)
    out = rope.apply(q, Step(positions, 41))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(qkv[:, :4 * 64].view(3, 4, 64), ref)  # in place


@pytest.mark.parametrize("tokens", [1, 3])
def test_rope_qk_one_launch_for_adjacent_q_and_k(tokens):
    """rope_qk on q and k that are views of one fused projection output: one in-place launch over
    both, equal to the twin on each; v untouched."""
    from hybridsparse.runtime.layers import rope_qk
    rope = Rotary(64, 10000.0, 64, "norm").to("cuda")
    qkv = torch.randn(tokens, (4 + 2 + 2) * 64, device="cuda")
    before = qkv.clone()
    positions = torch.tensor([5, 6, 40][:tokens], device="cuda")
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    q, k, _ = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    q, k = rope_qk(rope, q.reshape(tokens, 4, 64), k.reshape(tokens, 2, 64), Step(positions, 41))
    torch.testing.assert_close(q, rope.apply_reference(before[:, :256].view(tokens, 4, 64), cos, sin))
    torch.testing.assert_close(k, rope.apply_reference(before[:, 256:384].view(tokens, 2, 64), cos, sin))
    torch.testing.assert_close(qkv[:, 384:], before[:, 384:])
    assert q.data_ptr() == qkv.data_ptr()  # in place


def _twin_caches(n_kv, D, n_ctx, past, dtype):
    """Two caches holding the same random history in their first `past` positions (one for the twin,
    one for the op)."""
    caches = KVCache(n_kv, D, n_ctx, "cuda", dtype), KVCache(n_kv, D, n_ctx, "cuda", dtype)
    for c in caches:
        torch.manual_seed(1)
        c.k[:, :past] = torch.randn(n_kv, past, D, device="cuda").to(dtype)
        c.v[:, :past] = torch.randn(n_kv, past, D, device="cuda").to(dtype)
    return caches


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,window,n_q,n_kv,D", [(1, None, 8, 8, 64), (1, None, 8, 2, 128), (3, None, 4, 1, 256),
                                                     (1, 16, 4, 2, 64), (4, 8, 4, 4, 80)])
@pytest.mark.parametrize("unroll", ["1", "0"])  # HS_CUDA_ATT_UNROLL: the kernel's loads in flight, default and old
@pytest.mark.parametrize("fuse", ["1", "0"])  # HS_CUDA_ATT_FUSE: one token's k/v store and the combine inside, or apart
def test_attention(cache_dtype, tokens, window, n_q, n_kv, D, unroll, fuse, monkeypatch):
    monkeypatch.setenv("HS_CUDA_ATT_UNROLL", unroll)
    monkeypatch.setenv("HS_CUDA_ATT_FUSE", fuse)
    n_ctx, past = 64, 37
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = _twin_caches(n_kv, D, n_ctx, past, cache_dtype)
    q = torch.randn(tokens, n_q, D, device="cuda", generator=g)
    k = torch.randn(tokens, n_kv, D, device="cuda", generator=g)
    v = torch.randn(tokens, n_kv, D, device="cuda", generator=g)
    positions = torch.arange(past, past + tokens, device="cuda")
    kv_len = 64  # a graph bucket larger than the filled part: the causal rule must hold on the device
    if n_kv == 1:  # and a long cache: more positions than threads per block
        n_ctx = kv_len = past = 2000
        a, b = _twin_caches(n_kv, D, n_ctx + 8, past, cache_dtype)
        positions = torch.arange(past - tokens, past, device="cuda")
    ref = attend_reference(q, k, v, a, Step(positions, kv_len), window, D ** -0.5)
    out = kernels.ops().attention(q, k, v, b.k, b.v, positions, kv_len, window or 0, D ** -0.5)
    tol = 2e-3 if cache_dtype == torch.float16 else 1e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(b.k, a.k)
    torch.testing.assert_close(b.v, a.v)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n_q,n_kv,window", [(8, 2, None), (4, 4, 40)])
@pytest.mark.parametrize("graph", [False, True])
def test_attention_decode_steps(cache_dtype, n_q, n_kv, window, graph):
    """Decode steps one after another with the new token's k/v stored by the attention kernel and the
    chunks combined by each (token, head)'s last block (their counters must return to zero for the next
    launch), eagerly and replayed as one CUDA graph, against the twin step by step: outputs and caches."""
    D, past, steps, kv_len = 64, 90, 6, 128  # 4 chunks of 32 positions at the start
    a, b = _twin_caches(n_kv, D, kv_len, past, cache_dtype)
    g = torch.Generator(device="cuda").manual_seed(5)
    qs, ks, vs = (torch.randn(steps, 1, h, D, device="cuda", generator=g) for h in (n_q, n_kv, n_kv))
    q, k, v = qs[0].clone(), ks[0].clone(), vs[0].clone()
    pos = torch.tensor([past], device="cuda")
    run = lambda: kernels.ops().attention(q, k, v, b.k, b.v, pos, kv_len, window or 0, D ** -0.5)  # noqa: E731
    if graph:
        run()  # warm-up, then undo its store
        b.k[:, past:], b.v[:, past:] = 0, 0
        graph_obj = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph_obj):
            out = run()
    tol = 2e-3 if cache_dtype == torch.float16 else 1e-5
    for i in range(steps):
        q.copy_(qs[i]), k.copy_(ks[i]), v.copy_(vs[i]), pos.fill_(past + i)
        ref = attend_reference(qs[i], ks[i], vs[i], a, Step(pos.clone(), kv_len), window, D ** -0.5)
        if graph:
            graph_obj.replay()
        else:
            out = run()
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(b.k, a.k)
    torch.testing.assert_close(b.v, a.v)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("D,window", [(64, None), (7, None), (96, 5)])
def test_attention_one_chunk(cache_dtype, D, window):
    """A cache short enough for one block per head (no split-KV combine step), an odd head_dim (the
    lanes' scalar path) and a window inside the chunk."""
    n_q, n_kv, past, tokens, kv_len = 4, 2, 20, 2, 24
    a, b = _twin_caches(n_kv, D, kv_len, past, cache_dtype)
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(tokens, h, D, device="cuda", generator=g) for h in (n_q, n_kv, n_kv))
    positions = torch.arange(past, past + tokens, device="cuda")
    ref = attend_reference(q, k, v, a, Step(positions, kv_len), window, D ** -0.5)
    out = kernels.ops().attention(q, k, v, b.k, b.v, positions, kv_len, window or 0, D ** -0.5)
    tol = 2e-3 if cache_dtype == torch.float16 else 1e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("D", [640, 4096, 5120, 100])
def test_rms_norm(D):
    x, w = torch.randn(3, D, device="cuda"), torch.randn(D, device="cuda")
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), kernels.rms_norm_reference(x, w, 1e-6),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("D", [8192, 2048, 100])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm(D, with_bias):
    """The compiled layer norm (Falcon, OPT) against torch's, rows with a large common offset too
    (the mean is taken out before the variance)."""
    x = torch.randn(3, D, device="cuda") * 4 + torch.tensor([[0.0], [50.0], [-3.0]], device="cuda")
    w, b = torch.randn(D, device="cuda"), (torch.randn(D, device="cuda") if with_bias else None)
    ref = torch.nn.functional.layer_norm(x, (D,), w, b, 1e-5)
    torch.testing.assert_close(kernels.layer_norm(x, w, b, 1e-5), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kernels.layer_norm(x.cpu(), w.cpu(), None if b is None else b.cpu(), 1e-5), ref.cpu())


@pytest.mark.parametrize("activation,act_on_up", [("silu", False), ("relu", False), ("relu", True), ("gelu", False),
                                                  ("gelu_erf", False)])
def test_gated_act(activation, act_on_up):
    gu = torch.randn(2, 2 * 300, device="cuda") * 3
    gate, up = gu[:, :300], gu[:, 300:]  # views of a fused gate/up output
    out = kernels.ops().gated_act(gate, up, kernels.ACTIVATION_IDS[activation], act_on_up)
    ref = gated_act_reference(gate, up, FFNSpec(activation, act_on_up=act_on_up))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)  # fast-math exp/tanh: ~3e-5
    assert set(kernels.ACTIVATION_IDS) == set(ACTIVATIONS)
