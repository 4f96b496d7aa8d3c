"""hs-serve on a real GPU (skipped without CUDA): the model all on the GPU (CUDA graphs on) and the hybrid
runtime under a VRAM budget, each behind the server with several clients at once, so their tokens go
through one batched step: every client gets the greedy answer the CPU server gives it alone; the
official `openai` client streams from it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
pytest.importorskip("openai")
pytest.importorskip("fastapi")
import openai  # noqa: E402

from hybridsparse.runtime import server as S  # noqa: E402
from hybridsparse.runtime.hybrid import HybridOptions  # noqa: E402
from hybridsparse.runtime.loader import open_model  # noqa: E402
from test_server import serving  # noqa: E402
from tiny_models import tiny_llama  # noqa: E402

PROMPTS = ["alpha", "beta gamma", "delta epsilon zeta", "eta"]


def _answers(base: str, concurrent: bool) -> list[str]:
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    got = [None] * len(PROMPTS)

    def one(i):
        got[i] = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[i]}],
                                           max_tokens=12, temperature=0).choices[0].message.content
    if not concurrent:
        for i in range(len(PROMPTS)):
            one(i)
        return got
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return got


@pytest.mark.parametrize("placement", ["all-gpu", "hybrid"])
def test_batched_clients_on_cuda_get_the_cpu_answers(tmp_path, placement):
    path = tiny_llama(tmp_path / "tiny.gguf", layers=3)
    base_args = ["-m", str(path), "-np", str(len(PROMPTS)), "-c", "128", "-t", "4", "--alias", "tiny"]
    with serving(S.create_app(S.build_parser().parse_args(base_args + ["--no-graphs"]),
                              lambda: open_model(path, 0))) as base:
        want = _answers(base, concurrent=False)
    if placement == "all-gpu":
        loader = lambda: open_model(path, 99)  # noqa: E731
    else:  # every other neuron on the GPU, the rest on the CPU (oracle active sets: exact for a ReLU model)
        hot = [np.arange(0, 128, 2) for _ in range(3)]
        opts = HybridOptions(mode="oracle", device="cuda", hot=hot, attn_fast=[True] * 3, head_fast=True)
        loader = lambda: open_model(path, hybrid=opts, log_line=lambda *_: None)  # noqa: E731
    with serving(S.create_app(S.build_parser().parse_args(base_args), loader)) as base:
        got = _answers(base, concurrent=True)
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=12, temperature=0,
            stream=True) if ch.choices]
    assert got == want
    assert "".join(pieces) == want[0]
