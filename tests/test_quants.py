"""Dequantization against gguf's numpy routines, and every compiled CPU op against its pure-torch
twin: all weight types, odd row lengths, 1..N tokens, 1 and 2 threads, invalid arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from hybridsparse.runtime import kernels
from hybridsparse.runtime.quants import dequantize
from hybridsparse.runtime.weights import QWeight, linear_many
from quant_utils import quantize_activations, random_rows

BLOCK_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
KERNEL_TYPES = [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16]

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="compiled kernels unavailable")


def test_compiled_kernels_build():
    """A broken build must fail the suite, not quietly skip every kernel test."""
    import os
    assert kernels.available() or os.environ.get("HS_NO_KERNELS"), kernels._load_error


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_dequantize_matches_gguf(qtype):
    raw = random_rows(qtype, 5, GGML_QUANT_SIZES[qtype][0] * 3, seed=int(qtype))
    ours = dequantize(raw, qtype).numpy()
    ref = gguf_quants.dequantize(raw.numpy(), qtype)
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_1, Q.Q5_1])
def test_gguf_quantize_round_trip(qtype):
    x = np.random.default_rng(0).standard_normal((4, 96)).astype(np.float32)
    q = gguf_quants.quantize(x, qtype)
    np.testing.assert_array_equal(dequantize(torch.from_numpy(q), qtype).numpy(), gguf_quants.dequantize(q, qtype))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
def test_dequantize_f16_is_gguf_rounded_once(qtype):
    """kernels.dequantize_f16 (the prefill's float16 rows; compiled on the GPU, tests/gpu checks that one
    bit for bit against this) gives gguf's values rounded once to float16."""
    raw = random_rows(qtype, 7, 32 * 5, seed=3)
    got = kernels.dequantize_f16(raw, qtype)
    assert got.dtype == torch.float16
    np.testing.assert_array_equal(got.numpy(), gguf_quants.dequantize(raw.numpy(), qtype).astype(np.float16))


def test_float_types_dequantize():
    for qtype, dtype in [(Q.F16, torch.float16), (Q.BF16, torch.bfloat16)]:
        w = torch.randn(3, 7).to(dtype)
        assert torch.equal(dequantize(w.view(torch.uint8).view(3, 14), qtype), w.float())


def test_real_model_tensors_match_gguf(default_model):
    from hybridsparse.runtime.gguf_file import GGUFFile
    g = GGUFFile(default_model)
    seen = set()
    for name, info in g.tensors.items():
        if info.qtype in seen or info.qtype == Q.F32:
            continue
        seen.add(info.qtype)
        raw = g.raw(name)[:64]
        np.testing.assert_array_equal(dequantize(raw, info.qtype).numpy(),
                                      gguf_quants.dequantize(raw.numpy(), info.qtype), err_msg=name)
    assert {Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K} <= seen


def _block(qtype):
    return 1 if qtype in (Q.F16, Q.BF16) else GGML_QUANT_SIZES[qtype][0]


def _reference(w, qtype, x):
    """float64 product of the dequantized weights with the activations as the kernel sees them."""
    block = _block(qtype)
    xq = x.double() if block == 1 else quantize_activations(x, block)
    return xq @ dequantize(w, qtype).double().T


@needs_kernels
@pytest.mark.parametrize("qtype", KERNEL_TYPES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 6, 13, 15])  # token tiles of 8: every tile size and a remainder
@pytest.mark.parametrize("n_threads", [1, 2])
def test_qmatmul_matches_twin(qtype, tokens, n_threads, threads):
    torch.set_num_threads(n_threads)
    block = max(_block(qtype), 32)
    K = block * 3 if block > 1 else 101  # odd row lengths where the type allows
    N = 37
    w = random_rows(qtype, N, K if qtype not in (Q.F16, Q.BF16) else 101, seed=tokens)
    K = dequantize(w[:1], qtype).shape[1]
    x = torch.randn(tokens, K)
    y = kernels.ops().qmatmul(w.contiguous(), int(qtype), x)
    ref = _reference(w, qtype, x)
    assert y.shape == (tokens, N)
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, err
    # the exact twin (no activation quantization) agrees to the activation precision
    twin = kernels.matmul_reference(x, w, qtype)
    assert ((y - twin).abs().max() / twin.abs().max()).item() < 1e-3


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.F16, Q.BF16])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_qmatmul_t_matches_twin(qtype, n_threads, threads):
    torch.set_num_threads(n_threads)
    K = 96 if qtype not in (Q.F16, Q.BF16) else 101
    w = random_rows(qtype, 41, K, seed=3)
    h = torch.randn(2, 41)
    h[:, ::3] = 0  # inactive neurons are skipped
    h[1, :] = 0
    y = kernels.ops().qmatmul_t(w.contiguous(), int(qtype), h)
    ref = kernels.matmul_t_reference(h, w, qtype)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_empty_inputs():
    w = random_rows(Q.Q8_0, 4, 64)
    assert kernels.ops().qmatmul(w, int(Q.Q8_0), torch.zeros(0, 64)).shape == (0, 4)
    assert kernels.ops().qmatmul_t(w, int(Q.Q8_0), torch.zeros(0, 4)).shape == (0, 64)


