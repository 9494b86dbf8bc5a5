"""Our model as an lm-eval `LM`: `GptforgeLM`, registered with lm-eval as model "gptforge".

It wraps a loaded `gptforge.modeling.gpt.GPT` (a gptforge checkpoint, or a Hugging Face GPT-2 folder
converted on load) and its tiktoken tokenizer, and answers lm-eval's loglikelihood,
loglikelihood_rolling and generate_until requests. Every other Hugging Face causal LM (Llama,
Qwen2, ...: a transformers model with its own tokenizer, for which none of the reasons below
holds) is scored by lm-eval's own `HFLM`; `measured` adds to it the throughput figures
`GptforgeLM` keeps. It may import torch, lm-eval's model API, `gptforge.errors` and the model
code; nothing from the other `gptforge.evaluate` modules.

Why a registered `LM` subclass rather than exporting to a Hugging Face folder and using
lm-eval's `hf` model:
- no export step and no second copy of the weights: the checkpoint folder is read with
  `load_model` and scored by the same `GPT` code that trained it (padded vocabulary, -inf
  columns and all), so what is evaluated is what was trained;
- our tokenizer is tiktoken (`tokenizer.path`, possibly a small test BPE); `hf` needs a
  transformers tokenizer, which for a non-GPT-2 vocabulary would have to be built and kept in
  step by hand;
- our models have short windows (block_size 64 by default, 1024 for GPT-2 sizes). A context
  longer than the window is left-truncated here, to the last tokens the model has positions
  for, with the continuation kept whole, which is the scoring we want and can test directly;
- requests that share their model input (MMLU's four answer letters after one prompt) are run
  once, and only the continuation positions go through the output head, which is most of the
  CPU time for a 50257-token vocabulary.
The tokenization of (context, continuation) pairs is lm-eval's own (`TemplateLM`: encode the
whole string, split at the context's length, trailing context spaces moved into the
continuation), the same as for the `hf` model, so task scores are comparable with published
lm-eval figures.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from gptforge.errors import BadInput

log = logging.getLogger("gptforge")


@register_model("gptforge")
class GptforgeLM(TemplateLM):
    """A `gptforge.modeling.gpt.GPT` and its tiktoken tokenizer behind lm-eval's LM interface.

    loglikelihood: lm-eval tokenizes (context, continuation); each pair becomes one input of at
    most block_size tokens, (context + continuation)[-(block_size + 1):-1], whose last
    len(continuation) positions predict the continuation. A long context thus loses tokens on
    the left; a continuation longer than block_size (never the case in HellaSwag or MMLU at
    GPT-2's 1024) keeps its last block_size tokens and is counted in `cut_continuations`.
    Log-probabilities are log_softmax over the real vocabulary (ids < n_vocab) in float32.

    loglikelihood_rolling: lm-eval's disjoint rolling windows of block_size tokens.

    generate_until: greedy decoding (sampling only when a task asks for do_sample) with the
    model's KV-cached `generate`, cut at the first `until` string or <|endoftext|>. The prompt is
    left-truncated so that at least min(max_gen_toks, block_size // 2) new tokens fit in the
    window; longer generations slide the window as `generate` does.
    """

    def __init__(
        self,
        model,
        enc,
        *,
        batch_size: int = 16,
        device: str | torch.device = "cpu",
        name: str = "gptforge",
        max_gen_toks: int = 256,
        gen_chunk: int = 32,
    ) -> None:
        super().__init__()
        if model.config.n_vocab != enc.n_vocab:
            raise BadInput(
                f"model {name}: its checkpoint has a vocabulary of {model.config.n_vocab} tokens but the "
                f"tokenizer (tokenizer.path) has {enc.n_vocab}; evaluate it with the tokenizer it was trained with"
            )
        self._device = torch.device(device)
        self.model = model.to(self._device).eval()
        self.enc = enc
        self.name = name
        self.batch_size = int(batch_size)
        self.block_size = model.config.block_size
        self.n_vocab = model.config.n_vocab
        self.max_gen_toks = max_gen_toks
        self.gen_chunk = gen_chunk
        self.cut_continuations = 0
        self.seconds = 0.0  # time spent in the model (scoring and generation), for throughput
        self.counts = {"loglikelihood": 0, "loglikelihood_rolling": 0, "generate_until": 0}

    # -- what TemplateLM needs ------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.enc.eot_token

    @property
    def max_length(self) -> int:
        return self.block_size

    @property
    def tokenizer_name(self) -> str:
        return self.enc.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # Ordinary text only: a task string that spells "<|endoftext|>" is scored as text.
        return self.enc.encode_ordinary(string)

    def tok_decode(self, tokens: Iterable[int]) -> str:
        return self.enc.decode([t for t in tokens if t != self.eot_token_id])

    def get_model_info(self) -> dict:
        cfg = self.model.config
        return {
            "model_name": self.name,
            "model_num_parameters": self.model.num_params(non_embedding=False),
            "block_size": cfg.block_size,
            "n_layer": cfg.n_layer,
            "n_embd": cfg.n_embd,
            "tokenizer": self.enc.name,
        }

    # -- scoring ----------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context_ids, continuation_ids) -> (logprob, is_greedy)."""
        self.counts["loglikelihood"] += len(requests)
        return self.score_tokens([(ctx, cont) for _, ctx, cont in requests], disable_tqdm=disable_tqdm)

    @torch.inference_mode()
    def score_tokens(
        self, pairs: list[tuple[list[int], list[int]]], *, disable_tqdm: bool = False, desc: str = "loglikelihood"
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation)
        for each (context_ids, continuation_ids) pair, batched, in the input order."""
        t0 = time.perf_counter()
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        # Pairs with the same model input share one forward pass (MMLU: 4 letters, 1 prompt).
        groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for i, (ctx, cont) in enumerate(pairs):
            if not cont:
                out[i] = (0.0, True)
                continue
            seq = (list(ctx) + list(cont))[-(self.block_size + 1) :]
            inp = tuple(seq[:-1])
            if not inp:
                raise BadInput(
                    "a loglikelihood request with an empty context and a one-token continuation "
                    "(lm-eval should have put <|endoftext|> before it)"
                )
            k = min(len(cont), len(inp))
            if k < len(cont):
                self.cut_continuations += 1
                if self.cut_continuations == 1:
                    log.warning(
                        "evaluate %s: a continuation of %d tokens does not fit block_size %d; only its "
                        "last %d tokens are scored",
                        self.name,
                        len(cont),
                        self.block_size,
                        k,
                    )
            groups.setdefault(inp, []).append((i, k))
        # Longest first: a batch holds similar lengths, so little padding; OOM shows up at once.
        inputs = sorted(groups, key=len, reverse=True)
        head = self.model.lm_head.weight[: self.n_vocab]
        bar = _bar(len(pairs) - sum(o is not None for o in out), f"{self.name} {desc}", disable_tqdm)
        try:
            for start in range(0, len(inputs), self.batch_size):
                batch = inputs[start : start + self.batch_size]
                width = len(batch[0])
                idx = torch.zeros((len(batch), width), dtype=torch.long)
                for b, inp in enumerate(batch):
                    idx[b, : len(inp)] = torch.tensor(inp, dtype=torch.long)
                # Right padding is harmless under causal attention: real positions never see it.
                hidden = self.model.hidden_states(idx.to(self._device))
                rows, positions, targets, owners = [], [], [], []
                for b, inp in enumerate(batch):
                    L = len(inp)
                    for i, k in groups[inp]:
                        rows.append(torch.full((k,), b, dtype=torch.long))
                        positions.append(torch.arange(L - k, L))
                        targets.append(torch.tensor(pairs[i][1][-k:], dtype=torch.long))
                        owners.append((i, k))
                rows_t, pos_t = torch.cat(rows), torch.cat(positions)
                tgt = torch.cat(targets).to(self._device)
                logits = F.linear(hidden[rows_t.to(self._device), pos_t.to(self._device)], head).float()
                logp = F.log_softmax(logits, dim=-1)
                token_logp = logp.gather(1, tgt[:, None]).squeeze(1).double().cpu()
                greedy = (logits.argmax(dim=-1) == tgt).cpu()
                offset = 0
                for i, k in owners:
                    out[i] = (float(token_logp[offset : offset + k].sum()), bool(greedy[offset : offset + k].all()))
                    offset += k
                bar.update(len(owners))
        finally:
            bar.close()
            self.seconds += time.perf_counter() - t0
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        self.counts["loglikelihood_rolling"] += len(requests)
        windows, owner = [], []
        for r, req in enumerate(requests):
            (string,) = req.args
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.block_size,
                    context_len=1,
                ),
            ):
                windows.append((ctx, cont))
                owner.append(r)
        scores = self.score_tokens(windows, disable_tqdm=disable_tqdm, desc="loglikelihood_rolling")
        totals = [0.0] * len(requests)
        for r, (lp, _) in zip(owner, scores):
            totals[r] += lp
        return totals

    @torch.inference_mode()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from gptforge.modeling.decoding import generate

        self.counts["generate_until"] += len(requests)
        eot_text = "<|endoftext|>"
        t0 = time.perf_counter()
        results = []
        for req in _iter_bar(requests, f"{self.name} generate_until", disable_tqdm):
            context, gen_kwargs = req.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None) or [eot_text]
            until = [until] if isinstance(until, str) else [u for u in until if u]
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0) if do_sample else 0.0
            room = min(max_new, self.block_size // 2)
            ctx = self.tok_encode(context)[-(self.block_size - room) :] or [self.eot_token_id]
            idx = torch.tensor([ctx], dtype=torch.long, device=self._device)
            new: list[int] = []
            text = ""
            while len(new) < max_new:
                step = min(self.gen_chunk, max_new - len(new))
                full = generate(self.model, idx, step, temperature=temperature, eot_id=self.eot_token_id)
                chunk = full[0, idx.size(1) :].tolist()
                new += chunk
                idx = full
                text = self.tok_decode(new)
                if self.eot_token_id in chunk or any(u in text for u in until) or not chunk:
                    break
            if self.eot_token_id in new:
                text = self.tok_decode(new[: new.index(self.eot_token_id)])
            for u in until:
                text = text.split(u)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            results.append(text)
        self.seconds += time.perf_counter() - t0
        return results


def measured(lm: Any, name: str) -> Any:
    """`lm` (lm-eval's `HFLM`), counting what `GptforgeLM` counts of itself, for the stage's
    throughput figures: `seconds` spent scoring and generating (its `_loglikelihood_tokens`,
    which loglikelihood and loglikelihood_rolling requests go through once tokenized, and
    `generate_until`) and `counts` of requests per type. `cut_continuations` stays 0: HFLM cuts a
    long context on the left as GptforgeLM does, but a continuation longer than the model's
    window is an assertion there, which this turns into a one-line BadInput.

    The methods are wrapped on the instance: lm-eval still gets the `HFLM` it is.
    """
    lm.name = name
    lm.seconds = 0.0
    lm.counts = {"loglikelihood": 0, "loglikelihood_rolling": 0, "generate_until": 0}
    lm.cut_continuations = 0

    def counted(method, kind: str):
        @functools.wraps(method)
        def call(requests, *args, **kwargs):
            lm.counts[kind] += len(requests)
            return method(requests, *args, **kwargs)

        return call

    def timed(method, scoring: bool = False):
        @functools.wraps(method)
        def call(requests, *args, **kwargs):
            if scoring:  # ((context, continuation), context_ids, continuation_ids)
                longest = max((len(cont) for _, _, cont in requests), default=0)
                if longest > lm.max_length:
                    raise BadInput(
                        f"evaluate.models.{name}: a continuation of {longest} tokens does not fit the "
                        f"model's {lm.max_length} positions (lm-eval's HFLM scores it whole or not at all)"
                    )
            t0 = time.perf_counter()
            try:
                return method(requests, *args, **kwargs)
            finally:
                lm.seconds += time.perf_counter() - t0

        return call

    lm._loglikelihood_tokens = timed(lm._loglikelihood_tokens, scoring=True)
    lm.loglikelihood = counted(lm.loglikelihood, "loglikelihood")
    lm.loglikelihood_rolling = counted(lm.loglikelihood_rolling, "loglikelihood_rolling")
    lm.generate_until = counted(timed(lm.generate_until), "generate_until")
    return lm


class _NoBar:
    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


def _bar(total: int, desc: str, disable: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="req", disable=disable, leave=False)


def _iter_bar(items, desc: str, disable: bool):
    bar = _bar(len(items), desc, disable)
    try:
        for item in items:
            yield item
            bar.update(1)
    finally:
        bar.close()
