"""hs-convert: Hugging Face folders (written by transformers, random weights) to GGUF. The converted
file's logits equal transformers' on the same input; its tokenizer encodes as the source tokenizer
does (tokenizers, sentencepiece); PowerInfer's layout, predictors and activation counts come through;
broken inputs give one line and leave no file behind."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import transformers as tf
from gguf import GGMLQuantizationType as Q
from gguf import quants

import test_architectures as A
from cli_checks import one_line_error
from hybridsparse.predictor_training.train import load_predictors
from hybridsparse.profiler.activations import load_profile
from hybridsparse.profiler.corpus import load_documents, split
from hybridsparse.runtime import convert
from hybridsparse.runtime.gguf_file import GGUFFile
from hybridsparse.runtime.gguf_writer import add_metadata
from hybridsparse.runtime.hf_vocab import tokenizer_metadata
from hybridsparse.runtime.models import load_model
from hybridsparse.runtime.tokenizer import Tokenizer

N_VOCAB = 320  # the test tokenizer's 256 bytes + specials + merges, padded by the converter


@pytest.fixture(scope="module")
def corpus():
    return split(load_documents(None))


@pytest.fixture(scope="module")
def bpe_tokenizer(corpus):
    """A byte-level BPE trained here with `tokenizers` (GPT-2 style), as transformers saves it."""
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus[0][:200], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def hf_folder(name, path, tokenizer, monkeypatch, shard="60KB"):
    """transformers' model of test_architectures' case `name`, random norms and biases, saved sharded."""
    monkeypatch.setattr(A, "VOCAB", N_VOCAB)
    torch.manual_seed(0)
    model = A.CASES[name][0]().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or "ln" in pname or pname.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, max_shard_size=shard)
    tokenizer.save_pretrained(path)
    return model


def logits(model, ids):
    with torch.inference_mode():
        return model.forward(ids, torch.arange(len(ids)), model.new_cache(32), len(ids), all_logits=True)


IDS = torch.randint(0, 300, (13,), generator=torch.Generator().manual_seed(1))
HF_CASES = [n for n in sorted(A.CASES) if n != "llama-drelu"]  # dReLU models have no transformers class


@pytest.mark.parametrize("name", HF_CASES)
def test_converted_logits_equal_transformers_and_tokenizer_round_trips(name, tmp_path, bpe_tokenizer, corpus, monkeypatch):
    src = tmp_path / "hf"
    ref = hf_folder(name, src, bpe_tokenizer, monkeypatch)
    assert len(list(src.glob("*.safetensors"))) > 1  # sharded, through the index
    out = tmp_path / "m.gguf"
    assert convert.main([str(src), "-o", str(out), "--outtype", "f32"]) == 0
    g = GGUFFile(out)
    with torch.no_grad():
        want = ref(IDS.unsqueeze(0)).logits[0].float()
    A._close(logits(load_model(g), IDS), want)
    tok = Tokenizer(g)
    assert tok.n_vocab == N_VOCAB and g.get("tokenizer.ggml.pre") == "gpt-2"
    for text in corpus[1][:5] + ["  leading spaces, <s> a special token inside, ünïcödé\n\ttabs"]:
        assert tok.encode(text, add_bos=False) == bpe_tokenizer.encode(text, add_special_tokens=False)
        assert tok.decode(tok.encode(text, add_bos=False), skip_special=False) == text


def test_f16_and_quantized_outputs(tmp_path, bpe_tokenizer, monkeypatch):
    src = tmp_path / "hf"
    ref = hf_folder("llama-relu", src, bpe_tokenizer, monkeypatch)
    with torch.no_grad():
        want = ref(IDS.unsqueeze(0)).logits[0].float()
    assert convert.main([str(src), "--outtype", "f16"]) == 0  # default name: <folder>/<name>-F16.gguf
    g = GGUFFile(src / "hf-F16.gguf")
    assert g.tensors["blk.0.ffn_up.weight"].qtype == Q.F16 and g.tensors["blk.0.ffn_norm.weight"].qtype == Q.F32
    got = logits(load_model(g), IDS)
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()
    for outtype, qt in (("q8_0", Q.Q8_0), ("q4_0", Q.Q4_0)):
        out = tmp_path / f"{outtype}.gguf"
        assert convert.main([str(src), "-o", str(out), "--outtype", outtype, "-t", "2"]) == 0
        g = GGUFFile(out)
        assert g.get("general.file_type") == {"q8_0": 7, "q4_0": 2}[outtype]
        up = ref.model.layers[1].mlp.up_proj.weight.detach().float().numpy()
        assert bytes(g.raw("blk.1.ffn_up.weight").numpy()) == bytes(quants.quantize(up, qt))  # bit-exact with gguf
        assert g.tensors["output.weight"].qtype == Q.Q8_0  # the head keeps 8 bits, as llama.cpp's Q4_0 does
        top = logits(load_model(g), IDS).argmax(-1)
        assert (top == want.argmax(-1)).float().mean() >= 0.7


def test_powerinfer_layout_with_predictors_and_activation(tmp_path, bpe_tokenizer, monkeypatch):
    src = tmp_path / "hf"
    ref = hf_folder("llama-relu", src, bpe_tokenizer, monkeypatch)
    n_ff, d = ref.config.intermediate_size, ref.config.hidden_size
    pred, act = tmp_path / "predictors", tmp_path / "activation"
    pred.mkdir()
    act.mkdir()
    torch.manual_seed(3)
    fcs = []
    for i in range(2):
        fc1, fc2 = torch.randn(16, d), torch.randn(n_ff, 16)
        torch.save({"fc1.weight": fc1, "fc2.weight": fc2}, pred / f"model_{i}.pt")
        torch.save(torch.randint(0, 1000, (n_ff,)), act / f"activation_{i}.pt")
        fcs.append((fc1, fc2))
    (pred / "config.json").write_text(json.dumps({"sparse_threshold": 0.3}))
    out = tmp_path / "pi.gguf"
    assert convert.main([str(src), "-o", str(out), "--outtype", "f32", "--powerinfer", "--predictors", str(pred),
                         "--activation", str(act)]) == 0
    assert out.read_bytes()[:4] == b"PWRI"
    g = GGUFFile(out)
    assert "blk.0.ffn_down.weight" not in g.tensors
    down_t = g.raw("blk.1.ffn_down_t.weight").view(torch.float32)
    assert torch.equal(down_t, ref.model.layers[1].mlp.down_proj.weight.detach().T)
    with torch.no_grad():
        want = ref(IDS.unsqueeze(0)).logits[0].float()
    A._close(logits(load_model(g), IDS), want)
    layers, thresholds, _ = load_predictors(out)
    x = torch.randn(64, d)
    for (fc1, fc2), (g1, g2), t in zip(fcs, layers, thresholds):
        assert t == pytest.approx(0.3)
        assert torch.equal(fc2 @ torch.relu(fc1 @ x.T) >= 0.3, g2 @ torch.relu(g1 @ x.T) >= t)  # same predictions
    prof = load_profile(tmp_path / "pi.hs-profile")
    assert torch.equal(prof.counts[1], torch.load(act / "activation_1.pt").double())


def _fails(capsys, argv, *needles):
    return one_line_error(capsys, convert.main, "hs-convert", argv, *needles)


def test_broken_inputs_give_one_line_and_no_output(tmp_path, bpe_tokenizer, monkeypatch, capsys):
    src = tmp_path / "hf"
    hf_folder("llama-relu", src, bpe_tokenizer, monkeypatch)
    out = tmp_path / "o.gguf"
    args = [str(src), "-o", str(out)]
    shards = sorted(src.glob("*.safetensors"))
    cfg = json.loads((src / "config.json").read_text())

    (src / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 100}))
    _fails(capsys, args, "shape", "config.json implies")
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    _fails(capsys, args, "config.json", "'bert'", "not supported")
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "no-such-arch"}))
    _fails(capsys, args, "config.json", "no-such-arch")
    (src / "config.json").write_text(json.dumps(cfg))

    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[: len(data) // 2])
    _fails(capsys, args, shards[-1].name, "not a readable checkpoint")
    shards[-1].unlink()
    _fails(capsys, args, shards[-1].name, "missing")
    (src / "model.safetensors.index.json").unlink()  # without the index, the lost tensors are named
    _fails(capsys, args, "tensors missing from the checkpoint")

    bad = tmp_path / "pred"
    bad.mkdir()
    torch.save({"fc1.weight": torch.zeros(4, 64), "fc2.weight": torch.zeros(96, 4)}, bad / "model_0.pt")
    src2 = tmp_path / "hf2"
    hf_folder("llama-relu", src2, bpe_tokenizer, monkeypatch)
    _fails(capsys, [str(src2), "-o", str(out), "--predictors", str(bad)], "1 predictors", "2 layers")
    _fails(capsys, [str(tmp_path / "nowhere"), "-o", str(out)], "not a folder")
    (src2 / "tokenizer.json").unlink()
    _fails(capsys, [str(src2), "-o", str(out)], "no tokenizer")
    assert not out.exists() and not list(tmp_path.glob("*.part"))


def _metadata_gguf(path, arch, meta):
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in meta.items():
        add_metadata(w, k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Tokenizer(GGUFFile(path))


TEXTS = ["Hello world, this is a test.  Two  spaces\nnewline\ttab", "<start_of_turn>user\nHi<end_of_turn>",
         "Ünïcödé 日本語 🙂 1234567", "   leading and trailing   "]


def test_gemma_tokenizer_through_hugging_face_files_and_back(tmp_path, default_model):
    """The default model's vocabulary as transformers writes it (tokenizer.json, SentencePiece turned
    BPE with byte fallback), converted back: the same ids for the same text."""
    g = GGUFFile(default_model)
    orig = Tokenizer(g)
    hf = tf.PreTrainedTokenizerFast(tokenizer_object=orig.backend, bos_token=orig.tokens[orig.bos_id],
                                    eos_token=orig.tokens[orig.eos_id])
    hf.save_pretrained(tmp_path / "tok")
    meta = tokenizer_metadata(tmp_path / "tok", orig.n_vocab)
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.bos_token_id"] == orig.bos_id
    back = _metadata_gguf(tmp_path / "t.gguf", "gemma3", meta)
    assert back.n_vocab == orig.n_vocab
    for text in TEXTS:
        assert back.encode(text) == orig.encode(text)


def test_sentencepiece_model_encodes_as_sentencepiece(tmp_path, corpus):
    """A tokenizer.model (trained here with sentencepiece, Llama 2's settings: BPE, byte fallback, no
    normalization) becomes llama.cpp's `llama` vocabulary; ids equal sentencepiece's own."""
    spm = pytest.importorskip("sentencepiece")
    folder = tmp_path / "spm"
    folder.mkdir()
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus[0][:300]), model_writer=buf, vocab_size=500,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1,
                                   eos_id=2, pad_id=-1, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, minloglevel=2)
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    meta = tokenizer_metadata(folder, 512)
    types = meta["tokenizer.ggml.token_type"]
    assert meta["tokenizer.ggml.model"] == "llama" and len(meta["tokenizer.ggml.tokens"]) == 512
    assert types[meta["tokenizer.ggml.tokens"].index("<0x0A>")] == 6 and types[1] == 3 and types[500] == 5
    ours = _metadata_gguf(tmp_path / "t.gguf", "llama", meta)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    assert ours.bos_id == 1 and ours.add_bos
    for text in corpus[1][:40]:
        assert ours.encode(text[:400], add_bos=False) == sp.encode(text[:400])


def test_gpt2_slow_tokenizer_files(tmp_path, bpe_tokenizer, corpus):
    """vocab.json + merges.txt (GPT-2 / OPT checkpoints) as a `gpt2` vocabulary."""
    folder = tmp_path / "slow"
    folder.mkdir()
    bpe_tokenizer.backend_tokenizer.model.save(str(folder))
    meta = tokenizer_metadata(folder, N_VOCAB)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    ours = _metadata_gguf(tmp_path / "t.gguf", "opt", meta)
    for text in corpus[1][:5]:
        assert ours.encode(text, add_bos=False) == bpe_tokenizer.encode(text, add_special_tokens=False)


def test_write_is_atomic_when_a_tensor_fails(tmp_path):
    from hybridsparse.runtime.gguf_writer import PlannedTensor, write_gguf_stream

    def boom():
        raise RuntimeError("disk gone")
    plan = [PlannedTensor("a", (2, 32), Q.F32, lambda: np.zeros((2, 32), np.float32)),
            PlannedTensor("b", (2, 32), Q.F32, boom)]
    out = tmp_path / "x.gguf"
    out.write_bytes(b"old contents")
    with pytest.raises(RuntimeError):
        write_gguf_stream(out, "llama", lambda w: None, plan, desc=False)
    assert out.read_bytes() == b"old contents" and not list(tmp_path.glob("*.part"))


@pytest.mark.parametrize("name", ["llama-swiglu", "llama-tied-mha", "qwen2", "falcon-7b-gelu"])
def test_converted_files_run_in_llama_cpp(name, tmp_path, bpe_tokenizer, corpus, monkeypatch):
    """The converted file is a llama.cpp model (architectures llama.cpp has, with its own activations):
    llama.cpp's logits equal transformers', its tokenizer gives the same ids. Runs where
    llama-cpp-python is installed (it builds llama.cpp from source: not in CI)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    src = tmp_path / "hf"
    ref = hf_folder(name, src, bpe_tokenizer, monkeypatch)
    out = tmp_path / "m.gguf"
    assert convert.main([str(src), "-o", str(out), "--outtype", "f32"]) == 0
    llm = llama_cpp.Llama(str(out), n_ctx=32, logits_all=True, verbose=False, n_threads=2)
    llm.eval(IDS.tolist())
    got = torch.from_numpy(np.array(llm.scores[: len(IDS)], dtype=np.float32))
    with torch.no_grad():
        want = ref(IDS.unsqueeze(0)).logits[0].float()
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    for text in corpus[1][:3]:
        assert llm.tokenize(text.encode(), add_bos=False) == bpe_tokenizer.encode(text, add_special_tokens=False)


def test_custom_code_checkpoint_as_a_supported_family(tmp_path, bpe_tokenizer, monkeypatch, capsys):
    """A Bamboo/TurboSparse-style folder (its own model_type and classes, dReLU FFN): refused with the
    way out named, then converted with --model-type llama --ffn-activation drelu; logits equal the
    checkpoint's own computation (transformers' Llama with ReLU on gate and up)."""
    src = tmp_path / "hf"
    ref = hf_folder("llama-drelu", src, bpe_tokenizer, monkeypatch)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(model_type="bamboo", architectures=["BambooForCausalLM"], auto_map={"AutoConfig": "configuration_bamboo.BambooConfig"})
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "b.gguf"
    _fails(capsys, [str(src), "-o", str(out)], "'bamboo'", "--model-type llama")
    assert convert.main([str(src), "-o", str(out), "--outtype", "f32", "--model-type", "llama", "--ffn-activation", "drelu"]) == 0
    g = GGUFFile(out)
    assert g.get("hybridsparse.ffn_activation") == "drelu"
    with torch.no_grad():
        want = ref(IDS.unsqueeze(0)).logits[0].float()
    A._close(logits(load_model(g), IDS), want)
