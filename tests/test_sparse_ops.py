"""The sparse CPU ops against their pure-torch twins: every weight type and activation variant, odd
sizes, empty / single / all-active / unsorted index sets, 1..3 tokens, 1 and 2 threads."""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from hybridsparse.runtime import kernels
from hybridsparse.runtime.quants import dequantize
from quant_utils import quantize_activations, random_rows

pytestmark = pytest.mark.skipif(not kernels.available(), reason="compiled kernels unavailable")

N_ROWS = 67
ROW_TYPES = [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.F16, Q.BF16]
AXPY_TYPES = [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.F16, Q.BF16]


def index_sets(n):
    g = torch.Generator().manual_seed(n)
    return {"empty": torch.zeros(0, dtype=torch.int32), "single": torch.tensor([n // 2], dtype=torch.int32),
            "all": torch.arange(n, dtype=torch.int32), "unsorted": torch.randperm(n, generator=g)[: n // 3].int(),
            "none": None}


def _cols(qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    return 101 if block == 1 else block * 3


@pytest.mark.parametrize("qtype", ROW_TYPES)
@pytest.mark.parametrize("which", ["empty", "single", "all", "unsorted", "none"])
@pytest.mark.parametrize("tokens,n_threads", [(1, 1), (3, 2)])
def test_sparse_rowdot(qtype, which, tokens, n_threads, threads):
    torch.set_num_threads(n_threads)
    w = random_rows(qtype, N_ROWS, _cols(qtype), seed=7)
    K = dequantize(w[:1], qtype).shape[1]
    x = torch.randn(tokens, K)
    idx = index_sets(N_ROWS)[which]
    y = kernels.sparse_rowdot(w, qtype, x, idx)
    block = GGML_QUANT_SIZES[qtype][0]
    xq = x.double() if qtype in (Q.F16, Q.BF16) else quantize_activations(x, block)
    rows = w if idx is None else w[idx.long()]
    wd = dequantize(rows, qtype).double()
    ref = xq @ wd.T
    assert y.shape == ref.shape
    if ref.numel():
        # relative to the scale of the products summed (|x| . |w|): a single dot near zero (one listed
        # row, unseeded x) would otherwise make float rounding look like a large relative error
        scale = (xq.abs() @ wd.abs().T).max()
        assert ((y.double() - ref).abs().max() / scale).item() < 1e-6


@pytest.mark.parametrize("qtype", AXPY_TYPES)
@pytest.mark.parametrize("tokens", [4, 11, 19])
@pytest.mark.parametrize("density", [1.0, 0.5, 0.1])
def test_sparse_axpy_many_tokens(qtype, tokens, density, threads, monkeypatch):
    """Several tokens' down rows added for all the tokens at once (axpy_rows_tokens: chunks of 16 listed rows,
    tiles of 8 tokens, where enough of a chunk's pairs are active) or each token's own (few active, or
    HS_AXPY_TOKENS=0): the twin's sums either way, an odd row length included (F16)."""
    torch.set_num_threads(2)
    w = random_rows(qtype, N_ROWS, _cols(qtype), seed=31)
    idx = torch.randperm(N_ROWS, generator=torch.Generator().manual_seed(32))[:45].int()
    g = torch.Generator().manual_seed(33)
    h = torch.randn(tokens, 45, generator=g) * (torch.rand(tokens, 45, generator=g) < density)
    ref = kernels.sparse_axpy_reference(w, qtype, h, idx)
    y = kernels.sparse_axpy(w, qtype, h, idx)
    monkeypatch.setenv("HS_AXPY_TOKENS", "0")
    y0 = kernels.sparse_axpy(w, qtype, h, idx)
    for got in (y, y0):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()))


@pytest.mark.parametrize("qtype", AXPY_TYPES)
@pytest.mark.parametrize("which", ["empty", "single", "all", "unsorted", "none"])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_sparse_axpy(qtype, which, n_threads, threads):
    torch.set_num_threads(n_threads)
    w = random_rows(qtype, N_ROWS, _cols(qtype), seed=3)
    idx = index_sets(N_ROWS)[which]
    m = N_ROWS if idx is None else idx.numel()
    h = torch.randn(2, m)
    if m > 2:
        h[0, ::2] = 0  # inactive neurons
    y = kernels.sparse_axpy(w, qtype, h, idx)
    torch.testing.assert_close(y, kernels.sparse_axpy_reference(w, qtype, h, idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.F16, Q.BF16])
@pytest.mark.parametrize("which", ["empty", "all", "unsorted", "none"])
def test_many_tokens_take_gathered_slices_and_gemm(qtype, which, monkeypatch):
    """From CPU_SPARSE_GEMM_TOKENS tokens the sparse row-dot and axpy gather a slice of the listed rows
    at a time and use torch's GEMM: the same results as the twins (here from 5 tokens, slices of 8 rows;
    in float32: the bfloat16 GEMM's rounding is test_quants' test_many_token_cpu_gemm_matches_twin)."""
    monkeypatch.setattr(kernels, "CPU_SPARSE_GEMM_TOKENS", 5)
    monkeypatch.setattr(kernels, "CPU_GEMM_BF16", "0")
    monkeypatch.setattr(kernels, "_CPU_GEMM_CHUNK_ROWS", 8)
    w = random_rows(qtype, N_ROWS, _cols(qtype), seed=11)
    K = dequantize(w[:1], qtype).shape[1]
    idx = index_sets(N_ROWS)[which]
    m = N_ROWS if idx is None else idx.numel()
    x, h = torch.randn(6, K), torch.randn(6, m)
    torch.testing.assert_close(kernels.sparse_rowdot(w, qtype, x, idx),
                               kernels.sparse_rowdot_reference(w, qtype, x, idx), rtol=1e-4, atol=1e-4)
    if qtype in AXPY_TYPES:
        torch.testing.assert_close(kernels.sparse_axpy(w, qtype, h, idx),
                                   kernels.sparse_axpy_reference(w, qtype, h, idx), rtol=1e-4, atol=1e-4)


VARIANTS = [("silu", True, False), ("relu", True, False), ("relu", True, True), ("gelu", True, False),
            ("relu", False, False), ("gelu_erf", False, False)]


@pytest.mark.parametrize("activation,gated,act_on_up", VARIANTS)
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.F16])
@pytest.mark.parametrize("which", ["single", "all", "unsorted", "none"])
@pytest.mark.parametrize("tokens", [1, 2])  # one token with an index set: the fused decode kernel
def test_sparse_ffn(activation, gated, act_on_up, qtype, which, tokens):
    d, n_ff = 64, N_ROWS
    up, gate = random_rows(qtype, n_ff, d, seed=1), random_rows(qtype, n_ff, d, seed=2) if gated else None
    down_t = random_rows(qtype, n_ff, d, seed=3)
    bias = None if gated else torch.randn(n_ff) * 0.1
    idx = index_sets(n_ff)[which]
    # seeded: a gate within 8-bit rounding of zero can flip ReLU's side for some draws (an h error of
    # |g| * |u|), which is right but exceeds a per-element tolerance once in ~1500 draws
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(11))
    args = (x, up, qtype, gate, qtype, down_t, qtype, idx, bias, activation, act_on_up)
    y, h = kernels.sparse_ffn(*args)
    y_ref, h_ref = kernels.sparse_ffn_reference(*args)
    # the row-dots see two-plane 8-bit activations (~1e-4 of the scale); SiLU's tail amplifies that
    torch.testing.assert_close(h, h_ref, rtol=5e-3, atol=1e-4 * max(1.0, h_ref.abs().max().item()))
    torch.testing.assert_close(y, y_ref, rtol=5e-3, atol=1e-3 * max(1.0, y_ref.abs().max().item()))


