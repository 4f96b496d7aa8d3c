"""The CUDA sparse ops (csrc/cuda_sparse.cu) against their pure-torch twins and the CPU kernels:
F16/BF16/Q8_0/Q4_0, odd row counts, rows of 8-element units that are not multiples of 32 where the
type allows, empty / single / all / unsorted index sets, masks, 1..8 tokens, CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")

from hybridsparse.runtime import kernels  # noqa: E402
from hybridsparse.runtime.quants import dequantize  # noqa: E402
from quant_utils import quantize_activations, random_rows  # noqa: E402

TYPES = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0]
N_ROWS = 301


def _cols(qtype):
    return 8 * 33 if qtype in (Q.F16, Q.BF16) else 32 * 9


def _index_sets(n):
    g = torch.Generator().manual_seed(n)
    return {"empty": torch.zeros(0, dtype=torch.int32), "single": torch.tensor([n - 1], dtype=torch.int32),
            "all": torch.arange(n, dtype=torch.int32), "unsorted": torch.randperm(n, generator=g)[: max(1, n // 10)].int(),
            "none": None}


def _cuda(t):
    return None if t is None else t.cuda()


@pytest.fixture(autouse=True)
def _kernels_built():
    if not kernels._has_cuda_kernels():
        pytest.fail("the CUDA kernels did not build on a machine with CUDA")


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("which", ["empty", "single", "all", "unsorted", "none"])
@pytest.mark.parametrize("tokens", [1, 2, 5, 8])
def test_cuda_rowdot(qtype, which, tokens):
    w = random_rows(qtype, N_ROWS, _cols(qtype), seed=tokens)
    x = torch.randn(tokens, _cols(qtype))
    idx = _index_sets(N_ROWS)[which]
    y = kernels.ops().sparse_rowdot(w.cuda(), int(qtype), x.cuda(), _cuda(idx), None).cpu()
    ref = kernels.sparse_rowdot_reference(w, qtype, x, idx)
    assert y.shape == ref.shape
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * max(1.0, ref.abs().max().item() if ref.numel() else 1))
    if ref.numel() and qtype in kernels.CPU_QTYPES:  # CPU and CUDA agree (CPU: 8-bit activation planes)
        cpu = kernels.sparse_rowdot(w, qtype, x, idx)
        assert (y - cpu).abs().max().item() <= 2e-3 * max(1.0, cpu.abs().max().item())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
@pytest.mark.parametrize("rows,cols", [(301, 1280), (2200, 2048), (40, 8192), (7, 3328), (2200, 3328)])
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("which", ["all", "unsorted", "mask"])
@pytest.mark.parametrize("staged_q8", ["0", "1"])
@pytest.mark.parametrize("planes", ["2", "1"])
def test_cuda_rowdot_staged(qtype, rows, cols, tokens, which, staged_q8, planes, monkeypatch):
    """Q4_0 rows 16-byte aligned (K a multiple of 256) take the kernel that stages 32 blocks per warp in
    shared memory, two chunks of 32 at a time: a partial last chunk (1280 = 40 blocks), one slice per
    row (2200 rows), four (40 rows), an odd number of chunks (3328 = 104 blocks: 32+32+32+8) over one
    slice and over four (7 rows: a slice's second chunk past its end), masks; the same rows from a
    2-byte-misaligned start take rowdot_kernel and agree (Q8_0 rows, aligned or not, always take
    rowdot_kernel; with HS_CUDA_STAGED_Q8=1 aligned Q8_0 rows take the staged kernel against x in two
    8-bit planes). HS_ACT_PLANES=1: x in the first plane alone (llama.cpp's 8-bit activations), equal
    to the CPU kernels' with the same switch up to the order of the float sums."""
    if qtype == Q.Q4_0 and staged_q8 == "1":
        pytest.skip("HS_CUDA_STAGED_Q8 concerns Q8_0 rows")
    monkeypatch.setenv("HS_CUDA_STAGED_Q8", staged_q8)
    monkeypatch.setenv("HS_ACT_PLANES", planes)
    w = random_rows(qtype, rows, cols, seed=rows + tokens)
    x = torch.randn(tokens, cols)
    idx = None if which != "unsorted" else _index_sets(rows)["unsorted"]
    mask = torch.rand(rows, generator=torch.Generator().manual_seed(5)) < 0.3 if which == "mask" else None
    # Q4_0 (and staged Q8_0) read x in two 8-bit planes (~15 bits) or one, Q8_0 float32 x: one plane is
    # compared with the twin of those activations (an 8-bit x is off by up to a few % of a single output)
    quant_x = qtype == Q.Q4_0 or staged_q8 == "1"
    one = quant_x and planes == "1"
    ref = kernels.sparse_rowdot_reference(w, qtype, quantize_activations(x, 32, 1).float() if one else x, idx, mask)
    y = kernels.sparse_rowdot(w.cuda(), qtype, x.cuda(), _cuda(idx), _cuda(mask)).cpu()
    scale = max(1.0, ref.abs().max().item())
    x_tol = 2e-3 if quant_x and not one else 1e-4
    torch.testing.assert_close(y, ref, rtol=0, atol=x_tol * scale)
    if quant_x and qtype in kernels.CPU_QTYPES:  # the CPU's kernels quantize x the same way
        cpu = kernels.sparse_rowdot(w, qtype, x, idx, mask)
        torch.testing.assert_close(y, cpu, rtol=0, atol=1e-4 * scale)
    flat = torch.zeros(w.numel() + 2, dtype=torch.uint8, device="cuda")
    flat[2:].copy_(w.view(-1).cuda())
    w_odd = flat[2:].view(rows, -1)
    assert w_odd.data_ptr() % 16 == 2
    y_odd = kernels.sparse_rowdot(w_odd, qtype, x.cuda(), _cuda(idx), _cuda(mask)).cpu()
    if qtype == Q.Q8_0:  # misaligned Q8_0 rows read float x
        y = kernels.sparse_rowdot_reference(w, qtype, x, idx, mask)
    torch.testing.assert_close(y_odd, y, rtol=0, atol=1e-4 * scale)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("which", ["none", "unsorted", "all"])
def test_cuda_rowdot_mask(qtype, which):
    w = random_rows(qtype, N_ROWS, _cols(qtype), seed=3)
    x = torch.randn(3, _cols(qtype))
    idx = _index_sets(N_ROWS)[which]
    mask = torch.rand(N_ROWS, generator=torch.Generator().manual_seed(4)) < 0.1
    y = kernels.sparse_rowdot(w.cuda(), qtype, x.cuda(), _cuda(idx), mask.cuda()).cpu()
    ref = kernels.sparse_rowdot_reference(w, qtype, x, idx, mask)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * max(1.0, ref.abs().max().item()))
    rows = torch.arange(N_ROWS) if idx is None else idx.long()
    assert (y[:, ~mask[rows]] == 0).all()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("which", ["empty", "single", "all", "unsorted", "none"])
@pytest.mark.parametrize("tokens", [1, 3, 6])
def test_cuda_axpy(qtype, which, tokens):
    D = _cols(qtype) * 9  # several 256-column tiles and a partial one
    w = random_rows(qtype, N_ROWS, D, seed=tokens)
    idx = _index_sets(N_ROWS)[which]
    m = N_ROWS if idx is None else idx.numel()
    h = torch.randn(tokens, m)
    if m > 2:
        h[:, ::3] = 0  # inactive neurons (for every token): their rows are skipped
        h[0, 1::3] = 0  # inactive for one token only
    y = kernels.sparse_axpy(w.cuda(), qtype, h.cuda(), _cuda(idx)).cpu()
    ref = kernels.sparse_axpy_reference(w, qtype, h, idx)
    assert y.shape == ref.shape == (tokens, dequantize(w[:1], qtype).shape[1])
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * max(1.0, ref.abs().max().item()))
    if qtype in kernels.CPU_AXPY_QTYPES:
        torch.testing.assert_close(y, kernels.sparse_axpy(w, qtype, h, idx), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("activation,gated,act_on_up", [("relu", True, False), ("silu", True, False),
                                                        ("relu", True, True), ("relu", False, False)])
def test_cuda_sparse_ffn_equals_cpu(activation, gated, act_on_up):
    d, n_ff = 256, 512
    up, gate = random_rows(Q.Q8_0, n_ff, d, seed=1), random_rows(Q.Q8_0, n_ff, d, seed=2) if gated else None
    down_t = random_rows(Q.Q8_0, n_ff, d, seed=3)
    bias = None if gated else torch.randn(n_ff) * 0.1
    idx = torch.randperm(n_ff)[:50].int()
    x = torch.randn(2, d)
    y, h = kernels.sparse_ffn(x, up, Q.Q8_0, gate, Q.Q8_0, down_t, Q.Q8_0, idx, bias, activation, act_on_up)
    yc, hc = kernels.sparse_ffn(x.cuda(), up.cuda(), Q.Q8_0, _cuda(gate), Q.Q8_0, down_t.cuda(), Q.Q8_0, idx.cuda(),
                                _cuda(bias), activation, act_on_up)
    torch.testing.assert_close(hc.cpu(), h, rtol=5e-3, atol=1e-3 * max(1.0, h.abs().max().item()))
    torch.testing.assert_close(yc.cpu(), y, rtol=5e-3, atol=2e-3 * max(1.0, y.abs().max().item()))


def _captured(fn, warmups=1):
    """fn() captured in a CUDA graph after warm-up runs off the capture stream (as torch recommends):
    the graph and fn's outputs, which each replay rewrites."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(warmups):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def test_cuda_sparse_ops_capture_in_a_graph():
    """Launched on the current stream with no host synchronisation: a CUDA graph replays them."""
    qtype = Q.Q4_0
    w = random_rows(qtype, 1024, 512).cuda()
    x = torch.randn(1, 512, device="cuda")
    mask = torch.zeros(1024, dtype=torch.bool, device="cuda")
    def step():
        h = kernels.sparse_rowdot(w, qtype, x, None, mask, check=False).relu()
        return h, kernels.sparse_axpy(w, qtype, h, None, check=False)

    g, (h, y) = _captured(step, warmups=2)
    for density in (0.0, 0.1, 1.0):
        mask.copy_(torch.rand(1024, device="cuda") < density)
        x.normal_()
        g.replay()
        torch.cuda.synchronize()
        h_ref = kernels.sparse_rowdot_reference(w.cpu(), qtype, x.cpu(), None, mask.cpu()).relu()
        # Q4_0 row-dots read x in two 8-bit planes (~15 bits: 1.8e-4 off at worst on the H200)
        torch.testing.assert_close(h.cpu(), h_ref, rtol=0, atol=2e-3 * max(1.0, h_ref.abs().max().item()))
        assert ((h.cpu() != 0) == (h_ref != 0)).float().mean() > 0.99  # the same rows read, give or take a tie
        torch.testing.assert_close(y.cpu(), kernels.sparse_axpy_reference(w.cpu(), qtype, h.cpu(), None),
                                   rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0])
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("rows", [301, 5000])  # few rows: slices of a row over 2-4 warps
def test_cuda_matmul_add_is_the_gemv_plus_the_residual(qtype, tokens, rows):
    """matmul_add: the decode GEMV adding the residual as it writes equals the GEMV, then the add (the
    same sums: bit for bit but for rounding of the one add), and the twin; kernels.matmul_add takes it."""
    w = random_rows(qtype, rows, 512, seed=rows).cuda()
    x = torch.randn(tokens, 512, device="cuda")
    res = torch.randn(tokens, rows, device="cuda") * 10
    got = kernels.ops().matmul_add(w, int(qtype), x, res)
    want = res + kernels.matmul(x, w, qtype)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    torch.testing.assert_close(kernels.matmul_add(x, w, qtype, res), got, rtol=0, atol=0)
    twin = kernels.matmul_add_reference(x.cpu(), w.cpu(), qtype, res.cpu())
    tol = 2e-3 if qtype == Q.Q4_0 else 1e-4  # Q4_0 rows read x in two 8-bit planes
    torch.testing.assert_close(got.cpu(), twin, rtol=0, atol=tol * max(1.0, (twin - res.cpu()).abs().max().item()))


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("act,act_on_up", [(None, False), ("silu", False), ("relu", True), ("gelu", False)])
@pytest.mark.parametrize("tokens,cols,rows", [(1, 4096, 2 * 1500), (3, 1024, 2 * 301), (4, 2048, 2 * 40), (1, 8192, 2 * 7)])
def test_cuda_rowdot_fused(qtype, norm, act, act_on_up, tokens, cols, rows, monkeypatch):
    """The decode GEMV with the RMS norm before it and the gated activation after it in one kernel,
    against its twin (norm, matmul, activation apart, in torch) and against the runtime's separate
    kernels; few rows (slices of a row over 2-4 warps, gate and up warps of one block) and many."""
    monkeypatch.setattr(kernels, "CUDA_FUSE", "1")  # every size
    w = random_rows(qtype, rows, cols, seed=rows + cols).cuda()
    x = torch.randn(tokens, cols, device="cuda") * 3 + 1
    nw = torch.randn(cols, device="cuda")
    n = kernels.Norm(nw, 1e-5) if norm else None
    assert kernels.fused_ok(x, w, qtype, n)
    got = kernels.matmul_fused(x, w, qtype, n, act, act_on_up)
    apart = kernels.matmul_fused_reference(x, w, qtype, n, act, act_on_up, step=kernels.matmul)
    twin = kernels.matmul_fused_reference(x.cpu(), w.cpu(), qtype, kernels.Norm(nw.cpu(), 1e-5) if norm else None,
                                          act, act_on_up)
    assert got.shape == twin.shape == (tokens, rows // 2 if act else rows)
    scale = max(1.0, twin.abs().max().item())
    torch.testing.assert_close(got, apart, rtol=1e-4, atol=2e-5 * scale)  # fast-math exp/tanh: ~3e-5
    torch.testing.assert_close(got.cpu(), twin, rtol=1e-4, atol=1e-4 * scale)


def test_cuda_rowdot_fused_falls_back_and_refuses(monkeypatch):
    """Where the kernel cannot take its input (more than 4 tokens, a layer norm, Q4_0 rows, HS_CUDA_FUSE
    off) matmul_fused runs the steps apart with the same result; the op itself refuses with one clear
    line."""
    w = random_rows(Q.F16, 64, 512, seed=1).cuda()
    x = torch.randn(5, 512, device="cuda")
    n = kernels.Norm(torch.randn(512, device="cuda"), 1e-6)
    assert not kernels.fused_ok(x, w, Q.F16, n)
    assert kernels.fused_ok(x[:1], w, Q.F16, n)
    big = torch.empty(kernels.CUDA_FUSE_MAX_BYTES // 1024 + 1, 512, dtype=torch.float16, device="cuda")
    assert not kernels.fused_ok(x[:1], big, Q.F16, n)  # a large GEMV streams faster apart (HS_CUDA_FUSE=auto)
    monkeypatch.setattr(kernels, "CUDA_FUSE", "1")
    assert kernels.fused_ok(x[:1], big, Q.F16, n)
    monkeypatch.setattr(kernels, "CUDA_FUSE", "0")
    assert not kernels.fused_ok(x[:1], w, Q.F16, n)
    monkeypatch.setattr(kernels, "CUDA_FUSE", "auto")
    torch.testing.assert_close(kernels.matmul_fused(x, w, Q.F16, n), kernels.matmul(n(x), w, Q.F16))
    layer = kernels.Norm(n.weight, 1e-5, torch.randn(512, device="cuda"), layer=True)
    assert not kernels.fused_ok(x[:1], w, Q.F16, layer)
    torch.testing.assert_close(kernels.matmul_fused(x[:1], w, Q.F16, layer, "silu"),
                               kernels.matmul_fused_reference(x[:1], w, Q.F16, layer, "silu", step=kernels.matmul))
    with pytest.raises(RuntimeError, match="1 to 4 tokens, got 5"):
        kernels.ops().rowdot_fused(w, int(Q.F16), x, n.weight, 1e-6, -1, False)
    q4 = random_rows(Q.Q4_0, 64, 512, seed=2).cuda()
    assert not kernels.fused_ok(x[:1], q4, Q.Q4_0)
    with pytest.raises(RuntimeError, match="Q4_0 rows are not supported"):
        kernels.ops().rowdot_fused(q4, int(Q.Q4_0), x[:1].contiguous(), None, 0.0, -1, False)
    with pytest.raises(RuntimeError, match="gate rows then up rows"):
        kernels.ops().rowdot_fused(w[:63], int(Q.F16), x[:1].contiguous(), None, 0.0, 0, False)


@pytest.mark.parametrize("graph", [False, True])
def test_programmatic_dependent_launch_chain(graph, monkeypatch):
    """HS_CUDA_PDL=1 (csrc/cuda_launch.h): a chain of row-dots and an axpy, each reading what the one
    before wrote, the first a big dense GEMV whose last rows come in its last wave, then Q4_0 rows
    (x quantized by a kernel of its own, the staged kernel), Q8_0 rows by an index list, an F16 axpy:
    equal to the chain launched without PDL, op by op and replayed as a CUDA graph. A kernel that read
    before waiting would see the last wave's rows unwritten."""
    big = random_rows(Q.F16, 8192, 4096, seed=1).cuda()
    w4 = random_rows(Q.Q4_0, 512, 8192, seed=2).cuda()
    w8 = random_rows(Q.Q8_0, 1024, 512, seed=3).cuda()
    wt = random_rows(Q.F16, 1024, 512, seed=4).cuda()
    idx = torch.arange(1, 1024, 3, dtype=torch.int32, device="cuda")
    x = torch.randn(1, 4096, device="cuda")

    def chain():
        y1 = kernels.sparse_rowdot(big, Q.F16, x, None, check=False)
        y2 = kernels.sparse_rowdot(w4, Q.Q4_0, y1, None, check=False)
        y3 = kernels.sparse_rowdot(w8, Q.Q8_0, y2, idx, check=False)
        return y1, y2, y3, kernels.sparse_axpy(wt, Q.F16, y3, idx, check=False)

    def run(pdl):
        monkeypatch.setenv("HS_CUDA_PDL", pdl)
        if not graph:
            out = chain()
            torch.cuda.synchronize()
            return [t.clone() for t in out]
        g, out = _captured(chain)
        results = []
        for _ in range(3):  # replays: the same answer each time
            g.replay()
            torch.cuda.synchronize()
            results.append([t.clone() for t in out])
        for r in results[1:]:
            for a, b in zip(r, results[0]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))
        return results[0]

    ref, got = run("0"), run("1")
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))


