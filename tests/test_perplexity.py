"""hs-perplexity: llama.cpp's method (chunks of -c, BOS first, second half scored) against the same
computation done with transformers' model; the KL-divergence mode against a saved base."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers as tf

from hybridsparse.runtime import perplexity as P
from hybridsparse.runtime.convert import byte_level_vocab, write_gguf

TEXT = ("The quick brown fox jumps over the lazy dog. " * 12) + "Pack my box with five dozen liquor jugs. " * 10


@pytest.fixture(scope="module")
def model_pair(tmp_path_factory):
    vocab = byte_level_vocab()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=len(vocab["tokenizer.ggml.tokens"]), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_act="relu",
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(cfg).eval()
    path = write_gguf(tmp_path_factory.mktemp("ppl") / "m.gguf", cfg, model.state_dict().items(), extra_metadata=vocab)
    return model, path


def test_perplexity_is_llama_cpp_method_on_transformers(model_pair, tmp_path, capsys):
    ref, path = model_pair
    out = tmp_path / "r.json"
    assert P.main(["-m", str(path), "-f", _text(tmp_path), "-c", "64", "-t", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert "Final estimate: PPL = " in capsys.readouterr().out
    from hybridsparse.runtime.gguf_file import GGUFFile
    from hybridsparse.runtime.tokenizer import Tokenizer
    ids = Tokenizer(GGUFFile(path)).encode(TEXT)
    assert ids[0] == 0  # BOS first: this vocabulary adds it
    nll = []
    for c in range(len(ids) // 64):
        chunk = torch.tensor(ids[c * 64:(c + 1) * 64])
        chunk[0] = 0  # BOS replaces the chunk's first token
        with torch.no_grad():
            logp = torch.log_softmax(ref(chunk[None]).logits[0].float(), -1)
        nll += (-logp[32:63].gather(1, chunk[33:].unsqueeze(1))).squeeze(1).tolist()
    assert got["tokens_scored"] == len(nll) and got["chunks"] == len(ids) // 64
    assert got["perplexity"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)


def _text(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    return str(f)


def test_kl_divergence_against_a_saved_base(model_pair, tmp_path, capsys):
    _, path = model_pair
    base = tmp_path / "base.npy"
    common = ["-m", str(path), "-f", _text(tmp_path), "-c", "64", "-t", "1"]
    assert P.main(common + ["--kl-divergence-base", str(base)]) == 0
    out = tmp_path / "kl.json"
    assert P.main(common + ["--kl-divergence-base", str(base), "--kl-divergence", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["kl_mean"] < 1e-3 and r["same_top1"] == 1.0  # the same model: only float16 rounding of the base
    capsys.readouterr()
    assert P.main(common[:-4] + ["-c", "32", "-t", "1", "--kl-divergence-base", str(base), "--kl-divergence"]) == 1
    assert "n_ctx" in capsys.readouterr().err
    assert P.main(common + ["--kl-divergence"]) == 1
    assert P.main(common[:-4] + ["-c", "4096"]) == 1
    assert "fewer than one chunk" in capsys.readouterr().err