@pytest.mark.parametrize("rows", ["1", "2", "4", "8"])
@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q5_0])
@pytest.mark.parametrize("activation,gated,act_on_up", [("relu", True, False), ("relu", False, False), ("silu", True, False)])
def test_sparse_ffn_rows_side_by_side(rows, qtype, activation, gated, act_on_up, monkeypatch):
    """HS_FFN_ROWS: the decode FFN streaming 1, 2, 4 or 8 rows at once (a gated neuron's two: half as many
    neurons; AVX-512 or AVX2) gives the twin's answer, for a float16 row length with a tail (96 = 3 x 32)
    and a neuron count per thread that is not a multiple of the group."""
    monkeypatch.setenv("HS_FFN_ROWS", rows)
    d, n_ff = 96, 203
    up, gate = random_rows(qtype, n_ff, d, seed=1), random_rows(qtype, n_ff, d, seed=2) if gated else None
    down_t = random_rows(qtype, n_ff, d, seed=3)
    bias = None if gated else torch.randn(n_ff) * 0.1
    idx = torch.randperm(n_ff, generator=torch.Generator().manual_seed(4))[:91].sort().values.int()  # < half
    x = torch.randn(1, d, generator=torch.Generator().manual_seed(11))
    args = (x, up, qtype, gate, qtype, down_t, qtype, idx, bias, activation, act_on_up)
    y, h = kernels.sparse_ffn(*args)
    y_ref, h_ref = kernels.sparse_ffn_reference(*args)
    tol = 1e-4 if qtype == Q.F16 else 5e-3  # block types: the row-dots see two-plane 8-bit activations
    torch.testing.assert_close(h, h_ref, rtol=tol, atol=tol * max(1.0, h_ref.abs().max().item()))
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=10 * tol * max(1.0, y_ref.abs().max().item()))


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0])
@pytest.mark.parametrize("gated", [True, False])
def test_sparse_ffn_reads_rows_pitch_apart(qtype, gated):
    """The decode FFN takes its weights as views of one bundled tensor (a neuron's gate | up | down_t rows side
    by side, rows further apart than their length: tests/gpu/bundle_rows_bench.py) and gives the sums of the
    separate tensors bit for bit (one thread); rows that are not contiguous themselves are refused by name."""
    d, n_ff = 96, 203
    parts = [random_rows(qtype, n_ff, d, seed=s) for s in range(3 if gated else 2)]
    bundle = torch.cat(parts, 1)
    w = parts[0].shape[1]
    views = [bundle[:, i * w:(i + 1) * w] for i in range(len(parts))]
    assert not views[0].is_contiguous()
    idx = torch.randperm(n_ff, generator=torch.Generator().manual_seed(4))[:91].sort().values.int()
    x = torch.randn(1, d, generator=torch.Generator().manual_seed(11))
    bias = None if gated else torch.randn(n_ff) * 0.1

    def ffn(ws):
        gate, up, down = (ws[0], ws[1], ws[2]) if gated else (None, ws[0], ws[1])
        return kernels.cpu.sparse_ffn(x, up, int(qtype), gate, int(qtype) if gated else 0, down, int(qtype), idx,
                                      bias, 1, False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (y, h), (y_ref, h_ref) = ffn(views), ffn(parts)
        assert torch.equal(h, h_ref) and torch.equal(y, y_ref) and bool((h != 0).any())
        strided = torch.stack([parts[-1], parts[-1]], 2).flatten(1)[:, ::2]  # each row's elements 2 apart
        assert torch.equal(strided, parts[-1])
        with pytest.raises(RuntimeError, match="sparse_ffn: weight must be a 2-D tensor of contiguous rows"):
            ffn(views[:-1] + [strided])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q4_0])
def test_one_token_ffn_counts_what_fired(qtype):
    """sparse_ffn_stats: each one-token FFN over an index set adds its listed neurons, those that fired (h != 0)
    and the bytes of the fired ones' gate, up and down rows (the benchmark's measured roofline); several tokens
    or no index set add nothing."""
    d, n_ff = 96, 203
    up, gate, down_t = (random_rows(qtype, n_ff, d, seed=s) for s in (1, 2, 3))
    idx = torch.randperm(n_ff, generator=torch.Generator().manual_seed(4))[:91].int()
    x = torch.randn(2, d, generator=torch.Generator().manual_seed(11))
    row = up.shape[1] * up.element_size()
    before = kernels.cpu.sparse_ffn_stats()
    _, h = kernels.cpu.sparse_ffn(x[:1], up, int(qtype), gate, int(qtype), down_t, int(qtype), idx, None, 1, False)
    fired = int((h != 0).sum())
    assert 0 < fired < idx.numel()  # ReLU: some listed neurons did not fire
    kernels.cpu.sparse_ffn(x, up, int(qtype), gate, int(qtype), down_t, int(qtype), idx, None, 1, False)
    kernels.cpu.sparse_ffn(x[:1], up, int(qtype), gate, int(qtype), down_t, int(qtype), None, None, 1, False)
    after = kernels.cpu.sparse_ffn_stats()
    assert [a - b for a, b in zip(after, before)] == [1, idx.numel(), fired, fired * 3 * row]


@pytest.mark.parametrize("chunk", ["0", "1", "3", "16", "64"])
@pytest.mark.parametrize("rows", ["1", "4", "8"])
@pytest.mark.parametrize("n_threads", [1, 2, 4])
@pytest.mark.parametrize("qtype", [Q.F16, Q.Q4_0])
def test_sparse_ffn_claimed_shares(chunk, rows, n_threads, qtype, monkeypatch):
    """HS_FFN_CHUNK: the decode FFN's threads claiming neurons a chunk at a time (a chunk that is not
    a multiple of the side-by-side rows included) or taking fixed shares (0) give the twin's answer,
    with more threads than the cores here."""
    monkeypatch.setenv("HS_FFN_CHUNK", chunk)
    monkeypatch.setenv("HS_FFN_ROWS", rows)
    d, n_ff = 96, 301
    up, gate, down_t = (random_rows(qtype, n_ff, d, seed=s) for s in (1, 2, 3))
    idx = torch.randperm(n_ff, generator=torch.Generator().manual_seed(4))[:143].sort().values.int()
    x = torch.randn(1, d, generator=torch.Generator().manual_seed(11))
    args = (x, up, qtype, gate, qtype, down_t, qtype, idx, None, "relu", False)
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        y, h = kernels.sparse_ffn(*args)
    finally:
        torch.set_num_threads(before)
    y_ref, h_ref = kernels.sparse_ffn_reference(*args)
    tol = 1e-4 if qtype == Q.F16 else 5e-3
    torch.testing.assert_close(h, h_ref, rtol=tol, atol=tol * max(1.0, h_ref.abs().max().item()))
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=10 * tol * max(1.0, y_ref.abs().max().item()))


