"""hybridsparse.predictor_training: a pipeline stage (see README)."""
