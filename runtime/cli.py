"""hs-run: generate text from a GGUF model, with llama.cpp's flags and defaults where they apply."""

from __future__ import annotations

import argparse
import codecs
import logging
import os
import sys

import torch

from .errors import HybridSparseError, InputError


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def use_threads(n: int) -> int:
    """-t as every command takes it: at least one thread; torch's CPU pool set to it."""
    if n < 1:
        raise InputError(f"-t {n}: expected at least 1 thread")
    torch.set_num_threads(n)
    return n


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """Flags every command that loads a model shares."""
    ap.add_argument("-m", "--model", help="GGUF model file (llama.cpp or PowerInfer layout); "
                    "default: the embedded Gemma 3 270M Q4_K_M")
    ap.add_argument("-t", "--threads", type=int, default=default_threads(),
                    help="CPU threads for generation (default: %(default)s, the cores available)")
    ap.add_argument("-c", "--ctx-size", type=int, default=4096,
                    help="context size in tokens (default: %(default)s; 0 = the model's training context)")
    ap.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", type=int, default=None, dest="n_gpu_layers",
                    help="layers on the GPU, counted from the last (llama.cpp's rule); more than the layer "
                    "count also puts the output head there (default: -1 = all when CUDA is present)")
    ap.add_argument("-ctk", "--cache-type-k", choices=CACHE_TYPES, default="f16",
                    help="KV cache type of the layers on the CPU, keys (default: %(default)s, as llama.cpp; "
                    "f32 reads twice the bytes a token at long contexts); GPU layers keep f16")
    ap.add_argument("-ctv", "--cache-type-v", choices=CACHE_TYPES, default="f16",
                    help="the same for the values; one type for both here")
    ap.add_argument("--device", default=None, help="GPU to use, e.g. cuda:1 (default: cuda when present)")
    ap.add_argument("--verbose", action="store_true", help="log details and show tracebacks on errors")


CACHE_TYPES = {"f16": torch.float16, "f32": torch.float32}


def cache_dtype(args) -> torch.dtype:
    """-ctk / -ctv as one torch dtype (the CPU attention keeps keys and values in one type); commands
    without the flags (hs-bench hybrid) get their default."""
    k, v = getattr(args, "cache_type_k", "f16"), getattr(args, "cache_type_v", "f16")
    if k != v:
        raise InputError(f"-ctk {k} -ctv {v}: keys and values must have one cache type here (f16 or f32 for both)")
    return CACHE_TYPES[k]


def add_sampling_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed (default: -1 = random)")
    ap.add_argument("--temp", type=float, default=0.8, help="temperature; <= 0 is greedy (default: %(default)s)")
    ap.add_argument("--top-k", type=int, default=40, help="top-k sampling, 0 = off (default: %(default)s)")
    ap.add_argument("--top-p", type=float, default=0.95, help="top-p sampling, 1.0 = off (default: %(default)s)")
    ap.add_argument("--min-p", type=float, default=0.05, help="min-p sampling, 0.0 = off (default: %(default)s)")
    ap.add_argument("--repeat-penalty", type=float, default=1.0,
                    help="penalize repeated tokens, 1.0 = off (default: %(default)s)")
    ap.add_argument("--repeat-last-n", type=int, default=64,
                    help="tokens to consider for the penalty, -1 = all (default: %(default)s)")


def sampling_params(args):
    from .sampling import SamplingParams
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed)


