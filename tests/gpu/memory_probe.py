"""Where a hybrid model's device memory goes (tool, not a test): load MODEL in hybrid form at BUDGET
GiB, then print torch's allocated / reserved bytes and the driver's per-process figure after loading,
after a prompt and after decoding (CUDA graphs captured), beside the plan's own VRAM count, and the
largest live CUDA tensors by what holds them. Usage: memory_probe.py MODEL BUDGET_GIB [PROMPT_TOKENS]"""

import sys
from collections import Counter

import torch

from hybridsparse.runtime.generate import Generator
from hybridsparse.runtime.hybrid import HybridOptions, HybridFFN
from hybridsparse.runtime.loader import open_model
from hybridsparse.runtime.nvml import process_used_bytes

GiB = 2**30
path, budget = sys.argv[1], float(sys.argv[2])
n_prompt = int(sys.argv[3]) if len(sys.argv) > 3 else 64
dev = torch.device("cuda", 0)


def show(stage: str) -> None:
    torch.cuda.synchronize()
    used = process_used_bytes(0) or 0
    print(f"{stage:22s} allocated {torch.cuda.memory_allocated() / GiB:6.3f}  peak allocated "
          f"{torch.cuda.max_memory_allocated() / GiB:6.3f}  reserved {torch.cuda.memory_reserved() / GiB:6.3f}  "
          f"peak reserved {torch.cuda.max_memory_reserved() / GiB:6.3f}  driver {used / GiB:6.3f}  outside torch "
          f"{(used - torch.cuda.memory_reserved()) / GiB:6.3f} GiB", flush=True)


lm = open_model(path, hybrid=HybridOptions(vram_budget=budget, mode="predictor", n_ctx=512), log_line=print)
show("loaded")
m = lm.model
parts = Counter()
for i, layer in enumerate(m.layers):
    f = layer.ffn
    if isinstance(f, HybridFFN):
        parts["hot neurons"] += f.gpu_bytes
        p = f.predictor
        if p is not None and p.fc1.data.is_cuda:
            parts["predictors"] += p.fc1.data.nbytes + p.fc2.data.nbytes
parts["everything else (attention, norms, head, embeddings)"] = torch.cuda.memory_allocated() - sum(parts.values())
for k, v in parts.most_common(12):
    print(f"  {k:40s} {v / GiB:7.3f} GiB")
gen = Generator(m, lm.tokenizer, 512, use_graphs=True)
with torch.inference_mode():
    gen.eval(list(range(1, n_prompt + 1)))
    show(f"after {n_prompt}-token prompt")
    for i in range(8):
        gen.eval([100 + i])
    show("after 8 decode steps")
snap = torch.cuda.memory_snapshot()
sizes = Counter()
for seg in snap:
    sizes[(seg["segment_type"], seg["total_size"] >= 2 * 2**20)] += seg["total_size"]
print("segments (pool, large):", {f"{k[0]}/{'large' if k[1] else 'small'}": round(v / GiB, 3) for k, v in sizes.items()})
free = sum(b["size"] for seg in snap for b in seg["blocks"] if b["state"] == "inactive")
print(f"cached but free: {free / GiB:.3f} GiB in {len(snap)} segments")
