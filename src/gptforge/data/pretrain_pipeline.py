"""`prepare pretrain` as a datatrove pipeline: the corpus read, filtered and tokenized by tasks that
run here, on a Slurm cluster or on Ray (data.pretrain.executor), then merged into the shards the
training loader reads (`data.pretrain.ShardWriter`: the first `val_tokens` tokens val, the rest train).

The pipeline of each task is three datatrove steps:

- `ReadCorpus`: gptforge's own readers (`data.pretrain.iter_documents`: .txt, .jsonl, .parquet,
  gzipped or not, and hf:// datasets streamed), the input files dealt out among the tasks (file i
  to task i mod tasks; an hf:// dataset is one stream, read by task 0). One file keeps one task
  busy, as with datatrove's own readers.
- `MinChars` (data.pretrain.filters.min_chars, off by default): documents shorter are dropped.
- `TokenizeParts`: each input file's documents, in order, into one *part* of raw uint16 tokens
  (`<|endoftext|>` before each document), encoded on threads as the plain stage did
  (`data.pretrain.encode_stream`), written to a temporary name and renamed when whole.

datatrove marks each task complete when its pipeline has run; a rerun runs only the tasks
without the mark (a task killed mid-part left only a temporary file, which the rerun replaces).
The parts and marks live in a work folder keyed by what they depend on (the sources' names,
sizes and times, the tokenizer, the filters, the task count), beside the output (the stage's:
`data/.pretrain.work/KEY`) or under data.pretrain.cluster.logging_dir (a folder every node sees,
on a cluster); it is removed once the shards are written, and on bad input. The merge reads the parts in
input-file order, so the token ids are those of one pass over the corpus in order, whatever the
task count or executor: the plain stage's, id for id (tests/test_pretrain_pipeline.py).

Why our tokenizer step rather than datatrove's `DocumentTokenizer`: it writes a token file per
task with its documents shuffled and uses Hugging Face `tokenizers`; the training loader reads one
ordered stream, and our threaded tiktoken step is measured beside the plain stage in
benchmarks/bench_tokenize.py (docs/data.md).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
from datatrove.data import Document
from datatrove.executor.local import LocalPipelineExecutor
from datatrove.executor.slurm import SlurmPipelineExecutor
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.utils.word_tokenizers import WordTokenizer

from gptforge.data.pretrain import (
    Corpus,
    ShardStats,
    ShardWriter,
    check_split,
    default_workers,
    encode_stream,
    iter_work,
)
from gptforge.errors import BadInput, StageFailed
from gptforge.io import atomic_file
from gptforge.modeling.tokenizer import describe
from gptforge.runtime.pause import PausePoint

log = logging.getLogger("gptforge")

PARTS = "parts"
MERGE_TOKENS = 1 << 24  # tokens read from a part at a time while merging
_pieces_done = 0  # tokenizer pieces written by this process (the pause point counts them)


def part_count(corpus: Corpus) -> int:
    """One part per input file; an hf:// dataset is one stream, one part."""
    return 1 if corpus.hf_repo else len(corpus.files)


def parts_of_task(corpus: Corpus, rank: int, world_size: int) -> range:
    """The parts (input files) task `rank` of `world_size` reads."""
    return range(rank, part_count(corpus), world_size)


def part_path(work: Path, part: int) -> Path:
    return work / PARTS / f"{part:06d}.bin"


# ---------------------------------------------------------------------------------------------
# The steps (datatrove PipelineSteps; a Slurm task unpickles them with dill, by reference here)


class ReadCorpus(PipelineStep):
    """The documents of this task's input files, in order, each tagged with its part."""

    name = "gptforge corpus"
    type = "📖 - READER"

    def __init__(self, corpus: Corpus):
        super().__init__()
        self.corpus = corpus

    def run(self, data=None, rank: int = 0, world_size: int = 1) -> Iterator[Document]:
        from gptforge.data.pretrain import iter_documents

        for part in parts_of_task(self.corpus, rank, world_size):
            one = self.corpus
            if not one.hf_repo:
                one = Corpus(files=(one.files[part],), text_field=one.text_field, param=one.param)
            for index, blocks in enumerate(iter_documents(one)):
                self.stat_update("documents")
                yield Document(text="".join(blocks), id=f"{part}/{index}", metadata={"part": part})


