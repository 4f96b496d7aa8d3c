"""Tokenizer from GGUF metadata, through transformers' GGUF-to-`tokenizers` conversion.

The converted `tokenizers` JSON is cached next to the model (`<model>.tokenizer.json`, or under
~/.cache/hybridsparse when that folder is not writable), keyed by the tokenizer metadata's hash.
BOS/EOS ids and whether to add BOS come straight from the metadata, as llama.cpp reads them.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ModelError
from .gguf_file import GGUFFile

log = logging.getLogger(__name__)

_KEYS = {  # GGUF key -> the name transformers' converter expects
    "tokenizer.ggml.model": "tokenizer_type", "tokenizer.ggml.pre": "pre_tokenizer_type",
    "tokenizer.ggml.tokens": "tokens", "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type", "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.bos_token_id": "bos_token_id", "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id", "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_space_prefix": "add_prefix_space",
}
CONTROL, USER_DEFINED = 3, 4


def _metadata_digest(g: GGUFFile) -> str:
    h = hashlib.sha256()
    for key in sorted(_KEYS):
        value = g.metadata.get(key)
        if isinstance(value, np.ndarray):
            h.update(value.tobytes())
        elif isinstance(value, list):
            h.update("\x00".join(value).encode("utf-8", "replace"))
        else:
            h.update(repr(value).encode())
    return h.hexdigest()[:16]


def _cache_path(g: GGUFFile, digest: str) -> Path:
    beside = g.path.with_name(g.path.name + f".{digest}.tokenizer.json")
    if os.access(g.path.parent, os.W_OK):
        return beside
    cache = Path(os.environ.get("HS_CACHE", Path.home() / ".cache" / "hybridsparse")) / "tokenizers"
    cache.mkdir(parents=True, exist_ok=True)
    return cache / beside.name


def _legacy_converter(g: GGUFFile, d: dict):
    """transformers before integrations.gguf.gguf_tokenizer_mapping (up to 5.17 at least): its converters in
    integrations.ggml, keyed by model type. Only byte-level BPE vocabularies (merges stored) convert the
    same there; it splits SentencePiece vocabularies (Llama-2, Gemma: scores, no merges) into pieces."""
    import transformers
    from transformers.integrations.ggml import GGUF_TO_FAST_CONVERTERS, convert_gguf_tokenizer
    if d.get("tokenizer_type") != "gpt2" or not d.get("merges"):
        raise ModelError(f"{g.path}: transformers {transformers.__version__} cannot build this "
                         f"{d.get('tokenizer_type')!r} vocabulary correctly; install transformers>=5.25")
    name = g.architecture if g.architecture in GGUF_TO_FAST_CONVERTERS else "gpt2"
    return convert_gguf_tokenizer, name


def _convert(g: GGUFFile):
    d = {}
    for key, name in _KEYS.items():
        if key in g.metadata:
            value = g.metadata[key]
            d[name] = value.tolist() if isinstance(value, np.ndarray) else value
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
        name = g.architecture
    except ImportError:
        convert_gguf_tokenizer, name = _legacy_converter(g, d)
    try:
        backend, _ = convert_gguf_tokenizer(name, d)
    except Exception as e:
        raise ModelError(f"{g.path}: cannot build a tokenizer from tokenizer.ggml.* metadata: {e}") from None
    return backend


class Tokenizer:
    def __init__(self, g: GGUFFile):
        from tokenizers import Tokenizer as HFTokenizer
        if "tokenizer.ggml.tokens" not in g.metadata:
            raise ModelError(f"{g.path}: metadata tokenizer.ggml.tokens is missing (no vocabulary)")
        self.tokens: list[str] = g.metadata["tokenizer.ggml.tokens"]
        types = g.metadata.get("tokenizer.ggml.token_type")
        self.token_types = types if types is not None else np.zeros(len(self.tokens), np.int32)
        self.bos_id = g.get("tokenizer.ggml.bos_token_id")
        self.eos_id = g.get("tokenizer.ggml.eos_token_id")
        model = g.get("tokenizer.ggml.model")
        self.add_bos = bool(g.get("tokenizer.ggml.add_bos_token", model == "llama")) and self.bos_id is not None
        self.chat_template = g.get("tokenizer.chat_template")
        # End-of-generation ids: EOS, EOT and the control tokens llama.cpp treats as such.
        self.eog_ids = {i for i in (self.eos_id, g.get("tokenizer.ggml.eot_token_id"),
                                    g.get("tokenizer.ggml.eom_token_id")) if i is not None}
        for name in ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|endoftext|>"):
            idx = self._find(name)
            if idx is not None and self.token_types[idx] == CONTROL:
                self.eog_ids.add(idx)
        path = _cache_path(g, _metadata_digest(g))
        if path.exists():
            self.backend = HFTokenizer.from_file(str(path))
        else:
            self.backend = _convert(g)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(self.backend.to_str())
            os.replace(tmp, path)

    def _find(self, token: str) -> int | None:
        try:
            return self.tokens.index(token) if len(self.tokens) < 1000 else self._index().get(token)
        except ValueError:
            return None

    def _index(self) -> dict[str, int]:
        if not hasattr(self, "_token_index"):
            self._token_index = {t: i for i, t in enumerate(self.tokens)}
        return self._token_index

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Text to ids (special tokens written in the text are parsed); BOS first when the vocabulary
        asks for it (llama.cpp's rule)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids if text else []
        want_bos = self.add_bos if add_bos is None else add_bos
        if want_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, fallback: bool = False) -> str:
        """The GGUF's chat template rendered in a jinja2 sandbox (as transformers does); without one,
        where `fallback`, the format the vocabulary's turn tokens name (Gemma's, Llama 3's), else
        ChatML (llama.cpp's fallback); without either an error."""
        if not self.chat_template and not fallback:
            raise ModelError("this model has no tokenizer.chat_template; use a plain prompt")
        bos = self.tokens[self.bos_id] if self.bos_id is not None else ""
        eos = self.tokens[self.eos_id] if self.eos_id is not None else ""
        return self._chat_jinja.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       bos_token=bos, eos_token=eos)

    @functools.cached_property
    def _chat_jinja(self):
        """The chat template (or the built-in one the vocabulary names) compiled once: a server renders
        one a request, and looking through a 262k-token vocabulary took ~20 ms of each."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        if self.chat_template:
            return env.from_string(self.chat_template)
        known = set(self.tokens)
        return env.from_string(next((t for marks, t in BUILTIN_TEMPLATES if marks <= known), CHATML))


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# chat formats for GGUFs without tokenizer.chat_template, found by the turn tokens in the vocabulary
GEMMA = ("{{ bos_token }}{% set sys = messages[0]['content'] + '\n\n' if messages and messages[0]['role'] == 'system' "
         "else '' %}{% for m in messages if m['role'] != 'system' %}<start_of_turn>"
         "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ sys if loop.first else '' }}{{ m['content'] }}"
         "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
BUILTIN_TEMPLATES = [({"<start_of_turn>", "<end_of_turn>"}, GEMMA),
                     ({"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}, LLAMA3)]


def _raise(message):
    raise ModelError(f"chat template: {message}")


class StreamDecoder:
    """Incremental detokenization (the offsets method of vLLM/TGI): decodes a short window so each
    step costs O(1), and emits text only once it is complete UTF-8."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int] | None = None):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt or [])
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - 6)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        after = self.tok.decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before):]
