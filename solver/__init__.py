"""hybridsparse.solver: a pipeline stage (see README)."""
