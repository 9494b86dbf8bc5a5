"""The `gptforge` command line: help, config show, exit codes and one-line errors.

The bad-input catalogue (exit code 2, in-process) is tests/test_bad_inputs.py. The slow tests
run the real console script against a real Prefect server and MLflow database and read the
results back through both APIs.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import yaml
from cli_support import REPO, cli_env, error_lines, run_cli, snapshot
from process_support import free_port

from gptforge.cli import main


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPTFORGE_PREFECT", "0")
    (tmp_path / "params.yaml").write_text("tracking:\n  enabled: false\n")
    return tmp_path


def call(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_help_lists_only_existing_stages(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for present in (
        "prepare",
        "config",
        "pretrain",
        "finetune",
        "evaluate",
        "benchmark",
        "classify",
        "generate",
        "export",
    ):
        assert f"    {present}" in out
    for args in (["prepare", "--help"], ["prepare", "classify", "--help"], ["config", "show", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 0
        assert "--params" in capsys.readouterr().out or args == ["prepare", "--help"]


def test_config_show_prints_resolved_yaml(workdir, capsys):
    rc, out, err = call(
        capsys, "config", "show", "-S", "data.pretrain.max_tokens=1234", "-S", "data.classify.splits=[0.8, 0.1, 0.1]"
    )
    assert rc == 0, err
    shown = yaml.safe_load(out)
    assert shown["data"]["pretrain"]["max_tokens"] == 1234
    assert shown["data"]["classify"]["splits"] == [0.8, 0.1, 0.1]
    assert shown["tracking"]["enabled"] is False  # from the params file


def test_plan_counts_what_the_models_hold(workdir, capsys, tmp_path):
    """`gptforge plan`: the GPT's rows from its parameter count; for a Hugging Face folder under
    LoRA, the trained count peft itself gives the same model, and the fits column."""
    import peft
    import transformers

    from gptforge.modeling.gpt import GPT, GPTConfig

    rc, out, err = call(capsys, "plan", "--gpus", "4")
    assert rc == 0, err
    rows = {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line.split() and line.split()[0] in ("ddp", "zero1", "fsdp")
    }
    assert list(rows) == ["ddp", "zero1", "fsdp"] and "stage: pretrain" in out
    from gptforge.config.load import load_config

    m = load_config("params.yaml").model
    n = sum(p.numel() for p in GPT(GPTConfig.from_model_config(m, m.vocab_size)).parameters())
    assert float(rows["ddp"][0]) == pytest.approx(4 * n / 2**30, abs=0.006)  # fp32 weights, GiB to 2 places
    assert float(rows["fsdp"][2]) == pytest.approx(8 * n / 4 / 2**30, abs=0.006)  # AdamW's states over 4 GPUs

    folder = tmp_path / "tiny-llama"
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=128,
    )
    cfg.save_pretrained(folder)
    model = transformers.LlamaForCausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    lora = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        ),
    )
    trained = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    rc, out, err = call(
        capsys,
        "plan",
        "--stage",
        "instruct",
        "--gpus",
        "1",
        "--gpu-memory",
        "1MB",
        "-S",
        f"instruct.init_from={folder}",
        "-S",
        "instruct.method=lora",
        "-S",
        "instruct.lora.r=4",
    )
    assert rc == 0, err
    assert f"{total / 1e6:,.1f}M parameters, {trained / 1e6:,.1f}M trained" in out, out
    assert all(line.endswith("  no") for line in out.splitlines() if line.split()[:1] in (["ddp"], ["zero1"], ["fsdp"]))


# ---------------------------------------------------------------------------------------------
# Exit codes: 1 for a failure of the run itself, 2 from the console script; one line, no traceback


def closed_port_url() -> str:
    port = free_port()  # nothing listens there: connection refused at once, on loopback only
    return f"https://127.0.0.1:{port}/sms.zip"


def test_unreachable_url_fails_after_retries_without_partial_file(workdir, capsys):
    url = closed_port_url()
    rc, out, err = call(
        capsys,
        "prepare",
        "classify",
        "-S",
        f"data.classify.source={url}",
        "-S",
        "data.download.retries=2",
        "-S",
        "data.download.backoff=0.01",
    )
    assert rc == 1
    [line] = error_lines(err)
    assert url in line and "after 3 attempts" in line and "set data.classify.source to a local copy" in line
    assert "Traceback" not in err
    raw = workdir / "data" / "raw"
    assert not raw.exists() or not any(raw.iterdir())


def test_process_exit_code_and_single_line(tmp_path):
    """The installed console script itself: exit 2 and exactly one stderr line."""
    r = run_cli(
        ["config", "show", "-S", "data.pretrain.max_tokns=5"],
        cwd=tmp_path,
        env=cli_env(GPTFORGE_PREFECT="0"),
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "gptforge: error: config with -S overrides: unknown key 'data.pretrain.max_tokns' "
        "(did you mean 'data.pretrain.max_tokens'?)"
    ]


@pytest.mark.parametrize("raised", ["stop", "error"])
def test_the_last_line_is_a_line_of_its_own_after_a_bar_cut_off_mid_draw(capsys, monkeypatch, raised):
    """A signal can land inside a progress bar's close, which then draws nothing: the bar's
    half line is still there, and the CLI's last line starts a line of its own all the same."""
    import sys

    from gptforge import cli
    from gptforge.errors import BadInput
    from gptforge.runtime.signals import Terminated

    def half_drawn_then(_args):
        sys.stderr.write("\rclassify epoch 3/9:   0%|          | 0/4 [00:00<?, ?batch/s]")
        raise Terminated(15) if raised == "stop" else BadInput("no such file")

    import argparse

    parser = cli.build_parser()
    monkeypatch.setattr(parser, "parse_args", lambda argv: argparse.Namespace(func=half_drawn_then))
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    rc = cli.main(["config", "show"])
    err = capsys.readouterr().err
    assert rc == (143 if raised == "stop" else 2)
    assert err.splitlines()[-1] == (
        "gptforge: stopped by SIGTERM" if raised == "stop" else "gptforge: error: no such file"
    ), err
    assert err.endswith("batch/s]\n" + err.splitlines()[-1] + "\n")
    assert sys.stderr is not None and not hasattr(sys.stderr, "at_line_start")  # main() put stderr back


