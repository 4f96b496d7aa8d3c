"""Activation profiles on disk, PowerInfer's layout plus a metadata file of our own:

  DIR/activation/activation_N.pt   torch 1-D tensor of per-neuron activation counts of layer N
  DIR/profile.json                 tokens counted, criterion, per-layer thresholds, model fingerprint

Layers are ordered by their number (PowerInfer's solver sorted the names as text: layer 10 before 2).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridsparse.runtime.errors import InputError

_NAME = re.compile(r"^activation_(\d+)\.pt$")


@dataclass
class Profile:
    counts: list[torch.Tensor]  # per layer, float64 [n_ff]
    tokens: int | None  # tokens counted (None: a PowerInfer directory without our metadata)
    meta: dict = field(default_factory=dict)

    def frequencies(self) -> list[torch.Tensor]:
        """P(neuron active) per token; without a token count, counts over the largest count."""
        denom = self.tokens or max(float(c.max()) for c in self.counts) or 1.0
        return [(c / denom).clamp(0, 1) for c in self.counts]


def activation_dir(root: Path) -> Path:
    return root / "activation" if (root / "activation").is_dir() else root


def save_profile(root: str | Path, counts: list[torch.Tensor], tokens: int, meta: dict) -> Path:
    root = Path(root)
    adir = root / "activation"
    adir.mkdir(parents=True, exist_ok=True)
    for i, c in enumerate(counts):
        tmp = adir / f"activation_{i}.pt.part"
        torch.save(c.detach().cpu(), tmp)
        tmp.replace(adir / f"activation_{i}.pt")
    (root / "profile.json.part").write_text(json.dumps({**meta, "tokens": tokens, "layers": len(counts)}, indent=2))
    (root / "profile.json.part").replace(root / "profile.json")
    return root


def load_profile(root: str | Path) -> Profile:
    root = Path(root)
    adir = activation_dir(root)
    if not adir.is_dir():
        raise InputError(f"{root}: no activation profile here (expected {root}/activation/activation_N.pt; "
                         f"run `hs-profile` / `make profile MODEL=...` first)")
    found = {}
    for p in adir.iterdir():
        m = _NAME.match(p.name)
        if m:
            found[int(m.group(1))] = p
    if not found:
        raise InputError(f"{adir}: no activation_N.pt files (run `hs-profile` first)")
    layers = sorted(found)
    if layers != list(range(len(layers))):
        missing = sorted(set(range(max(layers) + 1)) - set(layers))
        raise InputError(f"{adir}: activation files of layers {missing} are missing")
    counts = []
    for i in layers:
        try:
            c = torch.load(found[i], map_location="cpu", weights_only=True)
        except Exception as e:  # truncated / not a torch file
            raise InputError(f"{found[i]}: not a readable torch tensor file ({type(e).__name__})") from None
        if not isinstance(c, torch.Tensor) or c.dim() != 1 or not c.numel():
            raise InputError(f"{found[i]}: expected a 1-D tensor of per-neuron counts")
        if not torch.isfinite(c.double()).all() or (c < 0).any():
            raise InputError(f"{found[i]}: counts must be finite and >= 0")
        counts.append(c.double())
    meta, tokens = {}, None
    if (root / "profile.json").is_file():
        try:
            meta = json.loads((root / "profile.json").read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"{root / 'profile.json'}: not valid JSON ({e.msg} at line {e.lineno})") from None
        tokens = meta.get("tokens")
        if not isinstance(tokens, int) or tokens <= 0:
            raise InputError(f"{root / 'profile.json'}: field tokens must be a positive integer")
    return Profile(counts, tokens, meta)


def profile_hash(profile: Profile) -> str:
    """Of the counts (what a placement depends on), whatever the files' other bytes."""
    h = hashlib.sha256()
    for c in profile.counts:
        h.update(c.double().numpy().tobytes())
    return h.hexdigest()[:16]
