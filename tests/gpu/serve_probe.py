"""Batched decode of the hybrid runtime as hs-serve runs it (CausalLM.forward_batch over N sequences,
each with its own KV cache), timed step by step with the hybrid's per-part host times: where a
many-client step spends its time. Usage: serve_probe.py MODEL VRAM_GIB N [N ...]"""

import faulthandler
import os
import sys
import time

import torch

os.environ.setdefault("HS_HYBRID_TIMING", "1")
from hybridsparse.runtime import hybrid as H  # noqa: E402
from hybridsparse.runtime.generate import Generator  # noqa: E402
from hybridsparse.runtime.loader import open_model  # noqa: E402

path, budget, sizes = sys.argv[1], float(sys.argv[2]), [int(a) for a in sys.argv[3:]]
torch.set_num_threads(int(os.environ.get("HS_THREADS", "16")))
faulthandler.dump_traceback_later(float(os.environ.get("HS_PROBE_TIMEOUT", "200")), exit=True)
lm = open_model(path, hybrid=H.HybridOptions(vram_budget=budget, n_ctx=256 * max(sizes)), log_line=lambda *a: None)
gens = [Generator(lm.model, lm.tokenizer, 256) for _ in range(max(sizes))]


def step(gs, toks):
    torch.cuda.synchronize()
    H.TIMING.clear()
    t = time.perf_counter()
    with torch.inference_mode():
        rows = lm.model.forward_batch(toks, [g.n_past for g in gs], [g.cache for g in gs])
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    for g, tk in zip(gs, toks):
        g.n_past += len(tk)
    parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(H.TIMING.items(), key=lambda kv: -kv[1])[:5])
    return rows, dt, parts


for n in sizes:
    gs = gens[:n]
    for g in gs:
        g.reset()
    prompts = [lm.tokenizer.encode(f"Hello number {i}, tell me a story about") for i in range(n)]
    rows, dt, parts = step(gs, prompts)
    print(f"N={n}: prefill {sum(map(len, prompts))} tokens {dt * 1e3:.0f} ms ({parts})", flush=True)
    for s in range(4):
        rows, dt, parts = step(gs, [[int(r.argmax())] for r in rows])
        print(f"N={n}: decode step {s}: {dt * 1e3:.0f} ms = {n / dt:.0f} tok/s ({parts})", flush=True)
