"""A run end to end: the entry point (run), the training loop (trainer), evaluation, checkpoint state, the
data on every rank and the step's seeds (rank_data), the pipeline trace, the memory record, signals,
non-finite handling, the run directory and the metrics logger."""