@needs_kernels
def test_rms_norm_matches_twin():
    x, w = torch.randn(5, 77), torch.randn(77)
    torch.testing.assert_close(kernels.ops().rms_norm(x, w, 1e-6), kernels.rms_norm_reference(x, w, 1e-6))


@needs_kernels
@pytest.mark.parametrize("bad", ["dtype", "row_bytes", "not_contiguous", "type_id", "x_shape"])
def test_invalid_arguments_raise(bad):
    w = random_rows(Q.Q8_0, 8, 64)
    x = torch.randn(2, 64)
    qtype = int(Q.Q8_0)
    if bad == "dtype":
        w = w.float()
    elif bad == "row_bytes":
        w = w[:, :-2].contiguous()
    elif bad == "not_contiguous":
        w = random_rows(Q.Q8_0, 8, 128)[:, ::2]
    elif bad == "type_id":
        qtype = 99
    elif bad == "x_shape":
        x = torch.randn(2, 63)
    with pytest.raises(ValueError, match="qmatmul"):
        kernels.qmatmul(w, qtype, x)
    if torch.cuda.is_available():
        return  # the C++ checks below raise here, but crashed the process on the GPU machine
    with pytest.raises(RuntimeError, match="qmatmul"):
        kernels.ops().qmatmul(w, qtype, x)


SCALAR_CHECK = """
import torch, sys
sys.path.insert(0, 'tests')
from gguf import GGMLQuantizationType as Q
from hybridsparse.runtime import kernels
from hybridsparse.runtime.quants import dequantize
from quant_utils import quantize_activations, random_rows
kernels.ops()
assert kernels.cpu.cpu_path() == sys.argv[1], kernels.cpu.cpu_path()
worst = 0.0
for qtype in [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16]:
    block = 32 if qtype in (Q.F16, Q.BF16) else __import__('gguf').GGML_QUANT_SIZES[qtype][0]
    w = random_rows(qtype, 19, block * 3 if block > 1 else 96, seed=5)
    K = dequantize(w[:1], qtype).shape[1]
    x = torch.randn(2, K)
    xq = x.double() if qtype in (Q.F16, Q.BF16) else quantize_activations(x, block)
    ref = xq @ dequantize(w, qtype).double().T
    y = kernels.cpu.qmatmul(w.contiguous(), int(qtype), x)
    worst = max(worst, ((y.double() - ref).abs().max() / ref.abs().max()).item())
    if qtype in (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.F16, Q.BF16):
        h = torch.randn(2, 19)
        yt = kernels.cpu.qmatmul_t(w.contiguous(), int(qtype), h)
        worst = max(worst, ((yt - kernels.matmul_t_reference(h, w, qtype)).abs().max() / yt.abs().max()).item())
print(worst)
"""


@needs_kernels
@pytest.mark.parametrize("path", ["scalar", "avx2"])
def test_other_cpu_paths_match_twin(path):
    """The portable path (machines without AVX2) and the AVX2 path (machines without AVX-512 VNNI)
    compute the same as the twins, whichever path this machine picks by itself."""
    import os
    import platform
    import subprocess
    import sys
    if path == "avx2" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    r = subprocess.run([sys.executable, "-c", SCALAR_CHECK, path], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HS_CPU_PATH": path})
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout.strip().splitlines()[-1]) < 1e-5


def _rerun_on_path(path: str, select: str, timeout: float):
    """test_sparse_ops.py's tests matching `select`, rerun in a process forced onto HS_CPU_PATH=path."""
    import os
    import platform
    import subprocess
    import sys
    from pathlib import Path
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    here = Path(__file__).parent
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / "test_sparse_ops.py"),
                        "-k", select], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "HS_CPU_PATH": path}, cwd=here.parent)
    assert r.returncode == 0, r.stdout[-3000:]
    assert " passed" in r.stdout and " failed" not in r.stdout