class MinChars(BaseFilter):
    """Drops documents shorter than `min_chars` characters."""

    name = "gptforge min_chars"

    def __init__(self, min_chars: int):
        super().__init__()
        self.min_chars = min_chars

    def filter(self, doc: Document) -> bool:
        return len(doc.text) >= self.min_chars


class TokenizeParts(PipelineStep):
    """Each part's documents into `parts/NNNNNN.bin` (raw little-endian uint16) and its record
    `parts/NNNNNN.json` (tokens, documents, capped), both whole or absent. A task stops tokenizing
    once it holds `max_tokens` (no merge can need more of it); its later parts are written empty
    and marked capped."""

    name = "gptforge tokenize"
    type = "🔢 - TOKENIZER"

    def __init__(self, corpus: Corpus, work: Path, tokenizer_path: str | None, max_tokens: int, threads: int):
        super().__init__()
        self.corpus, self.work, self.tokenizer_path = corpus, Path(work), tokenizer_path
        self.max_tokens, self.threads = max_tokens, threads

    def run(self, data=None, rank: int = 0, world_size: int = 1) -> None:
        from gptforge.data.pretrain import _progress_bar
        from gptforge.modeling.tokenizer import load_tokenizer

        enc = load_tokenizer(self.tokenizer_path)
        threads = self.threads or default_workers()
        (self.work / PARTS).mkdir(parents=True, exist_ok=True)
        self.bar = _progress_bar(unit="tok", unit_scale=True, desc=f"task {rank:05d}", mininterval=1.0)
        try:
            self._run(data, enc, threads, rank, world_size)
        finally:
            self.bar.close()

    def _run(self, data, enc, threads: int, rank: int, world_size: int) -> None:
        held = 0
        todo = list(parts_of_task(self.corpus, rank, world_size))
        for part, docs in itertools.groupby(data or (), key=lambda d: d.metadata["part"]):
            for empty in [p for p in todo if p < part]:  # files without a document (or all filtered)
                self._write(empty, iter(()), enc, threads, capped=held >= self.max_tokens)
            todo = [p for p in todo if p > part]
            held += self._write(part, docs, enc, threads, capped=False, room=self.max_tokens - held)
            if held >= self.max_tokens:  # the rest of this task's files is not read
                break
        for empty in todo:
            self._write(empty, iter(()), enc, threads, capped=held >= self.max_tokens)

    def _write(self, part: int, docs, enc, threads: int, *, capped: bool, room: int = 0) -> int:
        global _pieces_done
        path = part_path(self.work, part)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tokens = documents = 0
        pause = PausePoint.from_env()
        with open(tmp, "wb") as f:
            if not capped:
                counted = _CountedTexts(docs)
                stream = encode_stream(iter_work(counted), enc, threads)
                try:
                    for ids in stream:
                        f.write(ids.astype("<u2", copy=False).tobytes())
                        tokens += len(ids)
                        self.stat_update("tokens", value=len(ids))
                        self.bar.update(len(ids))
                        _pieces_done += 1
                        pause.after(_pieces_done)
                        if tokens >= room:
                            capped = True
                            break
                finally:
                    stream.close()
                documents = counted.documents
        os.replace(tmp, path)
        with atomic_file(path.with_suffix(".json")) as f:
            json.dump({"tokens": tokens, "documents": documents, "capped": capped}, f)
        return tokens


class _CountedTexts:
    """The documents' texts as `iter_work` takes them (each an iterator of blocks), counted."""

    def __init__(self, docs):
        self.docs, self.documents = docs, 0

    def __iter__(self):
        for doc in self.docs:
            self.documents += 1
            yield iter((doc.text,))


class WhitespaceWords(WordTokenizer):
    """MinHash's words, split on whitespace: datatrove's English word tokenizer needs spaCy or
    NLTK data downloaded; shingles of whitespace words find the same near-duplicate web pages
    (FineWeb's own dedup normalizes the text first, as MinhashDedupSignature does here)."""

    def word_tokenize(self, text: str) -> list[str]:
        return text.split()

    def sent_tokenize(self, text: str) -> list[str]:
        return [line for line in text.split("\n") if line.strip()]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [m.span() for m in re.finditer(r"\S+", text)]


def minhash_config():
    """FineWeb's MinHash settings (5-gram shingles, 14 buckets of 8 hashes: pairs above ~0.75
    Jaccard similarity are caught), with sha1 hashes (xxhash is an extra dependency)."""
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.utils.hashing import HashConfig

    return MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8, hash_config=HashConfig(hash_fc="sha1"))


