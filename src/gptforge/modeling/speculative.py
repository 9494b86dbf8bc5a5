"""Draft-free speculative decoding for the lean Llama decoder at batch 1: prompt lookup drafts
the next tokens by copying what followed the latest earlier occurrence of the sequence's last
n-gram (in the prompt or in the answer so far), and one forward of the target over the drafted
tokens verifies all of them at once (`speculative_decode`). Greedy: the drafted tokens the model
would have chosen itself are kept, then the model's own token where they part, so the text is
plain greedy's (up to floating-point ties: the verify forward multiplies several positions at
once). Sampling: each drafted token is kept with the model's probability of it, and on a
rejection the token is drawn from the model's distribution without it (`accept_or_resample`,
the standard acceptance rule for a draft that proposes one token with certainty), so the tokens
follow the model's distribution exactly.

It pays where answers copy their context (a RAG answer quoting its chunks, code edits,
summaries: several tokens per forward) and costs one lookup per token where nothing matches.
`generate_llama(..., speculate=K)` uses it; `stats` counts drafted and accepted tokens. `gptforge
serve --speculate K` drafts the same way for a lone greedy row (`serve.scheduler`) and verifies
in its backend (`serve.hf_backend.HFBackend.decode_greedy_draft`), with `greedy_kept`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gptforge.modeling.greedy_head import _argmax

MAX_NGRAM = 3  # the longest suffix looked up; shorter ones are tried in turn, down to MIN_NGRAM
# A one-token match drafts too often in plain chat: with a step of one row twice as fast as a
# verify forward of five (cpu_gemv), SmolLM2 bf16 at K=4 answered the 10 plain questions at 44.0
# tokens/s with one-token matches, 50.3 without, 48.7 without drafting; the 10 RAG answers at
# 25.9 and 27.9 (one round, 2026-11-29, docs/hf-models.md).
MIN_NGRAM = 2


def prompt_lookup(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int | None = None) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of
    `tokens`, for the longest n <= `max_ngram` (and >= `min_ngram`, default `MIN_NGRAM`) that
    occurs earlier; [] when none does."""
    min_ngram = MIN_NGRAM if min_ngram is None else min_ngram
    end = len(tokens)
    for n in range(min(max_ngram, end - 1), min_ngram - 1, -1):
        tail = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):  # latest first; the tail itself excluded
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def greedy_kept(draft: list[int], greedy: list[int]) -> int:
    """How many leading drafted tokens greedy decoding keeps: `greedy[i]` is the model's argmax
    after the verified token and `draft[:i]`; the first mismatch ends the run."""
    kept = 0
    while kept < len(draft) and draft[kept] == greedy[kept]:
        kept += 1
    return kept


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """The sampling distribution over the vocabulary (..., V): softmax(logits / temperature)
    over the `top_k` most likely tokens (None: all): what `generate_llama` samples from."""
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return F.softmax(logits, dim=-1)


def accept_or_resample(probs: torch.Tensor, drafted: int) -> tuple[bool, int]:
    """The acceptance rule for a drafted token under the target distribution `probs` (V,):
    kept with probability probs[drafted]; otherwise a token drawn from `probs` without
    `drafted`, renormalized. Together: a draw from `probs` (P(t) = p(d)[t=d] + (1 - p(d)) p(t) /
    (1 - p(d)) for t != d)."""
    p = float(probs[drafted])
    if torch.rand(()).item() < p:
        return True, drafted
    rest = probs.clone()
    rest[drafted] = 0
    return False, int(torch.multinomial(rest / rest.sum(), 1))


@torch.inference_mode()
def speculative_decode(
    decoder,
    prompt: list[int],
    first_hidden: torch.Tensor,
    max_new_tokens: int,
    *,
    k: int,
    temperature: float,
    top_k: int | None,
    stop: set[int],
    stats: dict | None = None,
) -> list[int]:
    """The new tokens after `prompt`, whose prefill left `first_hidden` (1, hidden) in
    `decoder` (a `llama_decoding.LlamaDecoder` of batch 1): up to `max_new_tokens`, ending at
    the first token in `stop` (kept). Each step drafts up to `k` tokens by `prompt_lookup` and
    verifies them in one forward; the decoder's position is moved back past rejected ones (their
    keys and values are overwritten by the next forward)."""
    device = decoder.head.device
    seq = list(prompt)
    out: list[int] = []
    counts = {"forwards": 0, "drafted": 0, "accepted": 0}

    def pick(logits: torch.Tensor) -> int:
        if temperature == 0:
            return int(_argmax(logits.float()[None])[0])
        return int(torch.multinomial(filtered_probs(logits, temperature, top_k), 1))

    nxt = pick(decoder.logits(first_hidden)[0])
    while True:
        out.append(nxt)
        seq.append(nxt)
        if nxt in stop or len(out) >= max_new_tokens:
            break
        room = min(k, max_new_tokens - len(out) - 1, decoder.max_len - decoder.pos - 1)
        draft = prompt_lookup(seq, room) if room > 0 else []
        start = decoder.pos
        hidden = decoder(torch.tensor([[nxt] + draft], device=device), all_positions=True)[0]
        counts["forwards"] += 1
        counts["drafted"] += len(draft)
        logits = decoder.logits(hidden)  # (1 + len(draft), V): row i follows draft[:i]
        greedy = _argmax(logits.float()).tolist() if temperature == 0 else None
        agreed = greedy_kept(draft, greedy) if greedy is not None else len(draft)
        kept = 0
        for i, d in enumerate(draft):
            if greedy is not None:
                ok, token = i < agreed, greedy[i]
            else:
                ok, token = accept_or_resample(filtered_probs(logits[i], temperature, top_k), d)
            if not ok:
                nxt = token
                break
            kept += 1
            out.append(d)
            seq.append(d)
            if d in stop or len(out) >= max_new_tokens:
                break
        else:
            nxt = greedy[len(draft)] if greedy is not None else pick(logits[len(draft)])
        counts["accepted"] += kept
        decoder.pos = start + 1 + kept  # the cache holds nxt's predecessor and the kept drafts
        if out[-1] in stop or len(out) >= max_new_tokens:
            break
    if stats is not None:
        stats.update(counts)
    return out[:max_new_tokens]