@needs_kernels
def test_avx2_rows_side_by_side_match_twin():
    """On the AVX2 path (CPUs without AVX-512) the one-token FFN and row-dot also stream rows side by
    side (F16, Q8_0, Q4_0, Q5_0 kernels of their own): the side-by-side, gate-first, claimed-share, GEMV-stream
    and Q4_0 dot tests of test_sparse_ops.py, rerun in a process forced onto that path (the streams' test found
    its one-row F16 and Q8_0 dots summing in another order than the side-by-side kernels there); and the
    prompt's eight-row Q4_0 / Q5_0 kernels and several tokens' down rows at once, in their AVX2 forms."""
    _rerun_on_path("avx2", "side_by_side or gate_first or claimed_shares or rowdot or one_plane or gemv_streams "
                           "or wide_q4_0 or prompt_rows or many_tokens or mask_per_token", timeout=600)


@needs_kernels
def test_avxvnni_prompt_rows_match_twin():
    """HS_CPU_PATH=avxvnni (AVX2 plus the 256-bit VEX vpdpbusd, as on Alder Lake: AVX-512 off) takes a
    prompt's Q4_0 / Q5_0 / Q8_0 rows eight at a time with that instruction: the prompt-rows test, rerun in a
    process on that path (on a CPU without AVX-VNNI it runs the AVX2 form again, Q8_0 one row at a time)."""
    _rerun_on_path("avxvnni", "prompt_rows", timeout=300)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_transposed_k_quant_rows_use_the_twin(qtype):
    """ffn_down_t in a K-quant has no compiled axpy: matmul_t must fall back, not raise."""
    w = random_rows(qtype, 8, 256)
    h = torch.randn(2, 8)
    torch.testing.assert_close(kernels.matmul_t(h, w, qtype), kernels.matmul_t_reference(h, w, qtype))


@needs_kernels
@pytest.mark.parametrize("qtype", sorted(kernels.CPU_DEQUANT_TYPES | {Q.F16, Q.BF16}))
@pytest.mark.parametrize("rows", [1, 5, 67])
def test_compiled_dequantize_matches_gguf(qtype, rows, threads):
    """The compiled dequantizer (a long prompt's GEMM slices) gives gguf's numpy values bit for bit,
    with or without a buffer to write into; a wrong type, a short buffer or a ragged row is refused."""
    cols = 256 * 3 if GGML_QUANT_SIZES[qtype][0] == 256 else (96 if GGML_QUANT_SIZES[qtype][0] == 32 else 101)
    w = random_rows(qtype, rows, cols, seed=rows).contiguous()
    if w.dtype == torch.uint8:
        want = torch.from_numpy(gguf_quants.dequantize(w.numpy(), qtype).astype(np.float32)).reshape(rows, -1)
    else:
        want = w.float()
    assert torch.equal(kernels.cpu.dequantize(w, int(qtype)), want)
    buf = torch.full((rows * want.shape[1] + 5,), float("nan"))
    got = kernels.cpu.dequantize(w, int(qtype), buf)
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="at least"):
        kernels.cpu.dequantize(w, int(qtype), torch.empty(rows * want.shape[1] - 1))
    with pytest.raises(RuntimeError, match="not supported"):
        kernels.cpu.dequantize(w, int(Q.Q4_1))
    if w.dtype == torch.uint8 and rows > 1:
        with pytest.raises(RuntimeError, match="whole number of blocks"):
            kernels.cpu.dequantize(w[:, :-1].contiguous(), int(qtype))


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K])
@pytest.mark.parametrize("bf16", ["0", "1"])
def test_many_token_cpu_gemm_matches_twin(qtype, bf16, threads, monkeypatch):
    """From CPU_GEMM_TOKENS tokens on, `matmul` dequantizes slices of rows for torch's GEMM: same result
    as the twin (and rows beyond one slice are all written); in bfloat16 (HS_CPU_GEMM_BF16=1; the
    default where the CPU has the instructions) for block-format and bfloat16 rows, within bfloat16's
    rounding of x, the rows and the products; float16 rows stay float32."""
    monkeypatch.setattr(kernels, "CPU_GEMM_BF16", bf16)
    in_bf16 = kernels.cpu_gemm_bf16(qtype)
    assert in_bf16 == (bf16 == "1" and qtype != Q.F16)
    w = random_rows(qtype, kernels._CPU_GEMM_CHUNK_ROWS + 37, 256, seed=3)
    x = torch.randn(max(kernels.CPU_GEMM_TOKENS, kernels.CPU_GEMM_TOKENS_BF16) + 3, 256)
    want = kernels.matmul_reference(x, w, qtype)
    tol = 2e-2 * want.abs().max().item() if in_bf16 else 1e-4
    torch.testing.assert_close(kernels.matmul(x, w, qtype), want, rtol=1e-4, atol=tol)
    ws = [QWeight.from_raw(w[:300], qtype, 256), QWeight.from_raw(w[300:400], qtype, 256)]
    for y, q in zip(linear_many(x, ws), ws):
        torch.testing.assert_close(y, kernels.matmul_reference(x, q.data, qtype), rtol=1e-4, atol=tol)
    rows = torch.tensor([5, 1030, 2], dtype=torch.int32)  # the sparse forms of a long prefill
    torch.testing.assert_close(kernels.cpu_gemm_rows(x, w, qtype, rows), want[:, rows.long()], rtol=1e-4, atol=tol)
    h = torch.randn(x.shape[0], 3)
    t_want = h @ kernels.dequantize(w[rows.long()], qtype)
    torch.testing.assert_close(kernels.cpu_gemm_t_rows(h, w, qtype, rows), t_want, rtol=1e-4,
                               atol=2e-2 * t_want.abs().max().item() if in_bf16 else 1e-4)


