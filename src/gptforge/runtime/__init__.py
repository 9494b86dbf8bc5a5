"""What every stage runs on: MLflow tracking and its outbox, how a recipe runs its steps, clean
stops on signals, one-run-at-a-time locks, child processes' output, pausing at a step, and the
allocator settings. No stage logic and no Prefect here."""
