"""The hybrid CPU/GPU sparse FFN: hot neurons on the fast device, cold neurons on the CPU.

Per layer, the predictor (on the device that holds the hidden state) says which neurons each token
activates. The fast device (the GPU; in tests a second CPU executor plays its role) computes the
active neurons among its resident hot rows while the CPU computes the active cold rows, read in
place from the memory-mapped model; the CPU's result is added on the hidden state's device.

On CUDA one layer costs: the predictor and the hot part launched on the stream; one device-to-host
copy of (x, the cold part of the mask) into pinned buffers; the CPU kernels; one host-to-device copy
of the CPU's output. No copy at all when no cold neuron is active for the step's tokens.

Modes: "predictor" (the trained predictors), "dense" (every neuron, exact, same placement),
"oracle" (the true active set from a dense gate/up pass: for tests and diagnostics), "sampled" (for
benchmarks on synthetic models: the predictors run, but each token's active set is drawn from the
profile's per-neuron frequencies, so the sets have published statistics).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from hybridsparse.solver.plan import PREFILL_TOKENS

from . import kernels
from .errors import InputError, ModelError
from .layers import ACTIVATIONS, FFNSpec, FFNWeights, gated_act
from .quants import FLOAT_TYPES, dequantize
from .weights import QWeight, linear, linear_many

log = logging.getLogger(__name__)

MODES = ("predictor", "dense", "oracle", "sampled")


PREDICTOR_TYPES = (Q.F16, Q.Q8_0, Q.Q4_0)  # predictor weights computed in their stored type


@dataclass
class LayerPredictor:
    """logits = fc2(relu(fc1(x))); a neuron is predicted active where logits >= threshold."""
    fc1: torch.Tensor | QWeight  # [rank, d_model]
    fc2: torch.Tensor | QWeight  # [n_ff, rank]
    threshold: float

    def to(self, device: torch.device) -> "LayerPredictor":
        """Run through the compiled GEMV on either device, in the type the file stores them in where
        that is float16, Q8_0 or Q4_0 (`hs-quantize --quantize-predictors`: a quarter to a half of the
        bytes each token reads, which is what the solver counts), else in float16: on the CPU a float32
        copy would double the bytes read per token. QWeight.to turns a type the CUDA kernels lack into
        float16."""
        def place(w):
            if isinstance(w, QWeight) and w.qtype in PREDICTOR_TYPES:
                return w.to(device)
            t = w.dequantize() if isinstance(w, QWeight) else w
            return QWeight(t.to(torch.float16).contiguous(), Q.F16, t.shape[1]).to(device)
        return LayerPredictor(place(self.fc1), place(self.fc2), self.threshold)

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.fc1, QWeight):
            return F.linear(F.relu(F.linear(x, self.fc1.float())), self.fc2.float()) >= self.threshold
        return linear(F.relu(linear(x, self.fc1)), self.fc2) >= self.threshold


# Host-side time per part of the hybrid FFN, summed over calls, when HS_HYBRID_TIMING=1 (tools only).
TIMING: dict[str, float] | None = {} if os.environ.get("HS_HYBRID_TIMING") == "1" else None


class _timed:
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        if TIMING is not None:
            self.t = time.perf_counter()

    def __exit__(self, *exc):
        if TIMING is not None:
            TIMING[self.name] = TIMING.get(self.name, 0.0) + time.perf_counter() - self.t


def _pinned(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


def _collector(yh: torch.Tensor, done):
    """A function giving the pinned buffer yh's contents once the event `done` (recorded after the copy
    into it was queued) has passed: the CPU works in between."""
    def collect() -> torch.Tensor:
        done.synchronize()
        return yh.clone()
    return collect


# A layer whose attention stays on the CPU sends one token's x and mask to the GPU, runs its hot
# neurons there and copies the result back: about ten small ops, 0.40 ms of Python and launches a
# layer in S2 on the H200 (43 such layers a token). From the second token on they are one CUDA graph
# per layer (copies from and to pinned buffers inside it), replayed with one launch; they share the
# memory pool of a live one (they run one after another on one stream; a pool whose graphs are all gone
# cannot be reused). HS_HOT_GRAPHS=0: op by op.
HOT_GRAPHS = os.environ.get("HS_HOT_GRAPHS", "1") != "0"
_HOT_POOL: dict[torch.device, weakref.ref] = {}  # a live hot-part graph per device, whose pool the next shares

# More tokens than this in one call (a prompt, a batch of many sequences): the fast device's rows are
# computed dense, the predictor runs only where a cold part needs it (HybridFFN._dense_batch). The
# CUDA GEMV kernels take up to this many tokens; past it a matmul reads every row anyway.
DENSE_BATCH_TOKENS = kernels.CUDA_MAX_GEMV_TOKENS


# Many tokens at once (a prefill, a server's batch): the CPU computes every (token, active cold
# neuron) pair, while copying the layer's cold rows to the GPU costs the same for any number of
# tokens; past the crossover the cold rows are streamed over PCIe a chunk at a time and computed
# there (llama.cpp does the same for CPU-resident weights from a batch of 32). The crossover comes
# from the two costs as measured on this machine so far (seconds per byte, a running mean started
# from round guesses). HS_COLD_STREAM=auto (default) | always | never, for tests and benchmarks.
COLD_STREAM = os.environ.get("HS_COLD_STREAM", "auto")
_RATES = {"cpu": 1 / 20e9, "stream": 1 / 10e9}  # seconds per byte: CPU per (token, neuron) rows, PCIe per cold row


def _measured(kind: str, seconds: float, nbytes: int) -> None:
    if nbytes > 0:
        _RATES[kind] = 0.7 * _RATES[kind] + 0.3 * seconds / nbytes


class _Streamer:
    """Two slots of staging buffers (pinned host memory, device memory) for the cold rows streamed
    to the fast device: the CPU gathers chunk k+1 while chunk k crosses PCIe and is computed. Shared
    by the layers of one device; the solver reserves its device memory (solver.plan.STREAM_BYTES)."""

    def __init__(self, dev: torch.device):
        from hybridsparse.solver.plan import STREAM_BYTES
        self.dev, self.cuda = dev, dev.type == "cuda"
        self.slot_bytes = STREAM_BYTES // 2
        self.host = [_pinned((self.slot_bytes,), torch.uint8) for _ in range(2)]
        self.buf = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=dev) for _ in range(2)] if self.cuda \
            else self.host
        self.copied = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self.computed = [torch.cuda.Event() for _ in range(2)] if self.cuda else None

    def chunk_neurons(self, mats: list[QWeight]) -> int:
        return max(1, (self.slot_bytes - 256 * len(mats)) // sum(q.row_bytes for q in mats))

    def stage(self, k: int, mats: list[QWeight], ids: torch.Tensor) -> list[QWeight]:
        """The rows `ids` of each weight, gathered into slot k % 2 and on the device (queued)."""
        s, n = k % 2, ids.numel()
        if self.cuda:
            self.copied[s].synchronize()  # the slot's pinned buffer has been read by its last copy
        views, off = [], 0
        for q in mats:
            nb = n * q.row_bytes
            host = self.host[s][off:off + nb].view(q.data.dtype).view(n, -1)
            torch.index_select(q.data, 0, ids, out=host)
            views.append((host, self.buf[s][off:off + nb].view(q.data.dtype).view(n, -1), q))
            off += (nb + 255) // 256 * 256
        if self.cuda:
            main, side = torch.cuda.current_stream(self.dev), _side_stream(self.dev)
            side.wait_event(self.computed[s])  # the slot's device buffer is no longer read
            with torch.cuda.stream(side):
                for host, dev, _ in views:
                    dev.copy_(host, non_blocking=True)
                self.copied[s].record(side)
            main.wait_event(self.copied[s])
        return [QWeight(dev, q.qtype, q.in_features) for _, dev, q in views]

    def done(self, k: int) -> None:
        if self.cuda:
            self.computed[k % 2].record(torch.cuda.current_stream(self.dev))


_STREAMERS: dict[torch.device, _Streamer] = {}


def _streamer(dev: torch.device) -> _Streamer:
    if dev not in _STREAMERS:
        _STREAMERS[dev] = _Streamer(dev)
    return _STREAMERS[dev]


_SIDE_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(dev: torch.device):
    """The stream the cold FFN's copies and host nodes go on (one per GPU, shared by the layers)."""
    if dev not in _SIDE_STREAMS:
        _SIDE_STREAMS[dev] = torch.cuda.Stream(dev)
    return _SIDE_STREAMS[dev]


