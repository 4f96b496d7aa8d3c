"""The compiled core (csrc/) as torch ops, with a pure-torch twin for each, chosen at call time.

The extension is built with torch's C++ extension tooling on first use (and by `make install`),
cached under ~/.cache/hybridsparse; with nvcc and a CUDA torch the CUDA sources are built too. When
the build is impossible the runtime says so in one line and uses the twins.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from .quants import FLOAT_TYPES, dequantize, row_elements

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
if not CSRC.is_dir():  # installed as a package: csrc is shipped inside hybridsparse/runtime
    CSRC = Path(__file__).resolve().parent / "csrc"

# Block formats the compiled CPU matmul computes natively (activations quantized per block to two
# 8-bit planes, see csrc/quant_blocks.h); the rest go through the twin.
CPU_QTYPES = {Q.F16, Q.BF16, Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K}
# Formats the compiled axpy (rows that are neurons: ffn_down_t, the sparse down projection) reads
# (csrc/dequant.cpp); K-quant rows go through the twin.
CPU_AXPY_QTYPES = {Q.F16, Q.BF16, Q.Q4_0, Q.Q5_0, Q.Q8_0}
CUDA_QTYPES = {Q.Q4_0, Q.Q8_0}  # quantized formats the CUDA GEMV reads (float ones go to cuBLAS)
# Formats of the CUDA sparse row-dot / axpy (csrc/cuda_sparse.cu), rows a multiple of 8 elements.
CUDA_SPARSE_QTYPES = {Q.F16, Q.BF16, Q.Q4_0, Q.Q8_0}
CUDA_MAX_GEMV_TOKENS = 8  # csrc/cuda_sparse.cu: cuda_max_tokens()
# Decode-sized float16/bfloat16 matmuls on the GPU: "ours" (csrc/cuda_sparse.cu) or "cublas"
# (torch's F.linear); HS_CUDA_GEMV picks, for side-by-side benchmarks.
CUDA_GEMV = os.environ.get("HS_CUDA_GEMV", "ours")
# A layer's RMS norm before its q/k/v and gate/up GEMVs, and the gated activation after gate/up, folded
# into those GEMVs on CUDA (`matmul_fused`) for weights of at most CUDA_FUSE_MAX_BYTES; HS_CUDA_FUSE=0
# never, =1 at every size. The fused GEMV reads the norm weight beside x and streams its rows ~12%
# slower; it saves a norm (~4 us) or activation kernel (~2 us) and a launch. H100, session 20, decode
# tokens/s of `hs-bench run` alternating: a Gemma-3-270M-shaped F16 model (weights <= 5 MiB a GEMV)
# 773 / 778 apart -> 893 / 895 fused (with the attention's fusion, HS_CUDA_ATT_FUSE); a 7B-shaped one
# (96 and 172 MiB) 172.6 / 171.9 -> 169.8 / 167.9 with every size fused.
CUDA_FUSE = os.environ.get("HS_CUDA_FUSE", "auto")
CUDA_FUSE_MAX_BYTES = 64 << 20
CUDA_FUSED_QTYPES = {Q.F16, Q.BF16, Q.Q8_0}  # csrc/cuda_sparse.cu rowdot_fused_kernel: rows read against float x
CUDA_FUSED_MAX_TOKENS = 4  # fused_max_tokens()
# Block-format weights go through cuBLAS / torch a slice of rows at a time, dequantized to float32:
# at most this many bytes of it per slice. Rows of 8192 elements 8192 at a time (as before) made
# ~1 GiB of temporaries on the GPU during a 70B prefill (the S2 plan's peak went over its budget);
# a few such slices fit in what the solver sets aside for activations (solver.plan.Problem).
DEQUANT_SLICE_BYTES = 32 << 20


def _slice_rows(data: torch.Tensor, qtype: Q) -> int:
    """Rows per dequantized slice of `data` (uint8 [rows, row_bytes] or a float tensor)."""
    elems = data.shape[1] if qtype in FLOAT_TYPES else row_elements(qtype, data.shape[1])
    return max(1, DEQUANT_SLICE_BYTES // (4 * max(1, elems)))


# Hybrid decode on CUDA: each layer's cold FFN runs as a host node of the stream (csrc/cold_ffn.cpp),
# so a step is queued (or replayed as a CUDA graph) without the Python thread waiting per layer.
# HS_HOST_NODES=0 uses the event-synchronised path instead, for side-by-side benchmarks.
HOST_NODES = os.environ.get("HS_HOST_NODES", "1") != "0"
# HS_HANDOVER=poll: inside a captured decode step the hand-over is polled instead of a host node
# (csrc/cuda_handover.cu): the graph's kernels write x and the mask to pinned memory and wait for y;
# the thread that replays the graph serves the layers' tasks in order (serve_polled). A host node left
# the GPU idle ~215 us per layer even with no CPU work (S1, H100: a step without CPU work 32.6 ms with
# host nodes, 19.5 ms polled). With the CPU work, alternating in one process (S1 with Q8_0 predictors,
# H100, session 16): host nodes 70.1 and 65.7 ms a token, polled 60.0 and 57.0. HS_HANDOVER=node to
# compare.
HANDOVER = os.environ.get("HS_HANDOVER", "poll")
# How long either side of a polled hand-over waits for the other before giving up with an error.
HANDOVER_TIMEOUT_S = float(os.environ.get("HS_HANDOVER_TIMEOUT_S", "30"))
_polled_tasks: list[int] | None = None  # while a decode step is captured: its polled tasks, in order
# Prefill on the CPU: from this many tokens per call, a slice of rows dequantized to float32 (compiled,
# csrc/dequant.cpp) and torch's GEMM beat the compiled per-row dot products (the dequantization is paid
# once for all the tokens). Gemma 3 270M Q4_K_M, 2 threads of the dev VM: alone in a process, a
# 64-token prompt ran at 409-514 tok/s this way against 376-411 with the per-row kernels; alternating
# with llama.cpp in one process (`hs-bench run --llama-cpp`, 128 generated tokens) at 239-276 against
# 350-385 (torch's GEMM suffers more from the other library's threads), so the switch stays at 128.
# In bfloat16 (CPU_GEMM_BF16) the GEMM wins from fewer tokens: Gemma 3 270M Q4_K_M, 2 threads of the dev
# VM, session 20, alternating: 16-token prompts 378 / 387 tok/s with the per-row kernels against 308 /
# 305 with the GEMM, 32 tokens 382 / 393 against 347 / 500, 64 tokens 426 / 441 against 794 / 709.
# Q4_0 / Q5_0 / Q8_0 rows on AVX-512 VNNI take a prompt 16 rows at a time (csrc dot16_q45_0_tokens), which
# moves the switch later: session 30's dev VM (a Xeon with AMX, whose bfloat16 GEMM torch uses), 11008 x
# 4096 Q4_0 rows, 2 threads: 64 tokens 164-175 GMAC/s against the bfloat16 GEMM's 122-125, 96 tokens 175 /
# 184, 112 tokens 168 / 204; with one activation plane (HS_ACT_PLANES=1) 96 tokens 274 / 172, 192
# tokens 294 / 306. Q8_0: 64 tokens 144-161 / 104-132, 96 tokens 152-164 / 146-184, 128 152 / 216-230.
# HS_CPU_GEMM_TOKENS sets all three.
CPU_GEMM_TOKENS = int(os.environ.get("HS_CPU_GEMM_TOKENS", "128"))
CPU_GEMM_TOKENS_BF16 = int(os.environ.get("HS_CPU_GEMM_TOKENS", "48"))
CPU_GEMM_TOKENS_ROWS16 = int(os.environ.get("HS_CPU_GEMM_TOKENS", "192" if os.environ.get("HS_ACT_PLANES") == "1" else "96"))
_CPU_GEMM_CHUNK_ROWS = 1024
# The sparse row-dot / axpy over listed rows (a hybrid model's cold neurons during a long prefill or a
# big server batch) switch to gathered slices and GEMM later: the per-row kernels win up to ~384 tokens
# on the 2-core dev VM; at 512-758 tokens the GEMM takes 0.4-0.75x their time (F16, Q8_0, Q4_0).
CPU_SPARSE_GEMM_TOKENS = int(os.environ.get("HS_CPU_SPARSE_GEMM_TOKENS", "512"))
# Several tokens over the union of their active cold neurons: from this fraction of (token, neuron) pairs
# in their masks, every pair is computed (the union's rows against all the tokens, 16 rows at a time,
# then the down rows for all the tokens at once) instead of each token's own pairs (sparse_ffn_masked).
# Dev VM (session 30, a Xeon), S5's model CPU-only sparse through hs-run -t 2, a 32-token prompt (its
# masks hold 30-40% of the union's pairs): 13.3-13.9 tok/s each token's own, 15.1-16.2 every pair from
# 0 / 0.2 / 0.3; on random masks of a 7B layer (/tmp script) 33% of pairs are a tie, all of them 2.4x.
CPU_MASKED_DENSE = float(os.environ.get("HS_MASKED_DENSE", "0.2"))

_ops = None
_load_error: str | None = None
cpu = None  # the CPU functions as a plain extension module (no dispatcher), once built


def _sources() -> tuple[list[str], bool]:
    cpp = sorted(str(p) for p in CSRC.glob("*.cpp"))
    cu = sorted(str(p) for p in CSRC.glob("*.cu"))
    with_cuda = bool(cu) and torch.cuda.is_available() and torch.version.cuda is not None \
        and _which("nvcc") is not None
    return cpp + (cu if with_cuda else []), with_cuda


def _which(cmd: str) -> str | None:
    import shutil
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return shutil.which(cmd) or (str(Path(cuda_home, "bin", cmd)) if Path(cuda_home, "bin", cmd).exists() else None)


def _torch_openmp_library() -> Path | None:
    """The OpenMP runtime torch itself loaded. Linking -fopenmp would bring the system libgomp as a
    second runtime when torch bundles its own under another name (CUDA wheels): two thread pools
    spinning on one set of cores made every kernel 3-4x slower on the GPU machine's CPU."""
    lib = Path(torch.__file__).resolve().parent / "lib"
    for folder in (lib, lib.parent.parent / "torch.libs"):
        for pattern in ("libgomp*.so*", "libiomp5*.so*"):
            found = sorted(folder.glob(pattern))
            if found:
                return found[0]
    return None