@pytest.mark.parametrize("rows", ["1", "2", "4", "8"])
@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q5_0])
@pytest.mark.parametrize("order", ["sorted", "unsorted"])
def test_sparse_rowdot_rows_side_by_side(rows, qtype, order, monkeypatch):
    """HS_FFN_ROWS for the one-token row-dot over a sparse index set (fewer than half the rows): the
    twin's answer for every group size, with a tail group and a row length with a tail."""
    monkeypatch.setenv("HS_FFN_ROWS", rows)
    n = 203
    w = random_rows(qtype, n, 96, seed=5)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(6))[:61]
    idx = (idx.sort().values if order == "sorted" else idx).int()
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(kernels.sparse_rowdot(w, qtype, x, idx),
                               kernels.sparse_rowdot_reference(w, qtype, x, idx), rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("activation,gated,act_on_up", VARIANTS)
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.F16, Q.BF16, Q.Q4_K])
@pytest.mark.parametrize("tokens", [1, 3, 11])  # 11: two tiles of tokens for the down rows (axpy_rows_tokens)
def test_sparse_ffn_with_a_mask_per_token(activation, gated, act_on_up, qtype, tokens):
    """Batched decode over the union of the tokens' active sets, each token only with its own neurons:
    the twin's y and h (h 0 outside the mask), including a token with no neuron at all."""
    g = torch.Generator().manual_seed(5)
    w_cols = _cols(qtype)
    up, gate = random_rows(qtype, N_ROWS, w_cols, seed=1), random_rows(qtype, N_ROWS, w_cols, seed=2)
    K = dequantize(up[:1], qtype).shape[1]
    down_type = qtype if qtype in AXPY_TYPES else Q.F16
    down = random_rows(down_type, N_ROWS, _cols(down_type), seed=4)
    idx = torch.randperm(N_ROWS, generator=g)[:40].int()
    mask = torch.rand(tokens, 40, generator=g) < (0.4 if tokens < 10 else 0.9)
    if tokens > 1:
        mask[1] = False
    x = torch.randn(tokens, K, generator=g)
    bias = None if gated else torch.randn(N_ROWS, generator=g) * 0.1
    args = (x, up, qtype, gate if gated else None, qtype, down, down_type, idx, mask, bias, activation, act_on_up)
    y, h = kernels.sparse_ffn_masked(*args)
    ry, rh = kernels.sparse_ffn_masked_reference(*args)
    assert (h[~mask] == 0).all()
    if tokens > 1:
        assert (y[1] == 0).all()
    # the row-dots see two-plane 8-bit activations (~1e-4 of the scale), as in test_sparse_ffn
    torch.testing.assert_close(h, rh, rtol=5e-3, atol=1e-4 * max(1.0, rh.abs().max().item()))
    torch.testing.assert_close(y, ry, rtol=5e-3, atol=1e-3 * max(1.0, ry.abs().max().item()))


@pytest.mark.parametrize("act_on_up", [False, True])
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.F16])
@pytest.mark.parametrize("form", ["one row at a time", "rows side by side", "a mask per token"])
def test_relu_gate_first_skips_only_what_is_zero(act_on_up, qtype, form, monkeypatch):
    """A ReLU gate is read before its up row, which is skipped where the gate did not fire
    (HS_GATE_FIRST, on by default, one row at a time: one token with HS_FFN_ROWS=1, several with a
    mask each): the same y and h as reading both rows, with about half the listed gates firing."""
    monkeypatch.setenv("HS_FFN_ROWS", "4" if form == "rows side by side" else "1")
    d, n_ff, tokens = 128, 301, 2 if form == "a mask per token" else 1
    up, gate, down_t = (random_rows(qtype, n_ff, d, seed=s) for s in (1, 2, 3))
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(7))
    idx = torch.randperm(n_ff, generator=torch.Generator().manual_seed(8))[:97].int()
    if tokens > 1:
        mask = torch.rand(tokens, 97, generator=torch.Generator().manual_seed(9)) < 0.7
        args = (x, up, qtype, gate, qtype, down_t, qtype, idx, mask, None, "relu", act_on_up)
        run = kernels.sparse_ffn_masked
    else:
        args = (x, up, qtype, gate, qtype, down_t, qtype, idx, None, "relu", act_on_up)
        run = kernels.sparse_ffn
    y, h = run(*args)
    assert 0.1 < (h != 0).float().mean() < 0.8  # (dReLU: a quarter of the listed neurons fire)
    monkeypatch.setenv("HS_GATE_FIRST", "0")
    y_both, h_both = run(*args)
    assert torch.equal(h.abs(), h_both.abs())  # 0 * u may be -0: the same value
    # y: the same terms, summed by whichever thread claimed each share first
    torch.testing.assert_close(y, y_both, rtol=1e-5, atol=1e-5 * y_both.abs().max().item())


def test_sparse_ffn_with_all_neurons_equals_dense_ffn():
    from hybridsparse.runtime.layers import FFN_VARIANTS, FFNWeights, ffn
    from hybridsparse.runtime.weights import QWeight
    d, n_ff = 64, 96
    up, gate, down_t = (random_rows(Q.Q8_0, n_ff, d, seed=s) for s in (4, 5, 6))
    x = torch.randn(3, d)
    dense = ffn(x, FFNWeights(up=QWeight(up, Q.Q8_0, d), gate=QWeight(gate, Q.Q8_0, d),
                              down=QWeight(down_t, Q.Q8_0, d), down_transposed=True), FFN_VARIANTS["relu"])
    y, _ = kernels.sparse_ffn(x, up, Q.Q8_0, gate, Q.Q8_0, down_t, Q.Q8_0, torch.arange(n_ff, dtype=torch.int32))
    torch.testing.assert_close(y, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad,match", [
    (torch.tensor([0, 67], dtype=torch.int32), "outside the 67 rows"),
    (torch.tensor([-1], dtype=torch.int32), "outside the 67 rows"),
    (torch.tensor([1, 2]), "int32"),
])
def test_bad_index_sets(bad, match):
    w = random_rows(Q.Q8_0, N_ROWS, 64)
    with pytest.raises(ValueError, match=match):
        kernels.sparse_rowdot(w, Q.Q8_0, torch.randn(1, 64), bad)
    with pytest.raises(ValueError, match=match):
        kernels.sparse_axpy(w, Q.Q8_0, torch.randn(1, bad.numel()), bad)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.F16])
@pytest.mark.parametrize("which", ["none", "unsorted", "all", "empty"])
def test_sparse_rowdot_with_mask(qtype, which):
    """The mask form (what the GPU gets from its predictor): masked-out rows give exactly 0, the
    others the same values as the index form; the dispatcher op agrees with the direct call."""
    w = random_rows(qtype, N_ROWS, _cols(qtype), seed=9)
    K = dequantize(w[:1], qtype).shape[1]
    x = torch.randn(2, K)
    idx = index_sets(N_ROWS)[which]
    mask = torch.rand(N_ROWS, generator=torch.Generator().manual_seed(1)) < 0.3
    y = kernels.sparse_rowdot(w, qtype, x, idx, mask)
    rows = torch.arange(N_ROWS) if idx is None else idx.long()
    full = kernels.sparse_rowdot(w, qtype, x, idx)
    torch.testing.assert_close(y, full * mask[rows].float())
    ref = kernels.sparse_rowdot_reference(w, qtype, x, idx, mask)  # float x: the kernel's 8-bit x errs ~1e-4
    torch.testing.assert_close(y, ref, rtol=1e-3, atol=2e-4 * max(ref.abs().amax().item() if ref.numel() else 0.0, 1.0))
    torch.testing.assert_close(kernels.ops().sparse_rowdot(w, int(qtype), x, idx, mask), y)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_0, Q.Q8_0])
