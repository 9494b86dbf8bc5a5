"""Training: the pretraining loop and recipe (`loop`), the token-shard loader, checkpoints with
exact resume, the AdamW builder, HellaSwag inside the loop, and the torchrun launcher."""
