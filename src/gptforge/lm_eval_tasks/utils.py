"""Functions the shipped task yaml files name with `!function`.

HellaSwag's document processing is lm-eval's own function, imported rather than copied, so the
local task builds the very queries lm-eval's `hellaswag` builds: `activity_label: ctx_a
Ctx_b`, then strip, " [title]" -> ". ", `[...]` tags removed, double spaces collapsed; the
endings get the same clean-up.
"""

from lm_eval.tasks.hellaswag.utils import preprocess, process_docs  # noqa: F401
