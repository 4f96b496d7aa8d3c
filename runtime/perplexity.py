"""hs-perplexity: llama.cpp's perplexity method on a text file, for any placement hs-run offers.

  hs-perplexity -m MODEL [-f TEXT] [-c 512] [--chunks N] [--vram-budget GiB ...]

The text is tokenized once (BOS first where the vocabulary adds one), cut into chunks of `-c` tokens;
each chunk is evaluated from an empty cache with its first token set to BOS, and only the second half
of each chunk is scored (each scored token then has at least c/2 tokens of context), as llama.cpp's
`perplexity` does. Prints the running estimate per chunk ([1]4.5321,[2]...) and the final figure with
its standard error. Without -f, the held-out part of the default corpus (never used for profiling).
`--kl-divergence-base FILE` saves every scored distribution; a second run with `--kl-divergence`
(e.g. sparse, or quantized) reports KL(base || run) and how often the top-1 token agrees.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from .errors import InputError


def chunk_logprobs(model, ids: list[int], bos: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """log-softmax over the vocabulary at the scored positions of one chunk (the second half, each
    predicting the next token), and the tokens they predict."""
    tokens = torch.tensor(ids, dtype=torch.long)
    if bos is not None:
        tokens[0] = bos
    n = len(ids)
    with torch.inference_mode():
        logits = model.forward(tokens, torch.arange(n), model.new_cache(n), n, all_logits=True).float().cpu()
    first = n // 2
    return torch.log_softmax(logits[first:n - 1], dim=-1), tokens[first + 1:]


class KLBase:
    """Saved log-probabilities of a reference run (llama.cpp's --kl-divergence-base): FILE is a float16
    .npy [scored tokens, n_vocab] written chunk by chunk (memory-mapped), FILE.json says which text,
    context and vocabulary it belongs to."""

    def __init__(self, path: str, key: dict, n_rows: int, n_vocab: int, write: bool):
        import json

        import numpy as np
        self.path, self.meta = path, path + ".json"
        if write:
            self.arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(n_rows, n_vocab))
            with open(self.meta, "w") as fh:
                json.dump({**key, "rows": n_rows, "n_vocab": n_vocab}, fh)
        else:
            try:
                with open(self.meta) as fh:
                    saved = json.load(fh)
                self.arr = np.load(path, mmap_mode="r")
            except (OSError, ValueError) as e:
                raise InputError(f"{path}: not a KL-divergence base written by --kl-divergence-base ({e})") from None
            for field, value in {**key, "n_vocab": n_vocab}.items():
                if saved.get(field) != value:
                    raise InputError(f"{path}: base was saved with {field} = {saved.get(field)!r}, this run has {value!r} "
                                     f"(same text, -c and vocabulary needed)")
            if self.arr.shape[0] < n_rows:
                raise InputError(f"{path}: base holds {self.arr.shape[0]} scored tokens, this run needs {n_rows} (fewer --chunks?)")
        self.row = 0

    def take(self, logp: torch.Tensor, write: bool) -> torch.Tensor | None:
        import numpy as np
        rows = slice(self.row, self.row + logp.shape[0])
        self.row += logp.shape[0]
        if write:
            self.arr[rows] = logp.numpy().astype(np.float16)
            return None
        return torch.from_numpy(np.asarray(self.arr[rows], dtype=np.float32))


def perplexity(model, tokenizer, text: str, n_ctx: int = 512, max_chunks: int | None = None, log=None,
               kl_base: str | None = None, kl: bool = False) -> dict:
    """llama.cpp's perplexity; with `kl_base`, also save (kl=False) or compare against (kl=True) the
    full distributions: KL(base || this run), top-1 agreement with the base."""
    import hashlib
    ids = tokenizer.encode(text)
    n_chunks = len(ids) // n_ctx
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks < 1:
        raise InputError(f"the text has {len(ids)} tokens, fewer than one chunk of -c {n_ctx}; give more text or a smaller -c")
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    per_chunk = n_ctx - n_ctx // 2 - 1
    base = None
    if kl_base is not None:
        key = {"n_ctx": n_ctx, "tokens_sha256": hashlib.sha256(str(ids[:n_chunks * n_ctx]).encode()).hexdigest()[:16]}
        base = KLBase(kl_base, key, n_chunks * per_chunk, tokenizer.n_vocab, write=not kl)
    all_nll, kls, same_top = [], [], 0
    t0 = time.perf_counter()
    for c in range(n_chunks):
        logp, target = chunk_logprobs(model, ids[c * n_ctx:(c + 1) * n_ctx], bos)
        logp = logp[:, :tokenizer.n_vocab]
        all_nll += (-logp.gather(1, target.unsqueeze(1)).squeeze(1)).tolist()
        if base is not None:
            ref = base.take(logp, write=not kl)
            if ref is not None:
                kls += (ref.exp() * (ref - logp)).sum(-1).clamp_min(0).tolist()
                same_top += int((ref.argmax(-1) == logp.half().float().argmax(-1)).sum())  # ties as the base rounded them
        if log:
            log(f"[{c + 1}]{math.exp(sum(all_nll) / len(all_nll)):.4f}")
    count = len(all_nll)
    mean = sum(all_nll) / count
    var = sum((x - mean) ** 2 for x in all_nll) / max(1, count - 1)
    ppl = math.exp(mean)
    out = {"perplexity": ppl, "stderr": ppl * math.sqrt(var / count), "chunks": n_chunks, "n_ctx": n_ctx,
           "tokens_scored": count, "seconds": time.perf_counter() - t0}
    if kls:
        k = sorted(kls)
        out.update({"kl_mean": sum(k) / len(k), "kl_p99": k[min(len(k) - 1, int(0.99 * len(k)))], "kl_max": k[-1],
                    "same_top1": same_top / len(k)})
    return out


def build_parser() -> argparse.ArgumentParser:
    from .cli import add_hybrid_args, add_model_args
    ap = argparse.ArgumentParser(prog="hs-perplexity", description="Perplexity of a model on a text file "
                                 "(llama.cpp's method: chunks of -c tokens, second half of each scored).")
    add_model_args(ap)
    add_hybrid_args(ap)
    ap.add_argument("-f", "--file", help="text file (default: the held-out part of the default corpus)")
    ap.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
    ap.add_argument("--kl-divergence-base", metavar="FILE", help="save this run's distributions to FILE "
                    "(or, with --kl-divergence, compare against them)")
    ap.add_argument("--kl-divergence", action="store_true", help="KL divergence from the saved base, and top-1 "
                    "agreement with it (e.g. sparse against dense on the same text)")
    ap.add_argument("--json", help="write the result as JSON here")
    ap.set_defaults(ctx_size=512)
    return ap


def _run(args) -> int:
    from .cli import cache_dtype, hybrid_options, use_threads
    from .loader import open_model, resolve_model_path
    use_threads(args.threads)
    if args.ctx_size < 8:
        raise InputError(f"-c {args.ctx_size}: perplexity needs chunks of at least 8 tokens")
    if args.kl_divergence and not args.kl_divergence_base:
        raise InputError("--kl-divergence needs --kl-divergence-base FILE (saved by an earlier run)")
    if args.chunks is not None and args.chunks < 1:
        raise InputError(f"--chunks {args.chunks}: expected at least 1")
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
                    hybrid=hybrid_options(args, path), log_line=lambda line: print(f"hs-perplexity: {line}", file=sys.stderr),
                    cache_dtype=cache_dtype(args))
    out = perplexity(lm.model, lm.tokenizer, text, args.ctx_size, args.chunks,
                     log=lambda s: print(s, end=",", file=sys.stderr, flush=True),
                     kl_base=args.kl_divergence_base, kl=args.kl_divergence)
    print(file=sys.stderr)
    print(f"Final estimate: PPL = {out['perplexity']:.4f} +/- {out['stderr']:.5f} "
          f"({out['chunks']} chunks of {out['n_ctx']}, {out['tokens_scored']} tokens scored, {out['seconds']:.1f} s)")
    if "kl_mean" in out:
        print(f"KL divergence from {args.kl_divergence_base}: mean {out['kl_mean']:.6f}, 99% {out['kl_p99']:.6f}, "
              f"max {out['kl_max']:.6f}; same top-1 token {100 * out['same_top1']:.2f}%")
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
