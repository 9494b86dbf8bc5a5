"""Running stages: the stage table (each DVC stage's recipe and params, one MLflow run per stage
run) and `gptforge pipeline` (`dvc repro` recorded as one run with the stages nested under it)."""
