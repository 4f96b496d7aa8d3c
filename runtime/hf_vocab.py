"""A Hugging Face model folder's tokenizer as GGUF `tokenizer.*` metadata, the way llama.cpp's
convert_hf_to_gguf.py writes it, so that the converted file tokenizes the same in llama.cpp and here.

  tokenizer.model (sentencepiece)        -> `llama` vocabulary: pieces, scores and types from the model
  tokenizer.json, BPE with byte fallback -> `llama` vocabulary (SentencePiece converted to BPE) + merges
  tokenizer.json, byte-level BPE         -> `gpt2` vocabulary + merges, pre-tokenizer named by its regex
  vocab.json + merges.txt                -> `gpt2` (GPT-2 / OPT slow-tokenizer files)
Special token ids, add_bos/add_eos and the chat template come from gguf's SpecialVocab (it reads
tokenizer_config.json, special_tokens_map.json and config.json as llama.cpp does).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import gguf

from .errors import ModelError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = (int(t) for t in (
    gguf.TokenType.NORMAL, gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED,
    gguf.TokenType.UNUSED, gguf.TokenType.BYTE))
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def tokenizer_metadata(folder: Path, n_vocab: int | None) -> dict:
    """tokenizer.ggml.* (and tokenizer.chat_template) entries for the tokenizer files in `folder`,
    padded to the model's vocabulary size with `[PADn]` tokens like llama.cpp."""
    folder = Path(folder)
    if (folder / "tokenizer.model").is_file():
        meta = _sentencepiece(folder / "tokenizer.model", n_vocab)
        _added_tokens(folder, meta)
    elif (folder / "tokenizer.json").is_file():
        meta = _tokenizer_json(folder / "tokenizer.json")
    elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        meta = _gpt2_files(folder)
    else:
        raise ModelError(f"{folder}: no tokenizer (expected tokenizer.model, tokenizer.json, or vocab.json + merges.txt)")
    tokens = meta["tokenizer.ggml.tokens"]
    if n_vocab is not None and len(tokens) > n_vocab:
        raise ModelError(f"{folder}: the tokenizer has {len(tokens)} tokens, more than config.json vocab_size {n_vocab}")
    for i in range(len(tokens), n_vocab or 0):
        tokens.append(f"[PAD{i}]")
        meta["tokenizer.ggml.token_type"].append(UNUSED)
        if "tokenizer.ggml.scores" in meta:
            meta["tokenizer.ggml.scores"].append(-1000.0)
    meta.update(_special(folder, len(tokens)))
    _special_by_text(folder, meta)
    return meta


def _special_by_text(folder: Path, meta: dict) -> None:
    """Special ids SpecialVocab could not resolve (it maps names to ids through tokenizer.json or
    config.json): tokenizer_config.json's bos_token etc. looked up in the vocabulary itself."""
    cfg = _json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    index = None
    for kind, ggml in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        key = f"tokenizer.ggml.{ggml}_token_id"
        text = cfg.get(f"{kind}_token")
        text = text.get("content") if isinstance(text, dict) else text
        if key in meta or not isinstance(text, str):
            continue
        if index is None:
            index = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
        if text in index:
            meta[key] = index[text]
    if "add_bos_token" in cfg and "tokenizer.ggml.add_bos_token" not in meta:
        meta["tokenizer.ggml.add_bos_token"] = bool(cfg["add_bos_token"])


def _sentencepiece(path: Path, n_vocab: int | None) -> dict:
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise ModelError(f"{path}: reading a sentencepiece model needs the sentencepiece package") from None
    sp = SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(path))
    except Exception as e:
        raise ModelError(f"{path}: not a readable sentencepiece model ({e})") from None
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.IdToPiece(i))
        scores.append(float(sp.GetScore(i)))
        types.append(UNKNOWN if sp.IsUnknown(i) else CONTROL if sp.IsControl(i) else UNUSED if sp.IsUnused(i)
                     else BYTE if sp.IsByte(i) else NORMAL)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types}
    try:  # llama.cpp's add_space_prefix, from the model's normalizer spec
        from sentencepiece import sentencepiece_model_pb2 as pb
        m = pb.ModelProto()
        m.ParseFromString(path.read_bytes())
        meta["tokenizer.ggml.add_space_prefix"] = bool(m.normalizer_spec.add_dummy_prefix)
    except Exception:  # protobuf missing or an unusual model: llama.cpp's default (True) applies
        pass
    return meta