def dedup_stages(corpus: Corpus, work: Path, min_chars: int) -> list[tuple[str, list, int]]:
    """datatrove's MinHash deduplication before the tokenizing run, as (name, steps, tasks):
    signatures of each task's documents, then per bucket the pairs that collide, then the
    clusters and which documents to drop (each cluster keeps one). The tokenizing run's
    `MinhashDedupFilter` drops them by their index in the task's stream, so the same reader and
    filters run before it (`corpus_steps`)."""
    from datatrove.pipeline.dedup.minhash import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupSignature

    config, m = minhash_config(), work / "minhash"
    signatures = MinhashDedupSignature(output_folder=str(m / "signatures"), config=config, language=WhitespaceWords())
    return [
        ("signatures", [*corpus_steps(corpus, min_chars), signatures], 0),
        (
            "buckets",
            [MinhashDedupBuckets(str(m / "signatures"), str(m / "buckets"), config=config)],
            config.num_buckets,
        ),
        ("clusters", [MinhashDedupCluster(str(m / "buckets"), str(m / "remove_ids"), config=config)], 1),
    ]


def corpus_steps(corpus: Corpus, min_chars: int) -> list:
    """The reader and the filters every run over the corpus starts with."""
    return [ReadCorpus(corpus)] + ([MinChars(min_chars)] if min_chars > 0 else [])


def build_pipeline(
    corpus: Corpus,
    work: Path,
    *,
    tokenizer_path: str | None,
    max_tokens: int,
    threads: int,
    min_chars: int,
    minhash: bool = False,
) -> list:
    """The steps of one task, in order."""
    steps = corpus_steps(corpus, min_chars)
    if minhash:
        from datatrove.pipeline.dedup.minhash import MinhashDedupFilter

        steps.append(MinhashDedupFilter(str(work / "minhash" / "remove_ids")))
    steps.append(TokenizeParts(corpus, work, tokenizer_path, max_tokens, threads))
    return steps


# ---------------------------------------------------------------------------------------------
# The stage's tokenizing


def tokenize_with_datatrove(
    corpus: Corpus, out_dir: Path, d, *, tokenizer_path: str | None, eot: int, work_root: Path | None = None
) -> ShardStats:
    """`tokenize_to_shards` as datatrove tasks (data.pretrain.executor) and a merge of their parts
    (data/pretrain_py): the same shards, id for id. The work folder is removed once the
    shards are written; a failed or killed run leaves it, and the next run redoes only the tasks
    that did not complete."""
    start = time.perf_counter()
    work_root = work_root or Path(out_dir).absolute().parent / ".prepare_pretrain.work"
    work = work_folder(corpus, d, describe(tokenizer_path), work_root)
    steps = build_pipeline(
        corpus,
        work,
        tokenizer_path=tokenizer_path,
        max_tokens=d.max_tokens,
        threads=d.workers,
        min_chars=d.filters.min_chars,
        minhash=d.filters.minhash,
    )
    executor = make_executor(d.executor, steps, d, work)
    log.info("tokenizing in %d %s task(s); work folder %s", d.cluster.tasks, d.executor, work)
    try:
        if d.filters.minhash:
            for name, dedup, tasks in dedup_stages(corpus, work, d.filters.min_chars):
                log.info("MinHash deduplication: %s", name)
                where = work / "minhash" / f"run_{name}"
                ex = make_executor(d.executor, dedup, d, where, tasks)
                run_tasks(d.executor, ex, d, where, what=f"MinHash {name} tasks")
        run_tasks(d.executor, executor, d, work)
        stats = merge_parts(
            work,
            part_count(corpus),
            Path(out_dir),
            shard_tokens=d.shard_tokens,
            val_tokens=d.val_tokens,
            max_tokens=d.max_tokens,
            eot=eot,
        )
        stats.seconds = time.perf_counter() - start
        check_split(stats, corpus.param, d.val_tokens)
    except BadInput:  # nothing to resume: the input changes before the next run
        remove_work(work)
        raise
    remove_work(work)
    return stats


# ---------------------------------------------------------------------------------------------
# Where the tasks run


