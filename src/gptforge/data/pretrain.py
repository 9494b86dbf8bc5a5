"""Pretraining tokens: reading a corpus's documents, encoding them on threads, and cutting the
stream into the uint16 GPT-2 token shards the training loader reads. The stage (`prepare
pretrain`, data/pretrain_stage.py) runs these pieces as datatrove tasks (data/pretrain_pipeline.py);
`tokenize_to_shards` is the same work as one plain in-process pass: the reference the tasks are
tested against, and bench_tokenize's loop.

Each (non-empty) document is preceded by `<|endoftext|>` (as in build-nanogpt's fineweb.py), so the token
stream reads `EOT doc0 EOT doc1 ...`. The first `val_tokens` tokens form the validation split,
the rest the training split, both cut into `.npy` shards of `shard_tokens` tokens
(`val_000000.npy`, `train_000000.npy`, ...).

Tokenization runs on threads of this process: tiktoken's Rust core releases the GIL while it
encodes, so `workers` threads encode work items of about a million characters in parallel while
the main thread reads the next ones, with no pickling of texts or token arrays between processes
and no worker start-up. A work item's documents are encoded in one call, joined by the
`<|endoftext|>` text with that special token allowed: the ids are those of `encode_ordinary` on
each document with the EOT id before it, since an allowed special token splits the text the way
separate calls would (an item whose documents themselves contain the `<|endoftext|>` text is
encoded document by document instead, that text as ordinary text).

Large documents (a single 50 MB `.txt` is one document) are cut into pieces for the threads
at points where cutting cannot change the result: right after a non-space character that is
followed by a space or newline. GPT-2's pre-tokenizer never joins a non-space character with
the whitespace after it, and it matches no pattern backwards, so encoding the pieces one by one
gives exactly the ids of encoding the whole text (tests check this against tiktoken).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import tiktoken

from gptforge.errors import BadInput
from gptforge.io import data_suffix, is_gzip, open_data, sha256_file
from gptforge.modeling.tokenizer import EOT_TOKEN, load_tokenizer

log = logging.getLogger("gptforge")

PIECE_CHARS = 1 << 20  # characters per work item given to a tokenizer thread
READ_CHARS = 4 << 20  # characters read from a text file at a time
READ_BYTES = 8 << 20  # bytes read from a JSONL file at a time
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


def _jsonl_lines(path: Path) -> Iterator[bytes]:
    """The lines of a JSONL file as bytes, split where text mode splits them (\\n, \\r\\n or \\r),
    read in large blocks."""
    try:
        with open_data(path, "rb") as f:
            carry = b""
            while block := f.read(READ_BYTES):
                if block.endswith(b"\r"):  # keep a \r\n together
                    block += f.read(1)
                data = carry + block if carry else block
                lines = data.splitlines()
                carry = b"" if data.endswith((b"\n", b"\r")) else lines.pop()
                yield from lines
            if carry:
                yield carry
    except (OSError, EOFError) as e:  # a damaged .gz (gzip.BadGzipFile is an OSError)
        raise BadInput(f"{path}: cannot read it ({' '.join(str(e).split())})") from None


def _jsonl_texts(path: Path, text_field: str) -> Iterator[str]:
    try:  # orjson is not a gptforge dependency (Prefect and DVC bring it): the standard library's otherwise
        from orjson import loads as fast_loads
    except ImportError:
        fast_loads = None
    for lineno, raw in enumerate(_jsonl_lines(path), 1):
        if not raw.strip():
            continue
        try:
            record = fast_loads(raw) if fast_loads else None
        except ValueError:  # orjson.JSONDecodeError: the standard library decides, with its own message
            record = None
        if record is None:
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadInput(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():  # only non-ASCII whitespace: skipped, as a text-mode reader would
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
# Tokenizing (on threads: tiktoken releases the GIL while it encodes)

_NO_SPECIAL: frozenset[str] = frozenset()


def _encode(enc: tiktoken.Encoding, text: str, allowed_special: frozenset[str]) -> np.ndarray:
    """`enc.encode_to_numpy` (uint32 ids, no list of Python ints), other special tokens as plain
    text; lone surrogates (a JSON escape can make them) are replaced as `encode_ordinary` does."""
    try:
        return enc.encode_to_numpy(text, allowed_special=allowed_special, disallowed_special=())
    except UnicodeEncodeError:
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return enc.encode_to_numpy(text, allowed_special=allowed_special, disallowed_special=())


def encode_item(enc: tiktoken.Encoding, item: list[Segment]) -> np.ndarray:
    """The uint16 ids of one work item: EOT before each document's first segment, then the
    segment's `encode_ordinary` ids."""
    starts = sum(1 for _, s in item if s)
    joined = "".join(EOT_TOKEN + text if s else text for text, s in item)
    if joined.count(EOT_TOKEN) == starts:
        # One call for the whole item. An allowed special token splits the text like separate
        # calls would, and an EOT text can only come from the joins (none is in the documents).
        ids = _encode(enc, joined, frozenset((EOT_TOKEN,)))
    else:  # a document holds the "<|endoftext|>" text: ordinary text there, so one call each
        eot = np.array([enc.eot_token], dtype=np.uint32)
        parts = []
        for text, s in item:
            if s:
                parts.append(eot)
            parts.append(_encode(enc, text, _NO_SPECIAL))
        ids = np.concatenate(parts)
    # The vocabulary was checked to fit uint16 before any work started.
    return ids.astype(np.uint16)


