"""One sequence's generation: batched prefill, decode with the KV cache, stop rules, timings.

On CUDA, when every layer is on the GPU (hybrid layers included: their CPU part is handed over by
the stream), each decode step replays a captured CUDA graph (one per power-of-two range of context
length), so a step costs one launch instead of hundreds. A hybrid layer's CPU part is a host node
on the driver's thread, or with HS_HANDOVER=poll served by this thread: the layer's kernels hand x
and the cold mask over through pinned memory and wait for the answer (runtime/kernels.py
polled_handover). This thread then sleeps until the step is done (a blocking-sync event) instead of
spinning in the copy of the logits: the CPU's cores are the cold FFN's (HS_GRAPH_WAIT=spin: the
spinning wait).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from . import kernels
from .errors import InputError
from .layers import Step
from .models.base import CausalLM
from .sampling import Sampler
from .tokenizer import StreamDecoder, Tokenizer

MIN_GRAPH_BUCKET = 256
# Steps with layers on both devices: the GPU's runs of layers as CUDA graphs (_RunGraphs). HS_RUN_GRAPHS=auto
# (default): where those runs hand no work to the CPU (a dense -ngl split); 1: also a hybrid step with
# attention on the CPU in some layers (its GPU layers then hand over as in a whole-step graph; not yet
# faster than the event path on the GPU machine, see HS_RUN_POOL); 0: never.
RUN_GRAPHS = os.environ.get("HS_RUN_GRAPHS", "auto")


@dataclass(slots=True)
class Timings:
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    gen_tokens: int = 0
    gen_s: float = 0.0
    stop_reason: str = ""

    def line(self, what: str, n: int, seconds: float) -> str:
        ms = seconds * 1000
        per = ms / n if n else 0.0
        tps = n / seconds if seconds > 0 else 0.0
        return f"{what} = {ms:10.2f} ms / {n:5d} tokens ({per:8.2f} ms per token, {tps:8.2f} tokens per second)"

    def summary(self) -> str:
        return "\n".join([self.line("prompt eval time", self.prompt_tokens, self.prompt_s),
                          self.line("       eval time", self.gen_tokens, self.gen_s)])


def _capture(fn, pool) -> tuple:
    """fn() captured as a CUDA graph in `pool` after one warm-up run outside it (allocator, cuBLAS
    handles): (graph, its output, the polled hand-over tasks that each replay must serve)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with kernels.polled_handover() as tasks, torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out, tasks


def _bucket(kv_len: int, n_ctx: int) -> int:
    """The context length a captured step is made for: a power of two from MIN_GRAPH_BUCKET, at most n_ctx."""
    b = MIN_GRAPH_BUCKET
    while b < kv_len:
        b *= 2
    return min(b, n_ctx)


class _DecodeGraphs:
    """Captured decode steps, one per context-length bucket; inputs are static tensors. The layers
    are all on the GPU (hybrid layers' cold parts run as host nodes inside the graph); an embedding
    table or output head kept on the CPU runs outside the graph."""

    def __init__(self, model: CausalLM, cache, n_ctx: int, device):
        self.model, self.cache, self.n_ctx = model, cache, n_ctx
        p = model.placement
        self.embed_inside, self.head_inside = p.embed.type == "cuda", p.head.type == "cuda"
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.x = torch.zeros(1, model.config.d_model, device=device)  # the embedded token, when embedded outside
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        host_work = any(getattr(getattr(layer, "ffn", None), "n_cold", 0) for layer in model.layers)
        self.done = torch.cuda.Event(blocking=True) if host_work else None

    def _step(self, kv_len: int) -> torch.Tensor:
        m = self.model
        x = m.embed(self.token, self.pos) if self.embed_inside else self.x
        x = m.run_layers(x, self.pos, self.cache, kv_len)
        return m.finish(x) if self.head_inside else x

    def run(self, token: int, pos: int) -> torch.Tensor:
        self.token.fill_(token)
        self.pos.fill_(pos)
        if not self.embed_inside:
            p = self.model.placement
            self.x.copy_(self.model.embed(torch.tensor([token], device=p.embed), torch.tensor([pos], device=p.embed)))
        b = _bucket(pos + 1, self.n_ctx)
        if b not in self.graphs:
            self.graphs[b] = _capture(lambda: self._step(b), self.pool)
        graph, out, tasks = self.graphs[b]
        graph.replay()
        kernels.serve_polled(tasks)  # the hybrid layers' CPU parts, on this thread, as the GPU reaches them
        if self.done is not None and os.environ.get("HS_GRAPH_WAIT", "block") != "spin":
            self.done.record()
            self.done.synchronize()
        return out if self.head_inside else self.model.finish(out)