def build(verbose: bool = False):
    """Compile (or load the cached build of) the extension; returns torch.ops.hybridsparse."""
    from torch.utils import cpp_extension

    sources, with_cuda = _sources()
    if not sources:
        raise RuntimeError(f"no C++ sources under {CSRC}")
    digest = hashlib.sha256()
    for path in sorted(CSRC.glob("*")):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    # an AddressSanitizer build gets its own directory instead of replacing the normal one
    digest.update(f"{torch.__version__}{with_cuda}{_torch_openmp_library()}{bool(os.environ.get('HS_SANITIZE'))}".encode())
    tag = digest.hexdigest()[:12]
    build_dir = Path(os.environ.get("HS_CACHE", Path.home() / ".cache" / "hybridsparse")) / "ext" / tag
    build_dir.mkdir(parents=True, exist_ok=True)
    cflags = ["-O3", "-fopenmp", "-fno-math-errno"]  # the C++ standard: torch's own choice
    if os.environ.get("HS_SANITIZE"):
        cflags += ["-fsanitize=address", "-fno-omit-frame-pointer"]
    cuda_flags = ["-O3", "--use_fast_math"]
    if with_cuda:
        major, minor = torch.cuda.get_device_capability()
        cuda_flags.append(f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}")
        cflags.append("-DHS_WITH_CUDA")
    if not (build_dir / "hybridsparse_C.so").exists():
        print(f"hybridsparse: building compiled kernels ({'CPU+CUDA' if with_cuda else 'CPU'}) "
              f"into {build_dir} (once)", file=sys.stderr)
    _clear_stale_lock(build_dir)
    global cpu
    omp = _torch_openmp_library()
    omp_link = [str(omp), f"-Wl,-rpath,{omp.parent}"] if omp else ["-fopenmp"]
    cpu = cpp_extension.load(
        name="hybridsparse_C", sources=sources, build_directory=str(build_dir),
        extra_cflags=cflags, extra_cuda_cflags=cuda_flags,
        extra_ldflags=omp_link + (["-fsanitize=address"] if os.environ.get("HS_SANITIZE") else []),
        is_python_module=True, verbose=verbose, with_cuda=with_cuda,
    )
    _register_fakes()
    return torch.ops.hybridsparse


STALE_LOCK_S = 600


