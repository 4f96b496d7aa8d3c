"""Token sampling with llama.cpp's defaults and chain order:
repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw. Temperature <= 0 is greedy."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = -1

    def __post_init__(self):
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed >= 0 else random.SystemRandom().randrange(2**31)
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        """logits [n_vocab] (any device) -> the next token id."""
        p = self.params
        if p.repeat_penalty != 1.0 and history and p.repeat_last_n != 0:
            recent = history[-p.repeat_last_n:] if p.repeat_last_n > 0 else history
            ids = torch.tensor(sorted(set(recent)), device=logits.device)
            picked = logits[ids]
            logits = logits.clone()
            logits[ids] = torch.where(picked > 0, picked / p.repeat_penalty, picked * p.repeat_penalty)
        if p.greedy:
            from . import kernels
            if kernels.use_cpu_op(logits) and logits.dim() == 1 and logits.is_contiguous():
                return kernels.cpu.argmax(logits)
            return int(torch.argmax(logits))
        logits = logits.float().cpu()
        if 0 < p.top_k < logits.numel():
            values, ids = torch.topk(logits, p.top_k)
        else:
            values, ids = torch.sort(logits, descending=True)
        probs = torch.softmax(values, dim=-1)
        keep = values.numel()
        if p.top_p < 1.0:
            cum = torch.cumsum(probs, dim=-1)
            keep = min(keep, int(torch.searchsorted(cum, torch.tensor([p.top_p])).item()) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int((probs >= p.min_p * probs[0]).sum())))
        values, ids = values[:keep], ids[:keep]
        probs = torch.softmax(values / p.temperature, dim=-1)
        choice = torch.multinomial(probs, 1, generator=self.generator)
        return int(ids[choice])
