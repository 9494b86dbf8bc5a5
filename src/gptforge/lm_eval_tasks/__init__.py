"""lm-eval task configs that read local copies of HellaSwag and MMLU (package data).

The yaml files here are templates: `gptforge.evaluate` validates the local data, writes a
normalised copy of it and, beside it, one task yaml per task made of a template plus the
absolute data paths (`dataset_kwargs`), then loads that folder with
`TaskManager(include_path=..., include_defaults=False)`. The templates hold lm-eval's own
prompts and metrics (lm_eval/tasks/hellaswag/hellaswag.yaml, lm_eval/tasks/mmlu/default/), so a
local run scores exactly what `hellaswag` / `mmlu` score on the hub data.
"""
