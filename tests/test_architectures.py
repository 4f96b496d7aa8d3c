"""Every architecture against transformers' implementation with the same random weights: logits of a
prefill and of token-by-token decode with the KV cache, fp32, within 1e-4 of the logit scale."""

from __future__ import annotations

import types

import pytest
import torch
import transformers as tf

from hybridsparse.runtime.convert import write_gguf
from hybridsparse.runtime.gguf_file import GGUFFile
from hybridsparse.runtime.layers import KVCache
from hybridsparse.runtime.models import load_model

VOCAB, SEQ = 96, 13


def _drelu_forward(self, x):
    return self.down_proj(torch.relu(self.gate_proj(x)) * torch.relu(self.up_proj(x)))


def _llama(act="silu", **kw):
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, hidden_act=act, max_position_embeddings=64,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, **kw)
    return tf.LlamaForCausalLM(cfg)


def _drelu_llama():
    model = _llama("relu")
    for layer in model.model.layers:  # TurboSparse/Bamboo dReLU: relu on both gate and up
        layer.mlp.forward = types.MethodType(_drelu_forward, layer.mlp)
    return model


CASES = {
    "llama-swiglu": (_llama, {}),
    "llama-relu": (lambda: _llama("relu"), {}),
    "llama-drelu": (_drelu_llama, {"hybridsparse.ffn_activation": "drelu"}),
    "llama-tied-mha": (lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=True)), {}),
    "qwen2": (lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)), {}),
    "gemma3": (lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=64, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=32)), {"attention.sliding_window_pattern": 3}),
    "falcon-40b-relu": (lambda: tf.FalconForCausalLM(tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, parallel_attn=True, bias=False, alibi=False, activation="relu",
        max_position_embeddings=64)), {}),
    "falcon-7b-gelu": (lambda: tf.FalconForCausalLM(tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=False, activation="gelu",
        max_position_embeddings=64)), {}),
    "opt": (lambda: tf.OPTForCausalLM(tf.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=64, do_layer_norm_before=True)), {}),
}


def build_case(name, tmp_path, dtype="f32"):
    torch.manual_seed(0)
    make, extra = CASES[name]
    model = make().eval()
    with torch.no_grad():  # random norm weights and biases, so mistakes in them show up
        for pname, p in model.named_parameters():
            if "norm" in pname or "ln" in pname or pname.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path = write_gguf(tmp_path / f"{name}.gguf", model.config, model.state_dict().items(), dtype=dtype,
                      extra_metadata=extra)
    return model, load_model(GGUFFile(path))


def _close(ours, ref):
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * max(scale, 1.0), f"max abs diff {err:.3g} vs logit scale {scale:.3g}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers(name, tmp_path):
    ref_model, ours = build_case(name, tmp_path)
    ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_model(ids.unsqueeze(0)).logits[0].float()
    c = ours.config
    cache = ours.new_cache(32)
    with torch.inference_mode():
        prefill = ours.forward(ids, torch.arange(SEQ), cache, SEQ, all_logits=True)
    _close(prefill, ref)

    cache = ours.new_cache(32)
    steps = []
    with torch.inference_mode():
        head = 5  # a short prefill, then one token at a time
        steps.append(ours.forward(ids[:head], torch.arange(head), cache, head, all_logits=True))
        for pos in range(head, SEQ):
            steps.append(ours.forward(ids[pos:pos + 1], torch.tensor([pos]), cache, pos + 1))
    _close(torch.cat(steps), ref)
    assert isinstance(cache[0], KVCache) and c.n_layers == len(cache)


@pytest.mark.parametrize("name,dtype,cache_dtype,layout", [("llama-swiglu", "f16", torch.float32, "llama.cpp"),
                                                            ("llama-relu", "q8_0", torch.float16, "powerinfer"),
                                                            ("llama-tied-mha", "q4_0", torch.float16, "llama.cpp"),
                                                            ("gemma3", "f16", torch.float32, "llama.cpp"),
                                                            ("gemma3", "q8_0", torch.float16, "llama.cpp")])