def _clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """torch's build lock (`lock` in the build folder) outlives a build that was killed (Ctrl-C, out of
    memory), and every later build then waits on it forever without a word. A lock in a folder where
    nothing was written for STALE_LOCK_S seconds is left over: removed, and said so. A fresh one is
    another process building now: said so, then torch waits for it."""
    import time
    lock = build_dir / "lock"
    if not lock.exists():
        return False
    newest = max((p.stat().st_mtime for p in build_dir.iterdir()), default=0.0)
    if (now if now is not None else time.time()) - newest > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
        print(f"hybridsparse: removed {lock}, left by a kernel build that did not finish", file=sys.stderr)
        return True
    print(f"hybridsparse: waiting for another process building the kernels ({lock}; if none is running, "
          f"delete it)", file=sys.stderr)
    return False


def _register_fakes() -> None:
    """Shape-only implementations so torch.compile / meta tensors can trace the ops."""
    if getattr(_register_fakes, "done", False):
        return
    _register_fakes.done = True

    @torch.library.register_fake("hybridsparse::qmatmul")
    def _(w, qtype, x):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("hybridsparse::rms_norm")
    def _(x, w, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("hybridsparse::attention")
    def _(q, k, v, k_cache, v_cache, positions, kv_len, window, scale):
        return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))

    @torch.library.register_fake("hybridsparse::gated_act")
    def _(gate, up, act, act_on_up):
        return torch.empty_like(gate)

    @torch.library.register_fake("hybridsparse::matmul_add")
    def _(w, qtype, x, res):
        return torch.empty_like(res)

    @torch.library.register_fake("hybridsparse::rowdot_fused")
    def _(w, qtype, x, norm_w, eps, act, act_on_up):
        return x.new_empty((x.shape[0], w.shape[0] // 2 if act >= 0 else w.shape[0]))

    @torch.library.register_fake("hybridsparse::sparse_rowdot")
    def _(w, qtype, x, idx, mask):
        return x.new_empty((x.shape[0], w.shape[0] if idx is None else idx.shape[0]))

    @torch.library.register_fake("hybridsparse::sparse_axpy")
    def _(w, qtype, h, idx):
        return h.new_empty((h.shape[0], row_elements(Q(qtype), w.shape[1] * w.element_size())))

    @torch.library.register_fake("hybridsparse::dequantize_f16")
    def _(w, qtype):
        return w.new_empty((w.shape[0], row_elements(Q(qtype), w.shape[1])), dtype=torch.float16)

    @torch.library.register_fake("hybridsparse::qmatmul_t")
    def _(w, qtype, h):
        block, size = GGML_QUANT_SIZES[Q(qtype)]
        return h.new_empty((h.shape[0], w.shape[1] * w.element_size() // size * block))


def ops():
    """The compiled ops, or None (said once) when they cannot be built or loaded."""
    global _ops, _load_error
    if _ops is None and _load_error is None:
        if os.environ.get("HS_NO_KERNELS"):
            _load_error = "disabled by HS_NO_KERNELS"
        else:
            try:
                _ops = build()
            except Exception as e:  # compiler missing, headers missing, link failure
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                _load_error = first
                print(f"hybridsparse: compiled kernels unavailable ({first}); using the pure-torch twins",
                      file=sys.stderr)
    return _ops


def available() -> bool:
    return ops() is not None


def cuda_supports(qtype: Q) -> bool:
    o = ops()
    return o is not None and qtype in CUDA_QTYPES and hasattr(o, "qmatmul") and _has_cuda_kernels()


_cuda_built: bool | None = None


def _has_cuda_kernels() -> bool:
    global _cuda_built
    if _cuda_built is None:
        o = ops()
        try:
            _cuda_built = bool(o.has_cuda())
        except (AttributeError, RuntimeError):
            _cuda_built = False
    return _cuda_built


# --- the ops and their twins ---------------------------------------------------------------------

def validate_matmul(data: torch.Tensor, qtype: Q, x: torch.Tensor, op: str = "qmatmul") -> None:
    """The compiled ops check their arguments too, but a C++ exception crashed the process on the GPU
    machine (torch 2.11 + CUDA 13), so bad arguments are refused here first, in Python."""
    if not isinstance(qtype, Q):
        try:
            qtype = Q(qtype)
        except ValueError:
            raise ValueError(f"{op}: unsupported weight type id {qtype}") from None
    if qtype not in GGML_QUANT_SIZES or qtype == Q.F32 and data.dtype != torch.float32:
        raise ValueError(f"{op}: unsupported weight type {qtype.name}")
    if data.dim() != 2 or not data.is_contiguous():
        raise ValueError(f"{op}: weight must be a contiguous 2-D tensor")
    if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"{op}: x must be a contiguous float32 [tokens, features] tensor")
    if x.device != data.device:
        raise ValueError(f"{op}: x is on {x.device}, the weight on {data.device}")
    block, size = GGML_QUANT_SIZES[qtype]
    K = x.shape[1]
    row_bytes = data.shape[1] * data.element_size()
    if K % block or row_bytes != K // block * size:
        raise ValueError(f"{op}: weight row has {row_bytes} bytes, expected {K // block * size} for {K} "
                         f"{qtype.name} elements")
    if data.is_cuda and qtype not in FLOAT_TYPES and qtype not in CUDA_QTYPES:
        raise ValueError(f"{op} (CUDA): weight type {qtype.name} is not supported (Q8_0 and Q4_0 are)")
    if data.is_cuda and qtype in CUDA_QTYPES and x.shape[0] > CUDA_MAX_GEMV_TOKENS:
        raise ValueError(f"{op} (CUDA): at most {CUDA_MAX_GEMV_TOKENS} tokens per call, got {x.shape[0]}")


def qmatmul(data: torch.Tensor, qtype: Q, x: torch.Tensor) -> torch.Tensor:
    """The compiled matmul with its arguments checked in Python first (tests, external callers)."""
    validate_matmul(data, qtype, x)
    if data.is_cuda:
        return ops().qmatmul(data, int(qtype), x)
    return cpu.qmatmul(data, int(qtype), x) if ops() is not None else matmul_reference(x, data, Q(qtype))


def matmul_reference(x: torch.Tensor, data: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Twin of `qmatmul`: y[T, rows] = x[T, in] @ dequantize(data).T in float32."""
    rows, n = data.shape[0], _slice_rows(data, qtype)
    if rows <= n:
        return F.linear(x, dequantize(data, qtype))
    return torch.cat([F.linear(x, dequantize(data[i:i + n], qtype)) for i in range(0, rows, n)], dim=-1)


def _our_cuda_gemv(x: torch.Tensor, data: torch.Tensor, qtype: Q) -> bool:
    """Whether `matmul` takes our CUDA row-dot over every row (decode-sized x)."""
    return data.is_cuda and x.shape[0] <= CUDA_MAX_GEMV_TOKENS and (qtype in CUDA_QTYPES or CUDA_GEMV == "ours") \
        and _cuda_sparse_ok(data, qtype, x.shape[0])


def matmul_add(x: torch.Tensor, data: torch.Tensor, qtype: Q, res: torch.Tensor) -> torch.Tensor:
    """res + x . W^T (a residual connection after a projection): on CUDA with decode-sized x, our GEMV
    adds res as it writes its rows, one kernel where a GEMV and an add were two (and the add broke
    the chain of kernels that HS_CUDA_PDL lets overlap); otherwise `matmul`, then the add."""
    if _our_cuda_gemv(x, data, qtype) and res.dtype == torch.float32 and res.device == data.device \
            and tuple(res.shape) == (x.shape[0], data.shape[0]):
        return ops().matmul_add(data, int(qtype), x.contiguous(), res.contiguous())
    return res + matmul(x, data, qtype)


def matmul_add_reference(x: torch.Tensor, data: torch.Tensor, qtype: Q, res: torch.Tensor) -> torch.Tensor:
    """Twin of the CUDA `matmul_add` op."""
    return res + matmul_reference(x, data, qtype)


class Norm:
    """The norm a layer applies to x before a projection: RMS norm, or layer norm (with an optional
    bias); calling it normalizes x, and `matmul_fused` folds it into a CUDA decode GEMV."""
    __slots__ = ("weight", "eps", "bias", "layer")

    def __init__(self, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None, layer: bool = False):
        self.weight, self.eps, self.bias, self.layer = weight, eps, bias, layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps) if self.layer else rms_norm(x, self.weight, self.eps)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer:
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)


def fused_ok(x: torch.Tensor, data: torch.Tensor, qtype: Q, norm: Norm | None = None) -> bool:
    """Whether `matmul_fused` runs as one CUDA kernel for this x, weight and norm (an RMS norm; a
    layer norm's mean would need more than the GEMV's own pass over x; weights small enough that a
    kernel less is worth more than the fused GEMV's slower stream, see CUDA_FUSE), else its steps run
    apart."""
    return CUDA_FUSE != "0" and data.is_cuda and qtype in CUDA_FUSED_QTYPES and x.is_cuda and x.dtype == torch.float32 \
        and (CUDA_FUSE == "1" or data.numel() * data.element_size() <= CUDA_FUSE_MAX_BYTES) \
        and 1 <= x.shape[0] <= CUDA_FUSED_MAX_TOKENS and _cuda_sparse_ok(data, qtype, x.shape[0]) \
        and (norm is None or (not norm.layer and norm.weight.is_cuda and norm.weight.dtype == torch.float32
                              and norm.weight.is_contiguous() and norm.weight.data_ptr() % 16 == 0))


def matmul_fused(x: torch.Tensor, data: torch.Tensor, qtype: Q, norm: Norm | None = None, act: str | None = None,
                 act_on_up: bool = False) -> torch.Tensor:
    """`matmul` of norm(x) (norm None: x); with `act`, the rows are gate rows then up rows and the result
    is act(gate) * up (act_on_up: * act(up)), [T, rows / 2]. One CUDA kernel where `fused_ok`, else
    the twin's steps apart, each as the runtime runs it."""
    if not fused_ok(x, data, qtype, norm):
        return matmul_fused_reference(x, data, qtype, norm, act, act_on_up, step=matmul)
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    return ops().rowdot_fused(data, int(qtype), x, None if norm is None else norm.weight,
                              0.0 if norm is None else float(norm.eps), -1 if act is None else ACTIVATION_IDS[act],
                              act_on_up)


def matmul_fused_reference(x: torch.Tensor, data: torch.Tensor, qtype: Q, norm: Norm | None = None,
                           act: str | None = None, act_on_up: bool = False, step=None) -> torch.Tensor:
    """Twin of the CUDA `rowdot_fused` op: the norm, the matmul, the gated activation, one after
    another (torch's ops; with `step` given, the norm and that matmul as the runtime runs them apart)."""
    if norm is not None:
        x = norm(x) if step is not None else norm.reference(x)
    y = (step or matmul_reference)(x, data, qtype)
    if act is None:
        return y
    from .layers import FFNSpec, gated_act_reference  # layers imports this module: import at call time
    return gated_act_reference(*y.chunk(2, dim=-1), FFNSpec(act, act_on_up=act_on_up))


def matmul(x: torch.Tensor, data: torch.Tensor, qtype: Q) -> torch.Tensor:
    """x [T, in] float32 times the weight [rows, in] (stored format) transposed -> [T, rows] float32."""
    if data.is_cuda:
        if _our_cuda_gemv(x, data, qtype):
            # decode: our GEMV reads the stored rows and takes/gives float32 (no cast kernels)
            return ops().sparse_rowdot(data, int(qtype), x.contiguous(), None, None)
        if qtype in FLOAT_TYPES:
            return F.linear(x.to(data.dtype), data).float()
        # prefill: dequantize a slice of rows at a time to float16 and use cuBLAS
        n, xh = _slice_rows(data, qtype), x.half()
        return torch.cat([F.linear(xh, dequantize_f16(data[i:i + n], qtype)).float()
                          for i in range(0, data.shape[0], n)], dim=-1)
    if qtype == Q.F32:
        return F.linear(x, data)
    if x.shape[0] >= cpu_gemm_tokens(qtype):
        return cpu_gemm(x, data, qtype)
    if qtype in CPU_QTYPES and ops() is not None:
        return cpu.qmatmul(data, int(qtype), x.contiguous())
    return matmul_reference(x, data, qtype)


def dequantize_f16(data: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Rows of a weight as float16 [rows, elements]: on the GPU, Q4_0 / Q8_0 in one compiled kernel
    (csrc/cuda_sparse.cu; the torch twin takes several float32 passes), otherwise the twin, which gives
    the same values (d * q is exact in float32 and rounded once)."""
    if (data.is_cuda and qtype in CUDA_QTYPES and data.dtype == torch.uint8 and data.is_contiguous()
            and _has_cuda_kernels()):
        return ops().dequantize_f16(data, int(qtype))
    return dequantize(data, qtype).half()


# Formats the compiled dequantizer reads (csrc/dequant.cpp); others go through the torch twin.
# (float16 / bfloat16: torch's own conversion is faster)
CPU_DEQUANT_TYPES = {Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K}


_SCRATCH = threading.local()


def dequantize_cpu(data: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Rows of a CPU weight as float32: compiled and parallel where it can, into this thread's scratch
    buffer (valid until its next call), else the torch twin (a new tensor)."""
    if qtype in CPU_DEQUANT_TYPES and ops() is not None and data.shape[0] > 0 and (data.is_contiguous() or data.shape[0] == 1):
        need = data.shape[0] * row_elements(qtype, data.shape[1] * data.element_size())
        buf = getattr(_SCRATCH, "buf", None)
        if buf is None or buf.numel() < need:
            buf = _SCRATCH.buf = torch.empty(need, dtype=torch.float32)
        return cpu.dequantize(data, int(qtype), buf)
    return dequantize(data, qtype)


# CPU GEMMs (prompts of CPU_GEMM_TOKENS tokens or more, big batches) in bfloat16 where the CPU has
# bfloat16 instructions (AVX512-BF16 or AMX, which torch's oneDNN kernels use): x, each dequantized
# slice of rows and the products rounded to bfloat16, the sums in float32. For block-format (and
# bfloat16) weights, where llama.cpp itself meets the rows with 8-bit activations; float16 weights
# keep float32. HS_CPU_GEMM_BF16=0: never, =1: on any CPU (emulated where it lacks the instructions).
CPU_GEMM_BF16 = os.environ.get("HS_CPU_GEMM_BF16", "auto")


def cpu_gemm_bf16(qtype: Q) -> bool:
    """Whether `cpu_gemm` and its sparse forms multiply rows of this type in bfloat16."""
    if CPU_GEMM_BF16 == "0" or qtype in (Q.F32, Q.F16):
        return False
    return CPU_GEMM_BF16 == "1" or _cpu_has_bf16()


def cpu_gemm_tokens(qtype: Q) -> int:
    """From how many tokens a CPU matmul of rows of this type takes `cpu_gemm`."""
    if qtype in (Q.Q4_0, Q.Q5_0, Q.Q8_0) and _cpu_prompt_rows16():
        return CPU_GEMM_TOKENS_ROWS16
    return CPU_GEMM_TOKENS_BF16 if cpu_gemm_bf16(qtype) else CPU_GEMM_TOKENS


@functools.cache
def _cpu_prompt_rows16() -> bool:
    """Whether the compiled CPU kernels take a prompt's Q4_0 / Q5_0 / Q8_0 rows 16 at a time (AVX-512 VNNI;
    HS_PROMPT_ROWS16=0 at start: not). Asked once: every CPU matmul's switch to the GEMM looks at it,
    decode steps included (asking the extension and the environment each time cost ~2 us a matmul)."""
    return ops() is not None and cpu.cpu_path() == "avx512" and os.environ.get("HS_PROMPT_ROWS16") != "0"


@functools.cache
def _cpu_has_bf16() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without these probes
        return False


def _rows_for_gemm(rows: torch.Tensor, qtype: Q, bf16: bool) -> torch.Tensor:
    """A slice of stored rows as the GEMM takes them: float32, or bfloat16 (bfloat16 rows as they are)."""
    if bf16 and qtype == Q.BF16:
        return rows
    w = dequantize_cpu(rows, qtype)
    return w.to(torch.bfloat16) if bf16 else w


def _gemm_into(x: torch.Tensor, xb: torch.Tensor | None, w: torch.Tensor, out: torch.Tensor) -> None:
    """out = x @ w.T, in bfloat16 when xb (x as bfloat16) is given."""
    if xb is None:
        torch.matmul(x, w.T, out=out)
    else:
        out.copy_(torch.matmul(xb, w.T))


def cpu_gemm(x: torch.Tensor, data: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Many tokens on the CPU: dequantize a slice of rows at a time (never the whole weight in float32)
    and let torch's GEMM do the arithmetic (in bfloat16 where `cpu_gemm_bf16`)."""
    rows = data.shape[0]
    out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    bf16 = cpu_gemm_bf16(qtype)
    xb = x.to(torch.bfloat16) if bf16 else None
    for i in range(0, rows, _CPU_GEMM_CHUNK_ROWS):
        _gemm_into(x, xb, _rows_for_gemm(data[i:i + _CPU_GEMM_CHUNK_ROWS], qtype, bf16),
                   out[:, i:i + _CPU_GEMM_CHUNK_ROWS])
    return out


def cpu_gemm_rows(x: torch.Tensor, data: torch.Tensor, qtype: Q, idx: torch.Tensor | None) -> torch.Tensor:
    """`cpu_gemm` over the rows idx (None: all): each slice of listed rows gathered, dequantized once for
    all the tokens, multiplied by torch's GEMM (the sparse row-dot of a long prefill or a big batch)."""
    if idx is None:
        return cpu_gemm(x, data, qtype)
    out = torch.empty(x.shape[0], idx.numel(), dtype=torch.float32)
    bf16 = cpu_gemm_bf16(qtype)
    xb = x.to(torch.bfloat16) if bf16 else None
    for i in range(0, idx.numel(), _CPU_GEMM_CHUNK_ROWS):
        rows = data.index_select(0, idx[i:i + _CPU_GEMM_CHUNK_ROWS].long())
        _gemm_into(x, xb, _rows_for_gemm(rows, qtype, bf16), out[:, i:i + _CPU_GEMM_CHUNK_ROWS])
    return out


def cpu_gemm_t_rows(h: torch.Tensor, data: torch.Tensor, qtype: Q, idx: torch.Tensor | None) -> torch.Tensor:
    """y[T, in] = h[T, |idx|] @ dequantize(data[idx]), a slice of gathered rows at a time (the sparse
    axpy of a long prefill or a big batch; in bfloat16 where `cpu_gemm_bf16`, summed in float32)."""
    n = data.shape[0] if idx is None else idx.numel()
    bf16 = cpu_gemm_bf16(qtype)
    hh = h.to(torch.bfloat16) if bf16 else h
    out = None
    for i in range(0, n, _CPU_GEMM_CHUNK_ROWS):
        rows = data[i:i + _CPU_GEMM_CHUNK_ROWS] if idx is None else \
            data.index_select(0, idx[i:i + _CPU_GEMM_CHUNK_ROWS].long())
        part = hh[:, i:i + _CPU_GEMM_CHUNK_ROWS] @ _rows_for_gemm(rows, qtype, bf16)
        out = part.float() if out is None else out.add_(part)
    return out if out is not None else h.new_zeros(h.shape[0], row_elements(qtype, data.shape[1] * data.element_size()))


def matmul_t_reference(h: torch.Tensor, data: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Twin of `qmatmul_t`: y[T, in] = h[T, rows] @ dequantize(data)."""
    return h @ dequantize(data, qtype)


def matmul_t(h: torch.Tensor, data: torch.Tensor, qtype: Q) -> torch.Tensor:
    """h [T, rows] times the weight [rows, in] (stored format) -> [T, in] float32."""
    if data.is_cuda and qtype in FLOAT_TYPES:
        return (h.to(data.dtype) @ data).float()
    if data.is_cuda:  # a slice of rows at a time in float16: never a float32 copy of the whole weight
        hh, out, n = h.half(), None, _slice_rows(data, qtype)
        for i in range(0, data.shape[0], n):
            part = hh[:, i:i + n] @ dequantize_f16(data[i:i + n], qtype)
            out = part.float() if out is None else out + part.float()
        return out if out is not None else h.new_zeros(h.shape[0], row_elements(qtype, data.shape[1]))
    if qtype == Q.F32:
        return matmul_t_reference(h, data, qtype)
    if qtype in CPU_AXPY_QTYPES and ops() is not None:
        return cpu.qmatmul_t(data, int(qtype), h.contiguous())
    return matmul_t_reference(h, data, qtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def use_cuda_op(*ts: torch.Tensor) -> bool:
    """The fused CUDA layer ops (csrc/cuda_layers.cu) take float32 tensors on one GPU."""
    return ts[0].is_cuda and _has_cuda_kernels() and all(t.dtype == torch.float32 and t.device == ts[0].device
                                                          for t in ts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        if use_cuda_op(x, weight) and weight.dim() == 1 and weight.shape[0] == x.shape[-1]:
            return ops().rms_norm(x.contiguous(), weight.contiguous(), eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if ops() is not None:
        return cpu.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """torch's layer norm, through the compiled kernel on CUDA (one block per row: torch's took ~15 us
    for one token's row of 8192)."""
    ts = (x, weight) if bias is None else (x, weight, bias)
    if x.is_cuda and use_cuda_op(*ts) and all(t.dim() == 1 and t.shape[0] == x.shape[-1] for t in ts[1:]):
        return ops().layer_norm(x.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(), eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


ACTIVATION_IDS = {"silu": 0, "relu": 1, "gelu": 2, "gelu_erf": 3}


# --- sparse ops over an index set of neurons (rows), with their twins ---------------------------

def _check_index(idx: torch.Tensor | None, rows: int, op: str) -> None:
    """Index sets are checked on the host; on the GPU that costs a synchronisation, so the runtime's
    own calls (check=False) skip it and rely on index sets it built itself."""
    if idx is None:
        return
    if idx.dim() != 1 or idx.dtype != torch.int32:
        raise ValueError(f"{op}: the index set must be an int32 vector, got {idx.dtype} {list(idx.shape)}")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= rows):
        raise ValueError(f"{op}: index {int(idx.max()) if int(idx.max()) >= rows else int(idx.min())} "
                         f"is outside the {rows} rows")


def _check_mask(mask: torch.Tensor | None, rows: int, like: torch.Tensor, op: str) -> None:
    if mask is not None and (mask.dtype != torch.bool or mask.shape != (rows,) or mask.device != like.device):
        raise ValueError(f"{op}: the mask must be a bool vector of {rows} entries on {like.device}, "
                         f"got {mask.dtype} {list(mask.shape)} on {mask.device}")


def _cuda_sparse_ok(data: torch.Tensor, qtype: Q, tokens: int) -> bool:
    """The CUDA kernels read rows in 8-element units, up to 8 tokens per launch."""
    if not data.is_cuda or qtype not in CUDA_SPARSE_QTYPES or tokens > CUDA_MAX_GEMV_TOKENS or not _has_cuda_kernels():
        return False
    n = row_elements(qtype, data.shape[1] * data.element_size())
    return n % 8 == 0 and (qtype not in FLOAT_TYPES or data.data_ptr() % 16 == 0)


def sparse_rowdot_reference(data: torch.Tensor, qtype: Q, x: torch.Tensor, idx: torch.Tensor | None,
                            mask: torch.Tensor | None = None) -> torch.Tensor:
    rows = data if idx is None else data[idx.long()]
    y = F.linear(x, dequantize(rows, qtype).to(x.device)) if rows.shape[0] else x.new_zeros((x.shape[0], 0))
    if mask is not None:
        y = y * (mask if idx is None else mask[idx.long()]).to(y.dtype)
    return y


def sparse_rowdot(data: torch.Tensor, qtype: Q, x: torch.Tensor, idx: torch.Tensor | None,
                  mask: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
    """y[t, k] = W[idx[k]] . x[t] (idx None: every row); rows whose mask entry is False are not
    read and give 0 (the GPU form: the mask comes from the predictor without a host round trip)."""
    if check:
        validate_matmul(data, qtype, x, "sparse_rowdot")
        _check_index(idx, data.shape[0], "sparse_rowdot")
        _check_mask(mask, data.shape[0], data, "sparse_rowdot")
    if _cuda_sparse_ok(data, qtype, x.shape[0]):
        return ops().sparse_rowdot(data, int(qtype), x.contiguous(), idx, mask)
    if not data.is_cuda and mask is None and x.shape[0] >= CPU_SPARSE_GEMM_TOKENS and qtype != Q.F32:
        return cpu_gemm_rows(x, data, qtype, idx)
    if use_cpu_op(x) and qtype in CPU_QTYPES:
        return cpu.sparse_rowdot(data, int(qtype), x, None if idx is None else idx.contiguous(), mask)
    return sparse_rowdot_reference(data, qtype, x, idx, mask)


def sparse_axpy_reference(data: torch.Tensor, qtype: Q, h: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    rows = data if idx is None else data[idx.long()]
    if not rows.shape[0]:
        return h.new_zeros((h.shape[0], row_elements(qtype, data.shape[1] * data.element_size())))
    return h @ dequantize(rows, qtype).to(h.device)


def sparse_axpy(data: torch.Tensor, qtype: Q, h: torch.Tensor, idx: torch.Tensor | None,
                check: bool = True) -> torch.Tensor:
    """y[t] = sum_k h[t, k] * W_t[idx[k]] (idx None: every row); the compiled ops skip the rows
    whose h is zero for every token, so a dense h with zeros is the mask form."""
    if check:
        _check_index(idx, data.shape[0], "sparse_axpy")
        n = data.shape[0] if idx is None else idx.numel()
        if h.dim() != 2 or h.dtype != torch.float32 or h.shape[1] != n or h.device != data.device:
            raise ValueError(f"sparse_axpy: h must be float32 [tokens, {n}] on {data.device}")
    if _cuda_sparse_ok(data, qtype, 0):
        return ops().sparse_axpy(data, int(qtype), h.contiguous(), idx)
    if not data.is_cuda and h.shape[0] >= CPU_SPARSE_GEMM_TOKENS and qtype != Q.F32:
        return cpu_gemm_t_rows(h, data, qtype, idx)
    if use_cpu_op(h) and qtype in CPU_AXPY_QTYPES:
        return cpu.sparse_axpy(data, int(qtype), h.contiguous(), None if idx is None else idx.contiguous())
    return sparse_axpy_reference(data, qtype, h, idx)


def sparse_ffn_reference(x, up, up_type, gate, gate_type, down_t, down_type, idx, up_bias, activation, act_on_up,
                         rowdot=sparse_rowdot_reference, axpy=sparse_axpy_reference, mask=None):
    """Twin of `sparse_ffn`: returns (y, h). (With the compiled rowdot/axpy: the GPU's sparse FFN.)
    With `mask` (bool [T, |idx|]), token t's h is kept only where mask[t] (`sparse_ffn_masked`)."""
    from .layers import ACTIVATIONS  # layers imports this module: import at call time
    act = ACTIVATIONS[activation]
    u = rowdot(up, up_type, x, idx)
    if up_bias is not None:
        u = u + (up_bias if idx is None else up_bias[idx.long()])
    if gate is not None:
        g = rowdot(gate, gate_type, x, idx)
        h = act(g) * (act(u) if act_on_up else u)
    else:
        h = act(u)
    if mask is not None:
        h = h * mask.to(h.dtype)
    return axpy(down_t, down_type, h, idx), h


def cpu_ffn_reads(up_type, gate_type, down_type) -> bool:
    """Whether the compiled CPU sparse FFN reads these weight types (gate_type None: no gate)."""
    rows = {Q(up_type)} | (set() if gate_type is None else {Q(gate_type)})
    return rows <= CPU_QTYPES and Q(down_type) in CPU_AXPY_QTYPES


def sparse_ffn(x, up, up_type, gate, gate_type, down_t, down_type, idx, up_bias=None, activation="relu",
               act_on_up=False, check: bool = True):
    """The FFN over the neurons idx (None: all): (y [T, d_model], h [T, |idx|]). check=False: the
    runtime's own index sets (a decode step's layer saves two reductions; the compiled op still refuses
    an id outside the rows)."""
    validate_matmul(up, up_type, x, "sparse_ffn")
    if gate is not None:
        validate_matmul(gate, gate_type, x, "sparse_ffn")
    if check:
        _check_index(idx, up.shape[0], "sparse_ffn")
    if use_cpu_op(x) and cpu_ffn_reads(up_type, None if gate is None else gate_type, down_type):
        return cpu.sparse_ffn(x, up, int(up_type), gate, int(gate_type) if gate is not None else 0, down_t,
                              int(down_type), None if idx is None else idx.contiguous(), up_bias,
                              ACTIVATION_IDS[activation], act_on_up)
    if x.is_cuda:  # the CUDA row-dot and axpy where they read the format, else the twins
        return sparse_ffn_reference(x, up, up_type, gate, gate_type, down_t, down_type, idx, up_bias, activation,
                                    act_on_up, rowdot=lambda w, q, xx, i: sparse_rowdot(w, q, xx, i, check=False),
                                    axpy=lambda w, q, hh, i: sparse_axpy(w, q, hh, i, check=False))
    return sparse_ffn_reference(x, up, up_type, gate, gate_type, down_t, down_type, idx, up_bias, activation,
                                act_on_up)


def sparse_ffn_masked_reference(x, up, up_type, gate, gate_type, down_t, down_type, idx, mask, up_bias=None,
                                activation="relu", act_on_up=False):
    """Twin of `sparse_ffn_masked`."""
    return sparse_ffn_reference(x, up, up_type, gate, gate_type, down_t, down_type, idx, up_bias, activation,
                                act_on_up, mask=mask)


def sparse_ffn_masked(x, up, up_type, gate, gate_type, down_t, down_type, idx, mask, up_bias=None,
                      activation="relu", act_on_up=False):
    """Several tokens over the union idx of their active sets, token t only with the neurons where
    mask[t, k] (bool [T, |idx|]): (y [T, d_model], h [T, |idx|], 0 outside the mask). On the CPU each
    listed row is read once and only the kept (token, neuron) pairs are computed."""
    validate_matmul(up, up_type, x, "sparse_ffn")
    _check_index(idx, up.shape[0], "sparse_ffn")
    if mask.dtype != torch.bool or mask.shape != (x.shape[0], idx.numel()):
        raise ValueError(f"sparse_ffn: the per-token mask must be bool [{x.shape[0]}, {idx.numel()}], got "
                         f"{mask.dtype} {list(mask.shape)}")
    if use_cpu_op(x) and cpu_ffn_reads(up_type, None if gate is None else gate_type, down_type):
        return cpu.sparse_ffn_masked(x.contiguous(), up, int(up_type), gate, int(gate_type) if gate is not None else 0,
                                     down_t, int(down_type), idx.contiguous(), mask.contiguous(), up_bias,
                                     ACTIVATION_IDS[activation], act_on_up)
    return sparse_ffn_masked_reference(x, up, up_type, gate, gate_type, down_t, down_type, idx, mask, up_bias,
                                       activation, act_on_up)


class polled_handover:
    """`with polled_handover() as tasks:` around a CUDA graph's capture: the hybrid layers captured
    inside hand over to the CPU by polling, and `tasks` lists their tasks in order; whoever replays
    the graph must then call serve_polled(tasks) (else the GPU gives up after HANDOVER_TIMEOUT_S and
    every later serve fails until the model is loaded again).
    Outside (eager steps) and with HS_HANDOVER=node, hybrid layers use host nodes."""

    def __enter__(self) -> list[int]:
        global _polled_tasks
        self.outer, self.tasks = _polled_tasks, []
        if HANDOVER == "poll" and host_nodes_available():
            _polled_tasks = self.tasks
        return self.tasks

    def __exit__(self, *exc):
        global _polled_tasks
        _polled_tasks = self.outer


def polling() -> bool:
    """Whether a hybrid layer queued now hands over by polling (inside polled_handover)."""
    return _polled_tasks is not None


def enqueue_polled(task: int, x: torch.Tensor, mask: torch.Tensor | None, y: torch.Tensor,
                   counter: torch.Tensor) -> None:
    """The task's polled hand-over on the current stream (see polled_handover), listed for serving."""
    cpu.cold_ffn_enqueue_polled(task, x, mask, y, counter, HANDOVER_TIMEOUT_S)
    _polled_tasks.append(task)


def serve_polled(tasks: list[int], use_pool: bool = True) -> None:
    """Run one replay's polled tasks on this thread as the GPU hands them over; raise what they met.
    use_pool=False: on this thread's OpenMP team instead of the spinning pool (steps whose CPU layers
    use that team)."""
    if tasks:
        cpu.cold_ffn_serve(tasks, HANDOVER_TIMEOUT_S, use_pool)
        raise_host_errors()


def host_nodes_available() -> bool:
    """Whether a hybrid layer's cold FFN can run as a host node of the CUDA stream."""
    return HOST_NODES and _has_cuda_kernels()


def cold_ffn_task(x, mask, ids, y, up, up_type, gate, gate_type, down_t, down_type, up_bias, activation,
                  act_on_up) -> int:
    """A layer's cold FFN as a task for host nodes (csrc/cold_ffn.cpp) over the pinned buffers x,
    mask (one bool per id), y; checked here first (a C++ exception takes the GPU machine's process down;
    the task itself runs where none can be raised). Free it with cpu.cold_ffn_free."""
    op = "cold_ffn"
    if ops() is None:
        raise RuntimeError(f"{op}: the compiled kernels are unavailable")
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype != torch.float32 or not x.is_contiguous() or x.is_cuda:
        raise ValueError(f"{op}: x must be a contiguous float32 [1, d_model] CPU tensor")
    if y.shape != x.shape or y.dtype != torch.float32 or not y.is_contiguous() or y.is_cuda:
        raise ValueError(f"{op}: y must be a contiguous float32 CPU tensor shaped like x {list(x.shape)}")
    if mask.dtype != torch.bool or not mask.is_contiguous() or mask.numel() != ids.numel() or mask.is_cuda:
        raise ValueError(f"{op}: mask must be a contiguous bool CPU tensor with one entry per id ({ids.numel()})")
    if not ids.is_contiguous() or ids.is_cuda:
        raise ValueError(f"{op}: ids must be a contiguous CPU vector")
    _check_index(ids, up.shape[0], op)
    if not cpu_ffn_reads(up_type, None if gate is None else gate_type, down_type):
        types = [Q(up_type).name] + ([] if gate is None else [Q(gate_type).name])
        raise ValueError(f"{op}: weight types {sorted(set(types))} / {Q(down_type).name} are not ones the "
                         "compiled CPU FFN reads")
    validate_matmul(up, up_type, x, op)
    if gate is not None:
        validate_matmul(gate, gate_type, x, op)
    if down_t.dim() != 2 or down_t.shape[0] != up.shape[0] or not down_t.is_contiguous():
        raise ValueError(f"{op}: ffn_down_t must be a contiguous [{up.shape[0]}, d_model] tensor")
    if up_bias is not None and (up_bias.shape != (up.shape[0],) or up_bias.dtype != torch.float32 or up_bias.is_cuda
                                or not up_bias.is_contiguous()):
        raise ValueError(f"{op}: up bias must be a contiguous float32 [{up.shape[0]}] CPU vector")
    return cpu.cold_ffn_new(x, mask, ids, y, up, int(up_type), gate, int(gate_type), down_t, int(down_type), up_bias,
                            ACTIVATION_IDS[activation], act_on_up)


def raise_host_errors() -> None:
    """Raise the first error a cold-FFN host node met (they cannot raise where they run)."""
    if cpu is not None:
        err = cpu.cold_ffn_error()
        if err:
            raise RuntimeError(f"the CPU part of a hybrid layer failed: {err}")


def pool_rest() -> None:
    """The host nodes' spinning threads (csrc/pool.cpp) sleep now: this thread is about to run CPU work
    with its own OpenMP team (a layer whose attention stays on the CPU). Called after the stream is done."""
    if cpu is not None:
        cpu.pool_rest()


def use_cpu_op(t: torch.Tensor) -> bool:
    return not t.is_cuda and ops() is not None


def cpu_block_ok(x: torch.Tensor, ws, cache=None) -> bool:
    """Whether one token's attention half runs as the compiled `attention_block` (or, without a cache,
    its FFN half as `ffn_block`): x contiguous float32 on the CPU, weights the CPU GEMV would take for
    it (linear_many's test), a float32 or float16 cache (a list of caches: a batch)."""
    return (not x.is_cuda and x.dtype == torch.float32 and x.is_contiguous() and ops() is not None
            and (cache is None or (not isinstance(cache, list) and cache.k.dtype in (torch.float32, torch.float16)))
            and all(w.qtype in CPU_QTYPES and x.shape[0] < cpu_gemm_tokens(w.qtype) for w in ws))


if __name__ == "__main__":  # `python -m hybridsparse.runtime.kernels`: build now (make install)
    build(verbose="-v" in sys.argv)
    print(f"hybridsparse: kernels ready (CPU path: {cpu.cpu_path()}, CUDA: {_has_cuda_kernels()})")
