"""`prepare pretrain`: a text corpus -> uint16 GPT-2 token shards + manifest.json.

Each (non-empty) document is preceded by `<|endoftext|>` (as in build-nanogpt's fineweb.py), so the token
stream reads `EOT doc0 EOT doc1 ...`. The first `val_tokens` tokens form the validation split,
the rest the training split, both cut into `.npy` shards of `shard_tokens` tokens
(`val_000000.npy`, `train_000000.npy`, ...). Tokenization runs in worker processes.

Large documents (a single 50 MB `.txt` is one document) are cut into pieces for the workers
at points where cutting cannot change the result: right after a non-space character that is
followed by a space or newline. GPT-2's pre-tokenizer never joins a non-space character with
the whitespace after it, and it matches no pattern backwards, so encoding the pieces one by one
gives exactly the ids of encoding the whole text (tests check this against tiktoken).
"""

from __future__ import annotations

import collections
import json
import logging
import multiprocessing as mp
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm.auto import tqdm

import gptforge
from gptforge.config.schema import Config
from gptforge.errors import BadInput
from gptforge.io import atomic_dir, data_suffix, is_gzip, open_data, sha256_file, write_json
from gptforge.modeling.tokenizer import check_fits_uint16, describe, load_tokenizer
from gptforge.runtime.steps import DIRECT, Steps
from gptforge.runtime.tracking import NullRun, publish_metrics

log = logging.getLogger("gptforge")

PIECE_CHARS = 1 << 20  # characters per work item sent to a tokenizer process
READ_CHARS = 4 << 20  # characters read from a text file at a time
TEXT_SUFFIXES = {".txt"}
RECORD_SUFFIXES = {".jsonl", ".parquet"}
_SAFE_CUT = re.compile(r"\S(?=[ \n])")

# A work item: (text, starts_document) segments, encoded in order.
Segment = tuple[str, bool]


@dataclass(frozen=True)
class Corpus:
    """Where documents come from: local files (in order) or a hub dataset."""

    files: tuple[str, ...] = ()
    hf_repo: str | None = None
    hf_name: str | None = None
    hf_split: str = "train"
    text_field: str = "text"
    param: str = "data.pretrain.source"


@dataclass
class ShardStats:
    shards: list[dict] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=lambda: {"val": 0, "train": 0})
    documents: dict[str, int] = field(default_factory=lambda: {"val": 0, "train": 0})
    truncated: bool = False
    seconds: float = 0.0

    @property
    def total_tokens(self) -> int:
        return self.tokens["val"] + self.tokens["train"]


# ---------------------------------------------------------------------------------------------
# Reading documents


def find_corpus(source: str, *, name: str | None, split: str, text_field: str, param: str) -> Corpus:
    """Resolve a local file/folder or an hf:// id into a Corpus. Raises BadInput."""
    if source.startswith("hf://"):
        return Corpus(hf_repo=source[len("hf://") :], hf_name=name, hf_split=split, text_field=text_field, param=param)
    path = Path(source)
    if not path.exists():
        raise BadInput(f"{param}: local source not found: {source}")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _format(p) in TEXT_SUFFIXES | RECORD_SUFFIXES)
        if not files:
            raise BadInput(f"{param}: folder {source} has no .txt, .jsonl or .parquet files")
    else:
        if _format(path) not in TEXT_SUFFIXES | RECORD_SUFFIXES:
            raise BadInput(f"{param}: {source} is not a .txt, .jsonl or .parquet file (the first two may be .gz)")
        files = [path]
    return Corpus(files=tuple(str(p) for p in files), text_field=text_field, param=param)


def iter_documents(corpus: Corpus) -> Iterator[Iterator[str]]:
    """Yield each document as an iterator of text blocks (a big .txt file streams in blocks)."""
    if corpus.hf_repo:
        from gptforge.data.sources import load_hf

        ds = load_hf(
            f"hf://{corpus.hf_repo}", name=corpus.hf_name, split=corpus.hf_split, streaming=True, param=corpus.param
        )
        for i, record in enumerate(ds):
            yield iter((_text_of(record, corpus.text_field, f"hf://{corpus.hf_repo} record {i}"),))
        return
    for file in corpus.files:
        path = Path(file)
        if _format(path) == ".txt":
            yield _read_blocks(path)
        elif _format(path) == ".jsonl":
            yield from (iter((t,)) for t in _jsonl_texts(path, corpus.text_field))
        else:
            yield from (iter((t,)) for t in _parquet_texts(path, corpus.text_field))


def _format(path: Path) -> str:
    """.txt, .jsonl or .parquet (gzip-compressed text and jsonl count as their inner format);
    anything else, such as a compressed parquet, is not a corpus file."""
    suffix = data_suffix(path)
    return "" if is_gzip(path) and suffix == ".parquet" else suffix


