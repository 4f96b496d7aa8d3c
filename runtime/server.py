"""hs-serve: an OpenAI-compatible HTTP server (and llama.cpp's extras) over any placement hs-run offers.

  hs-serve [-m MODEL] [--host 127.0.0.1] [--port 8080] [-np 4] [-c 4096] [--api-key KEY] [--alias NAME]
           [-t N] [-ngl N | --vram-budget GiB ...]

Endpoints: GET /v1/models; POST /v1/chat/completions and /v1/completions (streaming as SSE with
`data: [DONE]`); GET /health (503 while loading), /metrics (Prometheus), POST /tokenize, /detokenize;
GET / (a chat page). Errors come in OpenAI's JSON shape with the right status.

Scheduling (continuous batching): one engine thread owns the model. Each sequence (a request, or
each of its `n` choices) takes one of `-np` slots, each with its own KV cache; between steps, waiting
sequences join free slots and finished or disconnected ones leave. A step is one forward pass over
every active sequence's work: prompt chunks for those still reading their prompt (at most
--batch-size prompt tokens per step in all, oldest sequences first), the sampled token for the others (`CausalLM.forward_batch`: the linear layers, the
hybrid FFN included, read their weights once for all; attention runs per sequence over its own
cache), so no request waits behind another for more than one step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fastapi import Request  # at module level: FastAPI resolves the handlers' annotations here

from .errors import HybridSparseError, InputError
from .sampling import Sampler, SamplingParams
from .tokenizer import StreamDecoder


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


# --- sequences and the engine -------------------------------------------------------------------

@dataclass
class Seq:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str]
    logprobs: int | None  # top alternatives per token, None = no logprobs
    events: "asyncio.Queue"
    loop: asyncio.AbstractEventLoop
    index: int = 0
    echo_logprobs: bool = False  # completions with echo: logprobs of the prompt tokens too
    cancelled: bool = False
    # engine state
    slot: int = -1
    fed: int = 0
    tokens: list[int] = field(default_factory=list)
    text: str = ""

    def emit(self, event: dict) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """Owns the model; runs the scheduler loop on its own thread."""

    def __init__(self, lm, n_slots: int, n_ctx: int, n_batch: int, use_graphs: bool = True):
        from .generate import Generator
        self.lm, self.tok = lm, lm.tokenizer
        self.n_ctx, self.n_batch = n_ctx, n_batch
        self.slots = [Generator(lm.model, lm.tokenizer, n_ctx, n_batch=n_batch, use_graphs=use_graphs)
                      for _ in range(n_slots)]
        self.free = list(range(n_slots))
        self.active: list[Seq] = []
        self.waiting: "queue.Queue[Seq]" = queue.Queue()
        self.metrics = {"prompt_tokens_total": 0, "tokens_predicted_total": 0, "prompt_seconds_total": 0.0,
                        "tokens_predicted_seconds_total": 0.0, "requests_total": 0}
        self._wake = threading.Event()
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name="hs-serve-engine", daemon=True)
        self.thread.start()

    @property
    def deferred(self) -> int:
        return self.waiting.qsize()

    def submit(self, seq: Seq) -> None:
        if len(seq.prompt) >= self.n_ctx:
            raise APIError(400, f"the prompt has {len(seq.prompt)} tokens; the context of each slot holds {self.n_ctx} "
                           f"(start hs-serve with a larger -c)", "messages", "context_length_exceeded")
        self.metrics["requests_total"] += 1
        self.waiting.put(seq)
        self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self.thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop:
            while self.free and not self.waiting.empty():
                seq = self.waiting.get()
                if seq.cancelled:
                    continue
                seq.slot = self.free.pop()
                self.slots[seq.slot].reset()
                self.active.append(seq)
            if not self.active:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            batch: list[tuple[Seq, list[int]]] = []  # every sequence's work of this step, one pass
            # prompt tokens of this step, all sequences together (llama.cpp's n_batch; a hybrid model on CUDA
            # takes fewer, see CausalLM.max_batch_tokens), oldest first: a step stays short, so decoding
            # sequences are never held up by long prompts
            budget = min(self.n_batch, self.lm.model.max_batch_tokens or self.n_batch)
            for seq in list(self.active):
                try:
                    if seq.cancelled:
                        done = True
                    elif seq.fed < len(seq.prompt):
                        done = False
                        if seq.echo_logprobs:  # its own pass: the logits of every prompt position
                            done = self._prefill(seq)
                        elif budget > 0:
                            chunk = seq.prompt[seq.fed:seq.fed + budget]
                            budget -= len(chunk)
                            batch.append((seq, chunk))
                    else:
                        token = self._sample(seq)
                        done = token is None
                        if not done:
                            batch.append((seq, [token]))
                except Exception as e:  # noqa: BLE001 - one request's failure must not stop the server
                    seq.emit({"error": APIError(500, f"{type(e).__name__}: {e}", kind="server_error")})
                    done = True
                if done:
                    self._leave(seq)
            if batch:
                try:
                    self._run(batch)
                except Exception as e:  # noqa: BLE001
                    for seq, _ in batch:
                        seq.emit({"error": APIError(500, f"{type(e).__name__}: {e}", kind="server_error")})
                        self._leave(seq)

    def _leave(self, seq: Seq) -> None:
        if seq in self.active:
            self.active.remove(seq)
            self.free.append(seq.slot)

    def _prefill(self, seq: Seq) -> bool:
        """One chunk of the prompt with every position's logits (echo with logprobs)."""
        gen = self.slots[seq.slot]
        chunk = seq.prompt[seq.fed:seq.fed + self.n_batch]
        t = time.perf_counter()
        logits = gen.eval(chunk, all_logits=True)
        self.metrics["prompt_seconds_total"] += time.perf_counter() - t
        self.metrics["prompt_tokens_total"] += len(chunk)
        self._prompt_logprobs(seq, logits, seq.fed)
        seq.fed += len(chunk)
        return seq.fed >= len(seq.prompt) and self._start_decoding(seq, logits[-1])

    def _start_decoding(self, seq: Seq, logits: torch.Tensor) -> bool:
        """The prompt is in the cache: sampling state; True when nothing is to be generated."""
        seq.last_logits = logits
        seq.decoder = StreamDecoder(self.tok, seq.prompt)
        seq.sampler = Sampler(seq.params)
        if seq.max_tokens == 0:
            seq.emit({"finish": "length"})
            return True
        return False

    def _sample(self, seq: Seq) -> int | None:
        """The next token from the last logits, emitted; the token to feed back, or None when done."""
        t = time.perf_counter()
        logits = seq.last_logits
        token = seq.sampler(logits, seq.prompt + seq.tokens)
        lp = self._logprobs(logits, token, seq.logprobs) if seq.logprobs is not None else None
        if token in self.tok.eog_ids:
            seq.emit({"finish": "stop"})
            return None
        seq.tokens.append(token)
        self.metrics["tokens_predicted_total"] += 1
        piece = seq.decoder.push(token)
        finish = None
        if piece:
            before = len(seq.text)
            seq.text += piece
            hits = [i for i in (seq.text.find(x, max(0, before - len(x) + 1)) for x in seq.stop if x) if i >= 0]
            if hits:  # cut at the stop string (the part already streamed stays streamed)
                hit = min(hits)
                piece = seq.text[before:hit] if hit > before else ""
                seq.text = seq.text[:hit]
                finish = "stop"
        seq.emit({"text": piece, "token": token, "logprobs": lp})
        if finish is None and (len(seq.tokens) >= seq.max_tokens or self.slots[seq.slot].n_past >= self.n_ctx):
            finish = "length"
        self.metrics["tokens_predicted_seconds_total"] += time.perf_counter() - t
        if finish is not None:
            seq.emit({"finish": finish})
            return None
        return token

    def _run(self, batch: list[tuple[Seq, list[int]]]) -> None:
        """One forward pass for the step: prompt chunks of the sequences still reading their prompt and
        the sampled token of every other sequence (`CausalLM.forward_batch`: weights read once for
        all; attention per sequence over its own cache). A lone sequence takes the Generator's path
        (CUDA graphs for single tokens)."""
        from . import kernels
        t = time.perf_counter()
        gens = [self.slots[seq.slot] for seq, _ in batch]
        if len(batch) == 1:
            rows = [gens[0].eval(batch[0][1])]
        else:
            kernels.raise_host_errors()
            with torch.inference_mode():
                rows = self.lm.model.forward_batch([toks for _, toks in batch], [g.n_past for g in gens],
                                                   [g.cache for g in gens])
            for g, (_, toks) in zip(gens, batch):
                g.n_past += len(toks)
        dt = time.perf_counter() - t
        n_prompt = sum(len(toks) for seq, toks in batch if seq.fed < len(seq.prompt))
        n_all = sum(len(toks) for _, toks in batch)
        self.metrics["prompt_seconds_total"] += dt * n_prompt / n_all
        self.metrics["tokens_predicted_seconds_total"] += dt * (n_all - n_prompt) / n_all
        self.metrics["prompt_tokens_total"] += n_prompt
        for (seq, toks), row in zip(batch, rows):
            if seq.fed < len(seq.prompt):
                seq.fed += len(toks)
                if seq.fed >= len(seq.prompt) and self._start_decoding(seq, row):
                    self._leave(seq)
            else:
                seq.last_logits = row

    def _logprobs(self, logits: torch.Tensor, token: int, k: int) -> dict:
        logp = torch.log_softmax(logits.float().cpu(), -1)
        top = torch.topk(logp, k) if k > 0 else None
        return {"token": token, "logprob": float(logp[token]),
                "top": [] if top is None else [(int(i), float(v)) for v, i in zip(top.values, top.indices)]}

    def _prompt_logprobs(self, seq: Seq, logits: torch.Tensor, start: int) -> None:
        logp = torch.log_softmax(logits.float().cpu(), -1)
        out = []
        for j in range(logits.shape[0]):
            pos = start + j  # the token at pos+1 is predicted by logits[j]
            if pos + 1 < len(seq.prompt):
                t = seq.prompt[pos + 1]
                top = torch.topk(logp[j], seq.logprobs) if seq.logprobs else None
                out.append({"token": t, "logprob": float(logp[j, t]),
                            "top": [] if top is None else [(int(i), float(v)) for v, i in zip(top.values, top.indices)]})
        if start == 0:
            out.insert(0, {"token": seq.prompt[0], "logprob": None, "top": []})
        seq.emit({"prompt_logprobs": out})


