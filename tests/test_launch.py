"""Pretraining on several processes: `gptforge pretrain` launches itself under torchrun when
`pretrain.nproc_per_node * distributed.nnodes` is above 1 (gptforge.training.launch); the
fine-tuning stages' launch is in test_finetune_distributed.py.

Fast: the torchrun command lines (checked with torchrun's own parser), the multi-node settings'
validation, the workers' environment and the streaming of their output. Slow (CPU, gloo, two
processes): the launched run equals one process with the same global batch and makes exactly
one MLflow run; through Prefect it is the `pretrain` flow run with a `launch-pretrain` task and
the flow run id on the MLflow run; two "nodes" on this machine meet at a c10d rendezvous; bad
settings and a failed job are one line; Ctrl-C and SIGTERM stop every process of the job.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys

import pytest
from cli_support import BIN, cli_env, error_lines, run_cli
from pretrain_support import SMALL, losses, shards  # noqa: F401  (shards: a fixture, data/pretrain made once)
from process_support import Paused, free_port, started
from test_cli import prefect_get
from torch.distributed.run import parse_args as torchrun_args

from gptforge.config.load import load_config
from gptforge.errors import BadInput, StageFailed
from gptforge.runtime import child_output
from gptforge.runtime.run_context import env_tags
from gptforge.training import launch

# --------------------------------------------------------------------------------------------
# The command line


def test_single_node_is_standalone_and_passes_params_and_overrides():
    cfg = load_config(None, ["pretrain.nproc_per_node=4"])
    cmd = launch.torchrun_command(cfg, "snap.yaml", ["pretrain.max_steps=5", "model.n_layer=2"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    args = torchrun_args(cmd[3:])
    assert args.standalone and args.nproc_per_node == "4" and args.max_restarts == 0
    assert "--nnodes" not in cmd and "--rdzv_endpoint" not in cmd
    assert args.module and args.training_script == "gptforge.cli"
    assert args.training_script_args == [
        "pretrain",
        "--params",
        "snap.yaml",
        "-S",
        "pretrain.max_steps=5",
        "-S",
        "model.n_layer=2",
    ]


def test_multi_node_has_the_rendezvous():
    cfg = load_config(
        None,
        [
            "pretrain.nproc_per_node=8",
            "distributed.nnodes=4",
            "distributed.rdzv_endpoint=node0:29500",
            "distributed.rdzv_id=job7",
            "distributed.max_restarts=3",
        ],
    )
    cmd = launch.torchrun_command(cfg, None)
    args = torchrun_args(cmd[3:])
    assert not args.standalone
    assert (
        args.nproc_per_node,
        args.nnodes,
        args.rdzv_backend,
        args.rdzv_endpoint,
        args.rdzv_id,
        args.max_restarts,
    ) == ("8", "4", "c10d", "node0:29500", "job7", 3)
    assert args.training_script_args == ["pretrain"]
    static = load_config(
        None, ["distributed.nnodes=2", "distributed.rdzv_endpoint=10.0.0.1:29400", "distributed.rdzv_backend=static"]
    )
    assert torchrun_args(launch.torchrun_command(static, "p.yaml")[3:]).rdzv_backend == "static"


def test_launch_only_above_one_process_and_never_inside_a_worker(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not launch.needs_launch(load_config(None, []))
    two_nodes = load_config(None, ["distributed.nnodes=2", "distributed.rdzv_endpoint=node0"])
    assert two_nodes.world_size("pretrain") == 2 and launch.needs_launch(two_nodes)
    cfg = load_config(
        None, ["pretrain.nproc_per_node=2", "distributed.nnodes=3", "distributed.rdzv_endpoint=node0:1234"]
    )
    assert cfg.world_size("pretrain") == 6 and launch.needs_launch(cfg)
    # every training stage reads the nodes from distributed and its own nproc_per_node
    assert cfg.world_size("instruct") == 3 and launch.needs_launch(cfg, "finetune_instruct")
    assert not launch.needs_launch(cfg, "evaluate")
    monkeypatch.setenv("WORLD_SIZE", "6")  # torchrun's workers run the same stage: they train
    assert not launch.needs_launch(cfg)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["distributed.nnodes=2"], "distributed.rdzv_endpoint is required when distributed.nnodes > 1"),
        (
            ["distributed.nnodes=2", "distributed.rdzv_endpoint=node0:http"],
            "must be HOST or HOST:PORT, got 'node0:http'",
        ),
        (["distributed.rdzv_endpoint=:29400"], "must be HOST or HOST:PORT"),
        (["distributed.nnodes=0"], "distributed.nnodes: expected"),
        (["distributed.rdzv_backend=etcd"], "distributed.rdzv_backend: expected one of 'c10d', 'static'"),
        (["distributed.max_restarts=-1"], "distributed.max_restarts"),
        # the names these settings had first, in the pretrain section, still work, moved
        (["pretrain.nnodes=2"], "distributed.rdzv_endpoint is required when distributed.nnodes > 1"),
        (
            ["pretrain.nnodes=2", "distributed.nnodes=3", "distributed.rdzv_endpoint=h"],
            "pretrain.nnodes (2) and distributed.nnodes (3) disagree: set distributed.nnodes only",
        ),
        # the fine-tuning stages' processes
        (["preference.strategy=fsdp"], "preference.strategy: fsdp is not available for DPO"),
        (
            ["instruct.strategy=fsdp", "instruct.method=lora", "instruct.quantize=4bit"],
            "instruct.quantize: 4bit (QLoRA) keeps the base in bitsandbytes' 4-bit tensors",
        ),
        (["classify.strategy=zero1"], "classify.strategy: expected one of 'ddp', 'fsdp'"),
    ],
)
def test_multi_node_settings_are_validated(overrides, message):
    with pytest.raises(BadInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


@pytest.mark.slow
def test_cli_bad_multi_node_settings_are_one_line(tmp_path):
    env = cli_env(GPTFORGE_PREFECT="0")
    r = run_cli(["pretrain", "-S", "distributed.nnodes=2"], cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert (
        r.stderr.strip().splitlines()
        == error_lines(r.stderr)
        == [
            "gptforge: error: config with -S overrides: distributed.rdzv_endpoint is required when distributed.nnodes "
            "> 1 (got 2): the host:port of the rendezvous, the same on every node"
        ]
    )
    # The batch split counts every process of every node: 12 sequences x 64 tokens x 2 x 2.
    r = run_cli(
        [
            "pretrain",
            "-S",
            "pretrain.nproc_per_node=2",
            "-S",
            "pretrain.nnodes=2",
            "-S",
            "pretrain.rdzv_endpoint=node0:29400",
        ],
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2 and len(error_lines(r.stderr)) == 1 and "(12*64*4 = 3072)" in r.stderr, r.stderr


# --------------------------------------------------------------------------------------------
# The workers' environment and output


def test_workers_skip_prefect_and_get_the_tags(monkeypatch, caplog):
    monkeypatch.setenv("GPTFORGE_PARENT_RUN_ID", "parent123")
    monkeypatch.setenv("GPTFORGE_RUN_TAGS", json.dumps({"team": "lm", "prefect.flow_run_id": "outer"}))
    env = launch.worker_env({"prefect.flow_run_id": "f1", "prefect.flow_run_name": "brave-fox", "none": None})
    assert env["GPTFORGE_PREFECT"] == "0" and env["GPTFORGE_PARENT_RUN_ID"] == "parent123"
    assert json.loads(env["GPTFORGE_RUN_TAGS"]) == {
        "team": "lm",
        "prefect.flow_run_id": "f1",
        "prefect.flow_run_name": "brave-fox",
    }
    monkeypatch.setenv("GPTFORGE_RUN_TAGS", json.dumps({"a": 1}))
    assert env_tags() == {"a": 1}
    monkeypatch.setenv("GPTFORGE_RUN_TAGS", "[1, 2]")
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        assert env_tags() == {}
    assert "GPTFORGE_RUN_TAGS is not a JSON object" in caplog.text


class Collect(logging.Handler):
    """A non-console handler on the gptforge logger, as Prefect's API handler is in a flow run."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, str]] = []

    def emit(self, record):
        self.records.append((record.levelname, record.getMessage()))


