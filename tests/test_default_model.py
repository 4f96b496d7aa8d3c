"""The embedded default, Gemma 3 270M Q4_K_M (real weights): logits against transformers loading
the same GGUF, the tokenizer against transformers' GGUF tokenizer, greedy text stable."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hybridsparse.runtime.generate import Generator
from hybridsparse.runtime.loader import open_model
from hybridsparse.runtime.sampling import Sampler, SamplingParams

TEXT = ("The quick brown fox jumps over the lazy dog. In the beginning, there was a small village by the "
        "sea where fishermen mended their nets and children ran along the shore.")


@pytest.fixture(scope="module")
def lm(default_model):
    return open_model(default_model, 0)


@pytest.fixture(scope="module")
def hf_model(default_model):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(default_model.parent), gguf_file=default_model.name,
                                                dtype=torch.float32).eval()


def test_tokenizer_matches_transformers(lm, default_model):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(str(default_model.parent), gguf_file=default_model.name)
    for text in [TEXT, "Hello, world!", "  two  spaces\nand a newline", "naïve café 東京 🙂", "<start_of_turn>user"]:
        assert lm.tokenizer.encode(text) == ref(text).input_ids, text
        assert lm.tokenizer.decode(lm.tokenizer.encode(text, add_bos=False), skip_special=False) == text
    assert lm.tokenizer.bos_id == 2 and lm.tokenizer.eos_id == 1 and lm.tokenizer.add_bos


def test_logits_match_transformers(lm, hf_model):
    ids = lm.tokenizer.encode(TEXT)
    gen = Generator(lm.model, lm.tokenizer, 256)
    with torch.inference_mode():
        ours = gen.eval(ids, all_logits=True)
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), "top-1 differs at some position"
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() < 2e-3 * scale


def test_greedy_text_is_stable(lm):
    gen = Generator(lm.model, lm.tokenizer, 256)
    params = SamplingParams(temperature=0)
    first = "".join(gen.generate(lm.tokenizer.encode("Once upon a time"), 24, Sampler(params)))
    second = "".join(gen.generate(lm.tokenizer.encode("Once upon a time"), 24, Sampler(params)))
    assert first == second and len(first) > 40
    assert "girl" in first or "little" in first  # the model's known continuation


def test_seeded_sampling_reproducible(lm):
    gen = Generator(lm.model, lm.tokenizer, 256)
    out = ["".join(gen.generate(lm.tokenizer.encode("The sea"), 16, Sampler(SamplingParams(seed=42))))
           for _ in range(2)]
    assert out[0] == out[1]


def test_hs_run_default_model():
    r = subprocess.run([sys.executable, "-m", "hybridsparse.runtime.cli", "-n", "12", "--temp", "0", "-t", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time") and len(r.stdout) > 30
    assert "prompt eval time" in r.stderr and "tokens per second" in r.stderr


def test_hs_run_default_model_hybrid_dense_is_the_same_text():
    """The hybrid runtime on the default model (CPU only, every neuron, ffn_down transposed once into a
    cached F16 file): the same greedy text as the plain runtime."""
    base = [sys.executable, "-m", "hybridsparse.runtime.cli", "-n", "16", "--temp", "0", "-t", "2", "-p", "The sea"]
    plain = subprocess.run(base, capture_output=True, text=True, timeout=300)
    hybrid = subprocess.run(base + ["--dense", "--vram-budget", "0"], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and hybrid.returncode == 0, hybrid.stderr
    assert "hybrid: dense mode" in hybrid.stderr
    assert hybrid.stdout == plain.stdout


def test_next_turn_keeps_the_shared_prefix_and_gives_the_same_text(lm):
    """keep_prefix: a conversation's second turn evaluates only the tokens after what the cache
    already holds, and continues exactly as a fresh generator on the whole prompt does."""
    tok, params = lm.tokenizer, SamplingParams(temperature=0)
    turn1 = [{"role": "user", "content": "Name a color."}]
    gen = Generator(lm.model, tok, 512)
    reply = "".join(gen.generate(tok.encode(tok.render_chat(turn1, fallback=True)), 12, Sampler(params),
                                 keep_prefix=True))
    in_cache = len(gen.tokens)
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Another one."}]
    ids = tok.encode(tok.render_chat(turn2, fallback=True))
    kept = "".join(gen.generate(ids, 16, Sampler(params), keep_prefix=True))
    assert 0 < len(ids) - gen.timings.prompt_tokens <= in_cache  # the shared prefix was not evaluated again
    assert gen.timings.prompt_tokens < len(ids) // 2
    fresh = "".join(Generator(lm.model, tok, 512).generate(ids, 16, Sampler(params)))
    assert kept == fresh and len(fresh) > 0


def test_gemma_format_without_a_template_in_the_file(lm):
    """The embedded GGUF has no tokenizer.chat_template: its vocabulary's turn tokens choose Gemma's
    format (system text folded into the first user turn, assistant as 'model')."""
    tok = lm.tokenizer
    assert not tok.chat_template
    text = tok.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
                           fallback=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_hs_run_conversation_reads_turns_from_stdin():
    """-cnv: two user lines on stdin, two answers after '> ' prompts, timings summed over the turns;
    the second turn's prompt eval covers only its new tokens."""
    base = [sys.executable, "-m", "hybridsparse.runtime.cli", "-n", "8", "--temp", "0", "-t", "2"]
    r = subprocess.run(base + ["-cnv", "-p", "Answer briefly."], input="Hello\nThanks\n", capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("> ") >= 3 and "2 turns" in r.stderr and "prompt eval time" in r.stderr