class HybridFFN:
    """One layer's FFN split by neuron between `fast` (hot rows, gathered once) and the CPU (cold rows,
    read in place). Called by `layers.ffn` in place of the dense FFN."""

    def __init__(self, w: FFNWeights, down_t: QWeight, spec: FFNSpec, hot: np.ndarray, fast: torch.device | None,
                 predictor: LayerPredictor | None, mode: str, score_threshold: float | None = None,
                 freq: torch.Tensor | None = None, host_nodes: bool = True):
        if mode not in MODES:
            raise ValueError(f"unknown sparse mode {mode!r}; known: {MODES}")
        if mode in ("predictor", "sampled") and predictor is None:
            raise ValueError(f"{mode} mode needs a predictor")
        if mode == "sampled" and freq is None:
            raise ValueError("sampled mode needs per-neuron frequencies")
        self.freq = None if freq is None else freq.float()
        n_ff = w.up.out_features
        hot = np.asarray(hot, dtype=np.int64)
        if hot.size and (hot.min() < 0 or hot.max() >= n_ff or np.unique(hot).size != hot.size):
            raise InputError(f"GPU index: neuron ids must be distinct and below {n_ff}")
        if fast is None:
            hot = hot[:0]
        cold = np.setdiff1d(np.arange(n_ff), hot)
        self.spec, self.mode, self.n_ff = spec, mode, n_ff
        self.score_threshold = score_threshold
        self.full = w  # CPU, memory-mapped: the cold rows are read from here
        self.down_t = down_t
        self.predictor = predictor
        self.fast = torch.device(fast) if fast is not None else None
        self.host_nodes = host_nodes  # False: the event path even on CUDA (setup_hybrid: a step that is no graph)
        self.n_hot, self.n_cold = int(hot.size), int(cold.size)
        self.cold_ids = torch.from_numpy(cold.astype(np.int32))
        self._cold_on: dict[torch.device, torch.Tensor] = {torch.device("cpu"): self.cold_ids.long()}
        self._hot_on: dict[torch.device, torch.Tensor] = {}
        self._pinned: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._bias_on: dict[torch.device, torch.Tensor] = {}
        self._event = None
        self._hot_graph = None  # None: never run; False: warmed up; then (pinned x, mask, y, graph, event, ...)
        self._task = None  # the cold FFN as a host node task (decode on CUDA), made on first use
        self._cpu_token = None  # CPU-only decode's bound calls (_cpu_token_fn), made on first use; False: none
        self._cpu_block = None  # the same with the norm and residual, one compiled call (token_block)
        if self.n_hot:
            idx = torch.from_numpy(hot)
            gather = (lambda q: None if q is None else QWeight(q.data[idx], q.qtype, q.in_features).to(self.fast))
            self.gate_hot, self.up_hot, self.down_t_hot = gather(w.gate), gather(w.up), gather(down_t)
            self.up_bias_hot = None if w.up_bias is None else w.up_bias[idx].to(self.fast)
            self._hot_on[torch.device("cpu")] = idx
            self._hot_on[self.fast] = idx.to(self.fast)

    # --- placement facts -------------------------------------------------------------------------

    @property
    def capturable(self) -> bool:
        """A decode step can be a CUDA graph: the cold part (if any) runs as a host node, and there
        is no dense pass for an oracle."""
        return self.mode != "oracle" and (self.n_cold == 0 or self._host_nodes())

    def _one_token_handed_over(self, x: torch.Tensor) -> bool:
        """One token on CUDA whose cold part goes to the CPU through the stream (_decode_host_node)."""
        return bool(self.n_cold) and x.is_cuda and x.shape[0] == 1 and self._host_nodes()

    def _host_nodes(self) -> bool:
        """Whether the cold part runs as a host node: on CUDA, for the weight types the compiled CPU
        FFN reads (others go through the twins, on the Python thread), not for the oracle."""
        w = self.full
        return (self.host_nodes and self.mode != "oracle" and kernels.host_nodes_available()
                and kernels.cpu_ffn_reads(w.up.qtype, None if w.gate is None else w.gate.qtype, self.down_t.qtype))

    @property
    def gpu_bytes(self) -> int:
        if not self.n_hot or self.fast.type != "cuda":
            return 0
        return sum(q.nbytes for q in (self.gate_hot, self.up_hot, self.down_t_hot) if q is not None)

    # --- the active set --------------------------------------------------------------------------

    def active(self, x: torch.Tensor) -> torch.Tensor | None:
        """bool [T, n_ff] on x's device, or None for every neuron."""
        if self.mode == "dense":
            return None
        if self.mode == "predictor":
            return self.predictor.mask(x)
        if self.mode == "sampled":
            self.predictor.mask(x)  # its cost is real; its answer is replaced by a draw from the profile
            if self.freq.device != x.device:
                self.freq = self.freq.to(x.device)
            return torch.rand(x.shape[0], self.n_ff, device=x.device) < self.freq
        return self.true_active(x)

    def true_active(self, x: torch.Tensor) -> torch.Tensor:
        """The profiler's criterion on a dense pass: h != 0 (ReLU family), |score| > threshold otherwise."""
        w, spec, act = self.full, self.spec, ACTIVATIONS[self.spec.activation]
        xc = x.float().cpu()
        if spec.gated:
            gate, up = linear_many(xc, [w.gate, w.up])
            if w.up_bias is not None:
                up = up + w.up_bias
            score = act(gate)
            h = score * (act(up) if spec.act_on_up else up)
        else:
            h = score = act(linear(xc, w.up, w.up_bias))
        active = (h != 0) if self.score_threshold is None else (score.abs() > self.score_threshold)
        return active.to(x.device)

    # --- compute ---------------------------------------------------------------------------------

    def _dense_batch(self, x: torch.Tensor) -> bool:
        """Many tokens at once (a prompt, a large batch), more than the GEMV kernels take: the fast
        device computes its rows dense. Every resident row is read for such a batch anyway, so a mask
        would save nothing there and only cost accuracy; the predictor then runs only for a cold part
        (the CPU computes it sparsely, and the mask decides whether streaming it over PCIe wins)."""
        return self.fast is not None and x.shape[0] > DENSE_BATCH_TOKENS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device
        one_cpu_token = bool(self.n_cold) and dev.type == "cpu" and x.shape[0] == 1 and kernels.cpu is not None
        if one_cpu_token and self._cpu_token is not False:
            if self._cpu_token is None:
                self._cpu_token = self._cpu_token_fn()
            if self._cpu_token:
                return self._cpu_token(x)
        with _timed("predictor"):
            mask = None if (self.n_cold == 0 and self._dense_batch(x)) else self.active(x)
        if self._one_token_handed_over(x):
            return self._decode_host_node(x, mask)
        cold_in, pairs, cold_idx = None, None, None
        if one_cpu_token and mask is not None:
            # one token on the CPU: the active cold ids straight from the layer's mask, in one pass
            cold_idx = kernels.cpu.select_ids(mask[0].contiguous(), self.cold_ids)
            cold_in = self._send_to_cpu(x, None)
        elif self.n_cold:
            cold_mask = mask if (mask is None or not self.n_hot) else \
                mask.index_select(1, self._ids(self._cold_on, dev))  # every neuron is cold: as it is
            stream, pairs = self._stream_wins(x, cold_mask)
            if stream:
                return self._with_streamed_cold(x, mask, cold_mask)
            with _timed("send to CPU"):
                cold_in = self._send_to_cpu(x, cold_mask)
        with _timed("hot launch"):
            if self._hot_replayable(x):
                y = self._hot_replay(x, mask)
            else:
                y = self._hot_part(x, mask)
                if y is not None and y.device != dev:  # x on the CPU: the GPU's part comes back while the
                    y = self._from_fast(y, dev)        # CPU computes the cold part (collected below)
        if cold_in is not None:
            yc = self._cold(*cold_in, pairs=pairs, idx=cold_idx)
        if callable(y):
            with _timed("wait for GPU"):
                y = y()
        if cold_in is not None:
            if yc is not None:
                with _timed("copy back"):
                    if dev.type == "cuda":  # through a pinned buffer: the host goes on queueing work
                        key = ("out", yc.shape[0])
                        if key not in self._pinned:
                            self._pinned[key] = (_pinned(yc.shape, torch.float32), None)
                        out = self._pinned[key][0]
                        out.copy_(yc)
                        yc = out.to(dev, non_blocking=True)
                    y = yc if y is None else y + yc
        if y is None:
            y = x.new_zeros(x.shape[0], self.down_t.in_features)
        return self._plus_down_bias(y)

    def _cpu_token_fn(self):
        """CPU-only decode of one token (every neuron cold, the predictor deciding) as three compiled calls
        with their arguments bound once: the predictor's two GEMVs, the active ids from its scores, the
        fused FFN over them (the general path below makes ~25 Python calls a layer around the same three).
        False where this layer is not that case or its types are not the compiled ops'."""
        p, w, d = self.predictor, self.full, self.down_t
        if self.mode != "predictor" or self.n_hot or not isinstance(p.fc1, QWeight) \
                or not isinstance(p.fc2, QWeight) or p.fc1.qtype not in kernels.CPU_QTYPES \
                or p.fc2.qtype not in kernels.CPU_QTYPES or p.fc1.data.is_cuda \
                or not kernels.cpu_ffn_reads(w.up.qtype, None if w.gate is None else w.gate.qtype, d.qtype):
            return False
        qmatmul, select, ffn = kernels.cpu.qmatmul, kernels.cpu.select_ids, kernels.cpu.sparse_ffn
        fc1, t1, fc2, t2, thr = p.fc1.data, int(p.fc1.qtype), p.fc2.data, int(p.fc2.qtype), float(p.threshold)
        gate = None if w.gate is None else w.gate.data
        args = (w.up.data, int(w.up.qtype), gate, int(w.gate.qtype) if gate is not None else 0, d.data, int(d.qtype))
        tail = (w.up_bias, kernels.ACTIVATION_IDS[self.spec.activation], self.spec.act_on_up)
        ids, d_out = self.cold_ids, d.in_features
        plus_bias = self._plus_down_bias
        block_fn, down_bias = kernels.cpu.sparse_ffn_block, w.down_bias

        def block(x: torch.Tensor, norm: kernels.Norm) -> torch.Tensor:
            return block_fn(x, norm.weight, norm.eps, fc1, t1, fc2, t2, thr, ids, *args, *tail, down_bias)
        self._cpu_block = block

        def run(x: torch.Tensor) -> torch.Tensor:
            x = x.float().contiguous()
            with _timed("predictor"):
                idx = select(qmatmul(fc2, t2, qmatmul(fc1, t1, x).relu_())[0], ids, thr)
            with _timed("CPU FFN"):
                y = ffn(x, *args, idx, *tail)[0] if idx.numel() else x.new_zeros(1, d_out)
            return plus_bias(y)
        return run

    def token_block(self, x: torch.Tensor, norm: kernels.Norm) -> torch.Tensor | None:
        """x + this FFN of norm(x) as one compiled call (`kernels.cpu.sparse_ffn_block`: the norm and the
        bound calls of _cpu_token_fn, then the residual), for one token that layers.ffn_block found fit for
        the compiled CPU ops (x, an RMS norm); None where this layer is not CPU-only with a predictor
        (layers.ffn then takes the general path). Not while HS_HYBRID_TIMING times the predictor and the FFN
        apart."""
        if TIMING is not None or not self.n_cold:
            return None
        if self._cpu_token is None:
            self._cpu_token = self._cpu_token_fn()
        return self._cpu_block(x, norm) if self._cpu_token else None

    def start(self, x: torch.Tensor):
        """This FFN of x as a function giving its output (layers.ffn_start): one token on CUDA with a
        cold part queues it now (side stream, host node or polled hand-over) and joins it only when the
        function is called, so that work queued in between on this stream (Falcon's parallel attention)
        runs on the GPU while the CPU computes; otherwise computed now."""
        if self._one_token_handed_over(x):
            with _timed("predictor"):
                mask = self.active(x)
            return self._decode_host_node(x, mask, join_later=True)
        y = self(x)
        return lambda: y

    @property
    def _neuron_bytes(self) -> int:
        return sum(q.row_bytes for q in self._cold_mats())

    def _cold_mats(self) -> list[QWeight]:
        return [q for q in (self.full.up, self.full.gate, self.down_t) if q is not None]

    def _stream_wins(self, x: torch.Tensor, cold_mask: torch.Tensor | None) -> tuple[bool, int | None]:
        """Whether this call's cold part is streamed to the fast device (see COLD_STREAM), and the
        number of (token, cold neuron) pairs the CPU would compute (None when not estimated)."""
        t = x.shape[0]
        if t < 2 or self.fast is None or COLD_STREAM == "never":
            return False, None
        if COLD_STREAM == "always":
            return self._streamable(), None
        if self.fast.type != "cuda" or not self._streamable():
            return False, None
        pairs = t * self.n_cold if cold_mask is None else int(cold_mask.sum())  # one sync: a prefill step
        return _RATES["cpu"] * pairs > _RATES["stream"] * self.n_cold, pairs

    def _streamable(self) -> bool:
        """Every cold weight in a format the fast device computes as stored."""
        return all(q.qtype in FLOAT_TYPES or self.fast.type != "cuda" or kernels.cuda_supports(q.qtype)
                   for q in self._cold_mats())

    def _with_streamed_cold(self, x: torch.Tensor, mask: torch.Tensor | None,
                            cold_mask: torch.Tensor | None) -> torch.Tensor:
        """The whole layer on the fast device: the hot rows resident, the cold rows streamed in."""
        dev, fast = x.device, self.fast
        xf = x.float().to(fast)
        with _timed("hot launch"):
            y = self._hot_part(xf, mask)
        with _timed("stream cold"):
            t0 = time.perf_counter()
            dense = cold_mask is None or self._dense_batch(x)  # on the GPU, a prompt's rows are computed dense
            yc = self._stream_cold(xf, None if dense else cold_mask.to(fast))
            if fast.type == "cuda":
                torch.cuda.current_stream(fast).synchronize()
            _measured("stream", time.perf_counter() - t0, self.n_cold * self._neuron_bytes)
        return self._plus_down_bias((yc if y is None else y + yc).to(dev))

    def _stream_cold(self, x: torch.Tensor, cold_mask: torch.Tensor | None) -> torch.Tensor:
        w, st = self.full, _streamer(self.fast)
        mats = self._cold_mats()
        ids = self._cold_on[torch.device("cpu")]
        n = st.chunk_neurons(mats)
        y = None
        for k, c0 in enumerate(range(0, self.n_cold, n)):
            c1 = min(c0 + n, self.n_cold)
            staged = st.stage(k, mats, ids[c0:c1])
            up, down = staged[0], staged[-1]
            gate = staged[1] if w.gate is not None else None
            bias = None if w.up_bias is None else self._cold_bias()[c0:c1]
            part = self._masked_ffn(up, gate, bias, None if cold_mask is None else cold_mask[:, c0:c1],
                                    lambda q: kernels.matmul(x, q.data, q.qtype),
                                    lambda h: kernels.matmul_t(h, down.data, down.qtype))
            st.done(k)
            y = part if y is None else y + part
        return y

    def _cold_bias(self) -> torch.Tensor:
        if ("cold", self.fast) not in self._bias_on:  # the cold neurons' up bias on the fast device
            self._bias_on[("cold", self.fast)] = self.full.up_bias[self._cold_on[torch.device("cpu")]].to(self.fast)
        return self._bias_on[("cold", self.fast)]

    def _decode_host_node(self, x: torch.Tensor, mask: torch.Tensor | None, join_later: bool = False):
        """One token on CUDA with no host wait: on a side stream, x and the cold mask go to pinned
        buffers, a host node runs the cold FFN on the CPU (csrc/cold_ffn.cpp), its output comes back;
        the hot rows run on the main stream meanwhile. Capturable in a CUDA graph. join_later: a
        function that joins the side stream and gives the output (see start)."""
        dev = x.device
        t = self._host_task(dev)
        src = None
        if mask is not None:
            src = mask if not self.n_hot else torch.index_select(mask, 1, self._ids(self._cold_on, dev), out=t["cm"])
        xs = x.float().contiguous() if kernels.polling() else x  # on the main stream, before the fork
        # what the side stream reads stays referenced until this layer's next call, so that work queued
        # on the main stream before the join (join_later) cannot get its memory from the allocator
        t["in_flight"] = (xs, src)
        main, side = torch.cuda.current_stream(dev), _side_stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            if kernels.polling():  # a captured step: the GPU writes x and the mask itself, polls for y
                kernels.enqueue_polled(t["handle"], xs, src, t["yd"], t["counter"])
            else:
                t["xh"].copy_(x, non_blocking=True)
                if src is not None:
                    t["mh"].copy_(src, non_blocking=True)
                kernels.cpu.cold_ffn_enqueue(t["handle"])
                t["yd"].copy_(t["yh"], non_blocking=True)
        y = None
        if self.n_hot:
            mh = None if mask is None else torch.index_select(mask, 1, self._ids(self._hot_on, dev))
            y = self._hot(x, mh)

        def join() -> torch.Tensor:
            main.wait_stream(side)
            return self._plus_down_bias(t["yd"] + (0 if y is None else y))
        return join if join_later else join()

    def _hot_part(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The active hot neurons' output on the fast device (x and the mask are sent there if they are
        not), None without hot neurons (then nothing is sent)."""
        if not self.n_hot:
            return None
        if self._dense_batch(x):  # the resident rows dense for a prompt (see _dense_batch)
            mask = None
        mh = None if mask is None else self._to_fast(mask).index_select(1, self._ids(self._hot_on, self.fast))
        return self._hot(self._to_fast(x), mh)

    def _hot_replayable(self, x: torch.Tensor) -> bool:
        """One token on the CPU whose hot part goes through this layer's CUDA graph (see HOT_GRAPHS)."""
        return (HOT_GRAPHS and self.n_hot > 0 and x.device.type == "cpu" and x.shape[0] == 1
                and self.fast.type == "cuda")

    def _hot_replay(self, x: torch.Tensor, mask: torch.Tensor | None):
        """The hot part of one CPU token: a function giving its result on the CPU, to be called after the
        CPU's cold part. The first call runs op by op (the warm-up: kernels loaded, allocator primed),
        the second captures this layer's graph, every call from then on replays it."""
        if self._hot_graph is None:
            self._hot_graph = False
            return self._from_fast(self._hot_part(x, mask), x.device)
        if not self._hot_graph:
            self._hot_graph = self._capture_hot(x, mask)
        xh, mh, yh, graph, done = self._hot_graph[:5]
        xh.copy_(x)
        if mh is not None:
            mh.copy_(mask)
        graph.replay()
        done.record()
        return _collector(yh, done)

    def _capture_hot(self, x: torch.Tensor, mask: torch.Tensor | None) -> tuple:
        fast = self.fast
        xh = _pinned(x.shape, torch.float32)
        mh = None if mask is None else _pinned(mask.shape, torch.bool)
        yh = _pinned((1, self.down_t.in_features), torch.float32)
        xd = torch.empty(x.shape, device=fast)
        md = None if mask is None else torch.empty(mask.shape, dtype=torch.bool, device=fast)
        hot_ids = self._ids(self._hot_on, fast)
        owner = _HOT_POOL[fast]() if fast in _HOT_POOL else None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=None if owner is None else owner.pool()):
            xd.copy_(xh, non_blocking=True)
            if md is not None:
                md.copy_(mh, non_blocking=True)
            y = self._hot(xd, None if md is None else md.index_select(1, hot_ids))
            yh.copy_(y, non_blocking=True)
        if owner is None:
            _HOT_POOL[fast] = weakref.ref(graph)
        return xh, mh, yh, graph, torch.cuda.Event(), xd, md  # the graph reads xd and md: kept alive with it

    def _plus_down_bias(self, y: torch.Tensor) -> torch.Tensor:
        """y plus the down projection's bias, if any, copied once to y's device (a copy from pageable
        memory cannot be captured in a CUDA graph)."""
        if self.full.down_bias is None:
            return y
        if y.device not in self._bias_on:
            self._bias_on[y.device] = self.full.down_bias.to(y.device)
        return y + self._bias_on[y.device]

    def _host_task(self, dev: torch.device) -> dict:
        if self._task is None:
            w, d = self.full, self.down_t.in_features
            t = {"xh": _pinned((1, w.up.in_features), torch.float32), "yh": _pinned((1, d), torch.float32),
                 "mh": _pinned((1, self.n_cold), torch.bool), "yd": torch.zeros(1, d, device=dev),
                 "cm": torch.zeros(1, self.n_cold, dtype=torch.bool, device=dev)}
            if self.mode == "dense":
                t["mh"].fill_(True)
            t["handle"] = kernels.cold_ffn_task(
                t["xh"], t["mh"], self.cold_ids, t["yh"], w.up.data, w.up.qtype,
                None if w.gate is None else w.gate.data, (w.gate or w.up).qtype, self.down_t.data,
                self.down_t.qtype, w.up_bias, self.spec.activation, self.spec.act_on_up)
            t["sync"], t["counter"] = _pinned((4,), torch.int64).zero_(), torch.zeros(1, dtype=torch.int64, device=dev)
            kernels.cpu.cold_ffn_attach_sync(t["handle"], t["sync"])
            self._task = t
        return self._task

    def __del__(self):
        t = getattr(self, "_task", None)
        try:
            if t is not None and kernels.cpu is not None:
                kernels.cpu.cold_ffn_free(t["handle"])
        except (AttributeError, TypeError):  # interpreter shutdown: modules already torn down
            pass

    def _ids(self, cache: dict, device: torch.device) -> torch.Tensor:
        if device not in cache:
            cache[device] = cache[torch.device("cpu")].to(device)
        return cache[device]

    def _send_to_cpu(self, x: torch.Tensor, cold_mask: torch.Tensor | None):
        """x and the cold mask on the CPU; from CUDA through pinned buffers and one event."""
        if x.device.type != "cuda":
            return x.float().contiguous(), cold_mask
        key = (x.shape[0], cold_mask is not None)
        if key not in self._pinned:
            self._pinned[key] = (_pinned(x.shape, torch.float32),
                                 _pinned((x.shape[0], self.n_cold), torch.bool) if cold_mask is not None else None)
        xh, mh = self._pinned[key]
        xh.copy_(x, non_blocking=True)
        if mh is not None:
            mh.copy_(cold_mask, non_blocking=True)
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record()
        return xh, mh, self._event

    def _hot(self, x: torch.Tensor, mh: torch.Tensor | None) -> torch.Tensor:
        down = self.down_t_hot
        if x.is_cuda and x.shape[0] > kernels.CUDA_MAX_GEMV_TOKENS:
            # prefill on the GPU: the resident hot rows as dense matmuls (cuBLAS, block formats
            # dequantized a slice at a time; mh is None there, see _dense_batch)
            return self._masked_ffn(self.up_hot, self.gate_hot, self.up_bias_hot, mh,
                                    lambda q: kernels.matmul(x, q.data, q.qtype),
                                    lambda h: kernels.matmul_t(h, down.data, down.qtype))
        union = None if mh is None else (mh[0] if mh.shape[0] == 1 else mh.any(0))
        return self._masked_ffn(self.up_hot, self.gate_hot, self.up_bias_hot, mh,
                                lambda q: kernels.sparse_rowdot(q.data, q.qtype, x, None, union, check=False),
                                lambda h: kernels.sparse_axpy(down.data, down.qtype, h, None, check=False))

    def _masked_ffn(self, up: QWeight, gate: QWeight | None, up_bias, mask, rows_dot, down) -> torch.Tensor:
        """down(act(gate . x) * (up . x) * mask) over some rows: `rows_dot(w)` gives w's rows against x,
        `down(h)` the down projection of those rows."""
        u = rows_dot(up)
        if up_bias is not None:
            u = u + up_bias
        h = self._act(u, None if gate is None else rows_dot(gate))
        if mask is not None:
            h = h * mask
        return down(h.contiguous())

    def _act(self, u: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        return ACTIVATIONS[self.spec.activation](u) if g is None else gated_act(g, u, self.spec)

    def _to_fast(self, x: torch.Tensor) -> torch.Tensor:
        """x (or a mask) on the fast device; one token's from the CPU through a pinned buffer, without
        waiting for the copy (a pageable copy waits)."""
        if self.fast is None or self.fast.type != "cuda" or x.device.type != "cpu" or x.shape[0] != 1:
            return x.to(self.fast) if self.fast is not None else x
        key = ("in", x.dtype, tuple(x.shape))
        if key not in self._pinned:
            self._pinned[key] = (_pinned(x.shape, x.dtype), None)
        xh = self._pinned[key][0]
        xh.copy_(x)
        return xh.to(self.fast, non_blocking=True)

    def _from_fast(self, y: torch.Tensor, dev: torch.device):
        """A function giving y on `dev`: from CUDA to the CPU, the copy is queued now into a pinned buffer
        and waited for only when the function is called, so the CPU works in between."""
        if y.device.type != "cuda" or dev.type != "cpu" or y.shape[0] != 1:  # one token: buffers per shape
            y = y.to(dev)
            return lambda: y
        key = ("hot", tuple(y.shape))
        if key not in self._pinned:
            self._pinned[key] = (_pinned(y.shape, torch.float32), torch.cuda.Event())
        yh, done = self._pinned[key]
        yh.copy_(y, non_blocking=True)
        done.record()
        return _collector(yh, done)

    def _cold(self, x: torch.Tensor, cold_mask: torch.Tensor | None, event=None, pairs: int | None = None,
              idx: torch.Tensor | None = None):
        if event is not None:
            with _timed("wait for GPU"):
                event.synchronize()
        with _timed("CPU FFN"):
            t0 = time.perf_counter()
            y = self._cold_compute(x, cold_mask, idx)
            if pairs is not None:  # the CPU's side of the streaming decision, as measured
                _measured("cpu", time.perf_counter() - t0, pairs * self._neuron_bytes)
            return y

    def _cold_compute(self, x: torch.Tensor, cold_mask: torch.Tensor | None,
                      idx: torch.Tensor | None = None) -> torch.Tensor | None:
        """The active cold neurons' output on the CPU: those of cold_mask (None: every cold neuron), or
        the one token's active cold ids `idx` when the caller picked them."""
        w, spec = self.full, self.spec
        if idx is not None:
            tok = None
            if idx.numel() == 0:
                return None
        elif cold_mask is None:
            idx, tok = self.cold_ids, None
        else:
            union = cold_mask[0] if cold_mask.shape[0] == 1 else cold_mask.any(0)
            idx = self.cold_ids[union]
            tok = None if cold_mask.shape[0] == 1 else cold_mask[:, union]
            if idx.numel() == 0:
                return None
        gate = w.gate
        if tok is None:  # one token (or every neuron): the fused compiled FFN over the active cold rows
            y, _ = kernels.sparse_ffn(x, w.up.data, w.up.qtype, None if gate is None else gate.data,
                                      gate.qtype if gate is not None else w.up.qtype, self.down_t.data,
                                      self.down_t.qtype, idx, w.up_bias, spec.activation, spec.act_on_up,
                                      check=False)
            return y
        down = self.down_t
        if x.shape[0] < kernels.CPU_SPARSE_GEMM_TOKENS and tok.float().mean().item() < kernels.CPU_MASKED_DENSE:
            # each union row read once, each token's own pairs only
            y, _ = kernels.sparse_ffn_masked(x, w.up.data, w.up.qtype, None if gate is None else gate.data,
                                             gate.qtype if gate is not None else w.up.qtype, down.data, down.qtype,
                                             idx, tok.contiguous(), w.up_bias, spec.activation, spec.act_on_up)
            return y
        return self._masked_ffn(w.up, gate, None if w.up_bias is None else w.up_bias[idx.long()], tok,
                                lambda q: kernels.sparse_rowdot(q.data, q.qtype, x, idx, check=False),
                                lambda h: kernels.sparse_axpy(down.data, down.qtype, h, idx, check=False))


# --- the transposed down projection -------------------------------------------------------------

# --down-t-type: what a llama.cpp file's block-quantized ffn_down becomes once transposed. Q8_0 by
# default: F16 rows (3.6x a Q4_0 row's bytes) made CPU-only sparse decode of a 7B Q4_0 llama.cpp file
# slower than dense (dev VM, 2 threads: 5.6 against 6.0 tok/s; Q8_0 rows 7.0), and cost the GPU that
# much more VRAM per hot neuron; the second rounding moved the default model's perplexity by +0.04%.
DOWN_T_TYPES = {"f16": Q.F16, "q8_0": Q.Q8_0}
DEFAULT_DOWN_T_TYPE = "q8_0"


def check_down_t_type(name: str) -> str:
    if name not in DOWN_T_TYPES:
        raise InputError(f"--down-t-type: expected one of {', '.join(DOWN_T_TYPES)}, got {name!r}")
    return name


def down_t_cache_path(model_path: Path, down_t_type: str = DEFAULT_DOWN_T_TYPE) -> Path:
    tag = "" if down_t_type == "f16" else "-" + down_t_type  # F16 caches kept their first name
    return model_path.with_name(model_path.stem + f".hs-down_t{tag}.gguf")


def _transposed_type(qtype: Q, n: int, down_t_type: str = DEFAULT_DOWN_T_TYPE) -> Q:
    """The type the transposed rows are stored in. Float types as they are; block types cannot be
    transposed in place, and requantizing the transposed values rounds every weight a second time
    (Q8_0 moved Gemma 3 270M's logits by 1.2% of their scale, F16 by 0.05%), so they become Q8_0 by
    default (see DEFAULT_DOWN_T_TYPE; rows whose length is not a multiple of 32 F16) or F16 with
    --down-t-type f16. PowerInfer files, whose ffn_down_t was quantized from the original weights, avoid the cost."""
    if qtype in FLOAT_TYPES:
        return qtype
    qt = DOWN_T_TYPES[check_down_t_type(down_t_type)]
    return qt if qt == Q.F16 or n % 32 == 0 else Q.F16


def transposed_down(gguf, n_layers: int, progress=None, down_t_type: str = DEFAULT_DOWN_T_TYPE) -> list[QWeight]:
    """`ffn_down_t` per layer for a llama.cpp file (which stores ffn_down as [d_model rows of n_ff]):
    transposed once and kept next to the model (memory-mapped after): `<model>.hs-down_t-q8_0.gguf` with
    down_t_type "q8_0", `<model>.hs-down_t.gguf` with "f16"."""
    from hybridsparse.solver.gpuidx import model_fingerprint

    from .gguf_file import GGUFFile
    from .gguf_writer import gguf_part, tensor_nbytes
    from .quantize import quantize_rows

    path = down_t_cache_path(Path(gguf.path), down_t_type)
    fp = model_fingerprint(gguf)
    if path.exists():
        try:
            cache = GGUFFile(path)
            if cache.get("hybridsparse.model_fingerprint") == fp and f"blk.{n_layers - 1}.ffn_down_t.weight" in cache.tensors:
                return [_qweight(cache, f"blk.{i}.ffn_down_t.weight") for i in range(n_layers)]
            cache.close()
        except Exception as e:  # noqa: BLE001 - a damaged cache is rebuilt, never trusted
            log.warning("%s: unreadable (%s); rebuilding it", path, e)
    log.info("transposing ffn_down once into %s", path)
    for other in DOWN_T_TYPES:
        stale = down_t_cache_path(Path(gguf.path), other)
        if other != down_t_type and stale.exists():  # a 70B file's F16 copy is ~45 GB: say that it lies unread
            log.warning("%s (%.1f GiB) is the %s copy of ffn_down, read only with --down-t-type %s: delete it if you "
                        "no longer use that", stale, stale.stat().st_size / 2**30, other.upper(), other)
    infos = [gguf.tensors.get(f"blk.{i}.ffn_down.weight") for i in range(n_layers)]
    for i, info in enumerate(infos):
        if info is None:
            raise ModelError(f"{gguf.path}: tensor blk.{i}.ffn_down.weight is missing")
    types = [_transposed_type(info.qtype, info.shape[1], down_t_type) for info in infos]
    advice = ((" or use --down-t-type q8_0 (half the F16 copy's size)" if down_t_type == "f16" else "")
              + ", or convert the model to PowerInfer's layout, which stores ffn_down_t")
    with gguf_part(path, "hybridsparse.down_t", sum(tensor_nbytes(i.shape, qt) for i, qt in zip(infos, types)),
                   "transposing ffn_down once", "the transposed ffn_down", advice, error=ModelError) as w:
        w.add_string("hybridsparse.model_fingerprint", fp)
        for i, (info, qt) in enumerate(zip(infos, types)):
            w.add_tensor_info(f"blk.{i}.ffn_down_t.weight", info.shape, np.dtype(np.float32),
                              tensor_nbytes(info.shape, qt), raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i in range(n_layers) if progress is None else progress(range(n_layers)):
            dense = dequantize(gguf.raw(infos[i].name), infos[i].qtype).float().T.contiguous().numpy()
            # float types as they are, block types with the rows over the -t threads (the bytes of one
            # quants.quantize call)
            w.write_tensor_data(quantize_rows(dense, types[i], threads=torch.get_num_threads()))
    cache = GGUFFile(path)
    return [_qweight(cache, f"blk.{i}.ffn_down_t.weight") for i in range(n_layers)]


def _qweight(g, name: str) -> QWeight:
    info = g.tensors[name]
    return QWeight.from_raw(g.raw(name), info.qtype, info.shape[0])


# --- putting a model in hybrid form --------------------------------------------------------------

@dataclass
class HybridOptions:
    """What `hs-run` passes: the budget and where the pipeline's files are (defaults: beside the model)."""
    vram_budget: float | None = None  # GiB; None: all free VRAM minus a margin; 0: CPU only
    mode: str = "predictor"
    predictors: str | None = None  # default <model>.predictors.gguf, else the model's own blk.N.fc1/fc2
    profile: str | None = None  # default <model>.hs-profile
    gpu_index: str | None = None  # default <model>.generated.gpuidx
    reset_gpu_index: bool = False
    disable_gpu_index: bool = False
    n_ctx: int = 4096
    device: str | None = None  # the fast device; "cpu" lets a second CPU executor play the GPU (tests)
    hot: list | None = None  # explicit hot neuron ids per layer instead of a GPU index (tests)
    attn_fast: list | None = None  # with `hot`: which layers' attention runs on the fast device
    head_fast: bool = False
    hardware: object = None  # solver.plan.Hardware (or a function giving one) for a solve here; None: defaults
    sparsity: float | None = None  # threshold models: the exact |act| rule at this sparsity (profile's table)
    ubatch: int = PREFILL_TOKENS  # prompt tokens per GPU pass (-ub): the plan keeps VRAM for their activations
    down_t_type: str = DEFAULT_DOWN_T_TYPE  # a llama.cpp file's block-quantized ffn_down, transposed (--down-t-type)


def _side_path(model: Path, suffix: str) -> Path:
    return model.with_name(model.stem + suffix)


def load_layer_predictors(model_path: Path, model, opts: HybridOptions) -> list[LayerPredictor] | None:
    """Predictors from --predictors, the side file beside the model, or the model's own tensors."""
    from hybridsparse.predictor_training.train import load_powerinfer_dir, load_predictors
    c = model.config
    path = Path(opts.predictors) if opts.predictors else _side_path(model_path, ".predictors.gguf")
    if opts.predictors and not path.exists():
        raise InputError(f"{path}: no such predictor file")
    if path.is_dir():
        pairs, thresholds = load_powerinfer_dir(path)
    elif path.is_file():
        pairs, thresholds, _ = load_predictors(path)
    elif model.predictors is not None:  # a PowerInfer GGUF carries its predictors
        pairs = [(p.fc1, p.fc2) for p in model.predictors]  # as stored (LayerPredictor.to)
        thresholds = [model.sparse_threshold] * len(pairs)
        path = model_path
    else:
        return None
    if len(pairs) != c.n_layers:
        raise InputError(f"{path}: {len(pairs)} layers of predictors, the model has {c.n_layers}")
    out = []
    shape = (lambda w: [w.out_features, w.in_features] if isinstance(w, QWeight) else list(w.shape))
    for i, ((fc1, fc2), thr) in enumerate(zip(pairs, thresholds)):
        s1, s2 = shape(fc1), shape(fc2)
        if s1[1] != c.d_model or s2[0] != c.n_ff or s2[1] != s1[0]:
            raise InputError(f"{path}: blk.{i}.fc1/fc2 have shapes {s1}/{s2}, expected "
                             f"[rank, {c.d_model}] and [{c.n_ff}, rank]")
        out.append(LayerPredictor(fc1, fc2, float(thr)))
    return out


def load_predictors_available(model_path: Path) -> bool:
    """Whether the model file carries predictors (a PowerInfer GGUF): hs-run then goes hybrid unasked,
    as PowerInfer does. Predictors in a side file are used once a hybrid flag (--vram-budget) asks."""
    if not model_path.is_file():
        return False
    from .gguf_file import GGUFFile
    try:
        g = GGUFFile(model_path)
    except Exception:  # noqa: BLE001 - the loader reports a bad file properly
        return False
    try:
        return "blk.0.fc1.weight" in g.tensors
    finally:
        g.close()


def _score_thresholds(profile_dir: Path, n_layers: int, sparsity: float | None = None) -> list:
    """Per-layer |act| thresholds of a threshold model's profile (None for ReLU models); with
    `sparsity`, read off the profile's quantile table (hs-profile stores |act| quantiles per layer)."""
    import json
    meta_path = profile_dir / "profile.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    thr = meta.get("thresholds")
    if not (isinstance(thr, list) and len(thr) == n_layers):
        thr = [None] * n_layers
    if sparsity is None:
        return thr
    if not 0.0 < sparsity < 1.0:
        raise InputError(f"--sparsity {sparsity}: expected a fraction in (0, 1)")
    if meta.get("criterion") != "threshold":
        raise InputError(f"--sparsity applies to threshold models (SwiGLU, GeGLU); {meta_path} "
                         f"{'counts nonzero activations (a ReLU model)' if meta else 'does not exist: run hs-profile first'}")
    if meta.get("target_sparsity") == sparsity:
        return thr
    table = meta.get("threshold_table") or {}
    grid, rows = table.get("sparsity"), table.get("thresholds")
    if not grid or not isinstance(rows, list) or len(rows) != n_layers:
        raise InputError(f"{meta_path}: thresholds only for sparsity {meta.get('target_sparsity')} (an older profile); "
                         f"run hs-profile --sparsity {sparsity}")
    if not grid[0] <= sparsity <= grid[-1]:
        raise InputError(f"--sparsity {sparsity}: the profile's table covers {grid[0]:g} to {grid[-1]:g}")
    return [float(np.interp(sparsity, grid, row)) for row in rows]


def cuda_budget(budget_gib: float | None, device: torch.device) -> int:
    """The budget in bytes, and the allocator capped so torch cannot exceed it: the budget counts the
    CUDA context and everything else the driver reports, so the cap is the budget less the context
    (what it holds now or what the solver counts for it, whichever is more)."""
    from hybridsparse.solver.plan import CUDA_CONTEXT_BYTES, GiB
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    if budget_gib is None:
        budget_gib = max(0.0, free / GiB - 0.5)
    budget = int(budget_gib * GiB)
    used = _process_device_bytes(device)
    if used is None:  # without NVML: the context as the solver counts it
        used = CUDA_CONTEXT_BYTES
    if budget > total:
        raise InputError(f"--vram-budget {budget_gib:g} GiB is more than the {total / GiB:.1f} GiB the GPU has")
    if budget <= used:
        raise InputError(f"--vram-budget {budget_gib:g} GiB is below the {used / GiB:.2f} GiB the CUDA context "
                         "already takes; raise it or use --vram-budget 0 for CPU only")
    # the context grows after this (kernels load on first use: ~150 MiB in a 70B run on the H200), so
    # the cap leaves it what the solver counts for it, not what it holds now
    room = budget - max(used, CUDA_CONTEXT_BYTES)
    if room <= 0:
        raise InputError(f"--vram-budget {budget_gib:g} GiB leaves nothing for weights once the CUDA context "
                         f"({CUDA_CONTEXT_BYTES / GiB:.2f} GiB as counted) is set aside; raise it or use "
                         "--vram-budget 0 for CPU only")
    torch.cuda.set_per_process_memory_fraction(min(1.0, room / total), device)
    return budget, used


def _process_device_bytes(device: torch.device) -> int | None:
    """Device memory this process holds outside torch's allocator (the CUDA context, modules), from
    the driver's per-process figure; None when the driver does not say."""
    from .nvml import process_used_bytes
    torch.zeros(1, device=device)  # the context exists from here on
    used = process_used_bytes(device.index)
    return None if used is None else used - torch.cuda.memory_reserved(device)


def setup_hybrid(model, model_path: Path, opts: HybridOptions, log_line=print) -> dict:
    """Replace every layer's FFN by a `HybridFFN` and place the dense blocks, following the GPU index
    (solved here when missing or stale). Returns a report of the placement."""
    from tqdm import tqdm

    from .models.base import Placement
    c = model.config
    cpu = torch.device("cpu")
    spec = _ffn_spec(c)
    profile_dir = Path(opts.profile) if opts.profile else _side_path(model_path, ".hs-profile")
    predictors, freqs = None, [None] * c.n_layers
    if opts.mode == "sampled":
        from hybridsparse.profiler.activations import load_profile
        freqs = load_profile(profile_dir).frequencies()
    if opts.mode in ("predictor", "sampled"):
        predictors = load_layer_predictors(model_path, model, opts)
        if predictors is None:
            raise InputError(f"{model_path}: no predictors ({_side_path(model_path, '.predictors.gguf').name} not "
                             "found and the model has no blk.N.fc1 tensors): run `make profile` and `make "
                             "train-predictor` for it, or pass --dense (exact, same placement)")
    score_thr = _score_thresholds(profile_dir, c.n_layers, opts.sparsity)
    fast = None
    if opts.device is not None:
        fast = torch.device(opts.device)
    elif torch.cuda.is_available() and opts.vram_budget != 0:
        fast = torch.device("cuda")
    elif opts.vram_budget:
        log_line(f"no CUDA GPU here: --vram-budget {opts.vram_budget:g} does not apply, everything runs on the CPU")
    hot = [np.zeros(0, np.int64)] * c.n_layers
    attn_fast, head_fast, budget, source = [False] * c.n_layers, False, 0, "CPU only"
    context_bytes = 0
    if fast is not None and opts.hot is not None:
        hot = [np.asarray(h) for h in opts.hot]
        attn_fast = list(opts.attn_fast) if opts.attn_fast is not None else [True] * c.n_layers
        head_fast, source = opts.head_fast, "given hot sets"
    elif fast is not None:
        if fast.type != "cuda":
            raise InputError(f"--device {fast}: the hybrid runtime's fast device is a CUDA GPU")
        budget, context_bytes = cuda_budget(opts.vram_budget, fast)
        index, solved = _index(model_path, profile_dir, budget, opts, log_line)
        if len(index.n_ff) != c.n_layers or any(n != c.n_ff for n in index.n_ff):
            raise InputError(f"{opts.gpu_index or 'the GPU index'}: made for {len(index.n_ff)} layers of "
                             f"{index.n_ff[0] if index.n_ff else 0} neurons, the model has {c.n_layers} of {c.n_ff}: "
                             "pass --reset-gpu-index")
        attn_fast = list(index.meta.get("attn_gpu", [True] * c.n_layers))
        head_fast = bool(index.meta.get("head_gpu", False))
        if not opts.disable_gpu_index:
            hot = [np.asarray(g) for g in index.gpu_neurons]
        source = ("solved now" if solved else "cached GPU index") + (", FFNs kept off the GPU" if
                                                                      opts.disable_gpu_index else "")
    down_ts = None
    if any(not layer.ffn.down_transposed for layer in model.layers):
        down_ts = transposed_down(model.gguf, c.n_layers, progress=lambda it: tqdm(
            it, desc="transposing ffn_down (once)", unit="layer", leave=False), down_t_type=opts.down_t_type)
    layer_dev = [fast if (fast is not None and a) else cpu for a in attn_fast]
    head_dev = fast if (fast is not None and head_fast) else cpu
    # The token embedding stays on the CPU, as in llama.cpp: a decode step reads one of its rows, and the
    # plan does not count it (on the GPU, Falcon-40B's would take 1 GiB of a 24 GiB budget unplanned).
    embed_dev = cpu
    # Host nodes pay off inside a CUDA graph. A step that cannot be one (some attention on the CPU) is
    # faster with the event path: with host nodes the Python thread, launching the next layers, competes
    # for the cores with the nodes' threads (S2 on the H200: 266 ms per token with events, 284 with nodes).
    # With HS_RUN_GRAPHS=1 such a step's runs of GPU layers are graphs of their own (generate._RunGraphs):
    # their layers hand over as in a whole-step graph, the CPU-attention layers use events.
    from .generate import RUN_GRAPHS
    graphed = fast is not None and all(attn_fast)
    host_nodes = [graphed or (fast is not None and RUN_GRAPHS == "1" and a) for a in attn_fast]
    placement = Placement(embed_dev, layer_dev, head_dev, sorted({embed_dev, head_dev, *layer_dev}, key=str))

    def build(i, ffn, dev):
        if not isinstance(ffn, FFNWeights):
            raise ModelError(f"{model_path}: layer {i} is already in hybrid form")
        down_t = ffn.down if ffn.down_transposed else down_ts[i]
        pred = predictors[i].to(dev) if predictors is not None else None
        return HybridFFN(ffn, down_t, spec, hot[i], fast, pred, opts.mode, score_thr[i], freqs[i],
                         host_nodes=host_nodes[i])

    model.apply_placement(placement, build, progress=lambda it: tqdm(
        it, desc="placing layers", unit="layer", leave=False, disable=len(it) < 8))
    if budget:  # the plan left VRAM for the activations of this many prompt tokens at a time
        model.max_batch_tokens = opts.ubatch
    gpu_neurons = sum(int(l.ffn.n_hot) for l in model.layers)
    hot_bytes = sum(l.ffn.gpu_bytes for l in model.layers)
    report = {"source": source, "mode": opts.mode, "fast_device": str(fast) if fast else None,
              "vram_budget": budget, "cuda_context_bytes": context_bytes, "attn_fast": sum(attn_fast), "head_fast": head_fast,
              "hot_neurons": gpu_neurons, "hot_neuron_bytes": hot_bytes, "neurons": c.n_ff * c.n_layers}
    log_line(f"hybrid: {opts.mode} mode, {source}; attention of {sum(attn_fast)}/{c.n_layers} layers and "
             f"{gpu_neurons}/{c.n_ff * c.n_layers} FFN neurons on {fast or 'no fast device'}, output head on "
             f"{head_dev.type}")
    return report


def _ffn_spec(c) -> FFNSpec:
    from .layers import FFN_VARIANTS
    return FFN_VARIANTS[c.ffn_variant]


def _index(model_path: Path, profile_dir: Path, budget: int, opts: HybridOptions, log_line):
    """The GPU index for this budget: cached, solved now, or (no profile and FFNs kept off the GPU)
    a plan for the dense blocks alone."""
    import io

    from hybridsparse.solver import cli as solver_cli
    from hybridsparse.solver.gpuidx import read_index
    index_path = Path(opts.gpu_index) if opts.gpu_index else None
    if opts.gpu_index and not opts.reset_gpu_index and index_path.exists() and not profile_dir.exists():
        return read_index(index_path), False  # an index given as is (PowerInfer's exporter) with no profile
    if not (profile_dir / "activation").is_dir() and not any(profile_dir.glob("activation_*.pt")):
        if not opts.disable_gpu_index:
            raise InputError(f"{profile_dir}: no activation profile to place neurons with: run `make profile "
                             f"MODEL={model_path}` (then `make train-predictor`), or pass --disable-gpu-index to "
                             "keep the FFNs off the GPU")
        from hybridsparse.profiler.activations import save_profile
        from .gguf_file import GGUFFile
        g = GGUFFile(model_path)
        n_ff = [g.tensors[f"blk.{i}.ffn_up.weight"].rows for i in range(g.require(f"{g.architecture}.block_count"))]
        g.close()
        profile_dir = _side_path(model_path, ".hs-noprofile")
        save_profile(profile_dir, [torch.zeros(n, dtype=torch.float64) for n in n_ff], 1, {"criterion": "none"})
    out = io.StringIO()
    index, solved = solver_cli.ensure_index(model_path, profile_dir, budget, opts.n_ctx, ubatch=opts.ubatch,
                                            reset=opts.reset_gpu_index, down_t_type=opts.down_t_type,
                                            hw=opts.hardware, index_path=index_path, out=out, plan_out=out,
                                            tag="hs-run")
    for line in out.getvalue().splitlines():
        log_line(line)
    return index, solved