# ---------------------------------------------------------------------------------------------
# Real servers: the stage as a Prefect flow run with task runs, and as an MLflow run


def prefect_get(api: str, path: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"{api}{path}", data=data, method="POST" if data else "GET", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def mlflow_runs(uri: str, stage: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("gptforge")
    runs = client.search_runs(
        [exp.experiment_id], f"tags.`gptforge.stage` = '{stage}'", order_by=["attributes.start_time DESC"]
    )
    return client, runs


@pytest.mark.slow
def test_stage_is_a_prefect_flow_and_an_mlflow_run(tmp_path, sms_file, prefect_api, mlflow_uri):
    env = cli_env(PREFECT_API_URL=prefect_api, MLFLOW_TRACKING_URI=mlflow_uri)
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    r = run_cli(["prepare", "classify", "-S", f"data.classify.source={sms_file}"], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    for split in ("train", "val", "test"):
        assert (tmp_path / f"data/classify/{split}.jsonl").is_file()
    metrics = json.loads((tmp_path / "metrics/prepare_classify.json").read_text())
    assert metrics["train"] + metrics["val"] + metrics["test"] == 24  # 12 spam + 12 ham kept

    client, runs = mlflow_runs(mlflow_uri, "prepare_classify")
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "prepare_classify"
    assert run.data.params["data.classify.splits"] == "[0.7, 0.1, 0.2]"
    assert run.data.params["data.classify.source"] == str(sms_file)
    assert run.data.metrics["train"] == metrics["train"]
    tags = run.data.tags
    assert tags["gptforge.version"] and tags["device"] == "cpu"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "prepare_classify.json" in artifacts

    flow_run = prefect_get(prefect_api, f"/flow_runs/{tags['prefect.flow_run_id']}")
    assert flow_run["state"]["type"] == "COMPLETED"
    flow = prefect_get(prefect_api, f"/flows/{flow_run['flow_id']}")
    assert flow["name"] == "prepare-classify"
    task_runs = prefect_get(prefect_api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run["id"]]}}})
    names = {t["name"].rsplit("-", 1)[0] for t in task_runs}
    assert {"find-sms-file", "read-labelled", "balance-and-split", "write-splits"} <= names
    assert all(t["state"]["type"] == "COMPLETED" for t in task_runs)
    # The library's own log lines reach the flow run's logs, and the metrics are an artifact.
    logs = prefect_get(prefect_api, "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run["id"]]}}})
    assert any("classify data:" in entry["message"] for entry in logs)
    artifacts = prefect_get(
        prefect_api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}}
    )
    [artifact] = [a for a in artifacts if a["key"] == "prepare-classify-metrics"]
    assert f"| `train` | {metrics['train']} |" in artifact["data"]


