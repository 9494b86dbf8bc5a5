"""The RL stage's prompts: the instruction records of one split in the SFT stage's template, as
token ids (what trl is given) and as text (its key to them), with the prompts that leave no room
for an answer skipped and counted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from gptforge.finetune.templates import chat_template_tokenizer, encode, render, user_content

FIELDS = ("instruction", "input", "output")


# ---------------------------------------------------------------------------------------------
# Prompts


@dataclass
class Prompts:
    """The prompts of one split that fit: their records, template ids and text."""

    records: list[dict]
    ids: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)  # record index of each
    skipped_too_long: int = 0  # prompt + max_completion_length above max_length

    def head(self, n: int | None) -> "Prompts":
        """The first `n` kept prompts (all for None), as a Prompts of their own."""
        if n is None or n >= len(self.ids):
            return self
        return Prompts(self.records, self.ids[:n], self.texts[:n], self.kept[:n], self.skipped_too_long)

    def rows(self, n: int | None = None) -> list[dict]:
        """trl's dataset rows: the prompt's text (a key to its ids) and the record's fields,
        which trl hands to the reward functions."""
        return [
            {"prompt": text, **{k: self.records[i][k] for k in FIELDS}}
            for text, i in list(zip(self.texts, self.kept))[:n]
        ]


def prompt_text(record: Mapping[str, str], template: str, enc) -> str:
    """The prompt as text: the template's (alpaca, phi3), or the chat template's rendering."""
    if template == "chat":
        conversation = [{"role": "user", "content": user_content(record)}]
        return chat_template_tokenizer(enc).apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
    return render({**record, "output": ""}, template)[0]


def encode_prompts(records: list[dict], template: str, enc, max_prompt: int) -> Prompts:
    out = Prompts(records)
    for i, rec in enumerate(records):
        ids, _ = encode(rec, template, enc)
        if len(ids) > max_prompt:
            out.skipped_too_long += 1
            continue
        out.ids.append(ids)
        out.texts.append(prompt_text(rec, template, enc))
        out.kept.append(i)
    return out
