"""`prepare pretrain` as datatrove tasks (data/pretrain_pipeline.py) against the plain in-process
pass (`tokenize_to_shards`, the reference): the same shards, id for id, whatever the task count,
the workers or the executor (local; a local Ray and a real one-node Slurm cluster in the slow tests), the
`max_tokens` cut and the filters; a run killed mid-task redoes that task alone on the next run and
ends with the same bytes; bad executor settings end in one line.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_support import BIN, cli_env, last_error_line, run_cli, snapshot
from slurm_support import slurm_cluster  # noqa: F401  (fixture)

import gptforge.data.pretrain as P
from gptforge import samples
from gptforge.config.load import load_config
from gptforge.data.pretrain_pipeline import tokenize_with_datatrove
from gptforge.errors import BadInput

SAMPLE = Path(samples.__file__).parent / "fineweb_edu_sample.txt.gz"
TOKENIZER = str(Path(samples.__file__).parent / "gpt2_tokenizer")


def sample_lines() -> list[str]:
    return gzip.open(SAMPLE, "rt", encoding="utf-8").read().split("\n")


@pytest.fixture(scope="module")
def corpus_folder(tmp_path_factory) -> Path:
    """Eight input files of every kind: jsonl (one gzipped), parquet, txt, an empty one, and one
    with an empty record; the embedded FineWeb-Edu sample's lines dealt out among them."""
    folder = tmp_path_factory.mktemp("corpus")
    lines = sample_lines()
    for i in range(4):
        records = "".join(json.dumps({"text": t, "id": j}) + "\n" for j, t in enumerate(lines[i::6]))
        if i == 1:
            with gzip.open(folder / f"f{i}.jsonl.gz", "wt", encoding="utf-8") as f:
                f.write(records)
        else:
            (folder / f"f{i}.jsonl").write_text(records + ('{"text": ""}\n' if i == 2 else ""))
    pq.write_table(pa.table({"text": lines[4::6]}), folder / "f4.parquet")
    (folder / "f5.txt").write_text("\n".join(lines[5::6]))
    (folder / "f6.jsonl").write_text("")
    (folder / "f7.txt").write_text("A short closing document.")
    return folder


def settings(source, **keys):
    overrides = [f"data.pretrain.source={source}", f"tokenizer.path={TOKENIZER}", "tracking.enabled=false"]
    overrides += ["data.pretrain.val_tokens=3000", "data.pretrain.shard_tokens=25000"]
    overrides += [f"data.pretrain.{k}={v}" for k, v in keys.items()]
    return load_config(None, overrides).data.pretrain


def shards(folder: Path) -> dict[str, np.ndarray]:
    return {p.name: np.load(p) for p in sorted(folder.glob("*.npy"))}


def plain_and_tasks(tmp_path: Path, source, **keys) -> tuple[dict, dict, P.ShardStats, P.ShardStats]:
    d = settings(source, **keys)
    corpus = P.find_corpus(str(source), name=None, split="train", text_field="text", param="data.pretrain.source")
    plain, tasks = tmp_path / "plain", tmp_path / "tasks"
    plain.mkdir(), tasks.mkdir()
    a = P.tokenize_to_shards(
        corpus,
        plain,
        tokenizer_path=TOKENIZER,
        max_tokens=d.max_tokens,
        shard_tokens=d.shard_tokens,
        val_tokens=d.val_tokens,
    )
    b = tokenize_with_datatrove(corpus, tasks, d, tokenizer_path=TOKENIZER, eot=50256)
    return shards(plain), shards(tasks), a, b


def assert_same(plain: dict, tasks: dict) -> None:
    assert list(plain) == list(tasks)
    for name in plain:
        assert np.array_equal(plain[name], tasks[name]), name


@pytest.mark.parametrize(("tasks", "workers"), [(1, 1), (3, 1), (3, 2), (8, 1), (11, 1)])
def test_any_task_count_gives_the_plain_shards(tmp_path, corpus_folder, tasks, workers):
    plain, by_tasks, a, b = plain_and_tasks(
        tmp_path, corpus_folder, **{"cluster.tasks": tasks, "cluster.workers": workers}
    )
    assert len(plain) >= 9  # val and several train shards
    assert_same(plain, by_tasks)
    assert (a.tokens, a.documents, a.truncated) == (b.tokens, b.documents, b.truncated)
    assert not (tmp_path / ".prepare_pretrain.work").exists()  # removed once the shards are written