def test_one_plane_activations(qtype, monkeypatch):
    """HS_ACT_PLANES=1: the row-dot and the fused FFN over listed rows (four rows side by side, the
    rest one at a time), the row-dot over most rows and the dense GEMV (one row at a time) compute
    with llama.cpp's one-plane 8-bit activations, as the twin does with the same rounding; unset, the
    two-plane results come back."""
    K, n = 256, N_ROWS
    w, down_t = random_rows(qtype, n, K, seed=3), random_rows(qtype, n, K, seed=4)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(2))
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(5))[:23].int()  # < half: side by side
    wd = dequantize(w, qtype).double()
    two = kernels.sparse_rowdot(w, qtype, x, idx)
    monkeypatch.setenv("HS_ACT_PLANES", "1")
    one = kernels.sparse_rowdot(w, qtype, x, idx)
    for planes, got in ((1, one), (2, two)):
        ref = (quantize_activations(x, 32, planes) @ wd[idx.long()].T).float()
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert (one - two).abs().max() > 1e-3 * two.abs().max()  # the setting took effect
    y, h = kernels.sparse_ffn(x, w, qtype, None, qtype, down_t, qtype, idx, None, "relu", False)
    h_ref = torch.relu(quantize_activations(x, 32, 1) @ wd[idx.long()].T)
    torch.testing.assert_close(h, h_ref.float(), rtol=1e-4, atol=1e-4 * h_ref.abs().max().item())
    # one row at a time: more than half the rows listed, and the dense GEMV
    many = torch.randperm(n, generator=torch.Generator().manual_seed(6))[:50].int()
    for got, rows in ((kernels.sparse_rowdot(w, qtype, x, many), many.long()),
                      (kernels.matmul(x, w, qtype), torch.arange(n))):
        ref = (quantize_activations(x, 32, 1) @ wd[rows].T).float()
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    monkeypatch.delenv("HS_ACT_PLANES")
    torch.testing.assert_close(kernels.sparse_rowdot(w, qtype, x, idx), two, rtol=0, atol=0)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_0, Q.Q8_0])
@pytest.mark.parametrize("planes", ["2", "1"])
@pytest.mark.parametrize("tokens,n_threads", [(2, 1), (9, 2), (17, 1)])
def test_prompt_rows_in_groups(qtype, planes, tokens, n_threads, threads, monkeypatch):
    """A prompt on Q4_0 / Q5_0 / Q8_0 rows takes them 16 and 8 at a time (dot16_q45_0_tokens, dot8_q45_0_tokens_*), the
    last few one at a time: every row and a listed unsorted set, token counts below, at and past the
    tile of 8, both activation planes or one, give the twin's sums and those of one row at a time
    (HS_PROMPT_ROWS16=0)."""
    torch.set_num_threads(n_threads)
    monkeypatch.setenv("HS_ACT_PLANES", planes)
    n, K = 61, 32 * 5  # one thread: 16 + 16 + 16 + 8 + 5 rows
    w = random_rows(qtype, n, K, seed=21)
    x = torch.randn(tokens, K, generator=torch.Generator().manual_seed(22))
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(23))[:45].int()
    xq, wd = quantize_activations(x, 32, int(planes)), dequantize(w, qtype).double()
    got = {}
    for rows16 in ("1", "0"):
        monkeypatch.setenv("HS_PROMPT_ROWS16", rows16)
        got[rows16] = [kernels.matmul(x, w, qtype), kernels.sparse_rowdot(w, qtype, x, idx)]
    for rows, g, g1 in zip((torch.arange(n), idx.long()), got["1"], got["0"]):
        ref = xq @ wd[rows].T
        scale = (xq.abs() @ wd[rows].abs().T).max()
        assert ((g.double() - ref).abs().max() / scale).item() < 1e-6
        assert ((g - g1).abs().max() / scale).item() < 1e-6


def _has_vbmi() -> bool:
    try:
        return " avx512vbmi " in " " + open("/proc/cpuinfo").read().replace("\n", " ") + " "
    except OSError:
        return False


@pytest.mark.parametrize("planes", ["2", "1"])
@pytest.mark.parametrize("K", [32 * 8, 32 * 13])  # whole groups of four blocks; three and a 1-block tail
@pytest.mark.parametrize("rows", ["1", "2", "4", "8"])
def test_wide_q4_0_dots(planes, K, rows, monkeypatch):
    """One token of Q4_0 rows four blocks at a time (AVX-512 VBMI; HS_Q4_WIDE=0 the older 256-bit form; rows
    one at a time with and without prefetching ahead, HS_Q4_PREFETCH):
    the sparse row-dot side by side and one row at a time, the dense GEMV, two weights in one call
    and the fused FFN give the twin's sums (the same int32 sums; floats summed in another order) with
    either form, both planes or one, and a row length that is not a whole number of groups."""
    monkeypatch.setenv("HS_ACT_PLANES", planes)
    monkeypatch.setenv("HS_FFN_ROWS", rows)
    n = 203
    w, w2, down_t = (random_rows(Q.Q4_0, n, K, seed=s) for s in (8, 9, 10))
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(12))
    xq = quantize_activations(x, 32, int(planes))
    wd, w2d = dequantize(w, Q.Q4_0).double(), dequantize(w2, Q.Q4_0).double()
    few = torch.randperm(n, generator=torch.Generator().manual_seed(13))[:61].int()  # < half: side by side
    many = torch.randperm(n, generator=torch.Generator().manual_seed(14))[:150].int()  # one at a time
    results = {}
    for wide in ("1", "0"):
        monkeypatch.setenv("HS_Q4_WIDE", wide)
        got = [kernels.sparse_rowdot(w, Q.Q4_0, x, few), kernels.sparse_rowdot(w, Q.Q4_0, x, many),
               kernels.matmul(x, w, Q.Q4_0), *kernels.cpu.qmatmul_rows([w, w2], [int(Q.Q4_0)] * 2, x, [few, None])]
        refs = [xq @ wd[few.long()].T, xq @ wd[many.long()].T, xq @ wd.T, xq @ wd[few.long()].T, xq @ w2d.T]
        for i, (g, r) in enumerate(zip(got, refs)):
            scale = (xq.abs() @ wd.abs().T).max()
            assert ((g.double() - r).abs().max() / scale).item() < 1e-6, f"HS_Q4_WIDE={wide} case {i}"
        for act, idx in (("relu", few), ("silu", few), ("relu", many)):
            y, h = kernels.sparse_ffn(x, w, Q.Q4_0, w2, Q.Q4_0, down_t, Q.Q4_0, idx, None, act, False)
            g_ref, u_ref = xq @ w2d[idx.long()].T, xq @ wd[idx.long()].T
            h_ref = (torch.relu(g_ref) if act == "relu" else torch.nn.functional.silu(g_ref)) * u_ref
            torch.testing.assert_close(h.double(), h_ref, rtol=1e-4, atol=1e-4 * h_ref.abs().max().item())
        results[wide] = got
    if _has_vbmi() and kernels.cpu.cpu_path() == "avx512":  # the switch took effect (not on HS_CPU_PATH=avx2):
        # the float sums round in another order somewhere
        assert any(not torch.equal(a, b) for a, b in zip(results["1"], results["0"]))
    # rows one at a time (the dense GEMV in one stream a thread, a long listed set) prefetching ahead or not:
    # the same sums, bit for bit
    monkeypatch.setenv("HS_Q4_WIDE", "1")
    monkeypatch.setenv("HS_GEMV_STREAMS", "1")
    for pf in ("1", "0"):
        monkeypatch.setenv("HS_Q4_PREFETCH", pf)
        assert torch.equal(kernels.sparse_rowdot(w, Q.Q4_0, x, many), results["1"][1]), f"HS_Q4_PREFETCH={pf}"
        assert torch.equal(kernels.matmul(x, w, Q.Q4_0), results["1"][2]), f"HS_Q4_PREFETCH={pf}"