@pytest.fixture
def collected():
    logger, handler = logging.getLogger("gptforge"), Collect()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def test_output_goes_raw_to_stderr_and_line_by_line_to_the_log(monkeypatch, capsys, collected):
    monkeypatch.setattr(child_output, "PROGRESS_EVERY", 0.0)
    out = child_output.ChildOutput()
    error = "gptforge: error: boom \u2713\n".encode()  # a 3-byte character, cut between two reads
    raw = [
        b"W0101 torchrun warning\n12:00:01 INFO gptforge: pretraining 0.10M para",
        b"meters on cpu\n",
        b"\rpretrain:  10%|#   | 1/10",
        b"\rpretrain:  20%|##  | 2/10",
        b"\rpretrain: 100%|####| 10/10\n",
        b"12:00:09 WARNING gptforge: slow disk\n" + error[:-2],
        error[-2:],
        b"tail without newline",
    ]
    for chunk in raw:
        out.feed(chunk)
    out.close()
    assert capsys.readouterr().err == b"".join(raw).decode()  # the terminal sees what the workers wrote
    assert collected == [
        ("INFO", "W0101 torchrun warning"),
        ("INFO", "pretraining 0.10M parameters on cpu"),
        ("INFO", "pretrain:  10%|#   | 1/10"),
        ("INFO", "pretrain:  20%|##  | 2/10"),
        ("INFO", "pretrain: 100%|####| 10/10"),
        ("WARNING", "slow disk"),
        ("ERROR", "boom \u2713"),
        ("INFO", "tail without newline"),
    ]
    assert out.last_error == "boom \u2713"