@pytest.mark.parametrize("max_tokens", [3001, 40_000, 123_457])
def test_max_tokens_cuts_where_the_plain_pass_does(tmp_path, corpus_folder, max_tokens):
    plain, by_tasks, a, b = plain_and_tasks(tmp_path, corpus_folder, max_tokens=max_tokens, **{"cluster.tasks": 3})
    assert_same(plain, by_tasks)
    assert a.truncated and b.truncated and b.total_tokens == min(max_tokens, a.total_tokens)


def test_the_embedded_sample_one_big_document(tmp_path):
    plain, by_tasks, a, b = plain_and_tasks(tmp_path, SAMPLE)
    assert_same(plain, by_tasks)
    assert b.total_tokens == 217_889


def test_min_chars_drops_the_short_documents(tmp_path, corpus_folder):
    lines = [t for t in sample_lines()[0::6] if len(t) >= 400]
    kept = tmp_path / "kept.jsonl"
    kept.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    (tmp_path / "only").mkdir()
    os.link(corpus_folder / "f0.jsonl", tmp_path / "only" / "f0.jsonl")
    d = settings(tmp_path / "only", **{"filters.min_chars": 400})
    corpus = P.find_corpus(str(tmp_path / "only"), name=None, split="train", text_field="text", param="p")
    out, ref = tmp_path / "out", tmp_path / "ref"
    out.mkdir(), ref.mkdir()
    stats = tokenize_with_datatrove(corpus, out, d, tokenizer_path=TOKENIZER, eot=50256)
    ref_corpus = P.find_corpus(str(kept), name=None, split="train", text_field="text", param="p")
    P.tokenize_to_shards(
        ref_corpus, ref, tokenizer_path=TOKENIZER, max_tokens=10**9, shard_tokens=25000, val_tokens=3000
    )
    assert_same(shards(ref), shards(out))
    assert sum(stats.documents.values()) == len(lines) < len(sample_lines()[0::6])


@pytest.mark.parametrize("tasks", [1, 3])
def test_minhash_drops_the_near_duplicates_and_keeps_one_of_each(tmp_path, tasks):
    # documents of 60+ words; copies of some of them, exact or with one word changed (Jaccard
    # similarity of their 5-gram shingles ~0.9), spread over other files: each cluster keeps
    # its first member (the lowest file, then position), the rest go
    docs = [t for t in sample_lines() if len(t.split()) >= 60][:40]
    near = [d.replace(" the ", " a ", 1) for d in docs[:5]]
    folder, kept_only = tmp_path / "corpus", tmp_path / "kept.jsonl"
    folder.mkdir()
    files = [docs[:15], docs[15:30] + docs[:5], docs[30:] + near]  # duplicates later than their originals
    for i, texts in enumerate(files):
        (folder / f"f{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    kept_only.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    d = settings(folder, **{"filters.minhash": "true", "cluster.tasks": tasks})
    corpus = P.find_corpus(str(folder), name=None, split="train", text_field="text", param="p")
    out, ref = tmp_path / "out", tmp_path / "ref"
    out.mkdir(), ref.mkdir()
    stats = tokenize_with_datatrove(corpus, out, d, tokenizer_path=TOKENIZER, eot=50256)
    plain = P.find_corpus(str(kept_only), name=None, split="train", text_field="text", param="p")
    P.tokenize_to_shards(plain, ref, tokenizer_path=TOKENIZER, max_tokens=10**9, shard_tokens=25000, val_tokens=3000)
    assert sum(stats.documents.values()) == len(docs) == 40
    assert_same(shards(ref), shards(out))


def test_slurm_without_sbatch_and_without_a_partition(tmp_path, corpus_folder, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    corpus = P.find_corpus(str(corpus_folder), name=None, split="train", text_field="text", param="p")
    with pytest.raises(BadInput, match="executor is slurm, but there is no `sbatch` on PATH"):
        tokenize_with_datatrove(
            corpus, tmp_path, settings(corpus_folder, executor="slurm"), tokenizer_path=TOKENIZER, eot=50256
        )
    (tmp_path / "sbatch").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "sbatch").chmod(0o755)
    with pytest.raises(BadInput, match="cluster.partition: the Slurm partition"):
        tokenize_with_datatrove(
            corpus, tmp_path, settings(corpus_folder, executor="slurm"), tokenizer_path=TOKENIZER, eot=50256
        )


# ---------------------------------------------------------------------------------------------
# The stage as a user runs it: killed mid-task, run again; on a Slurm cluster


def stage_repo(tmp_path: Path, corpus_folder: Path, **keys) -> Path:
    """A project folder whose params run prepare_pretrain on `corpus_folder`."""
    repo = tmp_path / "repo"
    repo.mkdir(parents=True)
    params = {"data": {"pretrain": {"source": str(corpus_folder), "val_tokens": 3000, "shard_tokens": 25000, **keys}}}
    params["tokenizer"] = {"path": TOKENIZER}
    params["tracking"] = {"enabled": False}
    (repo / "params.yaml").write_text(json.dumps(params))
    return repo


def three_files(tmp_path: Path) -> Path:
    """Three input files, one per task: two of one document, the third big (several tokenizer
    pieces), so that a pause at piece N lands mid-way through the third task."""
    lines = sample_lines()
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": lines[0]}) + "\n")
    (folder / "b.jsonl").write_text(json.dumps({"text": lines[1]}) + "\n")
    (folder / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines * 3))
    return folder


