"""Prompt templates and batching for instruction fine-tuning.

An example is an Alpaca record (`instruction`, `input`, `output`). `render` turns it into a
prompt (what the model is given) and a response (what it should write); `encode` makes token
ids of both, the response ending in the tokenizer's `<|endoftext|>` id; `collate` pads a batch
into next-token inputs and targets.

Templates:

- `alpaca`: Stanford Alpaca's two prompts, character for character (tatsu-lab/stanford_alpaca,
  `PROMPT_DICT` in train.py): one for records with an input, one for records without.
- `phi3`: Microsoft Phi-3's chat turn (the `chat_template` of microsoft/Phi-3-*-instruct's
  tokenizer_config.json: `<|user|>\\n{content}<|end|>\\n<|assistant|>\\n`), with the user's
  content = the instruction, then a blank line and the input when there is one:

      <|user|>\\n{instruction}\\n\\n{input}<|end|>\\n<|assistant|>\\n     (with input)
      <|user|>\\n{instruction}<|end|>\\n<|assistant|>\\n                  (without)

  We keep Phi-3's own turn markers rather than LLMs-from-scratch ch. 7's variant
  (`<|user|>\\n{instruction}\\n{input}` ... `<|assistant|>:`), so a model tuned here is prompted
  the way Phi-3 users already write prompts. GPT-2's vocabulary has no such special tokens:
  the markers are ordinary text to it (a few BPE pieces each). The response ends with GPT-2's
  `<|endoftext|>` (not Phi-3's `<|end|>`) because that is the id generation stops on.

The end-of-text id is appended as an id, never encoded from text, and every text field is
encoded with special tokens disabled: a record that happens to contain the string
"<|endoftext|>" cannot end a sequence early (it becomes plain BPE pieces).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from gptforge.errors import BadInput

TEMPLATES = ("alpaca", "phi3")
IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
PHI3 = "<|user|>\n{content}<|end|>\n<|assistant|>\n"

Example = tuple[list[int], list[int]]  # (prompt_ids, response_ids), the response ending in eot


def render(example: Mapping[str, str], template: str) -> tuple[str, str]:
    """(prompt_text, response_text). The response text is the output alone: the end-of-text
    token is added by `encode` as an id."""
    instruction, inp, output = example["instruction"], example.get("input") or "", example["output"]
    if template == "alpaca":
        prompt = (ALPACA_WITH_INPUT.format(instruction=instruction, input=inp) if inp
                  else ALPACA_NO_INPUT.format(instruction=instruction))
    elif template == "phi3":
        prompt = PHI3.format(content=f"{instruction}\n\n{inp}" if inp else instruction)
    else:
        raise BadInput(f"instruct.template: unknown template {template!r}; choose one of {', '.join(TEMPLATES)}")
    return prompt, output


def encode(example: Mapping[str, str], template: str, enc) -> Example:
    """(prompt_ids, response_ids) with response_ids = output tokens + [eot]."""
    prompt, response = render(example, template)
    # disallowed_special=(): special-token strings inside the data are text, not control ids.
    return (enc.encode(prompt, disallowed_special=()),
            enc.encode(response, disallowed_special=()) + [enc.eot_token])


def encode_all(records: Sequence[Mapping[str, str]], template: str, enc,
               max_length: int) -> tuple[list[Example], list[int]]:
    """Encode every record; drop those whose prompt alone fills `max_length` tokens.

    Returns (examples, kept) where `kept` holds the record index of each example, so callers
    can pair responses with their records. A prompt of max_length tokens or more leaves no
    position inside the window to learn or generate even the first response token from.
    """
    examples, kept = [], []
    for i, record in enumerate(records):
        prompt_ids, response_ids = encode(record, template, enc)
        if len(prompt_ids) >= max_length:
            continue
        examples.append((prompt_ids, response_ids))
        kept.append(i)
    return examples, kept


def collate(batch: Sequence[Example], *, pad_id: int, max_length: int, mask_prompt: bool,
            ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad a batch into (inputs, targets), both (B, L) int64.

    For each row, seq = prompt + response (which ends in eot); inputs = seq[:-1] and
    targets = seq[1:], so targets[i] is the token after inputs[i]. Rows are right-padded with
    `pad_id` to the longest row, and padded target positions are `ignore_index`. The row's
    final real target is its eot, so every row learns to stop: this is LLMs-from-scratch
    ch. 7's collate exactly (there the text has no eot, the first padding token plays its part
    and is kept as a target while the later padding is ignored), but we mask by position, not
    by value, so an eot id inside the text would never be masked by accident.

    `mask_prompt`: targets that predict prompt tokens (i < len(prompt) - 1) are ignored too; the
    loss then covers only the response (and its eot). Rows are cut to `max_length` positions
    after all this (a long response loses its tail, eot included), so L = min(longest, max_length).
    """
    if not batch:
        raise ValueError("collate needs at least one example")
    width = min(max(len(p) + len(r) - 1 for p, r in batch), max_length)
    inputs = torch.full((len(batch), width), pad_id, dtype=torch.long)
    targets = torch.full((len(batch), width), ignore_index, dtype=torch.long)
    for row, (prompt, response) in enumerate(batch):
        seq = list(prompt) + list(response)
        x, y = seq[:-1][:width], seq[1:][:width]
        inputs[row, :len(x)] = torch.tensor(x, dtype=torch.long)
        targets[row, :len(y)] = torch.tensor(y, dtype=torch.long)
        if mask_prompt:
            targets[row, :max(0, len(prompt) - 1)] = ignore_index
    return inputs, targets
