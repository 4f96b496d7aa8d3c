"""hs-batched: several sequences decoded together, like llama.cpp's `batched` example.

  hs-batched [-m MODEL] -p PROMPT -np 4 [-n 32] [sampling flags] [placement flags]
  hs-batched [-m MODEL] -f PROMPTS.txt [-n 32]          (one prompt per line)

All prompts are prefilled in one pass and every step decodes one token of every unfinished sequence
in one pass (`CausalLM.forward_batch`: weights read once for the batch, attention per sequence over
its own cache). Prints each sequence's text, then prefill and aggregate decode tokens/s.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .errors import InputError


def batched_generate(model, tokenizer, prompts: list[list[int]], n_predict: int, samplers, n_ctx: int):
    """Yields (step, [(sequence, token)]); returns when every sequence has ended."""
    caches = [model.new_cache(n_ctx) for _ in prompts]
    with torch.inference_mode():
        logits = model.forward_batch(prompts, [0] * len(prompts), caches)
    pos = [len(p) for p in prompts]
    history = [list(p) for p in prompts]
    live = list(range(len(prompts)))
    rows = {b: logits[b] for b in live}
    step = 0
    while live:
        feed = []
        for b in live:
            tok = samplers[b](rows[b], history[b])
            if tok in tokenizer.eog_ids or pos[b] >= n_ctx:
                continue
            history[b].append(tok)
            feed.append((b, tok))
        yield step, feed
        live = [b for b, _ in feed if len(history[b]) - len(prompts[b]) < n_predict]
        if not live:
            return
        with torch.inference_mode():
            out = model.forward_batch([[history[b][-1]] for b in live], [pos[b] for b in live], [caches[b] for b in live])
        for b, row in zip(live, out):
            rows[b] = row
            pos[b] += 1
        step += 1


def build_parser() -> argparse.ArgumentParser:
    from .cli import add_hybrid_args, add_model_args, add_sampling_args
    ap = argparse.ArgumentParser(prog="hs-batched", description="Decode several sequences together "
                                 "(llama.cpp's batched example).")
    add_model_args(ap)
    add_hybrid_args(ap)
    add_sampling_args(ap)
    ap.add_argument("-p", "--prompt", default="Hello my name is", help="the prompt, decoded -np times")
    ap.add_argument("-f", "--file", help="prompts, one per line (instead of -p / -np)")
    ap.add_argument("-np", "--parallel", type=int, default=4, help="sequences for -p (default 4)")
    ap.add_argument("-n", "--n-predict", type=int, default=32, help="tokens per sequence (default 32)")
    ap.set_defaults(ctx_size=512)
    return ap


def _run(args) -> int:
    from .cli import cache_dtype, hybrid_options, sampling_params, use_threads
    from .loader import open_model, resolve_model_path
    from .sampling import Sampler, SamplingParams
    use_threads(args.threads)
    if args.parallel < 1 or args.n_predict < 1:
        raise InputError("-np and -n must be >= 1")
    if args.file:
        with open(args.file, encoding="utf-8") as fh:
            texts = [line.rstrip("\n") for line in fh if line.strip()]
        if not texts:
            raise InputError(f"{args.file}: no prompts (one per line expected)")
    else:
        texts = [args.prompt] * args.parallel
    path = resolve_model_path(args.model)
    lm = open_model(path, -1 if args.n_gpu_layers is None else args.n_gpu_layers, args.device,
                    hybrid=hybrid_options(args, path), log_line=lambda line: print(f"hs-batched: {line}", file=sys.stderr),
                    cache_dtype=cache_dtype(args))
    prompts = [lm.tokenizer.encode(t) for t in texts]
    longest = max(len(p) for p in prompts)
    if longest + args.n_predict > args.ctx_size:
        raise InputError(f"a prompt of {longest} tokens + -n {args.n_predict} does not fit -c {args.ctx_size}")
    base = sampling_params(args)
    samplers = [Sampler(SamplingParams(**{**{f: getattr(base, f) for f in base.__slots__},
                                          "seed": base.seed + b if base.seed >= 0 else -1})) for b in range(len(prompts))]
    outs = [[] for _ in prompts]
    t0 = time.perf_counter()
    t_prefill, decoded = None, 0
    for step, feed in batched_generate(lm.model, lm.tokenizer, prompts, args.n_predict, samplers, args.ctx_size):
        if t_prefill is None:  # the first tokens come from the prefill pass
            t_prefill = time.perf_counter() - t0
            t1 = time.perf_counter()
        else:
            decoded += len(feed)
        for b, tok in feed:
            outs[b].append(tok)
    t_decode = time.perf_counter() - t1
    for b, (text, ids) in enumerate(zip(texts, outs)):
        print(f"\nsequence {b}:\n{text}{lm.tokenizer.decode(ids)}")
    n_prompt, n_gen = sum(len(p) for p in prompts), sum(len(o) for o in outs)
    print(f"\nhs-batched: {len(prompts)} sequences; prompt {n_prompt} tokens in {t_prefill:.2f} s "
          f"({n_prompt / t_prefill:.1f} tok/s); generated {n_gen} tokens, {decoded} of them by batched decode steps "
          f"in {t_decode:.2f} s ({decoded / t_decode if t_decode else 0:.1f} tok/s aggregate)", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    from .cli import run_main
    return run_main("hs-batched", _run, argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