def _own_copy(enc: tiktoken.Encoding) -> tiktoken.Encoding:
    """The same tokenizer with its own Rust core (20 ms to build from the loaded vocabulary)."""
    try:
        return tiktoken.Encoding(
            enc.name, pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks, special_tokens=enc._special_tokens
        )
    except AttributeError:  # a tiktoken that keeps these elsewhere: share it
        return enc


def _per_thread(enc: tiktoken.Encoding) -> Callable[[], tiktoken.Encoding]:
    """A getter of one Encoding per thread: `enc` for the first thread that asks, a copy for the
    others. Threads that encode with one shared Encoding slow each other down: on 2 cores, 2
    threads spent 2.7-2.9 CPU seconds each on the 100 MB benchmark corpus with one shared, 5.2
    in some runs, and 2.0-2.3 with one each."""
    local, lock, given = threading.local(), threading.Lock(), []

    def get() -> tiktoken.Encoding:
        own = getattr(local, "enc", None)
        if own is None:
            with lock:
                first = not given
                given.append(True)
            own = local.enc = enc if first else _own_copy(enc)
        return own

    return get


def encode_stream(work: Iterable[list[Segment]], enc: tiktoken.Encoding, workers: int) -> Iterator[np.ndarray]:
    """Token arrays for the work items, in order, encoded by `workers` threads (each with its own
    Encoding) while this one reads on. At most 2 items per thread are in flight, so a streamed
    corpus is never read further ahead than the tokenizers can keep up with."""
    workers = max(1, workers)
    encoder = _per_thread(enc)
    pending: collections.deque[Future] = collections.deque()
    with ThreadPoolExecutor(workers, thread_name_prefix="gptforge-tokenize") as pool:
        try:
            for item in work:
                pending.append(pool.submit(lambda item=item: encode_item(encoder(), item)))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:  # stopped early (max_tokens, an error): drop what has not started
            for future in pending:
                future.cancel()


def default_workers() -> int:
    """One tokenizer thread per CPU this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------------
# Writing shards


class ShardWriter:
    """Cuts the token stream into val shards (the first `val_tokens`), then train shards."""

    def __init__(self, out_dir: Path, shard_tokens: int, val_tokens: int, max_tokens: int, eot: int) -> None:
        self.out_dir, self.shard_tokens, self.val_tokens, self.max_tokens, self.eot = (
            out_dir,
            shard_tokens,
            val_tokens,
            max_tokens,
            eot,
        )
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


def _progress_bar(**kwargs):
    """tqdm.auto's bar (a widget in a notebook) without its asyncio half, whose import (asyncio)
    costs this stage's process 25 ms."""
    import warnings

    from tqdm.std import TqdmExperimentalWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=TqdmExperimentalWarning)
        from tqdm.autonotebook import tqdm
    return tqdm(**kwargs)


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
    """Read, tokenize and write the corpus into `out_dir` (which must exist) in one pass, here;
    timed end to end. The stage's datatrove tasks write the same shards (the tests' reference)."""
    start = time.perf_counter()
    enc = load_tokenizer(tokenizer_path)
    workers = workers or default_workers()
    writer = ShardWriter(Path(out_dir), shard_tokens, val_tokens, max_tokens, enc.eot_token)
    bar = _progress_bar(total=max_tokens, unit="tok", unit_scale=True, desc="tokenize", mininterval=1.0)
    stream = encode_stream(iter_work(iter_documents(corpus), PIECE_CHARS), enc, workers)
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
    check_split(stats, corpus.param, val_tokens)
    return stats


def check_split(stats: ShardStats, param: str, val_tokens: int) -> None:
    """An empty corpus, or one that validation takes whole, is bad input."""
    if stats.total_tokens == 0:
        raise BadInput(f"{param}: empty corpus (no text found)")
    if stats.tokens["train"] == 0:
        raise BadInput(
            f"{param}: the corpus has {stats.total_tokens} tokens, all taken by validation "
            f"(data.pretrain.val_tokens={val_tokens}): no training tokens left"
        )
