"""hs-batched: sequences decoded together give what each gives alone (greedy), different prompts
included; bad flags are one-line errors."""

from __future__ import annotations

from hybridsparse.runtime import batched
from hybridsparse.runtime.generate import Generator
from hybridsparse.runtime.loader import open_model
from hybridsparse.runtime.sampling import Sampler, SamplingParams
from tiny_models import tiny_llama


def test_batched_greedy_equals_one_at_a_time(tmp_path, capsys, threads):
    path = tiny_llama(tmp_path / "t.gguf")
    prompts = tmp_path / "p.txt"
    texts = ["hello there", "a longer prompt than the first one", "x"]
    prompts.write_text("\n".join(texts) + "\n")
    assert batched.main(["-m", str(path), "-f", str(prompts), "-n", "10", "--temp", "0", "-t", "1", "-ngl", "0"]) == 0
    out = capsys.readouterr().out
    lm = open_model(path, 0)
    for b, text in enumerate(texts):
        gen = Generator(lm.model, lm.tokenizer, 64)
        logits, ids = gen.eval(lm.tokenizer.encode(text)), []
        for _ in range(10):  # greedy, one sequence alone
            ids.append(Sampler(SamplingParams(temperature=0))(logits, []))
            if ids[-1] in lm.tokenizer.eog_ids:
                ids.pop()
                break
            logits = gen.eval([ids[-1]])
        assert f"sequence {b}:\n{text}{lm.tokenizer.decode(ids)}\n" in out + "\n"


def test_bad_flags(tmp_path, capsys):
    path = tiny_llama(tmp_path / "t.gguf")
    assert batched.main(["-m", str(path), "-np", "0"]) == 1
    assert batched.main(["-m", str(path), "-n", "600", "-c", "64"]) == 1
    assert "does not fit" in capsys.readouterr().err
    empty = tmp_path / "e.txt"
    empty.write_text("\n")
    assert batched.main(["-m", str(path), "-f", str(empty)]) == 1


def test_prompt_in_micro_batches_equals_one_pass(tmp_path, threads):
    """A model that takes at most max_batch_tokens tokens a pass (a hybrid model on CUDA) runs a longer
    prompt in pieces: the same logits at every position and the same cache as one pass."""
    import torch
    lm = open_model(tiny_llama(tmp_path / "t.gguf"), 0)
    ids = lm.tokenizer.encode("a prompt of a good many tokens, longer than one micro-batch")
    assert len(ids) > 7
    whole = Generator(lm.model, lm.tokenizer, 64)
    ref = whole.eval(ids, all_logits=True)
    ref_next = whole.eval([ids[0]])
    lm.model.max_batch_tokens = 3
    pieces = Generator(lm.model, lm.tokenizer, 64)
    got = pieces.eval(ids, all_logits=True)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    torch.testing.assert_close(pieces.eval([ids[0]]), ref_next, rtol=1e-4, atol=1e-4 * ref_next.abs().max().item())
    pieces.reset()
    torch.testing.assert_close(pieces.eval(ids), ref[-1], rtol=1e-4, atol=1e-4 * ref.abs().max().item())
