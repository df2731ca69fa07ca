"""The run's one source of truth: the schema (dataclasses), loading YAML and --set values, the pure rules,
and the resolution that fixes every derived value once per run."""
