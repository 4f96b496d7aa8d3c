"""Where a decode step's time goes on the GPU (not a test): the kernels of one eager step by device
time, their count and sum, next to the measured time of a CUDA-graph step.
Usage: python tests/gpu/profile_decode.py MODEL.gguf"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hybridsparse.runtime.generate import Generator
from hybridsparse.runtime.loader import open_model

lm = open_model(sys.argv[1], 999)
gen = Generator(lm.model, lm.tokenizer, 512)
model, steps = lm.model, 5
with torch.inference_mode():
    gen.eval(list(range(10, 74)))
    token = torch.tensor([100], device="cuda")
    for i in range(3):  # graph steps, timed
        gen.eval([100])
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(20):
        gen.eval([100])
    torch.cuda.synchronize()
    graph_ms = (time.perf_counter() - t) / 20 * 1e3
    pos = gen.n_past
    model.forward(token, torch.tensor([pos], device="cuda"), gen.cache, 256)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            model.forward(token, torch.tensor([pos + i], device="cuda"), gen.cache, 256)
        torch.cuda.synchronize()
events = prof.key_averages()
kernels = [e for e in events if e.self_device_time_total > 0 and e.device_type.name == "CUDA"]  # not the ops' rows too
kernel_us = sum(e.self_device_time_total for e in kernels) / steps
n_kernels = sum(e.count for e in kernels) / steps
print(events.table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=60))
print(f"per decode step: {n_kernels:.0f} kernels, {kernel_us / 1e3:.2f} ms of kernel time; "
      f"CUDA-graph step measured {graph_ms:.2f} ms")