def work_folder(corpus: Corpus, d, tokenizer: str, root: Path) -> Path:
    """The work folder of this corpus and these settings: parts and completion marks made for
    other inputs are never reused (its name is a hash of everything they depend on)."""
    files = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in corpus.files]
    key = json.dumps(
        {
            "files": files,
            "hf": [corpus.hf_repo, corpus.hf_name, corpus.hf_split],
            "text_field": corpus.text_field,
            "tokenizer": tokenizer,
            "max_tokens": d.max_tokens,
            "tasks": d.cluster.tasks,
            "filters": d.filters.model_dump(),
        },
        sort_keys=True,
    )
    root = Path(d.cluster.logging_dir) if d.cluster.logging_dir else root
    return (root / hashlib.sha256(key.encode()).hexdigest()[:16]).absolute()


def make_executor(kind: str, steps: list, d, work: Path, tasks: int = 0):
    """datatrove's executor of `kind` over `steps` in `tasks` tasks (0: cluster.tasks), its logs
    and completion marks in `work`."""
    c = d.cluster.model_copy(update={"tasks": tasks}) if tasks else d.cluster
    if kind == "local":
        return LocalExecutor(steps, tasks=c.tasks, workers=min(c.workers, c.tasks), logging_dir=str(work))
    if kind == "slurm":
        if shutil.which("sbatch") is None:
            raise BadInput(
                "data.pretrain.executor is slurm, but there is no `sbatch` on PATH: "
                "run the stage where Slurm's commands are, or set executor: local"
            )
        if not c.partition:
            raise BadInput(
                "data.pretrain.cluster.partition: the Slurm partition to run on is needed with executor slurm"
            )
        return SlurmExecutor(
            steps,
            tasks=c.tasks,
            time=c.time,
            partition=c.partition,
            cpus_per_task=c.cpus_per_task,
            mem_per_cpu_gb=c.mem_per_cpu_gb,
            job_name=c.job_name,
            logging_dir=str(work),
            slurm_logs_folder=str(work / "slurm_logs"),
            env_command=_activate_command(),
            mail_type="NONE",
            sbatch_args={"chdir": os.getcwd()},
        )
    if kind == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise BadInput(
                "data.pretrain.executor is ray, but the `ray` package is not installed: pip install 'ray[default]'"
            ) from None
        from datatrove.executor.ray import RayPipelineExecutor

        if c.ray_address:
            os.environ["RAY_ADDRESS"] = c.ray_address
        return RayPipelineExecutor(
            steps,
            tasks=c.tasks,
            workers=c.workers,
            logging_dir=str(work),
            cpus_per_task=c.cpus_per_task,
            mem_per_cpu_gb=c.mem_per_cpu_gb,
        )
    raise BadInput(f"data.pretrain.executor: {kind!r} is not one of local, slurm, ray")


def _activate_command() -> str:
    """What a Slurm task runs before Python: this process's venv (its `launch_pickled_pipeline`
    and gptforge), so the node runs the same code."""
    if sys.prefix != sys.base_prefix:
        return f"source {shlex.quote(str(Path(sys.prefix) / 'bin' / 'activate'))}"
    return f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:$PATH"


class LocalExecutor(LocalPipelineExecutor):
    """datatrove's local executor without its `multiprocess.Manager`: that server process is forked
    from the stage, so it inherits the stage's lock (runtime.locks) and outlives a killed stage,
    holding the lock: the rerun that should resume found the stage "already running". One worker
    runs the tasks here in turn; more run them in a process pool whose workers come from a fork
    server (no inherited lock), and which ends with the stage."""

    def run(self) -> None:
        ranks = self.get_incomplete_ranks(range(self.tasks))
        if not ranks:
            return
        self.save_executor_as_json()
        if self.workers == 1:
            pipeline = self.pipeline
            try:
                for rank in ranks:
                    self.pipeline = copy.deepcopy(pipeline)
                    self._run_for_rank(rank)
            finally:
                self.pipeline = pipeline
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("forkserver")) as pool:
            list(pool.map(self._run_for_rank, ranks))

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1):
        """datatrove's task run, its log to the task's file only: on the console a failed task
        would print a traceback before the stage's one-line error (the file keeps it)."""
        import datatrove.executor.base as base

        console_and_file = base.add_task_logger
        base.add_task_logger = _task_log_file_only
        try:
            return super()._run_for_rank(rank, local_rank, node_rank)
        finally:
            base.add_task_logger = console_and_file