def test_cpu_blocks_equal_their_ops(name, dtype, cache_dtype, layout, tmp_path, monkeypatch):
    """One token's attention half as one compiled call (kernels.cpu.attention_block: norm, q/k/v GEMVs,
    rotary, attention, output GEMV plus residual; Gemma 3's q/k norms, window and post norm too) and its
    FFN half as another (ffn_block: norm, gate/up GEMV, activation, down projection over ffn_down or, in
    PowerInfer's layout, ffn_down_t rows, post norm, residual) give bit for bit what the block's separate
    calls give, GQA and not, over float32 and float16 caches, and are the path a CPU decode step takes."""
    from hybridsparse.runtime import kernels
    if not kernels.available():
        pytest.skip("compiled kernels not built")
    ref, model = build_case(name, tmp_path, "f16")
    if layout == "powerinfer":
        write_gguf(tmp_path / f"{name}.gguf", ref.config, ref.state_dict().items(), dtype="f16",
                   extra_metadata=CASES[name][1], powerinfer=True)
    if dtype != "f16":  # the block formats through hs-quantize's own path
        from hybridsparse.runtime.quantize import quantize_gguf
        quantize_gguf(tmp_path / f"{name}.gguf", tmp_path / f"{name}-{dtype}.gguf", dtype, log=lambda *a: None)
    model = load_model(GGUFFile(tmp_path / (f"{name}.gguf" if dtype == "f16" else f"{name}-{dtype}.gguf")))
    assert all(L.ffn.down_transposed == (layout == "powerinfer") for L in model.layers)
    model.cpu_cache_dtype = cache_dtype
    ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(2))

    def decode() -> torch.Tensor:
        cache, out = model.new_cache(32), []
        with torch.inference_mode():
            out.append(model.forward(ids[:4], torch.arange(4), cache, 4, all_logits=True))
            for pos in range(4, SEQ):
                out.append(model.forward(ids[pos:pos + 1], torch.tensor([pos]), cache, pos + 1))
        return torch.cat(out)

    calls = []
    blocks = {n: getattr(kernels.cpu, n) for n in ("attention_block", "ffn_block")}
    monkeypatch.setattr(kernels, "cpu", types.SimpleNamespace(**{
        n: getattr(kernels.cpu, n) for n in dir(kernels.cpu) if not n.startswith("__")}))
    for n, f in blocks.items():
        monkeypatch.setattr(kernels.cpu, n, lambda *a, n=n, f=f, **k: calls.append(n) or f(*a, **k))
    fused = decode()
    assert sorted(calls) == sorted(list(blocks) * ((SEQ - 4) * model.config.n_layers))
    monkeypatch.setattr(kernels, "cpu_block_ok", lambda *a: False)
    assert torch.equal(fused, decode())


