"""The hybrid decode's CPU side alone, on real-scale layers of a model file (not a test): one layer's
cold FFN task (csrc/cold_ffn.cpp: mask compaction, the fused FFN on the spinning pool) run back to
back over several layers with fresh random masks, in GiB/s of the rows read, side by side with
  - the fused FFN called directly (OpenMP threads of this thread; compaction not counted),
  - the task with OpenMP threads (HS_COLD_POOL=0),
  - the task with a pause between calls (the GPU's share of a step; the pool's threads idle),
  - the task over anonymous copies of the same rows (where the file is on tmpfs: 4 KiB pages).
  python tests/gpu/cold_task_bench.py MODEL.gguf [DENSITY] [LAYERS]   (HS_THREADS, default 16)"""

import os
import sys
import time

import torch

from hybridsparse.runtime import kernels
from hybridsparse.runtime.gguf_file import GGUFFile
from hybridsparse.runtime.weights import QWeight

kernels.ops()
path, density = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.065
n_layers = int(sys.argv[3]) if len(sys.argv) > 3 else 6
threads = int(os.environ.get("HS_THREADS", "16"))
torch.set_num_threads(threads)
g = GGUFFile(path)
# GELU, not the model's ReLU: every listed neuron then reads its down row too, so the bytes counted are
# the bytes read (random weights and x fire half of the ReLU neurons; planted models fire the predicted)
act = "gelu"


def weight(name):
    info = g.tensors[name]
    return QWeight.from_raw(g.raw(name), info.qtype, info.shape[0])


layers = []
for i in range(n_layers):
    up, down = weight(f"blk.{i}.ffn_up.weight"), weight(f"blk.{i}.ffn_down_t.weight")
    gate = weight(f"blk.{i}.ffn_gate.weight") if f"blk.{i}.ffn_gate.weight" in g.tensors else None
    layers.append((up, gate, down))
d, n_ff = layers[0][0].in_features, layers[0][0].data.shape[0]
row_bytes = sum(q.row_bytes for q in layers[0] if q is not None)
gen = torch.Generator().manual_seed(0)
x, y = torch.randn(1, d), torch.zeros(1, d)
ids = torch.arange(n_ff, dtype=torch.int32)
mask = torch.zeros(1, n_ff, dtype=torch.bool)


def tasks(ls):
    return [kernels.cold_ffn_task(x, mask, ids, y, u.data, u.qtype, None if gt is None else gt.data,
                                  (gt or u).qtype, dn.data, dn.qtype, None, act, False) for u, gt, dn in ls]


def run(label, ts, reps=48, pause=0.0, direct=None):
    times, rows = [], 0
    for r in range(reps):
        mask.copy_(torch.rand(1, n_ff, generator=gen) < density)
        x.normal_(generator=gen)
        k = r % len(direct or ts)
        t0 = time.perf_counter()
        if direct:
            u, gt, dn = direct[k]
            kernels.sparse_ffn(x, u.data, u.qtype, None if gt is None else gt.data, (gt or u).qtype, dn.data,
                               dn.qtype, ids[mask[0]], None, act, False)
        else:
            kernels.cpu.cold_ffn_run(ts[k])
        times.append(time.perf_counter() - t0)
        rows += int(mask.sum())
        if pause:
            time.sleep(pause)
    dt = sum(times[4:]) / len(times[4:])
    gib = rows / reps * row_bytes / dt / 2**30
    print(f"{label:34s} {dt * 1e3:7.3f} ms per layer  {gib:6.1f} GiB/s", flush=True)


ts = tasks(layers)
print(f"{path}: {n_layers} layers, {n_ff} neurons x {row_bytes} bytes, density {density}, {threads} threads, "
      f"cpu path {kernels.cpu.cpu_path()}")
for rep in range(2):
    run("task (pool)", ts)
    run("fused FFN direct (OpenMP)", None, direct=layers)
    os.environ["HS_COLD_POOL"] = "0"
    run("task (OpenMP)", ts)
    del os.environ["HS_COLD_POOL"]
    run("task (pool), 0.3 ms pause between", ts, pause=3e-4)
    kernels.cpu.cold_ffn_set_threads(threads - 1)
    run(f"task (pool), {threads - 1} threads", ts)
    kernels.cpu.cold_ffn_set_threads(threads)
anon = [tuple(None if q is None else QWeight(q.data.clone(), q.qtype, q.in_features) for q in lay) for lay in layers]
ts_anon = tasks(anon)
run("task (pool), anonymous copies", ts_anon)
run("task (pool), file mapping", ts)
run("task (pool), anonymous copies", ts_anon)
for t in ts + ts_anon:
    kernels.cpu.cold_ffn_free(t)
