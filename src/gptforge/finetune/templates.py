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

- `chat`: the tokenizer's own chat template (`apply_chat_template`, Hugging Face models: Qwen's
  ChatML, Llama 3's headers, ...), the record as one user turn (content as for phi3) and the
  output as the assistant's turn. The prompt is the conversation up to the generation prompt,
  the response the rest of the rendered conversation: the answer and the template's own end of
  turn (`<|im_end|>`, `<|eot_id|>`), which is an id generation stops on, so nothing is appended.
  The template's text is encoded as the model's tokenizer encodes a chat (its markers become
  their special ids); a record that itself contains such a marker is rendered into the chat as
  the template does it, which is what every trainer built on `apply_chat_template` does.

For alpaca and phi3, the end-of-text id is appended as an id, never encoded from text, and every text field is
encoded with special tokens disabled: a record that happens to contain the string
"<|endoftext|>" cannot end a sequence early (it becomes plain BPE pieces).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from gptforge.errors import BadInput

TEMPLATES = ("alpaca", "phi3", "chat")
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


def prompt_template(configured: str) -> str:
    """The instruction template that prompts a model without a chat template of its own (serve,
    the GGUF Modelfile): `instruct.template` when it is alpaca or phi3, alpaca otherwise."""
    return configured if configured in ("alpaca", "phi3") else "alpaca"


# The stops of the instruction templates in a Modelfile: the next turn's marker (a model tuned on
# one turn may go on to write the next); the tokenizer's end of text is added to them.
OLLAMA_STOPS = {"alpaca": ("### Instruction:",), "phi3": ("<|end|>", "<|user|>")}


def ollama_template(template: str) -> tuple[str, tuple[str, ...]]:
    """The instruction template (alpaca or phi3) as an Ollama Modelfile's TEMPLATE, with the
    user's message as `{{ .Prompt }}` (the strings `render` fills, so Ollama prompts as training
    did), and its stops."""
    if template not in OLLAMA_STOPS:
        raise BadInput(f"instruct.template {template!r}: a GGUF Modelfile takes alpaca or phi3")
    prompt = (
        PHI3.format(content="{{ .Prompt }}")
        if template == "phi3"
        else ALPACA_NO_INPUT.format(instruction="{{ .Prompt }}")
    )
    return prompt + "{{ .Response }}", OLLAMA_STOPS[template]


def render(example: Mapping[str, str], template: str) -> tuple[str, str]:
    """(prompt_text, response_text). The response text is the output alone: the end-of-text
    token is added by `encode` as an id."""
    instruction, inp, output = example["instruction"], example.get("input") or "", example["output"]
    if template == "alpaca":
        prompt = (
            ALPACA_WITH_INPUT.format(instruction=instruction, input=inp)
            if inp
            else ALPACA_NO_INPUT.format(instruction=instruction)
        )
    elif template == "phi3":
        prompt = PHI3.format(content=user_content(example))
    else:
        raise BadInput(f"instruct.template: unknown template {template!r}; choose one of {', '.join(TEMPLATES)}")
    return prompt, output


def user_content(example: Mapping[str, str]) -> str:
    """The user's turn of a chat template: the instruction, then a blank line and the input when
    there is one (phi3's content too)."""
    instruction, inp = example["instruction"], example.get("input") or ""
    return f"{instruction}\n\n{inp}" if inp else instruction


def chat_template_tokenizer(enc):
    """The transformers tokenizer behind `enc` when it has a chat template; BadInput otherwise
    (a gptforge model's tiktoken tokenizer, or a Hugging Face tokenizer without one)."""
    tokenizer = getattr(enc, "tokenizer", None)
    if tokenizer is None:
        raise BadInput(
            "instruct.template: chat uses the model's own chat template; gptforge's GPT models have "
            "none (their tokenizer is tiktoken's): use alpaca or phi3"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise BadInput(
            f"instruct.template: chat: the tokenizer of {tokenizer.name_or_path} has no chat template "
            "(a base model's often has none): use alpaca or phi3, or start from an instruct model"
        )
    return tokenizer


def encode_chat(example: Mapping[str, str], enc) -> Example:
    """(prompt_ids, response_ids) of a record rendered with the tokenizer's chat template."""
    tokenizer = chat_template_tokenizer(enc)
    user = [{"role": "user", "content": user_content(example)}]
    conversation = user + [{"role": "assistant", "content": example["output"]}]
    prompt = _ids(tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True))
    full = _ids(tokenizer.apply_chat_template(conversation, tokenize=True))
    if full[: len(prompt)] != prompt:
        raise BadInput(
            f"instruct.template: chat: the chat template of {tokenizer.name_or_path} does not render a "
            "conversation as its generation prompt followed by the answer; use alpaca or phi3"
        )
    return prompt, full[len(prompt) :]


def _ids(rendered) -> list[int]:
    """Token ids from apply_chat_template(tokenize=True): a list in transformers 4, a
    BatchEncoding in 5."""
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    return [int(i) for i in ids]


def encode(example: Mapping[str, str], template: str, enc) -> Example:
    """(prompt_ids, response_ids) with response_ids = output tokens + [eot] (chat: the rest of
    the rendered conversation, see `encode_chat`)."""
    if template == "chat":
        return encode_chat(example, enc)
    prompt, response = render(example, template)
    # disallowed_special=(): special-token strings inside the data are text, not control ids.
    return (enc.encode(prompt, disallowed_special=()), enc.encode(response, disallowed_special=()) + [enc.eot_token])


def encode_all(
    records: Sequence[Mapping[str, str]], template: str, enc, max_length: int
) -> tuple[list[Example], list[int]]:
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


def collate(
    batch: Sequence[Example], *, pad_id: int, max_length: int, mask_prompt: bool, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
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
        inputs[row, : len(x)] = torch.tensor(x, dtype=torch.long)
        targets[row, : len(y)] = torch.tensor(y, dtype=torch.long)
        if mask_prompt:
            targets[row, : max(0, len(prompt) - 1)] = ignore_index
    return inputs, targets