# --- request parsing ----------------------------------------------------------------------------

def _field(body: dict, name: str, kind, default=None, lo=None, hi=None):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind in (int, float, (int, float)) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        want = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array"}.get(kind, str(kind))
        raise APIError(400, f"'{name}' must be {want}, got {json.dumps(value)[:60]}", name)
    if lo is not None and value < lo or hi is not None and value > hi:
        raise APIError(400, f"'{name}' = {value} is out of range [{lo}, {hi}]", name)
    return value


def _sampling(body: dict) -> SamplingParams:
    """llama.cpp server's defaults for what the request leaves out (top-k 40 also keeps a 262k-entry
    vocabulary from being sorted for every token)."""
    return SamplingParams(temperature=_field(body, "temperature", float, 0.8, 0.0, 2.0),
                          top_p=_field(body, "top_p", float, 0.95, 0.0, 1.0),
                          top_k=_field(body, "top_k", int, 40, 0), min_p=_field(body, "min_p", float, 0.05, 0.0, 1.0),
                          repeat_penalty=_field(body, "repeat_penalty", float, 1.0, 0.01),
                          seed=_field(body, "seed", int, -1))


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        return stop
    raise APIError(400, "'stop' must be a string or an array of at most 16 strings", "stop")


# --- the HTTP app -------------------------------------------------------------------------------