def run_main(name: str, body, argv=None, parser: argparse.ArgumentParser | None = None) -> int:
    """Parse, run `body(args)`, and turn errors into one line on stderr with a non-zero exit."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format=f"{name}: %(message)s", stream=sys.stderr)
    try:
        return body(args) or 0
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except (HybridSparseError, ValueError, FileNotFoundError, OSError) as e:
        if args.verbose:
            raise
        print(f"{name}: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - the one-line contract covers every failure
        if args.verbose:
            raise
        print(f"{name}: error: {type(e).__name__}: {e} (run with --verbose for the traceback)", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hs-run", description="Generate text with a GGUF model (llama.cpp's flags where they apply). "
        "Text goes to stdout; timings go to stderr.")
    add_model_args(ap)
    ap.add_argument("-p", "--prompt", default=None, help="prompt text (default: 'Once upon a time')")
    ap.add_argument("-f", "--file", help="read the prompt from this file")
    ap.add_argument("-n", "--n-predict", type=int, default=-1,
                    help="tokens to generate (default: -1 = until end of text or a full context)")
    ap.add_argument("-b", "--batch-size", type=int, default=2048,
                    help="prompt tokens per forward pass (default: %(default)s)")
    add_sampling_args(ap)
    ap.add_argument("--stop", action="append", default=[], metavar="TEXT",
                    help="stop when the output contains TEXT (repeatable)")
    ap.add_argument("--no-display-prompt", action="store_true", help="do not echo the prompt before the output")
    ap.add_argument("--no-escape", action="store_true", help="do not process escapes (\\n, \\t) in the prompt")
    ap.add_argument("--no-graphs", action="store_true", help="do not capture CUDA graphs for decoding")
    ap.add_argument("-cnv", "--conversation", action="store_true",
                    help="chat: read user turns from stdin (one a line, after '> '), answer each through the "
                    "model's chat template (without one, Gemma's / Llama 3's by the vocabulary, else ChatML), keeping the conversation's KV cache; -p / -f "
                    "is then the system prompt; EOF ends it")
    add_hybrid_args(ap)
    return ap


def add_hybrid_args(ap: argparse.ArgumentParser) -> None:
    """The hybrid CPU/GPU sparse runtime's flags (PowerInfer's names where it has them)."""
    g = ap.add_argument_group("hybrid sparse runtime (on when any of these is given, or when the model file "
                              "carries predictors, as PowerInfer's do, and -ngl is not)")
    g.add_argument("--vram-budget", type=float, default=None, metavar="GiB",
                   help="GPU memory to use, everything counted (default: all free VRAM minus 0.5 GiB; 0 = CPU only)")
    g.add_argument("-ub", "--ubatch-size", type=int, default=None, metavar="N",
                   help="prompt tokens per pass on the GPU; the placement leaves VRAM for their activations, "
                        "the rest holds weights (default: 128; llama.cpp's is 512: faster long prompts, fewer "
                        "weights on the GPU)")
    g.add_argument("--reset-gpu-index", action="store_true",
                   help="solve the neuron placement again (after an out-of-memory error, say)")
    g.add_argument("--disable-gpu-index", action="store_true",
                   help="keep the FFNs off the GPU: only the dense blocks (attention, head) go there")
    g.add_argument("--dense", action="store_true", help="no predictors: every neuron, exact, same placement")
    g.add_argument("--sparsity", type=float, default=None, metavar="S",
                   help="threshold models: skip the neurons whose |act| is below the profile's threshold for "
                        "sparsity S (the exact rule, TEAL/CATS style; implies --oracle)")
    g.add_argument("--oracle", action="store_true", help="the true active set from a dense gate/up pass "
                   "(diagnostics: what perfect predictors would give)")
    g.add_argument("--predictors", help="predictor file or PowerInfer predictor folder "
                   "(default: <model>.predictors.gguf, else the model's own blk.N.fc1/fc2)")
    g.add_argument("--down-t-type", default=None, choices=["f16", "q8_0"],
                   help="llama.cpp files with block-quantized ffn_down (Q4_0, K-quants): the type of the transposed "
                        "copy the sparse FFN reads, made once beside the model (q8_0: 1.9x the bytes of a Q4_0 "
                        "row, rounds each weight once more; f16: exact, 3.6x; default: q8_0). PowerInfer files "
                        "carry ffn_down_t and ignore it")
    g.add_argument("--profile", help="activation profile directory (default: <model>.hs-profile)")
    g.add_argument("--gpu-index", help="GPU index file (default: <model>.generated.gpuidx)")
    g.add_argument("--measure", action="store_true", help="when the placement must be solved, measure this "
                   "machine's CPU/GPU read bandwidth and hand-over first (as hs-solve --measure) instead of "
                   "hs-solve's default figures")


def hybrid_options(args, model_path):
    """HybridOptions from the flags, or None for the dense runtime (-ngl)."""
    from pathlib import Path

    from hybridsparse.solver.plan import PREFILL_TOKENS, check_ubatch

    from .hybrid import DEFAULT_DOWN_T_TYPE, HybridOptions, load_predictors_available
    sparsity = getattr(args, "sparsity", None)
    ubatch = getattr(args, "ubatch_size", None)
    asked = (args.vram_budget is not None or args.reset_gpu_index or args.disable_gpu_index or args.dense
             or args.oracle or args.predictors or args.gpu_index or sparsity is not None or ubatch is not None
             or getattr(args, "down_t_type", None) is not None)
    if args.dense and args.oracle:
        raise ValueError("--dense and --oracle exclude each other")
    if sparsity is not None and (args.dense or args.predictors):
        raise ValueError("--sparsity is the exact threshold rule: it excludes --dense and --predictors")
    if asked and args.n_gpu_layers is not None:
        raise ValueError("-ngl places whole layers, --vram-budget & co. place neurons: pass one or the other")
    if not asked and (args.n_gpu_layers is not None or not load_predictors_available(Path(model_path))):
        return None
    if args.vram_budget is not None and args.vram_budget < 0:
        raise ValueError(f"--vram-budget must be >= 0 GiB, got {args.vram_budget}")
    if ubatch is not None:
        check_ubatch(ubatch)
    mode = "dense" if args.dense else "oracle" if args.oracle or sparsity is not None else "predictor"
    return HybridOptions(vram_budget=args.vram_budget, mode=mode, sparsity=sparsity, predictors=args.predictors,
                         profile=args.profile,
                         gpu_index=args.gpu_index, reset_gpu_index=args.reset_gpu_index,
                         disable_gpu_index=args.disable_gpu_index, n_ctx=args.ctx_size if args.ctx_size > 0 else 4096,
                         device=args.device, hardware=_measured_hardware if args.measure else None,
                         ubatch=ubatch or PREFILL_TOKENS, down_t_type=getattr(args, "down_t_type", None) or DEFAULT_DOWN_T_TYPE)


def _measured_hardware():
    """hs-solve --measure's figures, taken only when a solve needs them."""
    from hybridsparse.solver import cli as solver_cli
    return solver_cli.measure_hardware(solver_cli.build_parser().parse_args(["--measure"]))


