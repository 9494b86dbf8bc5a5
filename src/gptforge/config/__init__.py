"""The configuration: its schema (`schema`) and how `params.yaml` plus overrides load into it (`load`)."""