def random_prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def batched_vs_alone(model, prompts, rounds, ref=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`model.forward_batch` (the server's batched step) against each sequence's own forward on `ref`
    (default: the same model), every sequence with its own cache, prompts prefilled first; per round
    of new tokens, (batched, one at a time) logits on the CPU."""
    ref = ref or model
    alone, batch = [ref.new_cache(32) for _ in prompts], [model.new_cache(32) for _ in prompts]
    out = []
    with torch.inference_mode():
        for p, c1, c2 in zip(prompts, alone, batch):
            ref.forward(torch.tensor(p), torch.arange(len(p)), c1, len(p))
            model.forward(torch.tensor(p), torch.arange(len(p)), c2, len(p))
        starts = [len(p) for p in prompts]
        for new in rounds:
            want = torch.cat([ref.forward(torch.tensor(t), torch.arange(s, s + len(t)), c, s + len(t))
                              for t, s, c in zip(new, starts, alone)])
            out.append((model.forward_batch(new, starts, batch).cpu(), want.cpu()))
            starts = [s + len(t) for s, t in zip(starts, new)]
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_batched_sequences_equal_one_at_a_time(name, tmp_path):
    """forward_batch (the server's batched decode): three sequences of different lengths, each with its
    own cache, in one pass; every sequence's logits equal its own forward, for decode steps and for
    several tokens per sequence."""
    _, ours = build_case(name, tmp_path)
    for got, want in batched_vs_alone(ours, random_prompts(2, (5, 9, 2)), ([[7], [11], [13]], [[3, 4], [5], [6, 8, 9]])):
        _close(got, want)


@pytest.mark.parametrize("style", ["neox", "norm"])
@pytest.mark.parametrize("tokens", [1, 3])  # one token: the compiled kernel in place; several: the twin
def test_rope_qk_rotates_adjacent_q_and_k_in_one_call(style, tokens):
    """rope_qk over q and k that are views of one fused q/k/v output (one call for both heads' sets)
    gives what two separate calls give, and leaves v alone; q and k from separate buffers too."""
    from hybridsparse.runtime.layers import Rotary, Step, rope_qk
    rope = Rotary(32, 10000.0, 64, style)
    positions = torch.tensor([7, 8, 30][:tokens])
    hq, hk, d = 4, 2, 32
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=torch.Generator().manual_seed(3))
    q_ref = rope.apply(qkv[:, :hq * d].clone().view(tokens, hq, d), Step(positions, 31))
    k_ref = rope.apply(qkv[:, hq * d:(hq + hk) * d].clone().view(tokens, hk, d), Step(positions, 31))
    v_before = qkv[:, (hq + hk) * d:].clone()
    calls = []
    apply = rope.apply
    rope.apply = lambda x, step: calls.append(x.shape) or apply(x, step)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = rope_qk(rope, q.reshape(tokens, hq, d), k.reshape(tokens, hk, d), Step(positions, 31))
    assert calls == [(tokens, hq + hk, d)]  # one call over both
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    torch.testing.assert_close(v, v_before)
    q2, k2 = rope_qk(rope, qkv[:, :hq * d].clone().view(tokens, hq, d), torch.randn(tokens, hk, d), Step(positions, 31))
    assert q2.shape == (tokens, hq, d) and k2.shape == (tokens, hk, d) and len(calls) == 3  # apart: two calls


def test_cpu_kv_cache_commits_memory_only_for_positions_used():
    """A host KV cache reads as zeros and its pages are taken as positions are written, not at
    allocation (a 7B model's float32 cache at -c 4096 is 4.3 GB): 64 MiB of cache, a 3-token prompt
    stored through the attention op, well under 8 MiB more memory; the attention matches the eager
    reference on it."""
    import sys
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/statm")
    from hybridsparse.runtime.layers import Step, attend, attend_reference

    def anon_bytes():
        size, resident, shared = map(int, open("/proc/self/statm").read().split()[:3])
        return (resident - shared) * 4096

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 8, 64), torch.randn(3, 4, 64), torch.randn(3, 4, 64)
    step = Step(torch.arange(3), 3)
    before = anon_bytes()
    cache = KVCache(4, 64, 32768, "cpu", torch.float32)  # 32 MiB each for k and v
    out = attend(q, k, v, cache, step, None, 0.125)
    grown = anon_bytes() - before
    assert grown < 8 * 2**20, f"{grown / 2**20:.1f} MiB committed for 3 positions"
    assert cache.k[:, 3:].abs().sum() == 0 and cache.v[:, 3:].abs().sum() == 0
    ref_cache = types.SimpleNamespace(k=torch.zeros(4, 32768, 64), v=torch.zeros(4, 32768, 64))
    torch.testing.assert_close(out, attend_reference(q, k, v, ref_cache, step, None, 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,window,hq,hkv,d", [(1, None, 4, 4, 64), (5, None, 8, 2, 80), (3, 4, 6, 3, 33)])
def test_cpu_attention_op_over_a_float32_or_float16_cache(cache_dtype, tokens, window, hq, hkv, d):
    """The compiled CPU attention (store k/v, causal or windowed softmax, grouped heads; head sizes
    with a vector tail) against the eager reference on a float32 cache holding the values the op
    stores: for a float16 cache (-ctk/-ctv f16, the commands' default), k and v rounded to float16."""
    from hybridsparse.runtime import kernels
    from hybridsparse.runtime.layers import Step, attend, attend_reference
    if not kernels.available():
        pytest.skip("compiled kernels not built")
    g = torch.Generator().manual_seed(tokens * 7 + d)
    n_ctx, past = 64, 9
    cache = KVCache(hkv, d, n_ctx, "cpu", cache_dtype)
    history_k, history_v = torch.randn(hkv, past, d, generator=g), torch.randn(hkv, past, d, generator=g)
    cache.k[:, :past], cache.v[:, :past] = history_k, history_v
    q, k, v = (torch.randn(tokens, h, d, generator=g) for h in (hq, hkv, hkv))
    step = Step(torch.arange(past, past + tokens), past + tokens)
    out = attend(q, k, v, cache, step, window, d ** -0.5)
    stored = cache.k.float(), cache.v.float()
    rounded = k.to(cache_dtype).float(), v.to(cache_dtype).float()
    torch.testing.assert_close(stored[0][:, past:past + tokens], rounded[0].transpose(0, 1))
    torch.testing.assert_close(stored[1][:, past:past + tokens], rounded[1].transpose(0, 1))
    ref_cache = types.SimpleNamespace(k=torch.zeros(hkv, n_ctx, d), v=torch.zeros(hkv, n_ctx, d))
    ref_cache.k[:, :past], ref_cache.v[:, :past] = stored[0][:, :past], stored[1][:, :past]
    ref = attend_reference(q, *rounded, ref_cache, step, window, d ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,d,window", [(8, 1, 64, None), (8, 1, 64, 700), (6, 2, 64, 1200), (4, 4, 40, None)])
@pytest.mark.parametrize("tokens", [1, 3])
def test_cpu_decode_attention_splits_a_long_cache_across_threads(cache_dtype, hq, hkv, d, window, tokens):
    """One token over a long cache with fewer (token, key/value head) pairs than threads: the compiled
    op splits the positions into spans and merges their softmax sums (a window leaves the first span
    empty); grouped query heads read each cache row once. Against the eager reference."""
    from hybridsparse.runtime import kernels
    from hybridsparse.runtime.layers import Step, attend_reference
    if not kernels.available():
        pytest.skip("compiled kernels not built")
    g = torch.Generator().manual_seed(hq * 100 + d)
    past = 3000
    cache = KVCache(hkv, d, past + 8, "cpu", cache_dtype)
    cache.k[:, :past] = torch.randn(hkv, past, d, generator=g).to(cache_dtype)
    cache.v[:, :past] = torch.randn(hkv, past, d, generator=g).to(cache_dtype)
    q, k, v = (torch.randn(tokens, h, d, generator=g) for h in (hq, hkv, hkv))
    step = Step(torch.arange(past, past + tokens), past + tokens)
    ref_cache = types.SimpleNamespace(k=cache.k.float().clone(), v=cache.v.float().clone())
    ref = attend_reference(q, k.to(cache_dtype).float(), v.to(cache_dtype).float(), ref_cache, step, window, d ** -0.5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)  # more threads than pairs, whatever the machine
        out = kernels.cpu.attention(q, k, v, cache.k, cache.v, step.positions, step.kv_len, window or 0, d ** -0.5)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, ref.reshape(out.shape), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_cpu_prompt_attention_over_a_long_cache(cache_dtype, monkeypatch):
    """A prompt's tokens over a long cache go through the compiled op (passes of several tokens'
    queries, each with its own causal limit and window) and match the eager reference, multi-head and
    grouped, windowed and not; the cache holds the same values either way."""
    from hybridsparse.runtime import kernels, layers
    from hybridsparse.runtime.layers import Step, attend
    if not kernels.available():
        pytest.skip("compiled kernels not built")
    reference = layers.attend_reference
    calls = []
    monkeypatch.setattr(layers, "attend_reference", lambda *a, **kw: calls.append(1) or reference(*a, **kw))
    g = torch.Generator().manual_seed(11)
    T, past, hq, d = 37, 500, 8, 64
    for window, hkv in ((None, 8), (100, 8), (None, 2), (30, 2), (None, 1)):
        a, b = KVCache(hkv, d, 600, "cpu", cache_dtype), KVCache(hkv, d, 600, "cpu", cache_dtype)
        a.k[:, :past] = b.k[:, :past] = torch.randn(hkv, past, d, generator=g).to(cache_dtype)
        a.v[:, :past] = b.v[:, :past] = torch.randn(hkv, past, d, generator=g).to(cache_dtype)
        q, k, v = (torch.randn(T, h, d, generator=g) for h in (hq, hkv, hkv))
        step = Step(torch.arange(past, past + T), past + T)
        out = attend(q, k, v, a, step, window, 0.125)
        ref_cache = types.SimpleNamespace(k=b.k.float(), v=b.v.float())
        ref = reference(q, k.to(cache_dtype).float(), v.to(cache_dtype).float(), ref_cache, step, window, 0.125)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        assert torch.equal(a.k[:, past:past + T].float(), ref_cache.k[:, past:past + T])
        assert torch.equal(a.v[:, past:past + T].float(), ref_cache.v[:, past:past + T])
    assert not calls  # the compiled op, not the eager form


@pytest.mark.parametrize("path", ["avx2", "scalar"])
def test_cpu_attention_on_the_other_cpu_paths(path):
    """The attention tests above rerun in a process forced onto the AVX2 path (desktop CPUs without
    AVX-512: grouped heads in 256-bit registers) and the portable path."""
    import os
    import platform
    import subprocess
    import sys
    from pathlib import Path
    from hybridsparse.runtime import kernels
    if not kernels.available():
        pytest.skip("compiled kernels not built")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    here = Path(__file__).parent
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / "test_architectures.py"),
                        "-k", "cpu_attention_op or splits_a_long_cache or prompt_attention"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HS_CPU_PATH": path}, cwd=here.parent)
    assert r.returncode == 0, r.stdout[-3000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