@pytest.mark.slow
def test_failed_stage_is_failed_everywhere_and_prints_one_line(tmp_path, prefect_api, mlflow_uri):
    env = cli_env(PREFECT_API_URL=prefect_api, MLFLOW_TRACKING_URI=mlflow_uri)
    (tmp_path / "params.yaml").write_text("data:\n  classify:\n    source: broken.zip\n")
    (tmp_path / "broken.zip").write_bytes(b"not a zip at all")
    (tmp_path / "data/classify").mkdir(parents=True)
    (tmp_path / "data/classify/train.jsonl").write_text('{"text": "old", "label": 0}\n')
    before = snapshot(tmp_path / "data")
    r = run_cli(["prepare", "classify"], cwd=tmp_path, env=env)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert error_lines(r.stderr) == ["gptforge: error: broken.zip: not a valid zip archive (File is not a zip file)"]
    assert snapshot(tmp_path / "data") == before

    _, runs = mlflow_runs(mlflow_uri, "prepare_classify")
    failed = [run for run in runs if run.data.params.get("data.classify.source") == "broken.zip"]
    assert failed and failed[0].info.status == "FAILED"
    flow_run = prefect_get(prefect_api, f"/flow_runs/{failed[0].data.tags['prefect.flow_run_id']}")
    assert flow_run["state"]["type"] == "FAILED"


@pytest.mark.slow
def test_download_task_retries_with_backoff_in_prefect(tmp_path, prefect_api, mlflow_uri):
    env = cli_env(PREFECT_API_URL=prefect_api, MLFLOW_TRACKING_URI=mlflow_uri)
    url = closed_port_url()
    r = run_cli(
        [
            "prepare",
            "classify",
            "-S",
            f"data.classify.source={url}",
            "-S",
            "data.download.retries=2",
            "-S",
            "data.download.backoff=0.2",
        ],
        cwd=tmp_path,
        env=env,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    [line] = error_lines(r.stderr)
    assert "after 3 attempts" in line and "set data.classify.source to a local copy" in line
    assert not (tmp_path / "data/raw").exists() or not any((tmp_path / "data/raw").iterdir())

    _, runs = mlflow_runs(mlflow_uri, "prepare_classify")
    failed = [run for run in runs if run.data.params.get("data.classify.source") == url]
    assert failed[0].info.status == "FAILED"
    flow_run_id = failed[0].data.tags["prefect.flow_run_id"]
    task_runs = prefect_get(prefect_api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    [download] = [t for t in task_runs if t["name"].startswith("download-url")]
    assert download["run_count"] == 3 and download["state"]["type"] == "FAILED"
