"""hybridsparse.profiler: a pipeline stage (see README)."""
