"""Architectures, found by `general.architecture` in a registry (never by file name)."""

from __future__ import annotations

from ..errors import ModelError
from ..gguf_file import GGUFFile
from .base import CausalLM

REGISTRY: dict[str, type[CausalLM]] = {}


def register(*names: str):
    def wrap(cls):
        for name in names:
            REGISTRY[name] = cls
        return cls
    return wrap


def load_model(gguf: GGUFFile) -> CausalLM:
    arch = gguf.architecture
    cls = REGISTRY.get(arch)
    if cls is None:
        raise ModelError(f"{gguf.path}: unknown architecture {arch!r} "
                         f"(supported: {', '.join(sorted(REGISTRY))})")
    return cls(gguf, cls.Config.from_gguf(gguf))


from . import falcon, gemma3, llama, opt  # noqa: E402,F401  (register the architectures)