def test_a_line_another_rank_left_unterminated_does_not_hide_a_log_line(capsys, collected):
    # One rank's exit message (nanobind's leak report ends without a newline) runs into the
    # next rank's log line or error line: each still reaches the log as its own record.
    out = child_output.ChildOutput()
    out.feed(
        b"See https://nanobind.readthedocs.io/refleaks.html12:00:09 INFO gptforge: pretrain done: step 6\n"
        b"leak reportgptforge: error: boom\n"
    )
    assert collected == [
        ("INFO", "See https://nanobind.readthedocs.io/refleaks.html"),
        ("INFO", "pretrain done: step 6"),
        ("INFO", "leak report"),
        ("ERROR", "boom"),
    ]
    assert out.last_error == "boom"


def test_progress_bar_reaches_the_log_at_most_every_progress_every(capsys, collected):
    out = child_output.ChildOutput()  # PROGRESS_EVERY = 30 s: the redraws in between are not sent
    for i in range(1, 50):
        out.feed(f"\rpretrain: {i}/50".encode())
    out.feed(b"\rpretrain: 50/50\n")
    assert collected == [("INFO", "pretrain: 50/50")] and len(out.pending) == 0


# --------------------------------------------------------------------------------------------
# End to end (CPU, gloo, 2 processes)

TINY = [*SMALL, "pretrain.max_steps=6", "pretrain.batch_tokens=128"]


def _args(*overrides: str) -> list[str]:
    return sum((["-S", s] for s in overrides), [])


def _workdir(root, name, shards):
    (root / name / "data").mkdir(parents=True)
    (root / name / "data/pretrain").symlink_to(shards)
    return root / name


def _stage_runs(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id])


