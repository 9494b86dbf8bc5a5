"""What `gptforge serve` holds per model: a language model behind its engine (`ServedLM`) or
a spam classifier (`ServedClassifier`), built from a resolved `serve.sources.ModelSource`.

A served language model knows how to turn an OpenAI request into token ids and ids back into
text: a gptforge GPT with the project's tokenizer (`tokenizer.path`) and, for chat, the
pipeline's instruction template (`instruct.template`: alpaca or phi3); a Hugging Face causal
LM with its own tokenizer and chat template (without one, such as the registry's copy of a
gptforge model, the instruction template as for gptforge models).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from gptforge.errors import BadInput
from gptforge.serve.engine import Engine


class RequestError(ValueError):
    """A request this model cannot take (the API answers 400 with `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class ServedLM:
    name: str
    kind: str  # "gptforge" or "hf"
    engine: Engine
    context: int
    tokenizer: Any
    stop_ids: set[int]
    template: str = "alpaca"  # the instruct template of chat requests to a model without a chat template
    created: int = 0

    def encode(self, text: str) -> list[int]:
        if self.kind == "gptforge":
            return self.tokenizer.encode_ordinary(text)
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        if self.kind == "gptforge":
            return self.tokenizer.decode(list(ids))
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat_ids(self, messages: list[Mapping[str, str]]) -> list[int]:
        """The prompt of a chat: the tokenizer's chat template with the generation prompt (Hugging
        Face models), or the instruct template around the conversation (gptforge models)."""
        if self.kind == "hf" and getattr(self.tokenizer, "chat_template", None):
            enc = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
            return list(enc if isinstance(enc, list) else enc["input_ids"])
        # A gptforge model, or a Hugging Face folder without a chat template (the registry's copy
        # of a gptforge checkpoint, a base model tuned with instruct.template alpaca or phi3).
        return self.encode(render_conversation(messages, self.template))


def render_conversation(messages: list[Mapping[str, str]], template: str) -> str:
    """A conversation in an instruction template made for single turns: each user turn is an
    instruction, each assistant turn the response after it, turns joined by a blank line; a
    system message goes before the first instruction, as part of it. Ends with the last user
    turn's prompt, where the model writes."""
    from gptforge.finetune.templates import render

    system = "\n\n".join(m["content"] for m in messages if m["role"] in ("system", "developer"))
    parts, first = [], True
    for m in messages:
        if m["role"] == "user":
            instruction = f"{system}\n\n{m['content']}" if first and system else m["content"]
            parts.append(render({"instruction": instruction, "input": "", "output": ""}, template)[0])
            first = False
        elif m["role"] == "assistant":
            parts.append(m["content"] + "\n\n")
    if not parts or messages[-1]["role"] != "user":
        raise RequestError("messages must end with a user message", "messages")
    return "".join(parts)


@dataclass
class ServedClassifier:
    name: str
    classifier: Any
    enc: Any
    device: torch.device
    created: int = 0

    @property
    def context(self) -> int:
        return int(self.classifier.max_length)

    def classify(self, texts: list[str]) -> list[dict]:
        from gptforge.finetune.classifier import class_probabilities

        probs = class_probabilities(self.classifier, texts, self.enc, self.device)
        labels = list(self.classifier.labels)
        out = []
        for i, row in enumerate(probs.tolist()):
            best = max(range(len(row)), key=row.__getitem__)
            out.append(
                {"index": i, "label": labels[best], "probability": row[best], "probabilities": dict(zip(labels, row))}
            )
        return out


def load_served(
    source,
    cfg,
    *,
    max_batch: int,
    max_queue: int,
    device: torch.device,
    observe=None,
    prefill_chunk: int | None = None,
    prefix_cache_mb: float = 256.0,
    engine_process: bool = True,
    dtype: str = "auto",
    quantize: str | None = None,
    speculate: int = 0,
) -> ServedLM | ServedClassifier:
    """Load one resolved model (`serve.sources.ModelSource`) for serving: a language model's
    engine in a process of its own (`serve.engine_process`; `engine_process=False`: in a thread
    of this one), its tokenizer here. `dtype`: a Hugging Face model's (hf_causal.inference_dtype);
    `quantize` ("int8", "int4"): its decode step's linears (a Llama-family Hugging Face model only);
    `speculate` K: a lone greedy request drafts up to K tokens by prompt lookup (Llama-family)."""
    import time

    from gptforge.finetune.templates import prompt_template
    from gptforge.serve.engine_process import EngineSpec
    from gptforge.serve.scheduler import DEFAULT_PREFILL_CHUNK

    created = int(time.time())
    template = prompt_template(cfg.instruct.template)
    if source.kind == "classifier":
        from gptforge.finetune.classifier import load_classifier
        from gptforge.modeling.tokenizer import load_tokenizer

        classifier = load_classifier(source.path, map_location=device)
        tokenizer = classifier.tokenizer
        enc = (
            tokenizer
            if tokenizer is not None
            else load_tokenizer(str(source.tokenizer) if source.tokenizer else cfg.tokenizer.path)
        )
        return ServedClassifier(source.name, classifier, enc, device, created)
    spec = EngineSpec(
        "gptforge" if source.kind == "gptforge" else "hf",
        str(source.path),
        str(device),
        max_batch,
        prefill_chunk or DEFAULT_PREFILL_CHUNK,
        prefix_cache_mb,
        source.name,
        dtype,
        quantize,
        speculate,
    )
    ready = _start_engine(spec, engine_process)
    try:
        if source.kind == "gptforge":
            from gptforge.modeling.tokenizer import load_tokenizer

            tok = load_tokenizer(str(source.tokenizer) if source.tokenizer else cfg.tokenizer.path)
        else:
            from transformers import AutoTokenizer

            where = str(source.tokenizer or source.path)
            try:
                tok = AutoTokenizer.from_pretrained(where, local_files_only=True)
            except Exception as e:  # noqa: BLE001 - the engine's own error says more when it has one
                core = ready()
                raise BadInput(f"{source.spec}: {where} has no usable tokenizer ({type(e).__name__})") from None
        core = ready()
    except BaseException:
        _abandon(ready)
        raise
    info = core.info
    if source.kind == "gptforge":
        if info.n_vocab != tok.n_vocab:
            core.kill()
            raise BadInput(
                f"{source.spec}: a vocabulary of {info.n_vocab}, the tokenizer "
                f"{tok.n_vocab}: set tokenizer.path to the tokenizer it was trained with"
            )
        served = ServedLM(source.name, "gptforge", None, core.context, tok, {tok.eot_token}, template, created)
    else:
        from gptforge.modeling.hf_causal import stop_ids

        ids = set(info.stop_ids) | set(stop_ids(tok))
        served = ServedLM(source.name, "hf", None, core.context, tok, ids, template, created)
    served.engine = Engine(core, served.decode, max_queue=max_queue, observe=observe)
    return served


def _start_engine(spec, engine_process: bool):
    """A function that gives the engine's core once it is ready (loading runs meanwhile in the
    engine process, or runs in this one when the function is called)."""
    if engine_process:
        from gptforge.serve.engine_process import start_engine_process

        return start_engine_process(spec)
    from gptforge.serve.engine_core import ThreadCore
    from gptforge.serve.engine_process import build_scheduler

    def ready():
        scheduler, info = build_scheduler(spec)
        return ThreadCore(scheduler, info)

    return ready


def _abandon(ready) -> None:
    """Loading failed on this side: the engine process (if one started) is stopped."""
    abandon = getattr(ready, "abandon", None)
    if abandon is not None:
        abandon()