def _task_log_file_only(logging_dir, rank: int, local_rank: int = 0, node_rank: int = -1):
    """`datatrove.utils.logging.add_task_logger` without its console sink."""
    from loguru import logger

    logger.remove()
    logfile = logging_dir.open(f"logs/task_{rank:05d}.log", "w")
    logger.add(
        logfile,
        level="DEBUG",
        format="{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <8} | {name}:{function}:{line} - {message}",
    )
    logger.info(f"Launching pipeline for {rank=}")
    return logfile


class SlurmExecutor(SlurmPipelineExecutor):
    """datatrove's Slurm executor without its follow-up job that merges the tasks' statistics: that
    job waits `afterok` on the tasks, so a failed task would leave it pending for ever."""

    def launch_merge_stats(self) -> None:
        pass


def run_tasks(kind: str, executor, d, work: Path, what: str = "tasks") -> None:
    """Run the tasks to their end (a cluster job is waited for, its progress shown); a task that
    did not complete fails the stage with its name and log paths."""
    tasks = executor.world_size
    todo = executor.get_incomplete_ranks(range(tasks), skip_completed=True)
    names = " ".join(f"{r:05d}" for r in todo[:8]) + (" ..." if len(todo) > 8 else "")
    log.info("running task(s) %s of %d (%d completed before)", names, tasks, tasks - len(todo))
    executor.run()
    if kind == "slurm" and executor.job_id not in (None, -1):
        wait_for_slurm_job(str(executor.job_id), work, tasks, d.cluster.poll_seconds)
    missing = executor.get_incomplete_ranks(range(tasks), skip_completed=True)
    if missing:
        logs = ", ".join(f"task {r:05d} (log: {_task_logs(work, r)})" for r in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise StageFailed(f"data.pretrain: {len(missing)} of {tasks} {what} did not complete on {kind}: {logs}{more}")


def _task_logs(work: Path, rank: int) -> str:
    logs = [work / "logs" / f"task_{rank:05d}.log"]
    logs += sorted((work / "slurm_logs").glob(f"*_{rank}.out")) if (work / "slurm_logs").is_dir() else []
    return ", ".join(str(p) for p in logs if p.exists()) or f"none written under {work}"


def wait_for_slurm_job(job_id: str, work: Path, tasks: int, poll_seconds: float) -> None:
    """Until Slurm lists none of the job's array tasks, with a bar of the completed tasks."""
    from gptforge.data.pretrain import _progress_bar

    bar = _progress_bar(total=tasks, unit="task", desc=f"slurm job {job_id}")
    try:
        while True:
            listed = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i %T"], capture_output=True, text=True)
            done = len(list((work / "completions").glob("*"))) if (work / "completions").is_dir() else 0
            bar.update(done - bar.n)
            if listed.returncode != 0 or not listed.stdout.strip():
                return  # finished (squeue forgets a job after MinJobAge: an error then)
            time.sleep(poll_seconds)
    finally:
        bar.close()


def remove_work(work: Path) -> None:
    """The work folder, and its parent when that held nothing else."""
    shutil.rmtree(work, ignore_errors=True)
    with contextlib.suppress(OSError):
        work.parent.rmdir()


# ---------------------------------------------------------------------------------------------
# Merging the parts into shards


def merge_parts(
    work: Path, n_parts: int, out_dir: Path, *, shard_tokens: int, val_tokens: int, max_tokens: int, eot: int
) -> ShardStats:
    """The parts in input-file order through one `ShardWriter`: the shards one in-order pass
    over the corpus writes."""
    writer = ShardWriter(out_dir, shard_tokens, val_tokens, max_tokens, eot)
    capped = False
    for part in range(n_parts):
        path = part_path(work, part)
        record = path.with_suffix(".json")
        if not record.exists():
            raise StageFailed(f"data.pretrain: part {part} is missing from {work} although every task completed")
        capped = capped or json.loads(record.read_text())["capped"]
        tokens = np.memmap(path, dtype="<u2", mode="r") if path.stat().st_size else np.empty(0, np.uint16)
        for start in range(0, len(tokens), MERGE_TOKENS):
            writer.add(np.asarray(tokens[start : start + MERGE_TOKENS]))
        if writer.full:
            later = any(part_path(work, p).stat().st_size for p in range(part + 1, n_parts))
            writer.stats.truncated = writer.stats.truncated or later or capped
            break
    writer.flush()
    return writer.stats
