"""hybridsparse.runtime: GGUF loading, the architectures, tokenization, generation and the CLI."""
