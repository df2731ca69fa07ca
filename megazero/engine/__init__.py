"""What one rank trains with: ``build_engine`` assembles the model chunks, ZeRO, the pipeline executor,
the schedules and the loss scaler; ``step`` runs one optimizer step over them."""