QUANT_ACT_BYTES = """
import sys, torch
from hybridsparse.runtime import kernels
kernels.ops()
assert kernels.cpu.cpu_path() == "scalar", kernels.cpu.cpu_path()
x = torch.load(sys.argv[1])
torch.save([kernels.cpu.quantize_act_bytes(x, False), kernels.cpu.quantize_act_bytes(x, True)], sys.argv[2])
"""


def _activation_cases() -> torch.Tensor:
    """Blocks of 256 that reach the rounding's edges: values landing exactly on halves in both planes
    (amax 127: d0 = 1), all zeros, one nonzero, tiny and huge scales, and plain random ones."""
    g = torch.Generator().manual_seed(3)
    halves = torch.arange(-128, 128, dtype=torch.float32) / 2
    halves[0] = 127.0  # the block's amax: d0 = 1 exactly
    fine = torch.round(torch.randn(256, generator=g) * 4096) / 4096 * 40  # plane-1 halves among them
    fine[5] = -127.0
    one = torch.zeros(256)
    one[77] = -3.0
    blocks = [halves, fine, torch.zeros(256), one, torch.randn(256, generator=g) * 1e-30,
              torch.randn(256, generator=g) * 1e30, *(torch.randn(256, generator=g) * s for s in (0.01, 1, 50))]
    return torch.cat(blocks).contiguous()


@needs_kernels
@pytest.mark.skipif(not kernels.available() or kernels.cpu.cpu_path() == "scalar", reason="no vector path here")
def test_activation_quantization_vector_path_is_bit_exact(tmp_path):
    """The AVX2 activation quantization (ActQ8 per 32 values and ActQ8K per 256) writes the same
    bytes as the portable loops, and the values the Python twin computes."""
    import os
    import subprocess
    import sys
    x = _activation_cases()
    torch.save(x, tmp_path / "x.pt")
    r = subprocess.run([sys.executable, "-c", QUANT_ACT_BYTES, str(tmp_path / "x.pt"), str(tmp_path / "s.pt")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "HS_CPU_PATH": "scalar"})
    assert r.returncode == 0, r.stderr[-2000:]
    scalar = torch.load(tmp_path / "s.pt")
    vector = [kernels.cpu.quantize_act_bytes(x, False), kernels.cpu.quantize_act_bytes(x, True)]
    for k, (a, b) in enumerate(zip(vector, scalar)):
        assert torch.equal(a, b), f"k_quant={bool(k)}: {int((a != b).sum())} bytes differ"
    # ActQ8 = {float d, int8 q0[32], int8 q1[32], float dsum = d * sum of 128 q0 + q1}: its values against the twin
    raw = vector[0].numpy()
    rec = raw.reshape(-1, 72)
    d = rec[:, :4].copy().view(np.float32)[:, 0].astype(np.float64)
    q0 = rec[:, 4:36].view(np.int8).astype(np.float64)
    q1 = rec[:, 36:68].view(np.int8).astype(np.float64)
    dsum = rec[:, 68:72].copy().view(np.float32)[:, 0]
    assert np.array_equal(dsum, (d.astype(np.float32) * (128 * q0 + q1).sum(1).astype(np.float32)))
    twin = quantize_activations(x[None], 32)[0].double().numpy().reshape(-1, 32)
    assert np.array_equal(d[:, None] * (128 * q0 + q1), twin)