@pytest.mark.slow
def test_two_processes_from_the_cli_match_one_and_make_one_mlflow_run(tmp_path, shards, small_tokenizer, mlflow_uri):
    common = [*TINY, f"tokenizer.path={small_tokenizer}"]
    experiment = f"launch-{tmp_path.name}"
    env = cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI=mlflow_uri)
    one = run_cli(["pretrain", *_args(*common)], cwd=_workdir(tmp_path, "one", shards), env=env)
    assert one.returncode == 0, one.stderr
    ddp = run_cli(
        [
            "pretrain",
            *_args(*common, "pretrain.nproc_per_node=2", "tracking.enabled=true", f"tracking.experiment={experiment}"),
        ],
        cwd=_workdir(tmp_path, "ddp", shards),
        env=env,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "launching 2 processes (1 node x 2)" in ddp.stderr and "--standalone" in ddp.stderr
    assert "(fp32, 2 processes)" in ddp.stderr  # the workers trained with DDP, world size 2

    a, b = losses(tmp_path / "one/plots/pretrain.csv"), losses(tmp_path / "ddp/plots/pretrain.csv")
    assert sorted(a) == sorted(b) == list(range(6))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])
    metrics = json.loads((tmp_path / "ddp/metrics/pretrain.json").read_text())
    assert (tmp_path / "ddp/checkpoints/pretrain/final/model.safetensors").is_file()

    [run] = _stage_runs(mlflow_uri, experiment)  # rank 0's run; neither the launcher nor rank 1 made one
    assert run.info.status == "FINISHED" and run.data.tags["gptforge.stage"] == "pretrain"
    assert run.data.params["pretrain.nproc_per_node"] == "2" and run.data.params["distributed.nnodes"] == "1"
    assert run.data.metrics["val_loss"] == pytest.approx(metrics["val_loss"])
    assert "prefect.flow_run_id" not in run.data.tags