@pytest.mark.parametrize("qtype,planes", [(Q.F16, "2"), (Q.Q4_0, "2"), (Q.Q4_0, "1"), (Q.Q8_0, "2"), (Q.Q8_0, "1")])
@pytest.mark.parametrize("rows,chunk", [("8", "16"), ("4", "16"), ("8", "0")])
def test_next_rows_ask_changes_nothing(qtype, planes, rows, chunk, monkeypatch):
    """Listed rows side by side asking for the rows of the next group, or of the group 2 or 4 on, while they
    compute (HS_NEXT_ROWS=1/2/4; float16, Q8_0 and the four-blocks Q4_0 dots) or not: the same row-dot sums
    and FFN activations bit for bit (the ask only moves data), the FFN's y within float rounding (threads
    claim neurons as they go, so their partial sums add in any order); several groups, the last ones
    without one to ask for; the FFN's neurons claimed in chunks or as one share a thread."""
    monkeypatch.setenv("HS_ACT_PLANES", planes)
    monkeypatch.setenv("HS_FFN_ROWS", rows)
    monkeypatch.setenv("HS_FFN_CHUNK", chunk)
    n, K = 203, 416
    w, w2, down_t = (random_rows(qtype, n, K, seed=s) for s in (8, 9, 10))
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(12))
    few = torch.randperm(n, generator=torch.Generator().manual_seed(13))[:61].int()  # < half: side by side
    bias = torch.randn(n, generator=torch.Generator().manual_seed(14))

    def run():
        return [kernels.sparse_rowdot(w, qtype, x, few),
                *kernels.sparse_ffn(x, w, qtype, w2, qtype, down_t, qtype, few, None, "relu", False),
                *kernels.sparse_ffn(x, w, qtype, None, qtype, down_t, qtype, few, bias, "relu", False)]
    monkeypatch.setenv("HS_NEXT_ROWS", "0")
    off = run()
    for ahead in ("1", "2", "4"):
        monkeypatch.setenv("HS_NEXT_ROWS", ahead)
        on = run()
        for i, (a, b) in enumerate(zip(off, on)):
            if i in (1, 3):  # y
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * a.abs().max().item())
            else:
                assert torch.equal(a, b), f"HS_NEXT_ROWS={ahead} case {i}"
    xq = x.double() if qtype == Q.F16 else quantize_activations(x, 32, int(planes))  # what the kernel dots with
    wd = dequantize(w, qtype).double()[few.long()]
    assert ((on[0].double() - xq @ wd.T).abs().max() / (xq.abs() @ wd.abs().T).max()).item() < 1e-6


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
@pytest.mark.parametrize("threads", [1, 2])
def test_axpy_whole_scale_chunks(qtype, threads):
    """One token's down rows (the sparse axpy, the fused FFN's grouped axpy) over rows of 37 blocks: two whole
    chunks of 16 blocks, whose Q4_0 scales come by word permutes from four 64-byte loads, and a rest of 5
    that gathers them one by one; the last row of the tensor listed (nothing read past it): the twin's sums."""
    torch.set_num_threads(threads)
    n, K = 67, 32 * 37
    up, down_t = random_rows(qtype, n, K, seed=31), random_rows(qtype, n, K, seed=32)
    idx = torch.tensor([n - 1, 3, 40, 7, 12, 0, 55, 21, 30, 9, 64], dtype=torch.int32)
    h = torch.randn(1, idx.numel(), generator=torch.Generator().manual_seed(33))
    ref = kernels.sparse_axpy_reference(down_t, qtype, h, idx)
    got = kernels.sparse_axpy(down_t, qtype, h, idx)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(34))
    y, hh = kernels.sparse_ffn(x, up, qtype, None, qtype, down_t, qtype, idx, None, "gelu", False)
    y_ref = kernels.sparse_axpy_reference(down_t, qtype, hh, idx)  # the down rows with the op's own h
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4 * y_ref.abs().max().item())


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q5_0])
@pytest.mark.parametrize("threads", [1, 2])
def test_dense_gemv_streams(qtype, threads, monkeypatch):
    """A dense one-token GEMV with each thread's rows as 2, 4 or 8 interleaved streams (HS_GEMV_STREAMS) gives
    the sums of one stream bit for bit, and the twin's: row counts below, at and above a whole number of
    streams per thread, two weights in one call, a row length with a Q4_0 tail of one block."""
    torch.set_num_threads(threads)
    K = 32 * 13
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(3))
    for n in (5, 16, 37, 203):
        w, w2 = (random_rows(qtype, n, K, seed=s) for s in (4, 5))
        got = {}
        for streams in ("1", "2", "4", "8", "3"):  # 3: not a choice, one stream
            monkeypatch.setenv("HS_GEMV_STREAMS", streams)
            got[streams] = [kernels.matmul(x, w, qtype), *kernels.cpu.qmatmul_multi([w, w2], [int(qtype)] * 2, x)]
        for streams, g in got.items():
            assert all(torch.equal(a, b) for a, b in zip(g, got["1"])), f"HS_GEMV_STREAMS={streams}, {n} rows"
        ref = kernels.matmul_reference(x, w, qtype)
        torch.testing.assert_close(got["8"][0], ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_bad_mask():
    w = random_rows(Q.Q8_0, N_ROWS, 64)
    with pytest.raises(ValueError, match="bool vector of 67"):
        kernels.sparse_rowdot(w, Q.Q8_0, torch.randn(1, 64), None, torch.ones(66, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool vector of 67"):
        kernels.sparse_rowdot(w, Q.Q8_0, torch.randn(1, 64), None, torch.ones(67))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.F16])
@pytest.mark.parametrize("density", [0.0, 0.4, 1.0])
def test_cold_ffn_task(qtype, density):
    """The hybrid decode's host-node task (csrc/cold_ffn.cpp) on this thread: the active cold ids
    compacted from the pinned mask, the fused FFN over them, y written in place (zeros: none active)."""
    d, n_ff = 64, N_ROWS
    up, gate, down_t = (random_rows(qtype, n_ff, d, seed=s) for s in (1, 2, 3))
    g = torch.Generator().manual_seed(5)
    ids = torch.randperm(n_ff, generator=g)[:43].int()  # not a multiple of 8: the compaction's tail
    x, y = torch.randn(1, d), torch.full((1, d), float("nan"))
    mask = torch.rand(1, ids.numel(), generator=g) < density
    task = kernels.cold_ffn_task(x, mask, ids, y, up, qtype, gate, qtype, down_t, qtype, None, "silu", False)
    try:
        kernels.cpu.cold_ffn_run(task)
        active = ids[mask[0]]
        ref, _ = kernels.sparse_ffn(x, up, qtype, gate, qtype, down_t, qtype, active, None, "silu", False)
        # threads claim neurons in a varying order (HS_FFN_CHUNK): equal up to float rounding
        torch.testing.assert_close(y, ref if active.numel() else torch.zeros_like(y), rtol=1e-4, atol=1e-4)
        x.normal_()  # the task reads its buffers each time it runs
        kernels.cpu.cold_ffn_run(task)
        ref, _ = kernels.sparse_ffn(x, up, qtype, gate, qtype, down_t, qtype, active, None, "silu", False)
        torch.testing.assert_close(y, ref if active.numel() else torch.zeros_like(y), rtol=1e-4, atol=1e-4)
        assert kernels.cpu.cold_ffn_error() == ""
    finally:
        kernels.cpu.cold_ffn_free(task)


@pytest.mark.parametrize("n_threads", [1, 2, 4])
def test_cold_ffn_task_pool(n_threads, monkeypatch):
    """The task's threads come from the spinning pool (csrc/pool.cpp) with the thread count in force
    when it was made, also when it runs on another thread (the CUDA driver's, on the GPU machine):
    many runs in a row, some after the pool's threads went to sleep, agree with the fused FFN on this
    thread and with the OpenMP path (HS_COLD_POOL=0); the task counter sees every run."""
    import threading
    import time
    d, n_ff = 256, 512
    qtype = Q.Q8_0
    up, gate, down_t = (random_rows(qtype, n_ff, d, seed=s) for s in (1, 2, 3))
    g = torch.Generator().manual_seed(7)
    ids = torch.randperm(n_ff, generator=g)[:400].int()
    x, y = torch.randn(1, d), torch.zeros(1, d)
    mask = torch.rand(1, ids.numel(), generator=g) < 0.5
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        task = kernels.cold_ffn_task(x, mask, ids, y, up, qtype, gate, qtype, down_t, qtype, None, "silu", False)
    finally:
        torch.set_num_threads(before)
    results, (runs0, _, rows0) = [], kernels.cpu.cold_ffn_stats()

    def runner():
        for i in range(40):
            x.normal_(generator=torch.Generator().manual_seed(i))
            kernels.cpu.cold_ffn_run(task)
            results.append((x.clone(), y.clone()))
            if i == 20:
                time.sleep(0.01)  # past HS_POOL_SPIN_US: the pool's threads sleep and must be woken

    try:
        t = threading.Thread(target=runner)
        t.start()
        t.join()
        monkeypatch.setenv("HS_COLD_POOL", "0")
        kernels.cpu.cold_ffn_run(task)
        y_omp = y.clone()
        assert kernels.cpu.cold_ffn_error() == ""
        runs, _, rows = kernels.cpu.cold_ffn_stats()
        assert (runs - runs0, rows - rows0) == (41, 41 * int(mask.sum()))
    finally:
        kernels.cpu.cold_ffn_free(task)
    active = ids[mask[0]]
    torch.set_num_threads(n_threads)
    try:
        for xi, yi in results:
            ref, _ = kernels.sparse_ffn(xi, up, qtype, gate, qtype, down_t, qtype, active, None, "silu", False)
            # threads claim neurons in a varying order (HS_FFN_CHUNK): equal up to float rounding
            torch.testing.assert_close(yi, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        torch.testing.assert_close(y_omp, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    finally:
        torch.set_num_threads(before)


def test_cold_ffn_serve_polled_handover():
    """The polled hand-over's CPU side (cold_ffn_serve; csrc/cuda_handover.cu is the GPU's): a thread
    standing in for the GPU writes x and the mask, bumps a layer's flag word and waits for its done
    word; serve runs two layers' tasks in order, one step per call, each answer the fused FFN of that
    step's x, on the spinning pool or on the serving thread's OpenMP team. A flag that never comes, and a
    GPU side that gave up, end the serve with a one-line error instead of a hang."""
    import threading
    import time
    d, n_ff, qtype = 64, N_ROWS, Q.F16
    g = torch.Generator().manual_seed(11)
    layers = []
    for seed in (1, 2):
        up, gate, down_t = (random_rows(qtype, n_ff, d, seed=seed * 10 + s) for s in (1, 2, 3))
        ids = torch.randperm(n_ff, generator=g)[:40].int()
        x, y, mask = torch.zeros(1, d), torch.zeros(1, d), torch.zeros(1, ids.numel(), dtype=torch.bool)
        task = kernels.cold_ffn_task(x, mask, ids, y, up, qtype, gate, qtype, down_t, qtype, None, "silu", False)
        sync = torch.zeros(4, dtype=torch.int64)
        kernels.cpu.cold_ffn_attach_sync(task, sync)
        layers.append(dict(task=task, sync=sync, x=x, y=y, mask=mask, w=(up, gate, down_t), ids=ids))
    seen, errors = [], []

    def gpu(steps):
        try:
            for step in range(1, steps + 1):
                for L in layers:
                    xs = torch.randn(1, d, generator=g)
                    ms = torch.rand(1, L["ids"].numel(), generator=g) < 0.5
                    L["x"].copy_(xs)
                    L["mask"].copy_(ms)
                    L["sync"][0] = step
                    t0 = time.monotonic()
                    while int(L["sync"][1]) != step:
                        assert time.monotonic() - t0 < 10, "no answer"
                        time.sleep(1e-4)
                    seen.append((L, xs, ms, L["y"].clone()))
        except AssertionError as e:
            errors.append(e)

    try:
        t = threading.Thread(target=gpu, args=(4,))
        t.start()
        for step in range(4):  # on the spinning pool, then on this thread's OpenMP team (use_pool=False)
            assert kernels.cpu.cold_ffn_serve([L["task"] for L in layers], 10.0, step % 2 == 0) == 2
        t.join()
        assert not errors and len(seen) == 8 and kernels.cpu.cold_ffn_error() == ""
        for L, xs, ms, ys in seen:
            up, gate, down_t = L["w"]
            active = L["ids"][ms[0]]
            ref, _ = kernels.sparse_ffn(xs, up, qtype, gate, qtype, down_t, qtype, active, None, "silu", False)
            torch.testing.assert_close(ys, ref, rtol=1e-4, atol=1e-4)
        # no flag: the first layer times out, nothing runs, the error says what happened
        t0 = time.monotonic()
        assert kernels.cpu.cold_ffn_serve([L["task"] for L in layers], 0.05) == 0
        assert time.monotonic() - t0 < 5
        assert "did not hand over a hybrid layer in time" in kernels.cpu.cold_ffn_error()
        # with CUDA that time-out also raised the word telling every GPU wait to give up, which a model
        # loaded anew (cold_ffn_attach_sync) lowers again: do that, as a reload would
        for L in layers:
            L["sync"].zero_()
            kernels.cpu.cold_ffn_attach_sync(L["task"], L["sync"])
        layers[1]["sync"][2] = 4  # the GPU's time-out mark on the second layer
        layers[0]["sync"][0] = 4
        assert kernels.cpu.cold_ffn_serve([L["task"] for L in layers], 1.0) == 1
        with pytest.raises(RuntimeError, match="GPU stopped waiting"):
            kernels.raise_host_errors()
        L = layers[0]
        up, gate, down_t = L["w"]
        bare = kernels.cold_ffn_task(L["x"], L["mask"], L["ids"], L["y"], up, qtype, gate, qtype, down_t, qtype,
                                     None, "silu", False)
        try:
            assert kernels.cpu.cold_ffn_serve([bare], 1.0) == 0
            assert "without hand-over words" in kernels.cpu.cold_ffn_error()
            with pytest.raises(RuntimeError, match="int64 \\[4\\]"):
                kernels.cpu.cold_ffn_attach_sync(bare, torch.zeros(3, dtype=torch.int64))
        finally:
            kernels.cpu.cold_ffn_free(bare)
    finally:
        for L in layers:
            kernels.cpu.cold_ffn_free(L["task"])


def test_spin_pool():
    """csrc/pool.cpp directly: every task runs exactly once (each adds its own bit) for pool sizes that
    grow and shrink, from this thread and another; an exception in a task (the caller's or a pool
    thread's) reaches the caller once all tasks are done, and the pool works afterwards."""
    import threading
    pool = kernels.ops() and kernels.cpu
    for n in (1, 3, 8, 2, 8):
        assert pool.pool_selftest(n, -1) == 2**n - 1
    for bad in (0, 5):
        with pytest.raises(RuntimeError, match=f"task {bad} failed"):
            pool.pool_selftest(6, bad)
        assert pool.pool_selftest(6, -1) == 63
    out = []
    t = threading.Thread(target=lambda: out.extend(pool.pool_selftest(7, -1) for _ in range(200)))
    t.start()
    t.join()
    assert out == [127] * 200


def test_spin_pool_rest():
    """pool_rest(): the pool's idle threads stop spinning at once (a CPU-attention layer's OpenMP team
    needs the cores) and still run the next task. Seen in the process's CPU time while this thread
    sleeps: with a 1 s spin, three idle threads burn CPU; after pool_rest they do not."""
    import time
    pool = kernels.ops() and kernels.cpu

    def idle_cpu_seconds(rest: bool) -> float:
        assert pool.pool_selftest(4, -1) == 15
        if rest:
            pool.pool_rest()
        time.sleep(0.05)
        c0 = time.process_time()
        time.sleep(0.3)
        return time.process_time() - c0

    pool.pool_configure(1_000_000, 1_000_000)
    try:
        spinning = idle_cpu_seconds(rest=False)
        resting = idle_cpu_seconds(rest=True)
        assert pool.pool_selftest(4, -1) == 15  # woken for the next task
    finally:
        pool.pool_configure(2000, 50)
    assert spinning > 0.25, spinning
    assert resting < 0.1, resting


def test_cold_ffn_task_errors():
    """Bad buffers, ids and weights are refused in one line when the task is made (in Python: a C++
    exception takes the GPU machine's process down, and the task runs where none can be raised)."""
    d, n_ff = 64, N_ROWS
    up = random_rows(Q.Q8_0, n_ff, d, seed=1)
    ids, mask, x, y = torch.arange(4, dtype=torch.int32), torch.ones(1, 4, dtype=torch.bool), torch.randn(1, d), \
        torch.zeros(1, d)
    ok = (x, mask, ids, y, up, Q.Q8_0, None, Q.Q8_0, up, Q.Q8_0, None, "relu", False)

    def bad(i, value, match):
        args = list(ok)
        args[i] = value
        with pytest.raises(ValueError, match=match):
            kernels.cold_ffn_task(*args)

    bad(2, torch.tensor([0, 67, 1, 2], dtype=torch.int32), "outside the 67 rows")
    bad(1, mask[:, :3], "one entry per id")
    bad(3, torch.zeros(1, d + 1), "shaped like x")
    bad(0, torch.randn(2, d), r"\[1, d_model\]")
    bad(5, Q.Q2_K, "not ones the compiled CPU FFN reads")
    bad(4, torch.randn(n_ff, d), "row")  # float32 data declared Q8_0
    bad(8, up[:10], "ffn_down_t")
    task = kernels.cold_ffn_task(*ok)
    try:
        kernels.cpu.cold_ffn_run(task)
        assert kernels.cpu.cold_ffn_error() == ""
        ref, _ = kernels.sparse_ffn(x, up, Q.Q8_0, None, Q.Q8_0, up, Q.Q8_0, ids, None, "relu", False)
        torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    finally:
        kernels.cpu.cold_ffn_free(task)


def test_a_killed_builds_lock_is_cleared_and_a_live_one_kept(tmp_path, capsys):
    """torch's build lock left by a killed kernel build would make every later build wait forever."""
    import os
    import time

    from hybridsparse.runtime.kernels import STALE_LOCK_S, _clear_stale_lock
    assert not _clear_stale_lock(tmp_path)  # no lock: nothing to do
    (tmp_path / "ops.o").write_bytes(b"x")
    lock = tmp_path / "lock"
    lock.touch()
    assert not _clear_stale_lock(tmp_path) and lock.exists()  # a build writing now: kept, said so
    assert "waiting for another process" in capsys.readouterr().err
    old = time.time() - STALE_LOCK_S - 60
    for p in tmp_path.iterdir():
        os.utime(p, (old, old))
    assert _clear_stale_lock(tmp_path) and not lock.exists()
    assert "did not finish" in capsys.readouterr().err


def test_select_ids_picks_the_active_cold_neurons():
    """select_ids (a CPU layer's active cold neurons from its whole mask, or from the predictor's scores
    and threshold) keeps ids' order, and refuses an id outside the mask or a mask of the wrong type."""
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(1000, generator=g) < 0.3
    ids = torch.randperm(1000, generator=g)[:700].int()
    assert torch.equal(kernels.cpu.select_ids(mask, ids), ids[mask[ids.long()]])
    assert kernels.cpu.select_ids(torch.zeros(1000, dtype=torch.bool), ids).numel() == 0
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.cpu.select_ids(mask, torch.tensor([5, 1000], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="bool"):
        kernels.cpu.select_ids(mask.float(), ids)
    # with a threshold: the predictor's scores compared in the same pass (a NaN score is not active)
    scores = torch.randn(1000, generator=g)
    scores[ids[0]], scores[ids[1]] = float("nan"), 0.25
    picked = kernels.cpu.select_ids(scores, ids, 0.25)
    assert torch.equal(picked, ids[(scores >= 0.25)[ids.long()]]) and ids[1] in picked and ids[0] not in picked
    with pytest.raises(RuntimeError, match="float32"):
        kernels.cpu.select_ids(mask, ids, 0.25)


def test_compiled_errors_carry_numbers_and_types():
    """A failed check in the compiled code raises with its numbers and type names in the message (on the
    GPU machine, TORCH_CHECK's own formatting of a number crashed the process: csrc/check.h)."""
    with pytest.raises(RuntimeError, match="expected 1..1024 threads, got 0"):
        kernels.cpu.cold_ffn_set_threads(0)
    with pytest.raises(RuntimeError, match="block-format weights must be uint8, got Float"):
        kernels.cpu.qmatmul(torch.zeros(4, 18), int(Q.Q4_0), torch.zeros(1, 32))
    with pytest.raises(RuntimeError, match="row length 33 is not a multiple of the block size 32"):
        kernels.cpu.qmatmul(torch.zeros(4, 18, dtype=torch.uint8), int(Q.Q4_0), torch.zeros(1, 33))


def test_block_halves_refuse_bad_arguments():
    """The compiled halves of a decode step (attention_block, ffn_block, sparse_ffn_block) name what is
    wrong: several tokens, a weight of another width, a predictor whose scores do not match the FFN."""
    d, n_ff = 64, 96
    f16 = int(Q.F16)
    gate, up, down = (random_rows(Q.F16, n, k, seed=s) for n, k, s in ((n_ff, d, 1), (n_ff, d, 2), (d, n_ff, 3)))
    norm = torch.ones(d)
    with pytest.raises(RuntimeError, match="ffn_block: x must be one token"):
        kernels.cpu.ffn_block(torch.randn(2, d), norm, 1e-6, [gate, up], [f16, f16], down, f16, False, 0, False)
    with pytest.raises(RuntimeError, match="rms_norm: weight has 32 elements, x rows have 64"):
        kernels.cpu.ffn_block(torch.randn(1, d), torch.ones(32), 1e-6, [gate, up], [f16, f16], down, f16, False, 0, False)
    wide_down = random_rows(Q.F16, d + 32, n_ff, seed=4)
    with pytest.raises(RuntimeError, match="ffn_block: the down projection gives 96 values for a d_model of 64"):
        kernels.cpu.ffn_block(torch.randn(1, d), norm, 1e-6, [gate, up], [f16, f16], wide_down, f16, False, 0, False)
    fc1, fc2 = random_rows(Q.F16, 8, d, seed=5), random_rows(Q.F16, n_ff - 1, 8, seed=6)
    ids = torch.arange(n_ff, dtype=torch.int32)
    down_t = random_rows(Q.F16, n_ff, d, seed=7)
    with pytest.raises(RuntimeError, match="sparse_ffn_block: the predictor gives 95 scores for 96 neurons"):
        kernels.cpu.sparse_ffn_block(torch.randn(1, d), norm, 1e-6, fc1, f16, fc2, f16, 0.0, ids, up, f16, gate, f16,
                                     down_t, f16, None, 1, False, None)
    q, k, v, o = (random_rows(Q.F16, d, d, seed=s) for s in (8, 9, 10, 11))
    cache = torch.zeros(2, 8, 32)
    with pytest.raises(RuntimeError, match="attention_block: q_norm and k_norm go together"):
        kernels.cpu.attention_block(torch.randn(1, d), norm, 1e-6, [q, k, v], [f16] * 3, o, f16, 2, 2,
                                    torch.ones(1, 16), torch.zeros(1, 16), True, cache, cache.clone(),
                                    torch.tensor([0]), 1, 0.2, q_norm=torch.ones(32))


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0])
def test_matmul_add_on_the_cpu_is_matmul_then_add(qtype):
    """kernels.matmul_add (the residual added by the GEMV on CUDA) is matmul, then the add, on the CPU,
    and agrees with its twin."""
    w = random_rows(qtype, 37, 64, seed=5)
    x, res = torch.randn(2, 64), torch.randn(2, 37)
    got = kernels.matmul_add(x, w, qtype, res)
    torch.testing.assert_close(got, res + kernels.matmul(x, w, qtype), rtol=0, atol=0)
    tol = 1e-4 if qtype == Q.F16 else 5e-3
    torch.testing.assert_close(got, kernels.matmul_add_reference(x, w, qtype, res), rtol=tol, atol=tol)


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0])
@pytest.mark.parametrize("norm", ["rms", "layer_bias", "none"])
@pytest.mark.parametrize("act,act_on_up", [(None, False), ("silu", False), ("relu", True)])
def test_matmul_fused_on_the_cpu_is_its_steps(qtype, norm, act, act_on_up):
    """kernels.matmul_fused (norm, GEMV and gated activation in one kernel on CUDA) runs its steps apart
    on the CPU with the compiled ops, and agrees with its twin; its output has one column per neuron
    when the rows are gate rows then up rows."""
    w = random_rows(qtype, 2 * 19, 96, seed=7)
    x = torch.randn(3, 96) * 2 + 0.5
    nw, nb = torch.randn(96), torch.randn(96)
    n = None if norm == "none" else kernels.Norm(nw, 1e-5, nb if norm == "layer_bias" else None, norm != "rms")
    assert not kernels.fused_ok(x, w, qtype, n)
    got = kernels.matmul_fused(x, w, qtype, n, act, act_on_up)
    assert got.shape == (3, 19 if act else 38)
    h = x if n is None else n(x)
    y = kernels.matmul(h, w, qtype)
    if act is not None:
        f = {"silu": torch.nn.functional.silu, "relu": torch.relu}[act]
        g, u = y[:, :19], y[:, 19:]
        y = f(g) * (f(u) if act_on_up else u)
    torch.testing.assert_close(got, y, rtol=0, atol=0)
    twin = kernels.matmul_fused_reference(x, w, qtype, n, act, act_on_up)
    tol = 1e-4 if qtype == Q.F16 else 2e-2  # the CPU reads x in 8-bit planes for block formats
    torch.testing.assert_close(got, twin, rtol=tol, atol=tol * max(1.0, twin.abs().max().item()))