def test_cuda_sparse_bad_input():
    w = random_rows(Q.Q8_0, 16, 64).cuda()
    with pytest.raises(ValueError, match="outside the 16 rows"):
        kernels.sparse_rowdot(w, Q.Q8_0, torch.randn(1, 64, device="cuda"), torch.tensor([16], dtype=torch.int32).cuda())
    with pytest.raises(ValueError, match="bool vector of 16"):
        kernels.sparse_rowdot(w, Q.Q8_0, torch.randn(1, 64, device="cuda"), None, torch.ones(16, dtype=torch.bool))
    with pytest.raises(ValueError, match="is on cpu"):
        kernels.sparse_rowdot(w, Q.Q8_0, torch.randn(1, 64), None)
    with pytest.raises(ValueError, match=r"h must be float32 \[tokens, 16\]"):
        kernels.sparse_axpy(w, Q.Q8_0, torch.randn(1, 15, device="cuda"), None)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
@pytest.mark.parametrize("rows,cols", [(1, 32), (301, 32 * 9), (2200, 4096), (7, 32 * 111)])
def test_cuda_dequantize_f16_equals_the_twin(qtype, rows, cols):
    """The compiled prefill dequantizer gives the twin's float16 values bit for bit (d * q is exact in
    float32, rounded once), for whole weights and for row slices at odd offsets, and they are gguf's."""
    import numpy as np
    from gguf import quants as gguf_quants
    w = random_rows(qtype, rows, cols, seed=rows)
    for part in (w, w[rows // 3:]):
        got = kernels.ops().dequantize_f16(part.cuda(), int(qtype)).cpu()
        assert got.dtype == torch.float16 and got.shape == (part.shape[0], cols)
        assert torch.equal(got, dequantize(part, qtype).half())
        ref = gguf_quants.dequantize(part.numpy(), qtype).reshape(part.shape[0], cols)
        assert np.array_equal(got.numpy(), ref.astype(np.float16))
    assert kernels.ops().dequantize_f16(w[:0].cuda(), int(qtype)).shape == (0, cols)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
@pytest.mark.parametrize("tokens", [9, 64])
def test_cuda_prefill_matmuls_through_the_compiled_dequantizer(qtype, tokens, monkeypatch):
    """kernels.matmul / matmul_t on the GPU past the GEMV's 8 tokens (slices of float16 rows times cuBLAS)
    agree with the float32 twins, with slices smaller than the weight (several of them, a partial last)."""
    monkeypatch.setattr(kernels, "DEQUANT_SLICE_BYTES", 4 * 2048 * 100)
    w = random_rows(qtype, 301, 2048, seed=tokens)
    x, h = torch.randn(tokens, 2048), torch.randn(tokens, 301)
    y = kernels.matmul(x.cuda(), w.cuda(), qtype).cpu()
    ref = kernels.matmul_reference(x, w, qtype)
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    yt = kernels.matmul_t(h.cuda(), w.cuda(), qtype).cpu()
    ref_t = kernels.matmul_t_reference(h, w, qtype)
    torch.testing.assert_close(yt, ref_t, rtol=2e-2, atol=2e-2 * ref_t.abs().max().item())


def test_cuda_dequantize_f16_refuses():
    w = random_rows(Q.Q8_0, 16, 64)
    with pytest.raises(RuntimeError, match="weight type id 1 is not supported"):
        kernels.ops().dequantize_f16(w.cuda(), int(Q.F16))
    with pytest.raises(RuntimeError, match="contiguous uint8"):
        kernels.ops().dequantize_f16(w.cuda()[:, :34], int(Q.Q8_0))
    with pytest.raises(RuntimeError, match="not a whole number of blocks"):
        kernels.ops().dequantize_f16(w.cuda()[:, :33].contiguous(), int(Q.Q8_0))
    # a weight the kernel does not take goes through the twin
    f = torch.randn(4, 64, dtype=torch.float16)
    assert torch.equal(kernels.dequantize_f16(f.cuda(), Q.F16).cpu(), f)