def _added_tokens(folder: Path, meta: dict) -> None:
    """added_tokens.json and tokenizer_config.json's added_tokens_decoder on top of a sentencepiece
    vocabulary (llama.cpp: special ones are CONTROL, the others USER_DEFINED)."""
    tokens, types, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"], meta["tokenizer.ggml.scores"]
    added: dict[int, tuple[str, bool]] = {}
    if (folder / "added_tokens.json").is_file():
        for text, idx in _json(folder / "added_tokens.json").items():
            added[int(idx)] = (text, False)
    cfg = _json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    for idx, data in (cfg.get("added_tokens_decoder") or {}).items():
        added[int(idx)] = (data["content"], bool(data.get("special")))
    for idx, (text, special) in sorted(added.items()):
        while len(tokens) <= idx:
            tokens.append(f"[PAD{len(tokens)}]")
            types.append(UNUSED)
            scores.append(-1000.0)
        tokens[idx], types[idx] = text, CONTROL if special else USER_DEFINED
        scores[idx] = -1000.0 if types[idx] != CONTROL or scores[idx] == 0.0 else scores[idx]


def _tokenizer_json(path: Path) -> dict:
    tj = _json(path)
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise ModelError(f"{path}: tokenizer model type {model.get('type')!r} is not supported (BPE only)")
    vocab: dict[str, int] = model.get("vocab") or {}
    added = tj.get("added_tokens") or []
    n = max([*vocab.values(), *(a["id"] for a in added)], default=-1) + 1
    tokens: list[str | None] = [None] * n
    for text, idx in vocab.items():
        tokens[idx] = text
    spm = bool(model.get("byte_fallback"))
    types = [BYTE if spm and t is not None and _BYTE_TOKEN.fullmatch(t) else NORMAL for t in tokens]
    for a in added:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = CONTROL if a.get("special") else USER_DEFINED
    if model.get("unk_token") in vocab:
        types[vocab[model["unk_token"]]] = UNKNOWN
    for i, t in enumerate(tokens):
        if t is None:
            tokens[i], types[i] = f"[PAD{i}]", UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    if spm:  # SentencePiece turned BPE (Llama 2, Gemma): llama.cpp's llama vocabulary, scores by rank
        meta.update({"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
                     "tokenizer.ggml.scores": [-float(i) if t == NORMAL else 0.0 for i, t in enumerate(types)],
                     "tokenizer.ggml.add_space_prefix": _prepends_space(tj)})
    else:
        meta.update({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": _pre_name(tj.get("pre_tokenizer"))})
    return meta


def _prepends_space(tj: dict) -> bool:
    text = json.dumps([tj.get("normalizer"), tj.get("pre_tokenizer")])
    return '"prepend_scheme": "always"' in text or '"prepend": "\\u2581"' in text or '"add_prefix_space": true' in text


def _pre_name(pre: dict | None) -> str:
    """llama.cpp's pre-tokenizer name for a byte-level tokenizer.json, from its split regex (the
    regexes transformers maps those names to), `gpt-2` for GPT-2's own, else `default`."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:  # older transformers (integrations.ggml): no table of split regexes
        GGUF_PRE_TOKENIZER_SPLITS = {}
    text = json.dumps(pre or {})
    preferred = ["llama-bpe", "qwen2", "tekken", "gpt-4o", "qwen35"]
    for name in [n for n in preferred if n in GGUF_PRE_TOKENIZER_SPLITS] + sorted(GGUF_PRE_TOKENIZER_SPLITS):
        if json.dumps(GGUF_PRE_TOKENIZER_SPLITS[name])[1:-1] in text:
            return name
    if '"type": "ByteLevel"' in text and '"use_regex": true' in text:
        return "gpt-2"
    return "default"


def _gpt2_files(folder: Path) -> dict:
    vocab = _json(folder / "vocab.json")
    added = _json(folder / "added_tokens.json") if (folder / "added_tokens.json").is_file() else {}
    n = max([*vocab.values(), *added.values()], default=-1) + 1
    tokens, types = [f"[PAD{i}]" for i in range(n)], [UNUSED] * n
    for text, idx in vocab.items():
        tokens[idx], types[idx] = text, NORMAL
    for text, idx in added.items():
        tokens[idx], types[idx] = text, CONTROL
    merges = [line for line in (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
              if line and not line.startswith("#version")]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}


def _special(folder: Path, n_vocab: int) -> dict:
    logging.getLogger("gguf.vocab").setLevel(logging.ERROR)
    sv = gguf.SpecialVocab(folder, load_merges=False, n_vocab=n_vocab)
    names = {"unk": "unknown", "sep": "seperator", "pad": "padding"}  # llama.cpp's key names (sic)
    meta = {f"tokenizer.ggml.{names.get(kind, kind)}_token_id": int(idx) for kind, idx in sv.special_token_ids.items()}
    meta.update({f"tokenizer.ggml.add_{kind}_token": bool(v) for kind, v in sv.add_special_token.items()})
    template = sv.chat_template
    if isinstance(template, list):  # named templates: llama.cpp's default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template:
        meta["tokenizer.chat_template"] = template
    return meta


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: not readable JSON ({e})") from None