def assert_plain_bytes(tmp_path: Path, folder: Path, out: Path) -> None:
    """`out`'s shards are, byte for byte, those of one uninterrupted plain pass over `folder`."""
    reference = tmp_path / "reference"
    reference.mkdir()
    corpus = P.find_corpus(str(folder), name=None, split="train", text_field="text", param="p")
    P.tokenize_to_shards(
        corpus, reference, tokenizer_path=TOKENIZER, max_tokens=20_000_000, shard_tokens=25000, val_tokens=3000
    )
    assert {p.name: p.read_bytes() for p in reference.glob("*.npy")} == {
        p.name: p.read_bytes() for p in out.glob("*.npy")
    }


def paused_stage(repo: Path, pause: Path, piece: int, **env: str) -> subprocess.Popen:
    """`gptforge prepare pretrain` in `repo`, returned once a task holds after its tokenizer piece
    `piece` (the pause point wrote `pause`: "paused at step N, pid P")."""
    env = cli_env(GPTFORGE_PREFECT="0", GPTFORGE_PAUSE_AT_STEP=str(piece), GPTFORGE_PAUSE_FILE=str(pause), **env)
    proc = subprocess.Popen(
        [str(BIN / "gptforge"), "prepare", "pretrain"], cwd=repo, env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not pause.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.05)
    return proc


def slurm_keys(slurm_cluster, tasks: int) -> dict:
    """data.pretrain.cluster for the test cluster: small tasks, a quick poll."""
    return {
        "tasks": tasks,
        "partition": slurm_cluster.partition,
        "cpus_per_task": 1,
        "mem_per_cpu_gb": 1,
        "poll_seconds": 0.5,
    }