def _run(args) -> int:
    from .generate import Generator
    from .loader import open_model
    from .sampling import Sampler

    use_threads(args.threads)
    if args.file:
        with open(args.file, encoding="utf-8") as fh:
            prompt = fh.read()
    else:
        prompt = args.prompt if args.prompt is not None else "Once upon a time"
    if not args.no_escape:
        prompt = codecs.decode(prompt.encode("utf-8"), "unicode_escape").encode("latin-1").decode("utf-8")
    from .loader import resolve_model_path
    model_path = resolve_model_path(args.model)
    hybrid = hybrid_options(args, model_path)
    try:
        lm = open_model(model_path, -1 if args.n_gpu_layers is None else args.n_gpu_layers,
                        None if hybrid is not None else args.device, hybrid=hybrid,
                        log_line=lambda line: print(f"hs-run: {line}", file=sys.stderr), cache_dtype=cache_dtype(args))
    except torch.OutOfMemoryError:
        raise InputError(out_of_memory_advice(args)) from None
    n_ctx = args.ctx_size if args.ctx_size > 0 else lm.model.config.n_ctx_train
    if args.ctx_size < 0:
        raise ValueError(f"-c/--ctx-size must be >= 0, got {args.ctx_size}")
    gen = Generator(lm.model, lm.tokenizer, n_ctx, n_batch=max(1, args.batch_size), use_graphs=not args.no_graphs)
    sampler = Sampler(sampling_params(args))
    if args.conversation:
        return _conversation(args, lm, gen, sampler, prompt if (args.file or args.prompt is not None) else None)
    ids = lm.tokenizer.encode(prompt)
    if not args.no_display_prompt:
        sys.stdout.write(prompt)
        sys.stdout.flush()
    try:
        for piece in gen.generate(ids, args.n_predict, sampler, args.stop):
            sys.stdout.write(piece)
            sys.stdout.flush()
    except torch.OutOfMemoryError:
        raise InputError(out_of_memory_advice(args)) from None
    sys.stdout.write("\n")
    t = gen.timings
    print(f"\nhs-run: model {lm.gguf.path.name} ({lm.model.config.arch}), {args.threads} threads, "
          f"seed {sampler.seed}, stop: {t.stop_reason}", file=sys.stderr)
    for line in t.summary().splitlines():
        print(f"hs-run: {line}", file=sys.stderr)
    return 0


def _conversation(args, lm, gen, sampler, system: str | None) -> int:
    """-cnv: each user line becomes a turn; the whole conversation is rendered through the chat
    template again, and the generator keeps the cached positions it shares with the last turn, so a
    turn evaluates only its new tokens."""
    from .generate import Timings
    tok = lm.tokenizer
    messages = [{"role": "system", "content": system}] if system else []
    stop = list(args.stop)
    total = Timings()
    while True:
        sys.stdout.write("\n> ")
        sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = tok.encode(tok.render_chat(messages, fallback=True))
        reply = ""
        try:
            for piece in gen.generate(ids, args.n_predict, sampler, stop, keep_prefix=True):
                reply += piece
                sys.stdout.write(piece)
                sys.stdout.flush()
        except torch.OutOfMemoryError:
            raise InputError(out_of_memory_advice(args)) from None
        messages.append({"role": "assistant", "content": reply})
        t = gen.timings
        total.prompt_tokens, total.prompt_s = total.prompt_tokens + t.prompt_tokens, total.prompt_s + t.prompt_s
        total.gen_tokens, total.gen_s = total.gen_tokens + t.gen_tokens, total.gen_s + t.gen_s
        if t.stop_reason == "context":
            print(f"\nhs-run: the conversation filled the context of {gen.n_ctx} tokens (raise -c)", file=sys.stderr)
            break
    sys.stdout.write("\n")
    print(f"\nhs-run: model {lm.gguf.path.name} ({lm.model.config.arch}), {args.threads} threads, seed {sampler.seed}, "
          f"{sum(m['role'] == 'user' for m in messages)} turns", file=sys.stderr)
    for line in total.summary().splitlines():
        print(f"hs-run: {line}", file=sys.stderr)
    return 0


def out_of_memory_advice(args) -> str:
    budget = getattr(args, "vram_budget", None)
    if budget is not None or getattr(args, "n_gpu_layers", None) is None:
        return ("CUDA out of memory under the GPU index's placement: run again with --reset-gpu-index, or a lower "
                f"--vram-budget (now {budget if budget is not None else 'all free VRAM'}), or a smaller -c")
    return f"CUDA out of memory with -ngl {args.n_gpu_layers}: put fewer layers on the GPU or use a smaller -c"


def main(argv=None) -> int:
    return run_main("hs-run", _run, argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
