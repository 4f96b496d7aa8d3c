"""hs-quantize: a GGUF model to Q8_0 / Q4_0 (or F16 / BF16 / F32), llama.cpp's `quantize` for this project.

  hs-quantize IN.gguf OUT.gguf Q4_0 [-t THREADS] [--quantize-predictors] [--pure] [--allow-requantize]

Which tensors change follows llama.cpp: 2-D (and larger) `*.weight` tensors take the target type;
norms, biases and other 1-D tensors stay F32; learned position embeddings keep their type; a tensor
whose rows are not whole 32-element blocks falls back to F16. For Q4_0 the output head (or the tied
token embedding that serves as it) becomes Q8_0, as llama.cpp gives it a higher-precision type
(Q6_K there), unless `--pure`. Predictor tensors (`blk.N.fc1/fc2`) keep their type unless
`--quantize-predictors`. Metadata (tokenizer included), tensor order and the `PWRI` magic are kept;
`general.file_type` says the new type. Blocks are gguf's numpy `quants.quantize` (bit-exact with
ggml's reference), rows split over threads; the output is written atomically.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from .errors import InputError

TARGETS = {"Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0, "F16": Q.F16, "BF16": Q.BF16, "F32": Q.F32}
FILE_TYPE = {Q.F32: 0, Q.F16: 1, Q.Q4_0: 2, Q.Q8_0: 7, Q.BF16: 32}  # llama.cpp's llama_ftype
FLOATS = (Q.F32, Q.F16, Q.BF16)


def tensor_type(name: str, shape: tuple[int, ...], source: Q, target: Q, *, has_output: bool,
                quantize_predictors: bool = False, pure: bool = False) -> Q:
    """The type a tensor gets when the model goes to `target` (shape in numpy order)."""
    if source in (Q.I8, Q.I16, Q.I32, Q.I64, Q.F64):
        return source  # integer tensors (a GPU index's, ...) are data, not weights
    if len(shape) < 2 or not name.endswith(".weight") or "_norm" in name or name.startswith("position_embd"):
        return Q.F32 if len(shape) < 2 else source
    if not quantize_predictors and (".fc1." in name or ".fc2." in name):
        return source if source in FLOATS else Q.F16
    out = target
    if not pure and target == Q.Q4_0 and (name == "output.weight" or (not has_output and name == "token_embd.weight")):
        out = Q.Q8_0
    if out not in FLOATS and shape[-1] % GGML_QUANT_SIZES[out][0]:
        out = Q.F16
    return out


def quantize_rows(arr: np.ndarray, qtype: Q, threads: int = 1) -> np.ndarray:
    """float32 [..., n] -> the stored form of `qtype` (uint8 blocks, or the float dtype), rows split over
    threads (blocks never straddle rows, so the bytes equal one whole-array `quants.quantize`)."""
    from .gguf_writer import as_written
    if qtype not in (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_1, Q.Q5_1):
        return as_written(arr, qtype)
    flat = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1, arr.shape[-1])
    rows = flat.shape[0]
    if threads <= 1 or rows < 64:
        return gguf_quants.quantize(flat, qtype)
    step = max(16, -(-rows // (threads * 4)))
    with ThreadPoolExecutor(threads) as pool:
        parts = list(pool.map(lambda r0: gguf_quants.quantize(flat[r0:r0 + step], qtype), range(0, rows, step)))
    return np.concatenate(parts)


def quantize_gguf(src: str | Path, dst: str | Path, target: str, threads: int = 1, *,
                  quantize_predictors: bool = False, pure: bool = False, allow_requantize: bool = False,
                  log=print) -> Path:
    from .gguf_file import GGUFFile
    from .gguf_writer import PlannedTensor, copy_metadata, write_gguf_stream
    from .quants import dequantize
    if target.upper() not in TARGETS:
        raise InputError(f"type {target!r}: expected one of {', '.join(TARGETS)}")
    qt = TARGETS[target.upper()]
    src, dst = Path(src), Path(dst)
    if dst.exists() and dst.resolve() == src.resolve():
        raise InputError(f"{dst}: the output would overwrite the input")
    g = GGUFFile(src)
    has_output = "output.weight" in g.tensors
    plan, changed = [], 0
    for name, info in g.tensors.items():
        shape = tuple(reversed(info.shape))
        out = tensor_type(name, shape, info.qtype, qt, has_output=has_output,
                          quantize_predictors=quantize_predictors, pure=pure)
        if out == info.qtype:
            plan.append(PlannedTensor(name, shape, out, (lambda n=name: g.raw(n).numpy())))
            continue
        if info.qtype not in FLOATS and not allow_requantize:
            raise InputError(f"{src}: tensor {name} is already {info.qtype.name}; quantizing it again to {out.name} "
                             f"loses precision twice (pass --allow-requantize to do it anyway)")
        changed += 1
        plan.append(PlannedTensor(name, shape, out, (lambda n=name, i=info, o=out: quantize_rows(
            dequantize(g.raw(n), i.qtype).numpy().reshape(tuple(reversed(i.shape))), o, threads))))

    def metadata(w):
        copy_metadata(w, g, skip={"general.file_type", "general.quantization_version"})
        w.add_uint32("general.file_type", FILE_TYPE[qt])
        if qt not in FLOATS:
            w.add_uint32("general.quantization_version", 2)

    write_gguf_stream(dst, g.architecture, metadata, plan, powerinfer=g.flavor == "powerinfer",
                      desc=f"quantizing to {qt.name}")
    before, after = src.stat().st_size, dst.stat().st_size
    counts: dict[str, int] = {}
    for t in plan:
        counts[t.qtype.name] = counts.get(t.qtype.name, 0) + 1
    log(f"hs-quantize: {dst} ({qt.name}): {changed} of {len(plan)} tensors converted, "
        f"{before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB; types: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return dst


def build_parser() -> argparse.ArgumentParser:
    from .cli import default_threads
    p = argparse.ArgumentParser(prog="hs-quantize", description=__doc__.split("\n\n")[0])
    p.add_argument("input", help="GGUF model (llama.cpp or PowerInfer layout), F32/F16/BF16")
    p.add_argument("output", help="GGUF to write (atomically)")
    p.add_argument("type", help="Q8_0, Q4_0, F16, BF16 or F32")
    p.add_argument("-t", "--threads", type=int, default=default_threads(),
                   help="threads (default: %(default)s, the cores available)")
    p.add_argument("--quantize-predictors", action="store_true", help="quantize blk.N.fc1/fc2 too")
    p.add_argument("--pure", action="store_true", help="every weight to the target type (no Q8_0 output head)")
    p.add_argument("--allow-requantize", action="store_true", help="allow already-quantized tensors as input")
    p.add_argument("--verbose", action="store_true", help="tracebacks instead of one-line errors")
    return p


def _run(args) -> int:
    from .cli import use_threads
    quantize_gguf(args.input, args.output, args.type, use_threads(args.threads), quantize_predictors=args.quantize_predictors,
                  pure=args.pure, allow_requantize=args.allow_requantize)
    return 0


def main(argv: list[str] | None = None) -> int:
    from .cli import run_main
    return run_main("hs-quantize", _run, argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
