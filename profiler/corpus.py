"""Calibration text: the user's local files through HF `datasets` (a text file, a folder, jsonl or
parquet), or a default corpus that exists on every machine without a network: the docstrings of
Python's standard library, read with `ast` from its sources (nothing is imported). Every document
goes to calibration or to the held-out evaluation part by a hash of its name, so the two never mix.
"""

from __future__ import annotations

import ast
import sysconfig
import zlib
from pathlib import Path

from hybridsparse.runtime.errors import InputError

EVAL_SHARE = 10  # one document in ten is held out


def is_heldout(name: str) -> bool:
    return zlib.crc32(name.encode()) % EVAL_SHARE == 0


def stdlib_documents() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("test/", "site-packages/", "idlelib/idle_test", "lib2to3/tests")) or "/tests/" in rel:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        parts = [ast.get_docstring(node) for node in ast.walk(tree)
                 if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        text = "\n\n".join(p for p in parts if p and len(p) > 40)
        if text:
            docs.append((rel, text))
    return docs


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".md", ".jsonl", ".json", ".parquet"))
        if not found:
            raise InputError(f"{path}: no .txt, .md, .jsonl or .parquet files in this folder")
        return found
    if not path.exists():
        raise InputError(f"{path}: no such corpus file or folder")
    return [path]


def load_documents(corpus: str | None, text_field: str = "text") -> list[tuple[str, str]]:
    """(name, text) pairs; text files are split into documents of 20 lines, jsonl/parquet into rows
    (read with `datasets`)."""
    if corpus is None:
        return stdlib_documents()
    docs = []
    for f in _files(Path(corpus)):
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(f.suffix, "text")
        if kind == "text":  # plain text needs no `datasets` (nor its import time): one row per line
            try:
                rows = f.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise InputError(f"{f}: cannot read as UTF-8 text ({type(e).__name__}: {e})") from None
            docs.extend((f"{f.name}:{i}", "\n".join(rows[i:i + 20])) for i in range(0, len(rows), 20))
            continue
        import datasets
        datasets.disable_progress_bars()
        try:
            ds = datasets.load_dataset(kind, data_files=str(f), split="train")
        except Exception as e:  # unreadable / malformed file
            raise InputError(f"{f}: cannot read as {kind} ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
        if text_field not in ds.column_names:
            raise InputError(f"{f}: no field {text_field!r} (fields: {ds.column_names})")
        rows = ds[text_field]
        docs.extend((f"{f.name}:{i}", t) for i, t in enumerate(rows) if isinstance(t, str) and t.strip())
    return docs


def split(docs: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(calibration texts, held-out texts)."""
    calib = [t for n, t in docs if not is_heldout(n)]
    held = [t for n, t in docs if is_heldout(n)]
    return calib, held
