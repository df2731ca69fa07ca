"""Planning a run before it runs: the per-stage memory plan, fits, the plan table, the step-time model,
the layout search and its CLI (``python -m megazero.plan``), cluster files, ``--simulate`` and its
memory tracker."""
