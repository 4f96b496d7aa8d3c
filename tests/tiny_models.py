"""Tiny random models written as real GGUF files with gguf's writer (through the converter), with a
byte-level BPE vocabulary so the whole command-line path runs on them."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

from hybridsparse.runtime.convert import byte_level_vocab, write_gguf


def tiny_llama(path: Path, act: str = "relu", seed: int = 0, layers: int = 2, dtype: str = "f32", **extra) -> Path:
    vocab = byte_level_vocab()
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=len(vocab["tokenizer.ggml.tokens"]), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, hidden_act=act,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(cfg).eval()
    return write_gguf(path, cfg, model.state_dict().items(), dtype=dtype, extra_metadata={**vocab, **extra})
