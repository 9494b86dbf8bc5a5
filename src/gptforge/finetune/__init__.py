"""Fine-tuning recipes that start from a pretrained GPT: `classify` (a class head, Raschka's
LLMs-from-scratch ch. 6) and `instruct` (Alpaca-style instruction following, ch. 7).
`common` holds what both share: runtime, base-model loading, LoRA and the epoch loop."""