@pytest.mark.parametrize("width", [1, 63, 64, 2880, 4609])
@pytest.mark.parametrize("side,ahead", [(1, 0), (3, 1), (8, 0), (8, 1), (8, 2), (16, 5)])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_read_rows_sums_the_listed_rows(width, side, ahead, n_threads, threads):
    """hs-bench's ceiling probe (csrc/cpu_probe.cpp) reads every listed row once, whole, whatever the row
    width (tails past the last 64-byte line too), grouping, asking ahead and thread count: the sum of the
    bytes it returns is numpy's over the same rows"""
    g = torch.Generator().manual_seed(width)
    w = torch.randint(0, 256, (97, width), dtype=torch.uint8, generator=g)
    sets = index_sets(97)
    torch.set_num_threads(n_threads)
    for which in ("empty", "single", "all", "unsorted"):
        idx = sets[which].contiguous()
        assert kernels.cpu.read_rows(w, idx, side, ahead) == int(w[idx.long()].to(torch.int64).sum()), which
    if width % 2 == 0:  # any element type: its bytes
        idx = sets["unsorted"].contiguous()
        assert kernels.cpu.read_rows(w.view(torch.float16), idx, side, ahead) == int(w[idx.long()].to(torch.int64).sum())


@pytest.mark.parametrize("bad,match", [
    (lambda w: (w, torch.tensor([97], dtype=torch.int32), 8, 1), "index 97 out of range for 97 rows"),
    (lambda w: (w, torch.tensor([-1], dtype=torch.int32), 8, 1), "index -1 out of range"),
    (lambda w: (w, torch.tensor([1], dtype=torch.int64), 8, 1), "idx must be a contiguous int32"),
    (lambda w: (w, torch.tensor([1], dtype=torch.int32), 17, 1), "side must be 1..16, got 17"),
    (lambda w: (w, torch.tensor([1], dtype=torch.int32), 0, 1), "side must be 1..16, got 0"),
    (lambda w: (w, torch.tensor([1], dtype=torch.int32), 8, -1), "ahead must be >= 0 groups, got -1"),
    (lambda w: (w.t(), torch.tensor([1], dtype=torch.int32), 8, 1), "w must be a contiguous 2-D"),
])
def test_read_rows_refuses_bad_arguments(bad, match):
    w = torch.zeros(97, 64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=match):
        kernels.cpu.read_rows(*bad(w))