@pytest.mark.slow
def test_through_prefect_it_is_the_pretrain_flow_run_with_a_launch_task(
    tmp_path, shards, small_tokenizer, prefect_api, mlflow_uri
):
    experiment = f"launch-{tmp_path.name}"
    env = cli_env(PREFECT_API_URL=prefect_api, OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI=mlflow_uri)
    r = run_cli(
        [
            "pretrain",
            *_args(
                *TINY,
                f"tokenizer.path={small_tokenizer}",
                "pretrain.nproc_per_node=2",
                "tracking.enabled=true",
                f"tracking.experiment={experiment}",
            ),
        ],
        cwd=_workdir(tmp_path, "w", shards),
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    [run] = _stage_runs(mlflow_uri, experiment)
    flow_run_id = run.data.tags["prefect.flow_run_id"]  # handed by the launching flow to rank 0
    flow_run = prefect_get(prefect_api, f"/flow_runs/{flow_run_id}")
    assert flow_run["state"]["type"] == "COMPLETED" and run.data.tags["prefect.flow_run_name"] == flow_run["name"]
    assert prefect_get(prefect_api, f"/flows/{flow_run['flow_id']}")["name"] == "pretrain"
    task_runs = prefect_get(prefect_api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    assert [t["name"].rsplit("-", 1)[0] for t in task_runs] == ["launch-pretrain"]
    assert task_runs[0]["state"]["type"] == "COMPLETED"
    logs = prefect_get(prefect_api, "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}})
    messages = [entry["message"] for entry in logs]
    assert any(m.startswith("launching 2 processes") for m in messages)
    assert any(m.startswith("pretrain done: step 6") for m in messages)  # rank 0's line, streamed
    artifacts = prefect_get(prefect_api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    assert any(a["key"] == "pretrain-metrics" and "`val_loss`" in a["data"] for a in artifacts)


@pytest.mark.slow
def test_two_nodes_meet_at_the_rendezvous_and_only_rank_0_writes(tmp_path, shards, small_tokenizer):
    """Two "nodes" on this machine, each in its own folder (no shared working directory)."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1")
    args = [
        "pretrain",
        *_args(
            *TINY,
            f"tokenizer.path={small_tokenizer}",
            "pretrain.nnodes=2",
            f"pretrain.rdzv_endpoint={endpoint}",
            f"pretrain.rdzv_id={tmp_path.name}",
        ),
    ]
    nodes = [
        subprocess.Popen(
            [str(BIN / "gptforge"), *args],
            cwd=_workdir(tmp_path, f"node{i}", shards),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        stderrs = [node.communicate(timeout=240)[1] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, stderr in zip(nodes, stderrs):
        assert node.returncode == 0, stderr[-3000:]
        assert f"--nnodes 2 --rdzv_backend c10d --rdzv_endpoint {endpoint}" in stderr
    wrote = [(tmp_path / f"node{i}/metrics/pretrain.json").is_file() for i in range(2)]
    assert sorted(wrote) == [False, True]  # rank 0's node has the results, the other says so
    # rank 0 logs its progress; the other node's worker says only what goes wrong
    assert "(fp32, 2 processes)" in stderrs[wrote.index(True)]
    assert "(fp32, 2 processes)" not in stderrs[wrote.index(False)]
    assert "was not written on this node" in stderrs[wrote.index(False)]
    assert (tmp_path / f"node{wrote.index(True)}/checkpoints/pretrain/final/model.safetensors").is_file()


@pytest.mark.slow
def test_a_failed_job_raises_stage_failed_with_the_workers_reason(tmp_path, monkeypatch, small_tokenizer):
    monkeypatch.chdir(tmp_path)  # no data/pretrain here: the workers' input check fails
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(None, [*TINY, f"tokenizer.path={small_tokenizer}", "pretrain.nproc_per_node=2"])
    with pytest.raises(
        StageFailed,
        match=r"pretrain under torchrun failed \(exit code 1\): a worker said: "
        r"data/pretrain/manifest.json not found",
    ):
        launch.launch_pretrain(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("sig, returncode", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_every_process_of_the_job(tmp_path, shards, small_tokenizer, sig, returncode):
    """The signal comes while the workers train: rank 0 paused after step 2 (gptforge.runtime.pause),
    rank 1 waiting for it in its next collective; released once rank 0 has taken it."""
    import psutil

    pause = Paused(tmp_path, 2)
    env = cli_env(GPTFORGE_PREFECT="0", OMP_NUM_THREADS="1", **pause.env())
    log = tmp_path / "job.log"
    with started(
        [
            str(BIN / "gptforge"),
            "pretrain",
            *_args(
                *TINY, f"tokenizer.path={small_tokenizer}", "pretrain.nproc_per_node=2", "pretrain.max_steps=100000"
            ),
        ],
        _workdir(tmp_path, "w", shards),
        env,
        log,
    ) as proc:
        pause.wait(proc, output=log.read_text)
        job = psutil.Process(proc.pid).children(recursive=True)
        assert len(job) >= 3, [p.cmdline() for p in job]  # torchrun and its two workers
        proc.send_signal(sig)
        pause.release_once_taken(proc, log)
        # The job's own stop bounds: the launcher SIGKILLs what is left of the job 25 s after
        # the signal (signals.GROUP_GRACE_SECONDS) and exits soon after; the rest is a margin
        # for a machine busy with another process.
        proc.wait(timeout=90)
    output = log.read_text()
    assert proc.returncode == returncode, output[-3000:]
    # Rank 0 took it in the pause and stopped after the next step, with its checkpoint.
    assert f"pretrain stopped by {sig.name} at step 3; checkpoint checkpoints/pretrain/step_00000003 saved" in output, (
        output[-3000:]
    )
    assert (tmp_path / "w/checkpoints/pretrain/step_00000003/checksums.json").is_file()
    assert f"pretrain stopped by {sig.name} at step 3; checkpoint of rank 0 saved" in output  # rank 1's line
    # The launcher waits for the whole job before it exits: this only reaps what it left.
    gone, alive = psutil.wait_procs(job, timeout=10)
    assert not alive, [p.cmdline() for p in alive]
