"""HellaSwag during pretraining, completion style, as karpathy's build-nanogpt scores it.

Each example is a context and 4 candidate endings. Every ending is appended to the context
(with a leading space, so it tokenizes as a continuation) and the model's cross-entropy over
the ending tokens alone is measured. `acc` picks the ending with the lowest summed loss,
`acc_norm` the lowest mean loss per token (build-nanogpt's definitions; acc_norm is the number
nanoGPT-style runs report, since summed loss favours short endings).

This is not lm-eval's `hellaswag`, which builds its query from `activity_label`, `ctx_a` and
`ctx_b` with the `[...]` tags stripped and normalises by characters: the two figures differ
and are not to be compared with each other.

Input is the rowanz jsonl format (`hellaswag_val.jsonl`): one JSON object a line with `ctx`
(str), `endings` (4 str) and `label` (0-3); other keys are ignored. `label` may also be a
digit string, as Hugging Face's copy of the data set stores it.

Long examples: a row longer than the model's block size loses tokens from the LEFT of the
context, the same number from every row, so that all 4 endings are still scored against one
same context and every ending token is kept whole. An example whose longest ending does not
fit (with at least one context token before it) cannot be scored fairly; it is skipped and
counted in `skipped`, with a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from gptforge.errors import BadInput
from gptforge.io import open_data

log = logging.getLogger(__name__)

N_ENDINGS = 4
SOURCE_KEY = "pretrain.hellaswag.source"


# --------------------------------------------------------------------------------------------
# Loading


def local_copy(
    source: str,
    *,
    split: str = "validation",
    sha256: str | None = None,
    download=None,
    source_key: str = SOURCE_KEY,
    raw_dir: str | Path = "data/raw",
) -> Path:
    """A local rowanz-format jsonl for `source`: the path itself; an https:// URL downloaded once
    into `raw_dir` (resumable, checksum-verified: `data.sources.materialize`); or a hub dataset
    `hf://OWNER/NAME` whose `split` is written once to `raw_dir` as jsonl and reused from there."""
    from gptforge.config.data_schema import DownloadConfig
    from gptforge.data.sources import is_hf, load_hf, materialize
    from gptforge.io import atomic_file

    if not is_hf(source):
        return materialize(
            source, param=source_key, sha256=sha256, download=download or DownloadConfig(), raw_dir=raw_dir
        )
    repo = source[len("hf://") :]
    dest = Path(raw_dir) / f"hellaswag-{repo.replace('/', '--')}-{split}.jsonl"
    if dest.is_file():
        log.info("using cached %s", dest)
        return dest
    rows = load_hf(source, split=split, param=source_key)
    with atomic_file(dest, "w", encoding="utf-8") as f:  # a killed run leaves no half cache
        for row in rows:
            f.write(json.dumps(dict(row), ensure_ascii=False) + "\n")
    return dest


def load_examples(path: str | Path, limit: int | None = None, *, source_key: str = SOURCE_KEY) -> list[dict]:
    """The first `limit` (all when None) examples of a rowanz-format jsonl, checked line by line.

    Returns dicts with exactly `ctx` (str), `endings` (list of 4 str) and `label` (int).
    Any fault raises BadInput naming the file and the line, and the params key to fix.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{source_key}: HellaSwag file not found: {path}")

    def fail(lineno: int, why: str) -> BadInput:
        return BadInput(f"{path}:{lineno}: {why} (set {source_key} to a HellaSwag jsonl in the rowanz format)")

    examples: list[dict] = []
    with open_data(p, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if limit is not None and len(examples) >= limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise fail(lineno, "not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise fail(lineno, f"bad JSON ({e.msg} at column {e.colno})") from None
            examples.append(_check_example(obj, lambda why: fail(lineno, why)))
    if not examples and limit != 0:
        raise BadInput(f"{source_key}: no examples in {path}")
    return examples


def _check_example(obj: Any, fail: Callable[[str], BadInput]) -> dict:
    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("ctx", "endings", "label") if k not in obj]
    if missing:
        raise fail(f"missing {', '.join(missing)}")
    ctx, endings, label = obj["ctx"], obj["endings"], obj["label"]
    if not isinstance(ctx, str):
        raise fail(f"ctx must be a string, got {type(ctx).__name__}")
    if not ctx.strip():
        raise fail("ctx is empty")
    if not isinstance(endings, list) or not all(isinstance(e, str) for e in endings):
        raise fail("endings must be a list of strings")
    if len(endings) != N_ENDINGS:
        raise fail(f"endings must hold {N_ENDINGS} strings, got {len(endings)}")
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int):
        raise fail(f"label must be an integer, got {label!r}")
    if not 0 <= label < N_ENDINGS:
        raise fail(f"label must be 0-{N_ENDINGS - 1}, got {label}")
    return {"ctx": ctx, "endings": list(endings), "label": label}


# --------------------------------------------------------------------------------------------
# Rendering and scoring