def _read_blocks(path: Path) -> Iterator[str]:
    try:
        with open_data(path, "r", encoding="utf-8") as f:
            while block := f.read(READ_CHARS):
                yield block
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (OSError, EOFError) as e:  # a damaged .gz (gzip.BadGzipFile is an OSError)
        raise BadInput(f"{path}: cannot read it ({' '.join(str(e).split())})") from None


def _text_of(record, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        raise BadInput(f"{where}: no '{text_field}' field (set data.pretrain.text_field)")
    text = record[text_field]
    if not isinstance(text, str):
        raise BadInput(f"{where}: '{text_field}' is {type(text).__name__}, not a string")
    return text


def _jsonl_texts(path: Path, text_field: str) -> Iterator[str]:
    with open_data(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise BadInput(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            yield _text_of(record, text_field, f"{path}:{lineno}")


def _parquet_texts(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise BadInput(f"{path}: not a readable parquet file ({type(e).__name__})") from None
    if text_field not in pf.schema_arrow.names:
        raise BadInput(f"{path}: no '{text_field}' column (set data.pretrain.text_field)")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def cut_points(text: str, every: int) -> list[int]:
    """Positions at which `text` can be cut without changing its GPT-2 tokens, ~`every` apart."""
    cuts, pos = [], every
    while pos < len(text):
        m = _SAFE_CUT.search(text, pos)
        if m is None:
            break
        cuts.append(m.end())
        pos = m.end() + every
    return cuts


def iter_work(documents: Iterable[Iterator[str]], piece_chars: int = PIECE_CHARS) -> Iterator[list[Segment]]:
    """Group documents into work items of about `piece_chars` characters, cutting big ones safely."""
    item: list[Segment] = []
    size = 0
    for blocks in documents:
        starts = True
        carry = ""
        for block in blocks:
            text = carry + block
            cuts = cut_points(text, piece_chars)
            if not cuts:
                carry = text
                continue
            prev = 0
            for cut in cuts:
                item.append((text[prev:cut], starts))
                starts = False
                prev = cut
                yield item
                item, size = [], 0
            carry = text[prev:]
        if carry:  # an empty document adds nothing, not even its <|endoftext|>
            item.append((carry, starts))
            size += len(carry)
        if size >= piece_chars:
            yield item
            item, size = [], 0
    if item:
        yield item


# ---------------------------------------------------------------------------------------------
# Tokenizing (in worker processes)

_worker_enc = None


def _init_worker(tokenizer_path: str | None) -> None:
    global _worker_enc
    _worker_enc = load_tokenizer(tokenizer_path)


def encode_item(item: list[Segment]) -> np.ndarray:
    enc = _worker_enc
    parts = []
    eot = np.array([enc.eot_token], dtype=np.uint32)
    for text, starts in item:
        if starts:
            parts.append(eot)
        if text:
            parts.append(enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=()))
    if not parts:
        return np.empty(0, dtype=np.uint16)
    # The vocabulary was checked to fit uint16 before any work started.
    return np.concatenate(parts).astype(np.uint16)


def encode_stream(work: Iterable[list[Segment]], tokenizer_path: str | None, workers: int) -> Iterator[np.ndarray]:
    """Token arrays for the work items, in order. At most 2 items per worker are in flight,
    so a streamed corpus is never read further ahead than the tokenizers can keep up with."""
    if workers <= 1:
        _init_worker(tokenizer_path)
        yield from map(encode_item, work)
        return
    # forkserver: the parent may hold threads (progress bars, MLflow, Prefect) that fork would copy.
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path,)) as pool:
        pending: collections.deque = collections.deque()
        for item in work:
            pending.append(pool.apply_async(encode_item, (item,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ---------------------------------------------------------------------------------------------
# Writing shards


class ShardWriter:
    """Cuts the token stream into val shards (the first `val_tokens`), then train shards."""

    def __init__(self, out_dir: Path, shard_tokens: int, val_tokens: int, max_tokens: int, eot: int) -> None:
        self.out_dir, self.shard_tokens, self.val_tokens, self.max_tokens, self.eot = (
            out_dir, shard_tokens, val_tokens, max_tokens, eot)
        self.stats = ShardStats()
        self.buffer = np.empty(shard_tokens, dtype=np.uint16)
        self.filled = 0
        self.split = "val" if val_tokens > 0 else "train"
        self.index = {"val": 0, "train": 0}

    @property
    def full(self) -> bool:
        return self.stats.total_tokens + self.filled >= self.max_tokens

    def _room(self) -> int:
        left = self.max_tokens - self.stats.total_tokens - self.filled
        room = self.shard_tokens - self.filled
        if self.split == "val":
            room = min(room, self.val_tokens - self.stats.tokens["val"] - self.filled)
        return min(room, left)

    def add(self, tokens: np.ndarray) -> None:
        while len(tokens) and not self.full:
            n = min(self._room(), len(tokens))
            self.buffer[self.filled : self.filled + n] = tokens[:n]
            self.filled += n
            tokens = tokens[n:]
            if self.filled == self.shard_tokens or (
                self.split == "val" and self.stats.tokens["val"] + self.filled >= self.val_tokens
            ):
                self.flush()
        if len(tokens):
            self.stats.truncated = True

    def flush(self) -> None:
        if self.filled == 0:
            return
        data = self.buffer[: self.filled]
        name = f"{self.split}_{self.index[self.split]:06d}.npy"
        path = self.out_dir / name
        np.save(path, data)
        self.stats.shards.append(
            {"file": name, "split": self.split, "tokens": int(self.filled), "sha256": sha256_file(path)}
        )
        self.stats.tokens[self.split] += int(self.filled)
        self.stats.documents[self.split] += int(np.count_nonzero(data == self.eot))
        self.index[self.split] += 1
        self.filled = 0
        if self.split == "val" and self.stats.tokens["val"] >= self.val_tokens:
            self.split = "train"


def tokenize_to_shards(
    corpus: Corpus,
    out_dir: str | os.PathLike,
    *,
    tokenizer_path: str | None,
    max_tokens: int,
    shard_tokens: int,
    val_tokens: int,
    workers: int = 0,
) -> ShardStats:
    """Read, tokenize and write the corpus into `out_dir` (which must exist). Timed end to end."""
    start = time.perf_counter()
    enc = load_tokenizer(tokenizer_path)
    workers = workers or os.cpu_count() or 1
    writer = ShardWriter(Path(out_dir), shard_tokens, val_tokens, max_tokens, enc.eot_token)
    bar = tqdm(total=max_tokens, unit="tok", unit_scale=True, desc="tokenize", mininterval=1.0)
    stream = encode_stream(iter_work(iter_documents(corpus)), tokenizer_path, workers)
    try:
        for tokens in stream:
            before = writer.stats.total_tokens + writer.filled
            writer.add(tokens)
            bar.update(writer.stats.total_tokens + writer.filled - before)
            if writer.full:
                # Anything left in the corpus is cut off; say so only if there was more.
                writer.stats.truncated = writer.stats.truncated or next(stream, None) is not None
                break
    finally:
        stream.close()
        bar.close()
    writer.flush()
    stats = writer.stats
    stats.seconds = time.perf_counter() - start
    if stats.total_tokens == 0:
        raise BadInput(f"{corpus.param}: empty corpus (no text found)")
    if stats.tokens["train"] == 0:
        raise BadInput(
            f"{corpus.param}: the corpus has {stats.total_tokens} tokens, all taken by validation "
            f"(data.pretrain.val_tokens={val_tokens}): no training tokens left"
        )
    return stats


# ---------------------------------------------------------------------------------------------
# The recipe


def prepare_pretrain(
    cfg: Config,
    *,
    steps: Steps = DIRECT,
    run=NullRun(),
    out_dir: str | os.PathLike = "data/pretrain",
    metrics_path: str | os.PathLike = "metrics/prepare_pretrain.json",
    raw_dir: str | os.PathLike = "data/raw",
) -> dict:
    d = cfg.data.pretrain
    enc = load_tokenizer(cfg.tokenizer.path)
    check_fits_uint16(enc, cfg.tokenizer.path)
    source = d.source
    if source.startswith("https://"):
        from gptforge.data.sources import materialize

        source = str(
            materialize(source, param="data.pretrain.source", sha256=d.sha256, download=cfg.data.download,
                        steps=steps, raw_dir=raw_dir)
        )
    corpus = steps(find_corpus, source, name=d.name, split=d.split, text_field=d.text_field,
                   param="data.pretrain.source")
    with atomic_dir(out_dir) as tmp:
        stats = steps(
            tokenize_to_shards, corpus, tmp, tokenizer_path=cfg.tokenizer.path, max_tokens=d.max_tokens,
            shard_tokens=d.shard_tokens, val_tokens=d.val_tokens, workers=d.workers,
        )
        manifest = {
            "source": d.source,
            "name": d.name if d.source.startswith("hf://") else None,
            "tokenizer": {"name": describe(cfg.tokenizer.path), "n_vocab": enc.n_vocab, "eot": enc.eot_token},
            "dtype": "uint16",
            "documents": stats.documents,
            "tokens": stats.tokens,
            "truncated_at_max_tokens": stats.truncated,
            "tokens_per_sec": stats.total_tokens / stats.seconds,
            "seconds": stats.seconds,
            "shards": stats.shards,
            "gptforge_version": gptforge.__version__,
        }
        write_json(Path(tmp) / "manifest.json", manifest)
    metrics = {
        "tokens": stats.total_tokens,
        "train_tokens": stats.tokens["train"],
        "val_tokens": stats.tokens["val"],
        "documents": stats.documents["train"] + stats.documents["val"],
        "tokens_per_sec": manifest["tokens_per_sec"],
    }
    log.info("wrote %d shards, %d tokens (%.2fM tokens/s) to %s", len(stats.shards), stats.total_tokens,
             manifest["tokens_per_sec"] / 1e6, out_dir)
    publish_metrics(run, metrics, metrics_path)
    run.log_artifact(Path(out_dir) / "manifest.json")
    return metrics
