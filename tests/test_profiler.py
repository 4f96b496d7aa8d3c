"""hs-profile: counts equal a direct count with transformers' implementation of the same model, the
threshold criterion reaches its target sparsity, training samples agree with the counts, the plot is
written, the corpus split keeps held-out text apart, bad input is one clear error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers as tf

from hybridsparse.profiler import profile as P
from hybridsparse.profiler.activations import load_profile
from hybridsparse.profiler.corpus import is_heldout, load_documents, split
from hybridsparse.runtime.convert import byte_level_vocab, write_gguf

TEXT = "\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog, again and again, {i * 7} times."
                 for i in range(400))


def _model(tmp_path, act):
    vocab = byte_level_vocab()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=len(vocab["tokenizer.ggml.tokens"]), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_act=act,
                         max_position_embeddings=512, tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(cfg).eval()
    path = write_gguf(tmp_path / f"{act}.gguf", cfg, model.state_dict().items(), extra_metadata=vocab)
    (tmp_path / "corpus.txt").write_text(TEXT)
    return model, path


def test_relu_counts_equal_a_direct_count_with_transformers(tmp_path):
    hf, path = _model(tmp_path, "relu")
    out = tmp_path / "prof"
    assert P.main(["-m", str(path), "--corpus", str(tmp_path / "corpus.txt"), "--tokens", "1500", "-b", "128",
                   "--samples", "100000", "--plot", "-o", str(out), "-ngl", "0"]) == 0
    prof = load_profile(out)
    # the same windows through transformers, counting relu(gate) > 0 at every layer
    from hybridsparse.runtime.gguf_file import GGUFFile
    from hybridsparse.runtime.tokenizer import Tokenizer
    tok = Tokenizer(GGUFFile(path))
    calib, _ = split(load_documents(str(tmp_path / "corpus.txt")))
    direct = [torch.zeros(128, dtype=torch.float64) for _ in range(3)]
    def counter(k):
        def hook(module, inputs, output):  # returns None: the output stays as it is
            direct[k].add_((output[0] > 0).sum(0, dtype=torch.float64))
        return hook

    hooks = [layer.mlp.act_fn.register_forward_hook(counter(k)) for k, layer in enumerate(hf.model.layers)]
    done = 0
    with torch.no_grad():
        for text in calib:
            ids = tok.encode(text)
            for s in range(0, len(ids), 128):
                chunk = ids[s:s + 128][: 1500 - done]
                if len(chunk) < 2:
                    continue
                hf(torch.tensor([chunk]))
                done += len(chunk)
                if done >= 1500:
                    break
            if done >= 1500:
                break
    for h in hooks:
        h.remove()
    assert prof.tokens == done == 1500
    for ours, ref in zip(prof.counts, direct):
        assert (ours - ref).abs().sum() <= 1e-3 * ref.sum()  # fp noise can flip a value at 0
    meta = json.loads((out / "profile.json").read_text())
    assert meta["criterion"] == "nonzero" and meta["thresholds"] == [None] * 3
    # the training samples (FFN input, mask) cover every token and agree with the counts
    for layer in range(3):
        shards = sorted((out / "samples" / f"layer_{layer}").glob("shard_*.pt"))
        data = [torch.load(s, weights_only=True) for s in shards]
        masks = np.unpackbits(torch.cat([d["mask"] for d in data]).numpy(), axis=1)[:, :128]
        assert masks.shape[0] == 1500 and torch.cat([d["x"] for d in data]).shape == (1500, 64)
        assert np.array_equal(masks.sum(0), prof.counts[layer].numpy())
    assert (out / "activation-frequency.png").read_bytes()[:4] == b"\x89PNG"


def test_threshold_criterion_reaches_the_target_sparsity(tmp_path):
    _, path = _model(tmp_path, "silu")
    out = tmp_path / "prof"
    assert P.main(["-m", str(path), "--corpus", str(tmp_path / "corpus.txt"), "--tokens", "800", "-b", "128",
                   "--sparsity", "0.7", "--calib-tokens", "800", "-o", str(out), "-ngl", "0"]) == 0
    meta = json.loads((out / "profile.json").read_text())
    assert meta["criterion"] == "threshold" and all(t > 0 for t in meta["thresholds"])
    # calibrated on the same tokens: the density is the target's complement
    assert all(abs(d - 0.3) < 0.05 for d in meta["density_per_layer"]), meta["density_per_layer"]

    # other sparsities at run time, from the profile's |act| quantile table (hs-run/hs-perplexity --sparsity)
    from hybridsparse.runtime import perplexity as PP
    from hybridsparse.runtime.gguf_file import GGUFFile
    from hybridsparse.runtime.hybrid import HybridOptions, setup_hybrid
    from hybridsparse.runtime.models import load_model
    table = meta["threshold_table"]
    assert len(table["sparsity"]) == 19 and all(np.all(np.diff(row) >= 0) for row in table["thresholds"])
    for s, row_check in ((0.7, meta["thresholds"]), (0.4, [float(np.interp(0.4, table["sparsity"], r))
                                                          for r in table["thresholds"]])):
        m = load_model(GGUFFile(path))
        setup_hybrid(m, path, HybridOptions(mode="oracle", vram_budget=0, sparsity=s, profile=str(out)),
                     log_line=lambda *_: None)
        got = [layer.ffn.score_threshold for layer in m.layers]
        assert got == pytest.approx(row_check)
    assert all(a < b for a, b in zip(got, meta["thresholds"]))  # sparsity 0.4 keeps more neurons than 0.7
    base = ["-m", str(path), "-f", str(tmp_path / "corpus.txt"), "-c", "64", "--chunks", "2", "-t", "1",
            "--vram-budget", "0", "--profile", str(out)]
    assert PP.main(base + ["--sparsity", "0.4"]) == 0
    assert PP.main(base + ["--sparsity", "0.99"]) == 1
    assert PP.main(base + ["--sparsity", "0.4", "--dense"]) == 1


def test_default_corpus_and_heldout_split():
    docs = load_documents(None)
    calib, held = split(docs)
    assert len(calib) > 100 and len(held) > 10
    assert not set(calib) & set(held)
    assert all(is_heldout(n) for n, t in docs if t in set(held))


def test_bad_inputs(tmp_path, capsys):
    _, path = _model(tmp_path, "relu")
    assert P.main(["-m", str(path), "--corpus", str(tmp_path / "missing.txt")]) == 1
    assert "no such corpus" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    assert P.main(["-m", str(path), "--corpus", str(tmp_path / "bad.jsonl")]) == 1
    assert "no field 'text'" in capsys.readouterr().err
    assert P.main(["-m", str(path), "--sparsity", "1.5"]) == 1
    assert "--sparsity 1.5" in capsys.readouterr().err
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    assert P.main(["-m", str(path), "--corpus", str(tmp_path / "latin1.txt")]) == 1
    err = capsys.readouterr().err
    assert "latin1.txt: cannot read as UTF-8 text" in err and "Traceback" not in err


def test_text_corpus_documents_of_twenty_lines(tmp_path):
    """Plain text is read without `datasets`: one document per 20 lines, named by file and first line."""
    lines = [f"line {i}" for i in range(45)]
    (tmp_path / "c.txt").write_text("\n".join(lines) + "\n")
    docs = load_documents(str(tmp_path / "c.txt"))
    assert [n for n, _ in docs] == ["c.txt:0", "c.txt:20", "c.txt:40"]
    assert docs[1][1] == "\n".join(lines[20:40]) and docs[2][1] == "\n".join(lines[40:])


def test_predictors_train_to_the_recall_target_and_round_trip(tmp_path):
    from hybridsparse.predictor_training import train as T
    _, path = _model(tmp_path, "relu")
    out = tmp_path / "prof"
    assert P.main(["-m", str(path), "--corpus", str(tmp_path / "corpus.txt"), "--tokens", "3000", "-b", "128",
                   "--samples", "3000", "-o", str(out), "-ngl", "0"]) == 0
    pred = tmp_path / "relu.predictors.gguf"
    assert T.main(["-m", str(path), "--profile", str(out), "--widths", "16,64", "--epochs", "6", "--budget", "1.0",
                   "-o", str(pred)]) == 0
    report = json.loads(pred.with_suffix(".json").read_text())
    for row in report["layers"]:
        assert row["recall"] >= 0.97  # the threshold is set for 0.99 on held-out samples
        assert row["predicted_density"] >= row["true_density"] * 0.9
    layers, thresholds, meta = T.load_predictors(pred)
    assert len(layers) == 3 and layers[0][0].shape[1] == 64 and layers[0][1].shape[0] == 128
    assert thresholds == pytest.approx([r["threshold"] for r in report["layers"]], rel=1e-6)
    assert meta["recall_target"] == 0.99
    # PowerInfer's predictor directory
    pi = tmp_path / "pi"
    pi.mkdir()
    for i, (fc1, fc2) in enumerate(layers):
        torch.save({"fc1.weight": fc1, "fc2.weight": fc2}, pi / f"model_{i}.pt")
    (pi / "config.json").write_text('{"sparse_threshold": 0.25}')
    pl, pt = T.load_powerinfer_dir(pi)
    assert len(pl) == 3 and pt == [0.25] * 3 and torch.equal(pl[2][1], layers[2][1])


def test_predictor_training_without_samples_is_one_clear_error(tmp_path, capsys):
    from hybridsparse.predictor_training import train as T
    _, path = _model(tmp_path, "relu")
    assert T.main(["-m", str(path), "--profile", str(tmp_path / "nothing")]) == 1
    assert "no training samples" in capsys.readouterr().err
