"""A run end to end: the entry point, the training loop, evaluation, checkpoint state, signals,
non-finite handling, the run directory and the metrics logger."""
