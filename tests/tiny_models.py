"""Tiny random models written as real GGUF files with gguf's writer (through the converter), with a
small byte-level BPE vocabulary so the whole command-line path runs on them."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

from hybridsparse.runtime.convert import write_gguf


def byte_vocab() -> dict:
    """A GPT-2 style byte-level vocabulary: <s>, </s>, the 256 byte symbols and one merge."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    symbols = list(bytes_to_unicode().values())
    tokens = ["<s>", "</s>"] + symbols + ["Ġt"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3] + [1] * (len(symbols) + 1), "tokenizer.ggml.merges": ["Ġ t"],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.add_bos_token": True}


def tiny_llama(path: Path, act: str = "relu", seed: int = 0, layers: int = 2, **extra) -> Path:
    vocab = byte_vocab()
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=len(vocab["tokenizer.ggml.tokens"]), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, hidden_act=act,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(cfg).eval()
    return write_gguf(path, cfg, model.state_dict().items(), extra_metadata={**vocab, **extra})
