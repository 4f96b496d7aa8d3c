"""hs-bench serve: a bounded load test of hs-serve on loopback.

Starts hs-serve on a free loopback port (or uses --url), measures one streaming client alone, then
--clients concurrent streaming clients for --duration seconds: failed requests, time to first token
and inter-token latency (p50/p99), aggregate generated tokens/s against the single client, and the
server's resident memory before and after the concurrent run. Requests still streaming when the
time is up are hung up on (counted as cut, not failed: the server must free their slots).
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = ["Tell me about the sea.", "Write a short poem about autumn.", "What is a prime number?",
           "Describe a busy market in the morning.", "Explain how a bicycle works.", "Give three tips for sleeping well."]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


async def _client(http, url: str, key: str | None, i: int, until: float, max_tokens: int, stats: dict) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    k = 0
    while time.perf_counter() < until:
        body = {"messages": [{"role": "user", "content": PROMPTS[(i + k) % len(PROMPTS)]}], "max_tokens": max_tokens,
                "stream": True, "temperature": 0.8, "seed": i * 1000 + k}
        k += 1
        t0 = time.perf_counter()
        last, n = None, 0
        try:
            async with http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    stats["failed"] += 1
                    await r.aread()
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        stats["failed"] += 1
                        break
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        now = time.perf_counter()
                        if last is None:
                            stats["ttft"].append(now - t0)
                        else:
                            stats["itl"].append(now - last)
                        last, n = now, n + 1
                        stats["tokens"] += 1
            stats["requests"] += 1
        except asyncio.CancelledError:  # the run's time is up: this request is cut, not failed
            stats["cut"] += 1
            raise
        except Exception:  # noqa: BLE001 - a failed request is what this counts
            stats["failed"] += 1


async def _phase(url: str, key: str | None, clients: int, seconds: float, max_tokens: int) -> dict:
    import httpx
    stats = {"ttft": [], "itl": [], "tokens": 0, "requests": 0, "failed": 0, "cut": 0}
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        t0 = time.perf_counter()
        until = t0 + seconds
        tasks = [asyncio.ensure_future(_client(http, url, key, i, until, max_tokens, stats)) for i in range(clients)]
        done, running = await asyncio.wait(tasks, timeout=seconds)
        for t in running:  # requests still streaming when the time is up: hang up on them
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        wall = time.perf_counter() - t0
    return {"clients": clients, "seconds": round(wall, 1), "requests": stats["requests"], "cut_at_end": stats["cut"],
            "failed": stats["failed"],
            "generated_tokens": stats["tokens"], "tokens_per_s": stats["tokens"] / wall,
            "ttft_p50_s": _pct(stats["ttft"], 0.5), "ttft_p99_s": _pct(stats["ttft"], 0.99),
            "itl_p50_s": _pct(stats["itl"], 0.5), "itl_p99_s": _pct(stats["itl"], 0.99),
            "itl_mean_s": statistics.fmean(stats["itl"]) if stats["itl"] else None}


def run(args) -> int:
    from .bench import machine, write_json
    from .errors import InputError
    if args.clients < 1 or args.duration <= 0:
        raise InputError("--clients must be >= 1 and --duration > 0")
    proc, url = None, args.url
    if url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "hybridsparse.runtime.server", "--host", "127.0.0.1", "--port", str(port),
               "-np", str(args.parallel or args.clients), "-c", str(args.ctx_size), "-t", str(args.threads)]
        if args.model:
            cmd += ["-m", args.model]
        cmd += args.server_args.split() if args.server_args else []
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr)
        url = f"http://127.0.0.1:{port}"
    try:
        import httpx
        deadline = time.time() + args.load_timeout
        while True:
            if proc is not None and proc.poll() is not None:
                raise InputError(f"hs-serve exited with code {proc.returncode} before it was ready")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise InputError(f"{url}/health not ready after {args.load_timeout:.0f} s")
            time.sleep(0.5)
        asyncio.run(_phase(url, args.api_key, 1, 3, args.max_tokens))  # warm-up (caches, graphs)
        single = asyncio.run(_phase(url, args.api_key, 1, args.single_duration, args.max_tokens))
        print(f"hs-bench serve: 1 client: {single['tokens_per_s']:.1f} tok/s", file=sys.stderr)
        rss0 = _rss_kib(proc.pid) if proc else None
        many = asyncio.run(_phase(url, args.api_key, args.clients, args.duration, args.max_tokens))
        rss1 = _rss_kib(proc.pid) if proc else None
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    result = {"machine": machine(), "model": args.model or "default", "threads": args.threads,
              "slots": args.parallel or args.clients, "max_tokens": args.max_tokens, "single": single,
              "concurrent": many, "aggregate_vs_single": many["tokens_per_s"] / single["tokens_per_s"]
              if single["tokens_per_s"] else None,
              "server_rss_mib_before": rss0 / 1024 if rss0 else None, "server_rss_mib_after": rss1 / 1024 if rss1 else None}
    f = lambda v: "-" if v is None else f"{1000 * v:.0f} ms"  # noqa: E731
    print(f"{many['clients']} clients, {many['seconds']} s: {many['requests']} requests, {many['failed']} failed, "
          f"{many['tokens_per_s']:.1f} tok/s ({result['aggregate_vs_single'] or 0:.2f}x one client's "
          f"{single['tokens_per_s']:.1f}); time to first token p50 {f(many['ttft_p50_s'])} p99 {f(many['ttft_p99_s'])}; "
          f"inter-token p50 {f(many['itl_p50_s'])} p99 {f(many['itl_p99_s'])}"
          + (f"; server RSS {rss0 / 1024:.0f} -> {rss1 / 1024:.0f} MiB" if rss0 and rss1 else ""))
    write_json(args.json, result)
    return 0 if many["failed"] == 0 else 1


def add_parser(sub, default_threads: int) -> None:
    p = sub.add_parser("serve", help="load test of hs-serve: concurrent streaming clients on loopback")
    p.add_argument("-m", "--model")
    p.add_argument("-t", "--threads", type=int, default=default_threads)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of the concurrent run (default 60)")
    p.add_argument("--single-duration", type=float, default=15.0, help="seconds of the one-client run")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("-np", "--parallel", type=int, default=None, help="server slots (default: --clients)")
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="context per slot (default 512)")
    p.add_argument("--url", help="an hs-serve already running (default: start one on loopback)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--server-args", default="", help="more hs-serve flags, e.g. '--vram-budget 4'")
    p.add_argument("--load-timeout", type=float, default=600)
    p.add_argument("--json")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=run)
