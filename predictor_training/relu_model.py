"""A small ReLU-gated Llama trained here on real English text, so that the sparse pipeline has a real
sparse model to run on (no ReLU LLM can be downloaded on these machines): its activation sparsity
and the skew of its neuron frequencies are learned, not planted.

  python -m hybridsparse.predictor_training.relu_model [-o PATH] [--steps 600]

Trains transformers' LlamaForCausalLM (hidden_act relu, byte-level vocabulary) on the calibration
part of the default corpus (Python's standard-library docstrings; the held-out tenth is never seen)
on the CPU, then writes it as GGUF. The default output is cached under ~/.cache/hybridsparse/models/.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

from hybridsparse.runtime.cli import run_main

DEFAULT_PATH = Path(os.environ.get("HS_CACHE", Path.home() / ".cache" / "hybridsparse")) / "models" / \
    "relu-llama-tiny.gguf"


def _config(d_model: int, n_layers: int, n_ff: int, n_vocab: int):
    import transformers as tf
    return tf.LlamaConfig(vocab_size=n_vocab, hidden_size=d_model, intermediate_size=n_ff,
                          num_hidden_layers=n_layers, num_attention_heads=max(1, d_model // 64),
                          num_key_value_heads=max(1, d_model // 64), hidden_act="relu",
                          max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-5)


def make_relu_model(out: Path, steps: int = 600, d_model: int = 256, n_layers: int = 4, n_ff: int = 1024,
                    ctx: int = 128, batch: int = 16, lr: float = 3e-3, seed: int = 0, log=print) -> Path:
    import transformers as tf
    from tqdm import tqdm

    from hybridsparse.profiler.corpus import load_documents, split
    from hybridsparse.runtime.convert import byte_level_vocab, write_gguf
    from hybridsparse.runtime.gguf_file import GGUFFile
    from hybridsparse.runtime.tokenizer import Tokenizer

    vocab = byte_level_vocab()
    torch.manual_seed(seed)
    cfg = _config(d_model, n_layers, n_ff, len(vocab["tokenizer.ggml.tokens"]))
    model = tf.LlamaForCausalLM(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the tokenizer the runtime will use, built from the same metadata
    tok_path = write_gguf(out.with_name(out.name + ".tok.gguf"), cfg, model.state_dict().items(), extra_metadata=vocab)
    tok = Tokenizer(GGUFFile(tok_path))
    calib, _ = split(load_documents(None))
    stream = torch.tensor([t for text in calib for t in tok.encode(text, add_bos=False)], dtype=torch.long)
    tok_path.unlink()
    log(f"relu model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
        f"{stream.numel() / 1e6:.2f} M training tokens")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(seed)
    model.train()
    t0, losses = time.perf_counter(), []
    bar = tqdm(range(steps), desc="training the ReLU model", unit="step", file=sys.stderr, dynamic_ncols=True)
    for step in bar:
        for group in opt.param_groups:  # warm-up, then cosine decay
            group["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        starts = torch.randint(0, stream.numel() - ctx - 1, (batch,), generator=g)
        x = torch.stack([stream[s:s + ctx + 1] for s in starts.tolist()])
        loss = model(input_ids=x[:, :-1], labels=x[:, :-1].clone()).loss  # HF shifts the labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    model.eval()
    final = sum(losses[-20:]) / len(losses[-20:])
    log(f"relu model: {steps} steps in {time.perf_counter() - t0:.0f} s, final loss {final:.3f} "
        f"({final / math.log(2):.2f} bits/token)")
    write_gguf(out, cfg, model.state_dict().items(), extra_metadata={
        **vocab, "general.name": "hybridsparse-relu-llama-tiny", "hybridsparse.training_steps": steps,
        "hybridsparse.training_loss": float(final)})
    return out


def _main(args) -> int:
    out = Path(args.output) if args.output else DEFAULT_PATH
    if out.exists() and not args.force:
        print(f"{out} exists (--force trains again)")
        return 0
    torch.set_num_threads(args.threads)
    make_relu_model(out, steps=args.steps, d_model=args.d_model, n_layers=args.layers, n_ff=args.n_ff)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="relu_model", description="Train the project's small ReLU Llama (cached).")
    ap.add_argument("-o", "--output", help=f"GGUF to write (default: {DEFAULT_PATH})")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--n-ff", type=int, default=1024)
    ap.add_argument("-t", "--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    return ap


def main(argv=None) -> int:
    return run_main("relu_model", _main, argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
