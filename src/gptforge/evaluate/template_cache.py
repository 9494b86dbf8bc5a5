"""A faster `lm_eval.utils.apply_template`: each Jinja template compiled once, not once a document.

lm-eval renders every prompt, target and choice list through `lm_eval.utils.apply_template`,
which calls `env.from_string(template)` each time: Jinja parses and compiles the template again
for every document. On the quickstart's evaluation (1,240 examples a model, 11k renders) that
compiling was 4.2 s of each model's 12 s on 2 cores (cProfile, 2026-11-27). `install()` swaps in
`apply_template` below, which keeps the compiled templates of lm-eval's own environment in an LRU
cache keyed by the template's text and renders them as lm-eval does: the same string out
(tests/test_evaluate.py compares it with lm-eval's own on the shipped tasks' templates).
lm-eval's tasks look the function up in `lm_eval.utils` at each call, so the swap reaches them.
"""

from __future__ import annotations

import functools

_ORIGINAL = None


@functools.lru_cache(maxsize=512)
def _compiled(template: str):
    from lm_eval import utils

    return utils.env.from_string(template)


def apply_template(template: str, doc: dict) -> str:
    return _compiled(template).render(**doc)


def install() -> None:
    """Make lm-eval render through the cache (idempotent)."""
    global _ORIGINAL
    from lm_eval import utils

    if utils.apply_template is not apply_template:
        _ORIGINAL = utils.apply_template
        utils.apply_template = apply_template


def original():
    """lm-eval's own apply_template (for comparisons)."""
    from lm_eval import utils

    return _ORIGINAL or utils.apply_template