def render(example: dict, enc) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(tokens (4, L) long, mask (4, L) long, label): context + ending per row, right-padded with 0.

    The mask is 1 over the ending tokens only. Endings are encoded with a leading space, as
    build-nanogpt does, so that they continue the context's last word boundary.
    """
    ctx_tokens = enc.encode_ordinary(example["ctx"])
    if not ctx_tokens:
        raise BadInput("HellaSwag example with an empty context")
    rows, masks = [], []
    for ending in example["endings"]:
        end_tokens = enc.encode_ordinary(" " + ending)
        rows.append(ctx_tokens + end_tokens)
        masks.append([0] * len(ctx_tokens) + [1] * len(end_tokens))
    width = max(len(r) for r in rows)
    tokens = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, m) in enumerate(zip(rows, masks)):
        tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.long)
    return tokens, mask, int(example["label"])


def fit_to_block(tokens: torch.Tensor, mask: torch.Tensor, block_size: int | None):
    """Drop context tokens from the left so that no row is longer than `block_size`.

    The same number of leading columns goes from every row (all rows share the context), so
    the endings stay whole and are still scored against one context. Returns None when the
    longest ending plus one context token does not fit.
    """
    width = tokens.size(1)
    if block_size is None or width <= block_size:
        return tokens, mask
    drop = width - block_size
    ctx_len = int(mask.argmax(dim=1).min())  # every row's ending starts right after the context
    if drop >= ctx_len:
        return None
    return tokens[:, drop:], mask[:, drop:]


def score(model, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_loss (4,), avg_loss (4,)): the model's cross-entropy over each row's ending tokens.

    Token t+1 is predicted from the logits at t, in float32; only positions whose target is
    an ending token (mask[:, 1:]) count.
    """
    out = model(tokens)
    logits = out[0] if isinstance(out, (tuple, list)) else out
    if logits.dim() != 3 or logits.shape[:2] != tokens.shape:
        raise ValueError(
            f"the model must return logits (B, T, V) for every position; got {tuple(logits.shape)} "
            f"for tokens {tuple(tokens.shape)}"
        )
    shift_logits = logits[:, :-1, :].float()
    shift_tokens = tokens[:, 1:]
    losses = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_tokens.reshape(-1), reduction="none"
    ).view(shift_tokens.shape)
    shift_mask = mask[:, 1:].to(losses.device).bool()
    # where, not multiply: a padded position may have an infinite loss, and 0 * inf is nan.
    losses = torch.where(shift_mask, losses, torch.zeros_like(losses))
    sum_loss = losses.sum(dim=1)
    avg_loss = sum_loss / shift_mask.sum(dim=1)
    return sum_loss, avg_loss


# --------------------------------------------------------------------------------------------
# Evaluation


def evaluate(
    model,
    examples: list[dict],
    enc,
    *,
    device: str | torch.device = "cpu",
    rank: int = 0,
    world_size: int = 1,
    block_size: int | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> dict:
    """HellaSwag accuracy of `model` (any callable `model(idx) -> (logits, _)`) on `examples`.

    Rank r scores the examples i with i % world_size == r; when torch.distributed is
    initialised and world_size > 1 the counts are summed over ranks (a collective: every rank
    must call this), so all ranks return the global figures. `block_size` None: the model's
    `config.block_size` when it has one, else no truncation. An nn.Module runs in eval mode
    under torch.no_grad and gets its train/eval mode back afterwards.

    Returns acc, acc_norm (0.0 when nothing was scored), n, correct, correct_norm, skipped.
    """
    device = torch.device(device)
    if block_size is None:
        block_size = getattr(getattr(model, "config", None), "block_size", None)
    mine = [ex for i, ex in enumerate(examples) if i % world_size == rank]

    is_module = isinstance(model, torch.nn.Module)
    was_training = model.training if is_module else False
    if is_module:
        model.eval()
    amp = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    n = correct = correct_norm = skipped = 0
    try:
        with torch.no_grad(), _progress(len(mine), disable=rank != 0) as bar:
            for ex in mine:
                tokens, mask, label = render(ex, enc)
                fitted = fit_to_block(tokens, mask, block_size)
                bar.update(1)
                if fitted is None:
                    skipped += 1
                    continue
                tokens, mask = (t.to(device) for t in fitted)
                with amp:
                    sum_loss, avg_loss = score(model, tokens, mask)
                n += 1
                correct += int(sum_loss.argmin().item() == label)
                correct_norm += int(avg_loss.argmin().item() == label)
    finally:
        if is_module:
            model.train(was_training)

    if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        counts = torch.tensor([n, correct, correct_norm, skipped], dtype=torch.long, device=device)
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM)
        n, correct, correct_norm, skipped = (int(c) for c in counts.tolist())
    if skipped and rank == 0:
        log.warning(
            "hellaswag: skipped %d example(s) whose longest ending does not fit block_size %s", skipped, block_size
        )
    return {
        "acc": correct / n if n else 0.0,
        "acc_norm": correct_norm / n if n else 0.0,
        "n": n,
        "correct": correct,
        "correct_norm": correct_norm,
        "skipped": skipped,
    }


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def _progress(total: int, disable: bool):
    # tqdm is imported here so the training path needs only torch (DESIGN.md: bare GPU machine).
    try:
        from tqdm.auto import tqdm
    except ImportError:
        yield _NoBar()
        return
    bar = tqdm(total=total, desc="hellaswag", unit="ex", disable=disable, leave=False)
    try:
        yield bar
    finally:
        bar.close()
