"""Errors that reach the user as one line: each names the file, tensor or field at fault."""


class HybridSparseError(Exception):
    """Base for errors the command-line tools print as one line (no traceback without --verbose)."""


class GGUFError(HybridSparseError):
    """A GGUF file is malformed, truncated, or not what the runtime expects."""


class ModelError(HybridSparseError):
    """A model file is well-formed but cannot be run: unknown architecture, missing tensor, bad shape."""


class InputError(HybridSparseError):
    """A request cannot be served as given: prompt longer than the context, bad flag value."""
