"""Where a CPU-only decode step's time goes (tool): MODEL loaded for the CPU alone (hybrid form at
budget 0, predictors on, as `hs-run --vram-budget 0`), a prompt of HS_PARTS_PROMPT tokens (default 64,
as the scenarios), then N tokens decoded one at a time, and the host time
of each call the llama block makes (q/k/v GEMVs with the norm, rotary, attention, the output GEMV with
the residual, the FFN with its norm, predictor and the sparse FFN) summed per token, with the GiB/s of
the dense GEMVs on the bytes they read. The calls are timed by wrapping the names the model module
calls; the parts and the step are timed in separate runs (so the wrappers' own cost shows as the
difference), with each half of the block as its separate calls (the default step makes each one compiled
call, attention_block and sparse_ffn_block, also timed as a whole; the FFN's parts need HS_HYBRID_TIMING,
which this tool sets for that run only). Then the step with the attention op on one thread (what it ran
on below 2^20 multiply-adds until session 26), timed likewise, next to the default. On the GPU machine: the 16-thread Xeon's S5 step.
  HS_THREADS=16 python tests/gpu/cpu_step_parts.py MODEL [N]"""

import os
import sys
import time
from collections import defaultdict

import torch

from hybridsparse.runtime import hybrid, kernels
from hybridsparse.runtime.generate import Generator
from hybridsparse.runtime.hybrid import HybridOptions
from hybridsparse.runtime.loader import open_model
from hybridsparse.runtime.models import llama

kernels.ops()
path = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 16
torch.set_num_threads(int(os.environ.get("HS_THREADS", "16")))
# the commands' float16 KV cache (-ctk/-ctv f16)
lm = open_model(path, hybrid=HybridOptions(vram_budget=0, mode="predictor", n_ctx=512), log_line=lambda *a: None,
                cache_dtype=torch.float16)
model = lm.model
if not isinstance(model, llama.Llama):
    raise SystemExit(f"{path}: a llama-family model is needed (the parts timed are llama's)")
L0 = model.layers[0]
qkv_bytes = sum(w.nbytes for w in (L0.q, L0.k, L0.v))
o_bytes = L0.o.nbytes

spent: dict[str, float] = defaultdict(float)
PARTS = {"linear_many": "q/k/v GEMVs + norm", "rope_qk": "rotary", "attend": "attention",
         "linear_add": "output GEMV + residual", "ffn": "FFN (norm, predictor, sparse FFN)"}
originals = {name: getattr(llama, name) for name in PARTS}


def timed(name, f):
    def call(*args, **kw):
        t = time.perf_counter()
        out = f(*args, **kw)
        spent[name] += time.perf_counter() - t
        return out
    return call


def one_thread(f):
    def call(*args, **kw):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return f(*args, **kw)
        finally:
            torch.set_num_threads(threads)
    return call


prompt = int(os.environ.get("HS_PARTS_PROMPT", "64"))


def run(tokens: int) -> float:
    gen = Generator(model, lm.tokenizer, 512, use_graphs=False)
    with torch.inference_mode():
        gen.eval([1 + i % 1000 for i in range(prompt)])
        for i in range(4):
            gen.eval([5 + i])
        spent.clear()
        if hybrid.TIMING is not None:
            hybrid.TIMING.clear()
        t = time.perf_counter()
        for i in range(tokens):
            gen.eval([9 + i])
        return (time.perf_counter() - t) / tokens


print(f"{path}: {len(model.layers)} layers, {torch.get_num_threads()} threads, CPU path {kernels.cpu.cpu_path()}")
plain = run(n)
# each half as its separate calls (the step's default is one compiled call each: attention_block, sparse_ffn_block)
block_ok, token_block = kernels.cpu_block_ok, hybrid.HybridFFN.token_block
kernels.cpu_block_ok = lambda *a: False
hybrid.HybridFFN.token_block = lambda *a: None
apart = run(n)
for name in PARTS:
    setattr(llama, name, timed(name, originals[name]))
timing, hybrid.TIMING = hybrid.TIMING, {}  # the FFN's predictor and sparse FFN apart
parted = run(n)
parts, ffn_parts = dict(spent), dict(hybrid.TIMING)
hybrid.TIMING = timing
llama.attend = timed("attend", one_thread(originals["attend"]))
serial = run(n)
serial_attend = spent["attend"] / n
for name, f in originals.items():
    setattr(llama, name, f)
kernels.cpu_block_ok, hybrid.HybridFFN.token_block = block_ok, token_block
plain2 = run(n)
print(f"step {plain * 1e3:.2f} / {plain2 * 1e3:.2f} ms per token (plain, twice), {apart * 1e3:.2f} with each"
      f" half's calls apart, {parted * 1e3:.2f} so and timed (prompt {prompt}, {n} tokens)")
print(f"attention op on one thread: step {serial * 1e3:.2f} ms, attention {serial_attend * 1e3:.2f} ms "
      f"(on {torch.get_num_threads()}: {parts['attend'] / n * 1e3:.2f})")
layers = len(model.layers)
for name, label in PARTS.items():
    ms = parts[name] / n * 1e3
    extra = ""
    if name == "linear_many":
        extra = f"  {qkv_bytes * layers / (parts[name] / n) / 2**30:6.1f} GiB/s on q/k/v"
    elif name == "linear_add":
        extra = f"  {o_bytes * layers / (parts[name] / n) / 2**30:6.1f} GiB/s on o"
    print(f"  {label:36s} {ms:7.2f} ms  ({ms / layers * 1e3:6.1f} us a layer){extra}")
rest = parted - sum(parts.values()) / n
print(f"  {'rest (embedding, head, Python)':36s} {rest * 1e3:7.2f} ms")
if ffn_parts:
    for k, v in sorted(ffn_parts.items(), key=lambda kv: -kv[1]):
        print(f"    within the FFN: {k:20s} {v / n * 1e3:7.2f} ms")
