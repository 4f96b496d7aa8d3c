import pytest
import torch

from hybridsparse.runtime.sampling import Sampler, SamplingParams


def test_greedy_and_top_k_one_pick_argmax():
    logits = torch.randn(1000)
    best = int(logits.argmax())
    assert Sampler(SamplingParams(temperature=0))(logits, []) == best
    assert Sampler(SamplingParams(top_k=1, seed=3))(logits, []) == best


def test_seed_reproducible_and_varies():
    logits = torch.zeros(50)
    a = [Sampler(SamplingParams(seed=7, top_k=0, top_p=1, min_p=0))(logits, []) for _ in range(3)]
    assert len(set(a)) == 1
    draws = {Sampler(SamplingParams(seed=s, top_k=0, top_p=1, min_p=0))(logits, []) for s in range(30)}
    assert len(draws) > 5


def test_min_p_and_top_p_cut_the_tail():
    logits = torch.tensor([10.0, 9.9, 0.0, -1.0, -2.0])
    for seed in range(40):
        assert Sampler(SamplingParams(seed=seed, min_p=0.5, top_k=0, top_p=1))(logits, []) in (0, 1)
        assert Sampler(SamplingParams(seed=seed, top_p=0.5, top_k=0, min_p=0))(logits, []) == 0


def test_repeat_penalty_discourages_history():
    logits = torch.tensor([2.0, 1.9, -3.0])
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=1.5))(logits, [0]) == 1


def test_bad_params():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