@pytest.mark.slow
def test_a_killed_task_is_redone_alone_and_the_bytes_are_the_same(tmp_path):
    # three files, one per task, run one after another; the third is big (several tokenizer
    # pieces): the run is held after the first piece of task 2 (piece 3 of the process) and killed
    folder = three_files(tmp_path)
    repo = stage_repo(tmp_path, folder, cluster={"tasks": 3, "workers": 1})
    pause = tmp_path / "paused"
    proc = paused_stage(repo, pause, 3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    pause.unlink()
    work = next((repo / "data" / ".pretrain.work").iterdir())
    assert sorted(p.name for p in (work / "completions").iterdir()) == ["00000", "00001"]
    assert not (repo / "data" / "pretrain").exists()  # nothing published
    done_before = {p.name: p.stat().st_mtime_ns for p in (work / "parts").glob("00000[01].*")}

    again = run_cli(["prepare", "pretrain"], repo, cli_env(GPTFORGE_PREFECT="0"), fresh=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "running task(s) 00002 of 3 (2 completed before)" in again.stderr
    assert done_before and not (repo / "data" / ".pretrain.work").exists()

    assert_plain_bytes(tmp_path, folder, repo / "data" / "pretrain")


@pytest.mark.slow
def test_on_a_slurm_cluster_under_dvc_repro_the_shards_are_the_local_ones(tmp_path, corpus_folder, slurm_cluster):
    local = stage_repo(tmp_path / "local", corpus_folder, cluster={"tasks": 3})
    done = run_cli(["prepare", "pretrain"], local, cli_env(GPTFORGE_PREFECT="0"))
    assert done.returncode == 0, done.stderr[-2000:]

    repo = stage_repo(tmp_path / "slurm", corpus_folder)
    keys = slurm_keys(slurm_cluster, 3)
    params = json.loads((repo / "params.yaml").read_text())
    params["data"]["pretrain"].update(executor="slurm", cluster=keys)
    (repo / "params.yaml").write_text(json.dumps(params))
    (repo / "dvc.yaml").write_text(
        "stages:\n  prepare_pretrain:\n    cmd: gptforge prepare pretrain\n"
        "    params: [data.pretrain]\n    outs: [data/pretrain]\n"
    )
    env = cli_env(GPTFORGE_PREFECT="0", **slurm_cluster.env)
    for cmd in (["git", "init", "-q"], [str(BIN / "dvc"), "init", "-q"]):
        subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True, timeout=120)
    repro = subprocess.run(
        [str(BIN / "dvc"), "repro", "-q"], cwd=repo, env=env, capture_output=True, text=True, timeout=300
    )
    assert repro.returncode == 0, repro.stdout[-1500:] + repro.stderr[-2500:] + slurm_cluster.log_tail()
    assert snapshot(repo / "data" / "pretrain").keys() == snapshot(local / "data" / "pretrain").keys()
    for name, data in snapshot(local / "data" / "pretrain").items():
        if name.endswith(".npy"):
            assert (repo / "data" / "pretrain" / name).read_bytes() == data, name
    manifest = json.loads((repo / "data" / "pretrain" / "manifest.json").read_text())
    assert manifest["executor"] == {"kind": "slurm", "tasks": 3}


@pytest.mark.slow
def test_on_a_local_ray_the_shards_are_the_plain_ones(tmp_path, corpus_folder):
    import ray

    try:
        plain, by_tasks, _, b = plain_and_tasks(
            tmp_path, corpus_folder, executor="ray", **{"cluster.tasks": 4, "cluster.cpus_per_task": 1}
        )
    finally:
        ray.shutdown()  # the local Ray that the first task started in this process
    assert_same(plain, by_tasks)
    assert b.total_tokens > 200_000


@pytest.mark.slow
def test_a_failed_slurm_task_fails_the_stage_naming_it(tmp_path, corpus_folder, slurm_cluster):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("f0.jsonl", "f2.jsonl", "f3.jsonl"):
        os.link(corpus_folder / name, bad / name)
    (bad / "f1.jsonl").write_text('{"no_text": 1}\n')  # task 1 of 2 fails on it
    keys = slurm_keys(slurm_cluster, 2)
    repo = stage_repo(tmp_path, bad, executor="slurm", cluster=keys)
    failed = run_cli(["prepare", "pretrain"], repo, cli_env(GPTFORGE_PREFECT="0", **slurm_cluster.env), fresh=True)
    assert failed.returncode == 1, failed.stderr[-2000:]
    line = last_error_line(failed.stderr)
    assert "data.pretrain: 1 of 2 tasks did not complete on slurm: task 00001 (log: " in line
    assert "task_00001.log" in line and not (repo / "data" / "pretrain").exists()


@pytest.mark.slow
def test_a_slurm_task_killed_mid_part_is_redone_alone(tmp_path, slurm_cluster):
    # three files, one per Slurm task; each task is a process of its own, counting its pieces:
    # only the third (a big file) reaches piece 2, holds there, and its process is killed
    folder = three_files(tmp_path)
    keys = slurm_keys(slurm_cluster, 3)
    repo = stage_repo(tmp_path, folder, executor="slurm", cluster=keys)
    pause = tmp_path / "paused"
    proc = paused_stage(repo, pause, 2, **slurm_cluster.env)
    task_pid = int(pause.read_text().split("pid ")[1])
    os.kill(task_pid, signal.SIGKILL)  # the Slurm task's process, not the stage
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-2000:]
    assert "1 of 3 tasks did not complete on slurm: task 00002 (log: " in stderr.strip().splitlines()[-1]
    assert not (repo / "data" / "pretrain").exists()

    again = run_cli(["prepare", "pretrain"], repo, cli_env(GPTFORGE_PREFECT="0", **slurm_cluster.env), fresh=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "running task(s) 00002 of 3 (2 completed before)" in again.stderr
    assert_plain_bytes(tmp_path, folder, repo / "data" / "pretrain")