def layer_runs(devices: list[torch.device]) -> list[tuple[int, int, torch.device]]:
    """The layers as runs of consecutive layers on one device: (first, end, device), in order."""
    runs: list[tuple[int, int, torch.device]] = []
    for i, dev in enumerate(devices):
        if runs and runs[-1][2] == dev:
            runs[-1] = (runs[-1][0], i + 1, dev)
        else:
            runs.append((i, i + 1, dev))
    return runs


class _RunGraphs:
    """Decode steps whose layers alternate between the GPU and the CPU (the plan keeps some layers'
    attention on the CPU, or a dense layer split): each run of consecutive GPU layers is a captured
    CUDA graph per context-length bucket (hybrid layers' cold parts inside, handed over as in
    _DecodeGraphs), the CPU layers in between run op by op. Op by op, every GPU layer of such a step
    costs its launches on this thread (S3 on the H100: 24 GPU layers at ~0.35 ms each beyond their CPU
    FFN). Used where the GPU's runs hand nothing to the CPU, and for hybrid steps with HS_RUN_GRAPHS=1
    (RUN_GRAPHS). The embedding and the output head run outside the graphs."""

    def __init__(self, model: CausalLM, cache, n_ctx: int):
        self.model, self.cache, self.n_ctx = model, cache, n_ctx
        self.runs = layer_runs(model.placement.layers)
        d = model.config.d_model
        self.x_in = {r: torch.zeros(1, d, device=dev) for r, (_, _, dev) in enumerate(self.runs) if dev.type == "cuda"}
        self.pos = {dev: torch.zeros(1, dtype=torch.long, device=dev) for _, _, dev in self.runs}
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.done = torch.cuda.Event(blocking=True)

    @staticmethod
    def usable(model: CausalLM) -> bool:
        """Some layers on one CUDA device, some on the CPU, and the GPU layers capturable."""
        devs = set(model.placement.layers)
        gpu = [d for d in devs if d.type == "cuda"]
        return (len(gpu) == 1 and len(devs) == 2 and
                all(getattr(getattr(layer, "ffn", None), "capturable", True)
                    for layer, d in zip(model.layers, model.placement.layers) if d.type == "cuda"))

    def _layers(self, r: int, x: torch.Tensor, kv_len: int) -> torch.Tensor:
        m = self.model
        a, e, dev = self.runs[r]
        step = Step.build(self.pos[dev], kv_len, m.windows)
        for i in range(a, e):
            x = m.block(i, x, step, self.cache[i])
        return x

    def run(self, token: int, pos: int) -> torch.Tensor:
        m, p = self.model, self.model.placement
        x = m.embed(torch.tensor([token], device=p.embed), torch.tensor([pos], device=p.embed))
        b = _bucket(pos + 1, self.n_ctx)
        for dev in self.pos:
            self.pos[dev].fill_(pos)
        for r, (_, _, dev) in enumerate(self.runs):
            if dev.type != "cuda":
                if x.is_cuda:  # the GPU's run done (its host work included) before this thread's OpenMP team starts
                    self.done.record()
                    self.done.synchronize()
                    x = x.to(dev)
                    kernels.pool_rest()
                x = self._layers(r, x, pos + 1)
                continue
            self.x_in[r].copy_(x)
            if (r, b) not in self.graphs:
                self.graphs[r, b] = _capture(lambda: self._layers(r, self.x_in[r], b), self.pool)
            graph, out, tasks = self.graphs[r, b]
            graph.replay()
            # their polled CPU parts on this thread's OpenMP team, which the CPU layers use too: on the
            # spinning pool (HS_RUN_POOL=1, read per step) the two sets of threads fought over the cores (S3
            # on an H200 host, 16 threads: the cold FFNs at ~40 GiB/s, a step 107-109 ms against 85-92 op by op)
            kernels.serve_polled(tasks, use_pool=os.environ.get("HS_RUN_POOL") == "1")
            x = out
        return m.finish(x)


