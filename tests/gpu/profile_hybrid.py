"""Where a hybrid decode step goes (tool): load MODEL in hybrid form at a budget, decode, and print the
host-side time per part of the hybrid FFN (HS_HYBRID_TIMING) and torch's profile of two steps.
  HS_HYBRID_TIMING=1 python tests/gpu/profile_hybrid.py MODEL BUDGET_GIB [MODE]"""

import sys
import time

import torch

from hybridsparse.runtime import hybrid
from hybridsparse.runtime.hybrid import HybridOptions
from hybridsparse.runtime.loader import open_model

model, budget = sys.argv[1], float(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else "sampled"
torch.set_num_threads(16)
lm = open_model(model, hybrid=HybridOptions(vram_budget=budget, mode=mode), log_line=print)
m = lm.model
cache = m.new_cache(128)
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
with torch.inference_mode():
    for i in range(4):
        m.forward(torch.tensor([5]), torch.tensor([i]), cache, i + 1)
    sync()
    hybrid.TIMING.clear()
    n = 8
    t = time.perf_counter()
    for i in range(4, 4 + n):
        m.forward(torch.tensor([5]), torch.tensor([i]), cache, i + 1)
    sync()
    dt = (time.perf_counter() - t) / n
    print(f"{dt * 1e3:.1f} ms per token ({1 / dt:.2f} tok/s); host time per token by part:")
    for k, v in sorted(hybrid.TIMING.items(), key=lambda kv: -kv[1]):
        print(f"  {k:14s} {v / n * 1e3:8.2f} ms")
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as p:
        for i in range(12, 14):
            m.forward(torch.tensor([5]), torch.tensor([i]), cache, i + 1)
        sync()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
