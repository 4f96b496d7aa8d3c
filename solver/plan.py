"""Neuron placement as an integer linear program (PuLP, solved by CBC), with a cost model.

Per layer l the FFN neurons are sorted by activation frequency and cut into groups of G; the plan
puts a prefix of each layer's groups on the GPU (y[l][g], hottest first), each layer's attention
block (weights + KV cache + predictor) on the GPU or not (a[l]), and the output head (h).

  per-token latency = sum_l max(GPU_l, CPU_l) + sync * (split layers + device changes) + head
  GPU_l = a_l * dense_bytes_l / B_gpu + sum_g y_lg * active_bytes_lg / B_gpu
  CPU_l = (1 - a_l) * dense_bytes_l / B_cpu + sum_g (1 - y_lg) * active_bytes_lg / B_cpu
  dense_bytes_l = attention weights + predictor (the predictor runs on its attention's device)
  active_bytes_lg = (expected active neurons of the group per token) * bytes per neuron row set

subject to every byte of VRAM (weights at their stored size, KV cache, predictors, fixed buffers
and a margin) within the budget, and optionally the PCIe bytes per token within a budget. A layer
is split only where that pays for its sync (the sync term is in the objective). PowerInfer's own
objective, the activation mass the GPU serves, is reported beside it.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np

SOLVER_VERSION = "hs-ilp-7"  # 2: the cost of a decode step without a CUDA graph; 3: STREAM_BYTES; 4: context;
# 5: predictors timed with their attention block, activations for PREFILL_TOKENS; 6: the margin capped at 256 MiB;
# 7: a llama.cpp-layout ffn_down counted as the transposed rows the runtime reads (solver/cli.py transposed_down_info)
GiB = 1 << 30
# VRAM that is not weights: the CUDA context and cuBLAS workspace (the driver counts them), the
# activations, CUDA-graph buffers and allocator slack; plus a margin. The context as the
# driver counts it at its peak, with the kernels loaded lazily on first use: on the H200 machine
# (torch 2.11, CUDA 13) 610 MiB once made and 684-753 MiB outside torch's allocator at the peak of a
# 70B run. At 512 MiB the S2 plan (11 GiB) peaked at 11.09 GiB: the margin had gone to the context.
CUDA_CONTEXT_BYTES = 768 << 20
CUBLAS_WORKSPACE_BYTES = 32 << 20
# The margin: 3% of the budget, at most 256 MiB. What it covers (the driver's growth as kernels load,
# allocator rounding) does not grow with the budget, and the rest is counted closely: the S1 and S2
# hybrid runs of solver versions 4-5 peaked at the budget less the margin to within 2-44 MiB (S1 at
# 24 GiB, on the H200 and on an H100, 23.24 GiB; S2 at 11 GiB 10.67), so at 24 GiB 3% (737 MiB) left
# ~700 MiB unused that 15,000 more of Falcon-40B's hot neurons fill.
MARGIN = 0.03
MARGIN_CAP_BYTES = 256 << 20


def margin_bytes(vram_budget: int) -> int:
    return min(int(MARGIN * vram_budget), MARGIN_CAP_BYTES)


# Two staging slots for cold rows streamed to the GPU during a prefill (runtime.hybrid._Streamer).
STREAM_BYTES = 64 << 20
# Tokens of one prefill micro-batch on the GPU (hs-run -ub): the activations of this many are what the
# plan leaves room for, and a hybrid model on CUDA runs longer prompts in pieces of this size
# (CausalLM.max_batch_tokens). At 512 (llama.cpp's ubatch) a 70B model's reserve was 1.1 GiB, of
# which S2's 64-token prompt used a small part: VRAM that decoding every token could use instead.
PREFILL_TOKENS = 128


def activation_bytes(d_model: int, n_ff: int, tokens: int = PREFILL_TOKENS) -> int:
    """VRAM kept for the activations of a prefill micro-batch: 16 float32 vectors of the model's and
    the FFN's width per token (hidden states, q/k/v, the predictor's scores and mask, the hot rows'
    products), at least 64 MiB."""
    return max(64 << 20, 16 * (d_model + n_ff) * 4 * tokens)


@dataclass
class LayerShape:
    n_ff: int
    neuron_bytes: int  # gate + up + down rows of one neuron, stored sizes
    attn_bytes: int  # attention weights and norms
    kv_bytes: int  # K and V cache (float16) for the context
    predictor_bytes: int
    freq: np.ndarray  # P(active) per neuron
    vram_neuron_bytes: int = 0  # as held on the GPU (formats the CUDA kernels lack become F16); 0: as stored
    vram_attn_bytes: int = 0

    @property
    def gpu_neuron_bytes(self) -> int:
        return self.vram_neuron_bytes or self.neuron_bytes

    @property
    def dense_bytes(self) -> int:
        """What the layer's dense block reads per token on the device it is placed on: the attention
        weights and the predictor, which runs beside them."""
        return self.attn_bytes + self.predictor_bytes

    @property
    def gpu_attn_bytes(self) -> int:
        return self.vram_attn_bytes or self.attn_bytes


@dataclass
class Hardware:
    gpu_bw: float  # bytes/s
    cpu_bw: float
    sync_s: float  # one CPU<->GPU hand-over of the hidden state (latency + transfer)
    pcie_bw: float = 25e9
    pcie_budget: float | None = None  # bytes per token over PCIe
    # Per layer and token, the cost of a decode step run op by op instead of replayed as one CUDA graph,
    # which the runtime can do only when every layer's attention is on the GPU (measured on the H200:
    # 57.7 vs 47.8 ms for 40 layers of a 13B model at 11 GiB, tests/gpu/profile_hybrid.py)
    eager_layer_s: float = 250e-6


@dataclass
class Problem:
    layers: list[LayerShape]
    head_bytes: int
    d_model: int
    vram_budget: int
    hw: Hardware
    group: int = 64
    activation_bytes: int = 64 << 20
    vram_head_bytes: int = 0  # 0: head_bytes
    _groups: dict = field(default_factory=dict, repr=False)

    @property
    def gpu_head_bytes(self) -> int:
        return self.vram_head_bytes or self.head_bytes

    def fixed_vram(self) -> int:
        return (CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + STREAM_BYTES + self.activation_bytes
                + margin_bytes(self.vram_budget))

    def groups(self, l: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(neuron order hottest first, expected active neurons per group, neurons per group), sorted
        once per layer: the solvers and the cost model ask for them many times."""
        if l not in self._groups:
            self._groups[l] = self._sort_groups(l)
        return self._groups[l]

    def _sort_groups(self, l: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        L = self.layers[l]
        order = np.argsort(-L.freq, kind="stable")
        sizes = np.full(math.ceil(L.n_ff / self.group), self.group)
        sizes[-1] = L.n_ff - self.group * (len(sizes) - 1)
        mass = np.add.reduceat(L.freq[order], np.arange(0, L.n_ff, self.group))
        return order, mass, sizes


@dataclass
class Plan:
    gpu_groups: list[int]  # per layer: how many of its hottest groups are on the GPU
    attn_gpu: list[bool]
    head_gpu: bool
    method: str
    status: str = ""
    solve_s: float = 0.0
    report: dict = field(default_factory=dict)

    def gpu_neurons(self, problem: Problem) -> list[np.ndarray]:
        out = []
        for l, k in enumerate(self.gpu_groups):
            order, _, sizes = problem.groups(l)
            out.append(np.sort(order[:int(sizes[:k].sum())]))
        return out


def evaluate(problem: Problem, plan: Plan) -> dict:
    """The cost model of a plan: per-layer GPU/CPU milliseconds, syncs, VRAM, predicted tokens/s."""
    hw, per_layer = problem.hw, []
    vram, gpu_mass, total_mass, syncs, pcie = problem.fixed_vram(), 0.0, 0.0, 0, 0.0
    total = 0.0
    prev_gpu = None
    for l, L in enumerate(problem.layers):
        _, mass, sizes = problem.groups(l)
        k, a = plan.gpu_groups[l], plan.attn_gpu[l]
        g_bytes = float(mass[:k].sum()) * L.neuron_bytes
        c_bytes = float(mass[k:].sum()) * L.neuron_bytes
        gpu = (a * L.dense_bytes + g_bytes) / hw.gpu_bw
        cpu = ((not a) * L.dense_bytes + c_bytes) / hw.cpu_bw
        split = (a and k < len(sizes)) or (not a and k > 0)
        change = prev_gpu is not None and prev_gpu != a
        syncs += split + change
        t = max(gpu, cpu) + hw.sync_s * (split + change)
        total += t
        prev_gpu = a
        vram += a * (L.gpu_attn_bytes + L.kv_bytes + L.predictor_bytes) + int(sizes[:k].sum()) * L.gpu_neuron_bytes
        gpu_mass += float(mass[:k].sum())
        total_mass += float(mass.sum())
        per_layer.append({"layer": l, "gpu_neurons": int(sizes[:k].sum()), "n_ff": L.n_ff, "attn_gpu": bool(a),
                          "gpu_ms": gpu * 1e3, "cpu_ms": cpu * 1e3, "split": bool(split), "ms": t * 1e3})
    eager = 0.0 if all(plan.attn_gpu) else len(problem.layers) * hw.eager_layer_s  # no decode graph
    total += eager
    head = problem.head_bytes / (hw.gpu_bw if plan.head_gpu else hw.cpu_bw)
    change = prev_gpu is not None and prev_gpu != plan.head_gpu
    syncs += change
    total += head + hw.sync_s * change
    vram += plan.head_gpu * problem.gpu_head_bytes
    pcie = syncs * 2 * problem.d_model * 4
    return {"ms_per_token": total * 1e3, "tokens_per_s": 1.0 / total if total > 0 else float("inf"),
            "vram_bytes": int(vram), "vram_budget": problem.vram_budget, "syncs_per_token": int(syncs),
            "eager_ms_per_token": eager * 1e3,
            "pcie_bytes_per_token": pcie, "gpu_activation_share": gpu_mass / total_mass if total_mass else 0.0,
            "head_gpu": plan.head_gpu, "layers": per_layer}


def check_ubatch(tokens: int) -> None:
    """-ub as hs-run and hs-solve take it: at least one prompt token per pass."""
    from hybridsparse.runtime.errors import InputError
    if tokens < 1:
        raise InputError(f"-ub {tokens}: expected at least 1 prompt token per pass")


def check_budget(problem: Problem) -> None:
    from hybridsparse.runtime.errors import InputError
    need = problem.fixed_vram()
    if problem.vram_budget < need:
        raise InputError(f"--vram-budget {problem.vram_budget / GiB:.2f} GiB is below the {need / GiB:.2f} GiB the "
                         "GPU needs before any weight (CUDA context, cuBLAS workspace, activations, margin); "
                         f"use at least {math.ceil(need / GiB * 100) / 100:.2f} GiB or --vram-budget 0 for CPU only")


def solve_ilp(problem: Problem, time_limit: float = 30.0) -> Plan:
    """The ILP above with CBC; with a time limit, the best solution found by then."""
    import pulp

    hw, t0 = problem.hw, time.perf_counter()
    m = pulp.LpProblem("placement", pulp.LpMinimize)
    n = len(problem.layers)
    a = [pulp.LpVariable(f"a{l}", cat="Binary") for l in range(n)]
    h = pulp.LpVariable("head", cat="Binary")
    y, t, s, c = [], [], [], []
    vram = problem.fixed_vram() + h * problem.gpu_head_bytes
    objective = problem.head_bytes / hw.cpu_bw + h * (problem.head_bytes / hw.gpu_bw - problem.head_bytes / hw.cpu_bw)
    for l, L in enumerate(problem.layers):
        _, mass, sizes = problem.groups(l)
        yl = [pulp.LpVariable(f"y{l}_{g}", cat="Binary") for g in range(len(sizes))]
        for g in range(len(yl) - 1):
            m += yl[g] >= yl[g + 1]  # hottest groups first
        act = [float(mass[g]) * L.neuron_bytes for g in range(len(sizes))]
        tl = pulp.LpVariable(f"t{l}", lowBound=0)
        sl = pulp.LpVariable(f"s{l}", cat="Binary")  # the layer's FFN is split from its attention
        m += tl >= (a[l] * L.dense_bytes + pulp.lpSum(yl[g] * act[g] for g in range(len(yl)))) / hw.gpu_bw
        m += tl >= ((1 - a[l]) * L.dense_bytes + pulp.lpSum((1 - yl[g]) * act[g] for g in range(len(yl)))) / hw.cpu_bw
        m += sl >= a[l] - yl[-1]
        m += sl >= yl[0] - a[l]
        objective += tl + hw.sync_s * sl
        vram += a[l] * (L.gpu_attn_bytes + L.kv_bytes + L.predictor_bytes) + \
            pulp.lpSum(yl[g] * int(sizes[g]) * L.gpu_neuron_bytes for g in range(len(yl)))
        y.append(yl), t.append(tl), s.append(sl)
    for l in range(n):  # the hidden state changes device between layers (and before the head)
        nxt = a[l + 1] if l + 1 < n else h
        cl = pulp.LpVariable(f"c{l}", lowBound=0)
        m += cl >= a[l] - nxt
        m += cl >= nxt - a[l]
        objective += hw.sync_s * cl
        c.append(cl)
    if hw.eager_layer_s > 0:  # z: every attention on the GPU, so the decode step is one CUDA graph
        z = pulp.LpVariable("all_attn_gpu", cat="Binary")
        for l in range(n):
            m += z <= a[l]
        objective += (1 - z) * n * hw.eager_layer_s
    m += objective * 1e3  # in milliseconds: in seconds the costs sit near CBC's tolerances
    m += vram <= problem.vram_budget
    if hw.pcie_budget is not None:
        m += (pulp.lpSum(s) + pulp.lpSum(c)) * 2 * problem.d_model * 4 <= hw.pcie_budget
    status = m.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit))
    name = pulp.LpStatus[status]
    if name not in ("Optimal",) and a[0].value() is None:
        raise RuntimeError(f"CBC found no placement ({name})")
    gpu_groups = [int(round(sum(v.value() or 0 for v in yl))) for yl in y]
    return Plan(gpu_groups, [bool(round(v.value() or 0)) for v in a], bool(round(h.value() or 0)), "ilp",
                status=name if name == "Optimal" else f"{name} (time limit {time_limit:g} s: best found)",
                solve_s=time.perf_counter() - t0)