PAGE = Path(__file__).with_name("chat.html")


def create_app(args, load):
    """`load()` returns the LoadedModel; it runs in the background so /health answers 503 meanwhile."""
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI(title="hs-serve", docs_url=None, redoc_url=None, openapi_url=None)
    state = {"engine": None, "error": None, "alias": args.alias}

    def _load():
        try:
            lm = load()
            state["alias"] = args.alias or Path(lm.gguf.path).name
            state["engine"] = Engine(lm, args.parallel, args.ctx_size, args.batch_size, use_graphs=not args.no_graphs)
        except Exception as e:  # noqa: BLE001 - reported on /health and each request
            state["error"] = f"{type(e).__name__}: {e}"
            print(f"hs-serve: error: model failed to load: {state['error']}", file=sys.stderr)

    threading.Thread(target=_load, name="hs-serve-load", daemon=True).start()
    app.state.hs = state

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(404)
    async def _not_found(request, exc):
        return JSONResponse(APIError(404, f"no route {request.method} {request.url.path}").body(), status_code=404)

    @app.exception_handler(405)
    async def _bad_method(request, exc):
        return JSONResponse(APIError(405, f"method {request.method} not allowed on {request.url.path}").body(),
                            status_code=405)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        public = request.url.path in ("/", "/health") or not args.api_key
        if not public and request.headers.get("authorization", "") != f"Bearer {args.api_key}":
            return JSONResponse(APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                         kind="authentication_error").body(), status_code=401)
        return await call_next(request)

    def engine() -> Engine:
        if state["error"]:
            raise APIError(500, f"the model failed to load: {state['error']}", kind="server_error")
        if state["engine"] is None:
            raise APIError(503, "loading model", kind="unavailable_error")
        return state["engine"]

    async def _json(request: Request) -> dict:
        raw = await request.body()
        if len(raw) > 8 * 2**20:
            raise APIError(413, "request body over 8 MiB")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        return body

    def _model_name(body: dict) -> None:
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise APIError(400, "'model' must be a string", "model")
        if name and name != state["alias"]:
            raise APIError(404, f"the model '{name}' does not exist (this server has '{state['alias']}')", "model",
                           "model_not_found")

    @app.get("/health")
    async def health():
        if state["error"]:
            return JSONResponse({"status": "error", "error": state["error"]}, status_code=500)
        if state["engine"] is None:
            return JSONResponse({"status": "loading model"}, status_code=503)
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.get("/v1/models")
    async def models():
        eng = engine()
        return {"object": "list", "data": [{"id": state["alias"], "object": "model", "created": 0, "owned_by": "hybridsparse",
                                             "meta": {"n_ctx": eng.n_ctx, "n_vocab": eng.tok.n_vocab}}]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        eng = engine()
        m = eng.metrics
        lines = []
        for key, kind, help_ in (("prompt_tokens_total", "counter", "prompt tokens processed"),
                                 ("tokens_predicted_total", "counter", "tokens generated"),
                                 ("prompt_seconds_total", "counter", "prompt processing time"),
                                 ("tokens_predicted_seconds_total", "counter", "generation time"),
                                 ("requests_total", "counter", "requests accepted")):
            lines += [f"# HELP hybridsparse:{key} {help_}", f"# TYPE hybridsparse:{key} {kind}", f"hybridsparse:{key} {m[key]}"]
        rates = (("prompt_tokens_seconds", m["prompt_tokens_total"], m["prompt_seconds_total"]),
                 ("predicted_tokens_seconds", m["tokens_predicted_total"], m["tokens_predicted_seconds_total"]))
        for key, n, s in rates:
            lines += [f"# TYPE hybridsparse:{key} gauge", f"hybridsparse:{key} {n / s if s else 0.0}"]
        lines += ["# TYPE hybridsparse:requests_processing gauge", f"hybridsparse:requests_processing {len(eng.active)}",
                  "# TYPE hybridsparse:requests_deferred gauge", f"hybridsparse:requests_deferred {eng.deferred}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json(request)
        text = _field(body, "content", str, "")
        ids = engine().tok.encode(text, add_bos=_field(body, "add_special", bool, False))
        if _field(body, "with_pieces", bool, False):
            return {"tokens": [{"id": i, "piece": engine().tok.decode([i], skip_special=False)} for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _json(request)
        ids = _field(body, "tokens", list, [])
        tok = engine().tok
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < tok.n_vocab for i in ids):
            raise APIError(400, f"'tokens' must be token ids in [0, {tok.n_vocab})", "tokens")
        return {"content": tok.decode(ids, skip_special=False)}

    def _common(body: dict, eng: Engine) -> dict:
        n = _field(body, "n", int, 1, 1, 16)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = _field({"max_tokens": max_tokens}, "max_tokens", int, None, 0, eng.n_ctx)
        return {"n": n, "max_tokens": max_tokens, "params": _sampling(body), "stop": _stop(body),
                "stream": _field(body, "stream", bool, False)}

    def _seqs(eng, prompt, c, logprobs, echo=False) -> list[Seq]:
        loop = asyncio.get_running_loop()
        max_tokens = c["max_tokens"] if c["max_tokens"] is not None else eng.n_ctx - len(prompt)
        seqs = []
        for i in range(c["n"]):
            p = c["params"]
            params = SamplingParams(p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.repeat_last_n,
                                    p.seed + i if p.seed >= 0 else -1)
            seqs.append(Seq(prompt, params, max_tokens, c["stop"], logprobs, asyncio.Queue(), loop, index=i,
                            echo_logprobs=echo))
        for s in seqs:
            eng.submit(s)
        return seqs

    async def _collect(seq: Seq) -> dict:
        out = {"text": "", "tokens": [], "logprobs": [], "prompt_logprobs": None, "finish": None}
        while True:
            ev = await seq.events.get()
            if "error" in ev:
                raise ev["error"]
            if "prompt_logprobs" in ev:
                out["prompt_logprobs"] = (out["prompt_logprobs"] or []) + ev["prompt_logprobs"]
            elif "finish" in ev:
                out["finish"] = ev["finish"]
                return out
            else:
                out["text"] += ev["text"]
                out["tokens"].append(ev["token"])
                if ev["logprobs"] is not None:
                    out["logprobs"].append(ev["logprobs"])

    def _piece(tok, i: int) -> str:
        return tok.decode([i], skip_special=False)

    def _chat_entry(tok, i: int, logprob) -> dict:
        piece = _piece(tok, i)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    def _chat_logprobs(tok, lps: list[dict]) -> dict:
        return {"content": [{**_chat_entry(tok, lp["token"], lp["logprob"]),
                             "top_logprobs": [_chat_entry(tok, i, v) for i, v in lp["top"]]} for lp in lps]}

    def _usage(prompt: list[int], outs: list[dict]) -> dict:
        gen = sum(len(o["tokens"]) for o in outs)
        return {"prompt_tokens": len(prompt), "completion_tokens": gen, "total_tokens": len(prompt) + gen}

    def _stream(seqs: list[Seq], make_chunk, final_usage):
        async def body():
            pending = {s.index: s for s in seqs}
            outs = {s.index: {"tokens": []} for s in seqs}
            getters: dict[int, asyncio.Future] = {}  # one waiting read per sequence
            try:
                for s in seqs:
                    first = make_chunk(s.index, None, None, start=True)
                    if first is not None:
                        yield f"data: {json.dumps(first)}\n\n"
                while pending:
                    for i, s in pending.items():
                        if i not in getters:
                            getters[i] = asyncio.ensure_future(s.events.get())
                    done, _ = await asyncio.wait(getters.values(), return_when=asyncio.FIRST_COMPLETED)
                    for i in [i for i, f in getters.items() if f in done]:
                        ev = getters.pop(i).result()
                        if "error" in ev:
                            yield f"data: {json.dumps(ev['error'].body())}\n\n"
                            pending.pop(i, None)
                        elif "finish" in ev:
                            yield f"data: {json.dumps(make_chunk(i, None, ev['finish']))}\n\n"
                            pending.pop(i, None)
                        elif "text" in ev:
                            outs[i]["tokens"].append(ev["token"])
                            yield f"data: {json.dumps(make_chunk(i, ev, None))}\n\n"
                usage = final_usage([outs[i] for i in sorted(outs)])
                if usage is not None:
                    yield f"data: {json.dumps(usage)}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or we finished): free the slots now
                for f in getters.values():
                    f.cancel()
                for s in seqs:
                    s.cancelled = True
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json(request)
        eng = engine()
        _model_name(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty array", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, f"messages[{i}] must be an object with a string 'role'", "messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
            if not isinstance(content, str):
                raise APIError(400, f"messages[{i}].content must be a string or text parts", "messages")
            messages[i] = {**m, "content": content}
        c = _common(body, eng)
        logprobs = None
        if _field(body, "logprobs", bool, False):
            logprobs = _field(body, "top_logprobs", int, 0, 0, 20)
        tok = eng.tok
        try:
            text = tok.render_chat(messages, fallback=True)
        except HybridSparseError as e:
            raise APIError(400, str(e), "messages") from None
        prompt = tok.encode(text)
        seqs = _seqs(eng, prompt, c, logprobs)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": state["alias"]}
        if c["stream"]:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage")) \
                if isinstance(body.get("stream_options"), dict) else False

            def make_chunk(i, ev, finish, start=False):
                delta = {"role": "assistant", "content": ""} if start else ({} if ev is None else {"content": ev["text"]})
                choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}
                if ev is not None and ev["logprobs"] is not None:
                    choice["logprobs"] = _chat_logprobs(tok, [ev["logprobs"]])
                return {**head, "object": "chat.completion.chunk", "choices": [choice]}

            def usage(outs):
                if not include_usage:
                    return None
                return {**head, "object": "chat.completion.chunk", "choices": [], "usage": _usage(prompt, outs)}
            return _stream(seqs, make_chunk, usage)
        outs = await _gather(seqs)
        choices = [{"index": s.index, "message": {"role": "assistant", "content": o["text"]},
                    "finish_reason": o["finish"],
                    "logprobs": _chat_logprobs(tok, o["logprobs"]) if logprobs is not None else None}
                   for s, o in zip(seqs, outs)]
        return {**head, "choices": choices, "usage": _usage(prompt, outs)}

    async def _gather(seqs):
        try:
            return await asyncio.gather(*(_collect(s) for s in seqs))
        finally:
            for s in seqs:
                s.cancelled = True

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        eng = engine()
        _model_name(body)
        tok = eng.tok
        prompts = _prompts(body.get("prompt"), tok)
        c = _common(body, eng)
        echo = _field(body, "echo", bool, False)
        logprobs = _field(body, "logprobs", int, None, 0, 20)
        if c["stream"] and len(prompts) > 1:
            raise APIError(400, "streaming takes one prompt", "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": state["alias"]}
        if c["stream"]:
            prompt = prompts[0]
            seqs = _seqs(eng, prompt, c, logprobs)

            def make_chunk(i, ev, finish, start=False):
                if start:
                    return None
                choice = {"index": i, "text": "" if ev is None else ev["text"], "finish_reason": finish, "logprobs": None}
                if ev is not None and ev["logprobs"] is not None:
                    choice["logprobs"] = _cmpl_logprobs(tok, [ev["logprobs"]])
                return {**head, "choices": [choice]}
            return _stream(seqs, make_chunk, lambda outs: None)
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for k, prompt in enumerate(prompts):
            seqs = _seqs(eng, prompt, c, logprobs, echo=echo and logprobs is not None)
            outs = await _gather(seqs)
            for s, o in zip(seqs, outs):
                text = (tok.decode(prompt, skip_special=False) if echo else "") + o["text"]
                lp = None
                if logprobs is not None:
                    lps = (o["prompt_logprobs"] or []) + o["logprobs"] if echo else o["logprobs"]
                    lp = _cmpl_logprobs(tok, lps)
                choices.append({"index": k * c["n"] + s.index, "text": text, "finish_reason": o["finish"], "logprobs": lp})
            u = _usage(prompt, outs)
            usage = {key: usage[key] + u[key] for key in usage}
        return {**head, "choices": choices, "usage": usage}

    def _cmpl_logprobs(tok, lps: list[dict]) -> dict:
        tokens, offsets, pos = [], [], 0
        for lp in lps:
            tokens.append(_piece(tok, lp["token"]))
            offsets.append(pos)
            pos += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [lp["logprob"] for lp in lps],
                "top_logprobs": [({_piece(tok, i): v for i, v in lp["top"]} if lp["top"] else None) for lp in lps],
                "text_offset": offsets}

    return app


def _prompts(prompt, tok) -> list[list[int]]:
    """OpenAI's prompt forms: text, token ids, or a list of either."""
    def one(p):
        if isinstance(p, str):
            ids = tok.encode(p)
        elif isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
            if not all(0 <= i < tok.n_vocab for i in p):
                raise APIError(400, f"'prompt' token ids must be in [0, {tok.n_vocab})", "prompt")
            ids = list(p)
        else:
            raise APIError(400, "'prompt' must be a string, an array of token ids, or an array of either", "prompt")
        if not ids:
            raise APIError(400, "'prompt' is empty", "prompt")
        return ids
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [one(p) for p in prompt]
    return [one(prompt)]


def build_parser() -> argparse.ArgumentParser:
    from .cli import add_hybrid_args, add_model_args
    ap = argparse.ArgumentParser(prog="hs-serve", description="OpenAI-compatible server (llama.cpp's server flags).")
    add_model_args(ap)
    add_hybrid_args(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    ap.add_argument("-np", "--parallel", type=int, default=4, help="concurrent sequences (slots, default 4)")
    ap.add_argument("-b", "--batch-size", type=int, default=512,
                    help="prompt tokens per step, all sequences together (default 512; lower it to keep decode "
                         "steps short while long prompts arrive, e.g. 64 for a hybrid placement whose cold "
                         "neurons are computed by the CPU)")
    ap.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    ap.add_argument("--alias", default=None, help="model name clients use (default: the file name)")
    ap.add_argument("--no-graphs", action="store_true", help="do not capture CUDA graphs for decoding")
    ap.set_defaults(ctx_size=4096)
    return ap


def _run(args) -> int:
    import uvicorn

    from .cli import cache_dtype, hybrid_options, use_threads
    from .loader import open_model, resolve_model_path
    if args.parallel < 1 or args.parallel > 256:
        raise InputError(f"-np {args.parallel}: expected 1 to 256 slots")
    if args.ctx_size < 16:
        raise InputError(f"-c {args.ctx_size}: expected at least 16 tokens per slot")
    if args.batch_size < 1:
        raise InputError(f"-b {args.batch_size}: expected at least 1 prompt token per step")
    if not 0 < args.port < 65536:
        raise InputError(f"--port {args.port}: expected 1 to 65535")
    use_threads(args.threads)
    path = resolve_model_path(args.model)
    if not Path(path).is_file():
        raise InputError(f"{path}: no such model file")
    hybrid = hybrid_options(args, path)
    if hybrid is not None:  # the placement counts the KV cache of every slot against the VRAM budget
        hybrid.n_ctx = args.ctx_size * args.parallel

    def load():
        return open_model(path, -1 if args.n_gpu_layers is None else args.n_gpu_layers,
                          None if hybrid is not None else args.device, hybrid=hybrid,
                          log_line=lambda line: print(f"hs-serve: {line}", file=sys.stderr), cache_dtype=cache_dtype(args))
    app = create_app(args, load)
    print(f"hs-serve: listening on http://{args.host}:{args.port} ({args.parallel} slots of {args.ctx_size} tokens)",
          file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def main(argv=None) -> int:
    from .cli import run_main
    return run_main("hs-serve", _run, argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
