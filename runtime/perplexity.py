"""hs-perplexity: llama.cpp's perplexity method on a text file, for any placement hs-run offers.

  hs-perplexity -m MODEL [-f TEXT] [-c 512] [--chunks N] [--vram-budget GiB ...]

The text is tokenized once (BOS first where the vocabulary adds one), cut into chunks of `-c` tokens;
each chunk is evaluated from an empty cache with its first token set to BOS, and only the second half
of each chunk is scored (each scored token then has at least c/2 tokens of context), as llama.cpp's
`perplexity` does. Prints the running estimate per chunk ([1]4.5321,[2]...) and the final figure with
its standard error. Without -f, the held-out part of the default corpus (never used for profiling).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from .errors import InputError


def chunk_nll(model, ids: list[int], bos: int | None) -> tuple[float, int, list[float]]:
    """Summed negative log-likelihood of the second half of one chunk, with its token count."""
    tokens = torch.tensor(ids, dtype=torch.long)
    if bos is not None:
        tokens[0] = bos
    n = len(ids)
    with torch.inference_mode():
        logits = model.forward(tokens, torch.arange(n), model.new_cache(n), n, all_logits=True).float().cpu()
    first = n // 2
    logp = torch.log_softmax(logits[first:n - 1], dim=-1)
    nll = -logp.gather(1, tokens[first + 1:].unsqueeze(1)).squeeze(1)
    return float(nll.sum()), nll.numel(), nll.tolist()


def perplexity(model, tokenizer, text: str, n_ctx: int = 512, max_chunks: int | None = None, log=None) -> dict:
    ids = tokenizer.encode(text)
    n_chunks = len(ids) // n_ctx
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks < 1:
        raise InputError(f"the text has {len(ids)} tokens, fewer than one chunk of -c {n_ctx}; give more text or a smaller -c")
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    total, count, all_nll = 0.0, 0, []
    t0 = time.perf_counter()
    for c in range(n_chunks):
        s, k, nll = chunk_nll(model, ids[c * n_ctx:(c + 1) * n_ctx], bos)
        total, count = total + s, count + k
        all_nll += nll
        if log:
            log(f"[{c + 1}]{math.exp(total / count):.4f}")
    mean = total / count
    var = sum((x - mean) ** 2 for x in all_nll) / max(1, count - 1)
    ppl = math.exp(mean)
    return {"perplexity": ppl, "stderr": ppl * math.sqrt(var / count), "chunks": n_chunks, "n_ctx": n_ctx,
            "tokens_scored": count, "seconds": time.perf_counter() - t0}


def build_parser() -> argparse.ArgumentParser:
    from .cli import add_hybrid_args, add_model_args
    ap = argparse.ArgumentParser(prog="hs-perplexity", description="Perplexity of a model on a text file "
                                 "(llama.cpp's method: chunks of -c tokens, second half of each scored).")
    add_model_args(ap)
    add_hybrid_args(ap)
    ap.add_argument("-f", "--file", help="text file (default: the held-out part of the default corpus)")
    ap.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
    ap.add_argument("--json", help="write the result as JSON here")
    ap.set_defaults(ctx_size=512)
    return ap


def _run(args) -> int:
    from .cli import hybrid_options
    from .loader import open_model, resolve_model_path
    if args.threads < 1:
        raise InputError(f"-t/--threads must be >= 1, got {args.threads}")
    if args.ctx_size < 8:
        raise InputError(f"-c {args.ctx_size}: perplexity needs chunks of at least 8 tokens")
    if args.chunks is not None and args.chunks < 1:
        raise InputError(f"--chunks {args.chunks}: expected at least 1")
    torch.set_num_threads(args.threads)
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as fh:
                text = fh.read()
        except UnicodeDecodeError as e:
            raise InputError(f"{args.file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    else:
        from hybridsparse.profiler.corpus import load_documents, split
        text = "\n\n".join(split(load_documents(None))[1])
    path = resolve_model_path(args.model)
    lm = open_model(path, -1 if args.n_gpu_layers is None else args.n_gpu_layers, args.device,
                    hybrid=hybrid_options(args, path), log_line=lambda line: print(f"hs-perplexity: {line}", file=sys.stderr))
    out = perplexity(lm.model, lm.tokenizer, text, args.ctx_size, args.chunks,
                     log=lambda s: print(s, end=",", file=sys.stderr, flush=True))
    print(file=sys.stderr)
    print(f"Final estimate: PPL = {out['perplexity']:.4f} +/- {out['stderr']:.5f} "
          f"({out['chunks']} chunks of {out['n_ctx']}, {out['tokens_scored']} tokens scored, {out['seconds']:.1f} s)")
    if args.json:
        import json
        with open(args.json, "w") as fh:
            json.dump({"model": str(path), **out}, fh, indent=2)
    return 0


def main(argv=None) -> int:
    from .cli import run_main
    return run_main("hs-perplexity", _run, argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