def solve_greedy(problem: Problem) -> Plan:
    """Dense blocks first (attention layer by layer, then the head), then neuron groups by expected
    active bytes saved per byte of VRAM, while they fit."""
    t0 = time.perf_counter()
    free = problem.vram_budget - problem.fixed_vram()
    n = len(problem.layers)
    attn = [False] * n
    for l, L in enumerate(problem.layers):
        need = L.gpu_attn_bytes + L.kv_bytes + L.predictor_bytes
        if need <= free:
            attn[l], free = True, free - need
    head = problem.gpu_head_bytes <= free and all(attn)
    free -= head * problem.gpu_head_bytes
    cands = []
    for l, L in enumerate(problem.layers):
        _, mass, sizes = problem.groups(l)
        for g in range(len(sizes)):
            cands.append((-(mass[g] / sizes[g]), l, g, int(sizes[g]) * L.gpu_neuron_bytes))
    cands.sort()
    k = [0] * n
    for _, l, g, nbytes in cands:
        if g == k[l] and nbytes <= free:  # keep each layer's GPU part a prefix of its hottest groups
            k[l], free = k[l] + 1, free - nbytes
    return Plan(k, attn, head, "greedy", status="heuristic", solve_s=time.perf_counter() - t0)


def solve_brute_force(problem: Problem) -> Plan:
    """Every plan of a tiny problem (tests): the reference the ILP must equal."""
    best, best_ms = None, float("inf")
    ranges = [range(len(problem.groups(l)[1]) + 1) for l in range(len(problem.layers))]
    for ks in itertools.product(*ranges):
        for attn in itertools.product([False, True], repeat=len(problem.layers)):
            for head in (False, True):
                plan = Plan(list(ks), list(attn), head, "brute force")
                r = evaluate(problem, plan)
                if r["vram_bytes"] > problem.vram_budget:
                    continue
                if problem.hw.pcie_budget is not None and r["pcie_bytes_per_token"] > problem.hw.pcie_budget:
                    continue
                if r["ms_per_token"] < best_ms - 1e-12:
                    best, best_ms = plan, r["ms_per_token"]
    if best is None:
        raise RuntimeError("no feasible plan")
    return best


def solve(problem: Problem, time_limit: float = 30.0, method: str = "ilp") -> Plan:
    """The ILP, falling back to the greedy plan (said so in the plan's status) if CBC cannot run."""
    check_budget(problem)
    if method == "greedy":
        plan = solve_greedy(problem)
    else:
        try:
            plan = solve_ilp(problem, time_limit)
        except Exception as e:  # pulp/CBC missing or failing
            plan = solve_greedy(problem)
            plan.status = f"greedy fallback: the ILP solver failed ({type(e).__name__}: {e})"
    plan.report = evaluate(problem, plan)
    greedy = evaluate(problem, solve_greedy(problem)) if plan.method != "greedy" else plan.report
    plan.report["greedy_ms_per_token"] = greedy["ms_per_token"]
    plan.report["greedy_gpu_activation_share"] = greedy["gpu_activation_share"]
    return plan
