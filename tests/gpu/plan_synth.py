"""The placement a scenario's synthetic model would get, without writing the model (tool; runs on any
machine, no GPU): the layer shapes and stored sizes of `hs-bench synth --shape SHAPE --dtype DTYPE`, its
planted per-layer frequencies, a rank-512 predictor per layer (float16 unless PREDICTOR_TYPE is q8_0/q4_0), solved by the same ILP as
`hs-solve` for a budget and a prefill micro-batch. For S2 (70B Q4_0 at 11 GiB, -ub 128) it gives 80
attentions and 18,880 hot neurons on the GPU, head on the CPU, where the H200's solve of the written
model gave 80, 19,264 and the CPU (session 13; the bandwidths measured there differ a little).
  python tests/gpu/plan_synth.py SHAPE DTYPE BUDGET_GIB [UBATCH] [CPU_GIB_S] [TIME_LIMIT_S] [PREDICTOR_TYPE]
  e.g. python tests/gpu/plan_synth.py relu-llama-2-70b q4_0 11 128 93.4"""

import sys

from gguf import GGML_QUANT_SIZES

from hybridsparse.runtime.synth import DTYPES, MODELS, PREDICTOR_DTYPES, layer_statistics
from hybridsparse.solver.plan import GiB, PREFILL_TOKENS, Hardware, LayerShape, Problem, activation_bytes, solve

shape, dtype, budget = sys.argv[1], sys.argv[2], float(sys.argv[3])
ubatch = int(sys.argv[4]) if len(sys.argv) > 4 else PREFILL_TOKENS
cpu_gib_s = float(sys.argv[5]) if len(sys.argv) > 5 else 93.4
time_limit = float(sys.argv[6]) if len(sys.argv) > 6 else 30.0
pred_type = sys.argv[7] if len(sys.argv) > 7 else "f16"  # as synth's --predictor-type
s = MODELS[shape]
block, block_bytes = GGML_QUANT_SIZES[DTYPES[dtype]]
stored = lambda n: n // block * block_bytes  # bytes of n weights in the stored type
d, ff = s.d, s.ff
kv_dim = s.kv_heads * d // s.heads
attn = stored(d * (2 * d + 2 * kv_dim)) + 2 * 4 * d  # q, k, v, o and two norms
neuron = (3 if s.arch == "llama" else 2) * stored(d)  # gate (llama), up and down rows of one neuron
pred_block, pred_block_bytes = GGML_QUANT_SIZES[PREDICTOR_DTYPES[pred_type]]
predictor = (512 * d + ff * 512) // pred_block * pred_block_bytes
freqs = layer_statistics(s, s.density, s.hot_share, 1)  # as write_synth does with its default seed 0
layers = [LayerShape(ff, neuron, attn, 2 * 512 * kv_dim * 2, predictor, f) for f in freqs]
hw = Hardware(3956 * GiB, cpu_gib_s * GiB, 20e-6)
problem = Problem(layers, stored(s.vocab * d) + 4 * d, d, int(budget * GiB), hw, 64,
                  activation_bytes=activation_bytes(d, ff, ubatch))
plan = solve(problem, time_limit)
r = plan.report
cpu = sum((not a) * L.dense_bytes + float(problem.groups(l)[1][k:].sum()) * L.neuron_bytes
          for l, (L, a, k) in enumerate(zip(layers, plan.attn_gpu, plan.gpu_groups)))
print(f"{shape} {dtype} (predictors {pred_type}) at {budget:g} GiB, -ub {ubatch}: predicted {r['ms_per_token']:.1f} ms/token; attention "
      f"{sum(plan.attn_gpu)}/{len(layers)} on the GPU ({''.join('G' if a else 'c' for a in plan.attn_gpu)}), "
      f"{sum(x['gpu_neurons'] for x in r['layers'])} hot neurons ({100 * r['gpu_activation_share']:.1f}% of the "
      f"activation mass), head on {'GPU' if plan.head_gpu else 'CPU'}; the CPU reads {cpu / 1e9:.2f} GB a token; "
      f"VRAM {r['vram_bytes'] / GiB:.2f} GiB; {plan.status}")