@dataclass
class Generator:
    model: CausalLM
    tokenizer: Tokenizer
    n_ctx: int
    n_batch: int = 2048
    use_graphs: bool = True
    timings: Timings = field(default_factory=Timings)

    def __post_init__(self):
        self.cache = self.model.new_cache(self.n_ctx)
        self.n_past = 0
        self.tokens: list[int] = []  # what the cache holds, position by position
        p = self.model.placement
        layers_gpu = len(set(p.layers)) == 1 and p.layers[0].type == "cuda" and self.model.capturable()
        self._graphs = _DecodeGraphs(self.model, self.cache, self.n_ctx, p.layers[0]) \
            if (self.use_graphs and layers_gpu) else None
        if self._graphs is None and self.use_graphs and RUN_GRAPHS != "0" and torch.cuda.is_available() \
                and _RunGraphs.usable(self.model):
            self._graphs = _RunGraphs(self.model, self.cache, self.n_ctx)

    def reset(self) -> None:
        self.n_past = 0
        self.tokens = []

    @torch.inference_mode()
    def eval(self, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Feed tokens after the current position; returns logits of the last one (or of all)."""
        if self.n_past + len(ids) > self.n_ctx:
            raise InputError(f"prompt of {len(ids)} tokens after {self.n_past} does not fit the context "
                             f"of {self.n_ctx} tokens (raise -c)")
        kernels.raise_host_errors()  # a hybrid layer's CPU part in an earlier step
        del self.tokens[self.n_past:]
        self.tokens.extend(ids)
        if len(ids) == 1 and self._graphs is not None and not all_logits:
            out = self._graphs.run(ids[0], self.n_past)[0]
            self.n_past += 1
            return out
        outs = []
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start:start + self.n_batch]
            tokens = torch.tensor(chunk, dtype=torch.long)
            positions = torch.arange(self.n_past, self.n_past + len(chunk), dtype=torch.long)
            logits = self.model.forward(tokens, positions, self.cache, self.n_past + len(chunk), all_logits)
            self.n_past += len(chunk)
            outs.append(logits)
        return torch.cat(outs) if all_logits else outs[-1][-1]

    def generate(self, prompt: list[int], n_predict: int, sampler: Sampler,
                 stop: list[str] | None = None, keep_prefix: bool = False) -> Iterator[str]:
        """Yields text pieces as they complete; `timings` holds counts and times afterwards.
        keep_prefix: the cache's positions that already hold the prompt's first tokens are kept
        (a conversation's next turn evaluates only what is new; at least one token is)."""
        if not prompt:
            raise InputError("empty prompt: nothing to condition on")
        kept = 0
        if keep_prefix:
            limit = min(len(prompt) - 1, self.n_past)
            while kept < limit and self.tokens[kept] == prompt[kept]:
                kept += 1
        self.n_past = kept  # eval drops what the cache held beyond it
        t = self.timings = Timings(prompt_tokens=len(prompt) - kept)
        start = time.perf_counter()
        logits = self.eval(prompt[kept:])
        _sync(logits)
        t.prompt_s = time.perf_counter() - start
        history = list(prompt)
        stream = StreamDecoder(self.tokenizer, prompt)
        text, limit = "", n_predict if n_predict >= 0 else self.n_ctx
        start = time.perf_counter()
        while True:
            token = sampler(logits, history)
            if token in self.tokenizer.eog_ids:
                t.stop_reason = "eos"
                break
            history.append(token)
            t.gen_tokens += 1
            piece = stream.push(token)
            if piece:
                text += piece
                hit = next((s for s in (stop or []) if s and s in text), None)
                if hit is not None:
                    cut = text.index(hit)
                    tail = piece[:max(0, len(piece) - (len(text) - cut))]
                    if tail:
                        yield tail
                    t.stop_reason = "stop"
                    break
                yield piece
            if t.gen_tokens >= limit:
                t.stop_reason = "length"
                break
            if self.n_past >= self.n_ctx:
                t.stop_reason = "context"
                break
            logits = self.eval([token])
        t.gen_s = time.perf_counter() - start


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
