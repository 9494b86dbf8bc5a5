"""`gptforge pipeline`: dvc repro as one Prefect flow run and one MLflow run, stages nested.

The full deployment path (prefect.yaml, a worker, an MLflow server, the UI pages) is in
test_deploy.py; here the pipeline runs in-process against the session's Prefect server.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from cli_support import BIN, cli_env, error_lines, last_error_line, run_cli, set_params, snapshot
from process_support import free_port

from gptforge.errors import BadInput
from gptforge.pipeline.dvc import ReproOutcome, check_stage_names
from gptforge.pipeline.run import PipelineReport, StageReport, stage_reports


def test_stage_reports_follow_dvc_output():
    events = [
        (0.0, "skipped", "prepare_pretrain"),
        (1.0, "running", "prepare_classify"),
        (3.5, "locked", ""),
        (4.0, "restored", "prepare_instruct"),
        (5.0, "running", "finetune_classify"),
    ]
    reports, failed = stage_reports(
        ReproOutcome(1, events, [], end=9.0),
        ["prepare_pretrain", "prepare_classify", "prepare_instruct", "finetune_classify", "evaluate"],
    )
    by = {r.name: r for r in reports}
    assert [r.name for r in reports] == [
        "prepare_pretrain",
        "prepare_classify",
        "prepare_instruct",
        "finetune_classify",
        "evaluate",
    ]
    assert by["prepare_pretrain"].status == "up to date" and by["prepare_pretrain"].seconds is None
    assert by["prepare_classify"].status == "ran" and by["prepare_classify"].seconds == pytest.approx(2.5)
    assert by["prepare_instruct"].status == "restored"
    assert failed == "finetune_classify" and by["finetune_classify"].status == "failed"
    assert by["finetune_classify"].seconds == pytest.approx(4.0)
    assert by["evaluate"].status == "not run"


def test_markdown_names_failed_stage_and_links():
    report = PipelineReport(
        stages=[
            StageReport("pretrain", "failed", 3.0),
            StageReport(
                "prepare_pretrain",
                "ran",
                1.25,
                {"tokens": 100},
                "abc123",
                "http://127.0.0.1:5000/#/experiments/1/runs/abc123",
            ),
        ],
        failed_stage="pretrain",
        error="stage pretrain failed: loss is nan",
    )
    md = report.markdown()
    assert "FAILED at stage `pretrain`" in md and "loss is nan" in md
    assert "[abc123](http://127.0.0.1:5000/#/experiments/1/runs/abc123)" in md
    assert "| `prepare_pretrain` | ✅ ran | 1.2 s | tokens 100 |" in md
    with pytest.raises(Exception, match="stage pretrain failed"):
        report.raise_for_failure()


def test_unknown_stage_is_named_with_a_suggestion():
    with pytest.raises(BadInput, match=r"unknown stage 'pretrian' \(did you mean 'pretrain'\?\); stages in dvc.yaml"):
        check_stage_names(["pretrian"], ["prepare_pretrain", "pretrain"])
    # a foreach group's entry (evaluate@instruct) is DVC's to check; a plain stage has none
    check_stage_names(["evaluate@instruct"], {"evaluate": {"foreach": "${evaluate.models}"}})
    with pytest.raises(BadInput, match="unknown stage 'pretrain@x'"):
        check_stage_names(["pretrain@x"], {"pretrain": {"cmd": "gptforge pretrain"}})


def test_cli_unknown_stage_fails_before_any_work(repo_copy):
    before = snapshot(repo_copy)
    out = run_cli(["pipeline", "prepare_classify", "nosuchstage"], repo_copy, cli_env(), timeout=120)
    assert out.returncode == 2, out.stderr
    assert error_lines(out.stderr) == [
        "gptforge: error: unknown stage 'nosuchstage'; stages in dvc.yaml: "
        "prepare_base, synthesize, index, evaluate_qa, prepare_pretrain, prepare_classify, "
        "prepare_instruct, prepare_preference, pretrain, finetune_classify, "
        "finetune_instruct, finetune_instruct_variant, finetune_preference, train_reward, "
        "finetune_rl, evaluate, evaluate_report, "
        "register, register_report, benchmark"
    ]
    assert "Traceback" not in out.stderr and snapshot(repo_copy) == before


def test_cli_bad_override_fails_before_any_work(repo_copy):
    before = (repo_copy / "params.yaml").read_bytes()
    out = run_cli(["pipeline", "-S", "pretrain.max_stepz=3"], repo_copy, cli_env(), timeout=120)
    assert out.returncode == 2
    assert error_lines(out.stderr) == [
        "gptforge: error: params.yaml with -S overrides: unknown key "
        "'pretrain.max_stepz' (did you mean 'pretrain.max_steps'?)"
    ]
    assert (repo_copy / "params.yaml").read_bytes() == before


@pytest.mark.slow
def test_pool_that_does_not_exist(repo_copy, prefect_api):
    out = run_cli(["pipeline", "--pool", "nosuchpool"], repo_copy, cli_env(PREFECT_API_URL=prefect_api), timeout=120)
    assert out.returncode == 2, out.stderr
    [line] = error_lines(out.stderr)
    assert line.startswith(f"gptforge: error: work pool 'nosuchpool' does not exist on {prefect_api}")
    assert "prefect work-pool create nosuchpool" in line and "Traceback" not in out.stderr


@pytest.mark.slow
def test_pool_without_a_server(repo_copy):
    env = cli_env()
    env.pop("PREFECT_API_URL", None)
    out = run_cli(["pipeline", "--pool", "gpu"], repo_copy, env, timeout=120)
    assert out.returncode == 2
    assert error_lines(out.stderr)[0].startswith("gptforge: error: --pool gpu needs a Prefect server")


@pytest.mark.slow
def test_pipeline_nests_stages_and_survives_an_unreachable_remote(
    repo_copy, tmp_path, small_tokenizer, sms_file, alpaca_file, prefect_api, mlflow_uri
):
    set_params(repo_copy, **{"data.classify.source": str(sms_file)})
    # A DVC remote nobody listens on: pull and push fail, the pipeline still runs locally.
    dead = f"http://127.0.0.1:{free_port()}/dvc-store"
    subprocess.run([str(BIN / "dvc"), "remote", "add", "-d", "broken", dead], cwd=repo_copy, check=True, env=cli_env())
    env = cli_env(PREFECT_API_URL=prefect_api, MLFLOW_TRACKING_URI=mlflow_uri)
    out = run_cli(["pipeline", "prepare_classify", "-S", "data.classify.seed=7"], repo_copy, env, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    # DVC's pull finds nothing to fetch on a first run; the push must reach the remote, and says so.
    assert "dvc push to remote broken failed" in out.stderr and "did not push" in out.stderr
    assert yaml.safe_load((repo_copy / "params.yaml").read_text())["data"]["classify"]["seed"] == 7
    lock = yaml.safe_load((repo_copy / "dvc.lock").read_text())
    assert set(lock["stages"]) == {"prepare_classify"}
    assert lock["stages"]["prepare_classify"]["params"]["params.yaml"]["data.classify"]["seed"] == 7

    # MLflow: a pipeline run with the stage's run nested under it, holding its metrics.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name("gptforge")
    [parent] = client.search_runs(
        [exp.experiment_id],
        "tags.`gptforge.stage` = 'pipeline'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    assert parent.info.status == "FINISHED" and parent.data.metrics["stages_ran"] == 1
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert [c.data.tags["gptforge.stage"] for c in children] == ["prepare_classify"]
    assert children[0].data.metrics["train"] > 0
    summary = client.download_artifacts(parent.info.run_id, "pipeline.md", str(tmp_path))
    text = open(summary).read()
    assert "| `prepare_classify` | ✅ ran |" in text and "did not push" in text

    # Prefect: the stage's flow run is a subflow of the pipeline's flow run.
    flow_run_id = parent.data.tags["prefect.flow_run_id"]
    stage_run = children[0].data.tags["prefect.flow_run_id"]
    import httpx

    with httpx.Client(base_url=prefect_api, timeout=30) as api:
        sub = api.get(f"/flow_runs/{stage_run}").json()
        tracker = api.get(f"/task_runs/{sub['parent_task_run_id']}").json()
        assert tracker["flow_run_id"] == flow_run_id and tracker["state"]["type"] == "COMPLETED"
        assert api.get(f"/flow_runs/{flow_run_id}").json()["state"]["type"] == "COMPLETED"
        artifacts = api.post("/artifacts/filter", json={"artifacts": {"key": {"any_": ["pipeline-summary"]}}}).json()
        assert any(a["flow_run_id"] == flow_run_id for a in artifacts)

    # A second run with no change: every stage up to date.
    again = run_cli(["pipeline", "prepare_classify", "--no-pull", "--no-push"], repo_copy, env, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "prepare_classify   up to date" in again.stderr


@pytest.mark.slow
def test_failed_stage_fails_the_pipeline_naming_it(repo_copy, prefect_api, mlflow_uri, tmp_path):
    bad = tmp_path / "broken.jsonl"
    bad.write_text("not json at all\n" * 5)
    env = cli_env(GPTFORGE_PREFECT="0", MLFLOW_TRACKING_URI=mlflow_uri)
    # The source is checked by the stage itself (it exists, so the pre-check passes).
    out = run_cli(["pipeline", "prepare_classify", "-S", f"data.classify.source={bad}"], repo_copy, env, timeout=400)
    assert out.returncode == 1, out.stderr[-2000:]
    line = last_error_line(out.stderr)
    assert line.startswith("gptforge: error: stage prepare_classify failed: ")
    assert "Traceback" not in out.stderr
    assert not (repo_copy / "data" / "classify").exists()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name("gptforge")
    [parent] = client.search_runs(
        [exp.experiment_id],
        "tags.`gptforge.stage` = 'pipeline'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    assert parent.data.tags["gptforge.pipeline.failed_stage"] == "prepare_classify"
    assert json.loads(json.dumps(parent.data.metrics))["stages_failed"] == 1


@pytest.mark.slow
def test_offline_hub_source_fails_naming_stage_and_param(repo_copy, small_tokenizer, prefect_api, mlflow_uri):
    """A real run's config offline: the pipeline stops at the first remote source, one line
    naming the stage, the source and the param to set."""
    set_params(
        repo_copy,
        **{
            "tokenizer.path": str(small_tokenizer),
            "data.pretrain.source": "hf://HuggingFaceFW/fineweb-edu",
            "data.pretrain.name": "sample-10BT",
        },
    )
    env = cli_env(PREFECT_API_URL=prefect_api, MLFLOW_TRACKING_URI=mlflow_uri)
    out = run_cli(["pipeline", "prepare_pretrain"], repo_copy, env, timeout=300)
    assert out.returncode == 1
    line = last_error_line(out.stderr)
    assert line.startswith("gptforge: error: stage prepare_pretrain failed: cannot load hf://HuggingFaceFW/fineweb-edu")
    assert line.endswith("set data.pretrain.source to a local copy")
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_prefect_api_that_does_not_answer_delays_neither_the_pipeline_nor_its_summary(
    repo_copy, sms_file, mlflow_uri
):
    """The pipeline journals its flow run: a configured Prefect server that is down holds the
    journals (delivered when it is back), and the pipeline does not wait for them at its end."""
    set_params(repo_copy, **{"data.classify.source": str(sms_file)})
    dead = f"http://127.0.0.1:{free_port()}/api"
    env = cli_env(PREFECT_API_URL=dead, MLFLOW_TRACKING_URI=mlflow_uri, GPTFORGE_WAIT_FOR_RECORDS="0")
    out = run_cli(["pipeline", "prepare_classify", "--no-pull", "--no-push"], repo_copy, env, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"the Prefect API at {dead} does not answer: 1 stage journal(s) wait in" in out.stderr, out.stderr[-3000:]
    assert "has not delivered" not in out.stderr, out.stderr[-3000:]
    waiting = sorted(
        p.name.split("-", 1)[1].rsplit("-", 1)[0] for p in (repo_copy / ".gptforge" / "records").glob("*.jsonl")
    )
    assert waiting == ["pipeline", "prepare_classify"], waiting  # kept until the server answers


def test_closing_summary_shows_the_reward_model_and_the_rl_reward_before_and_after(tmp_path):
    from gptforge.pipeline.summary import closing_summary

    (tmp_path / "metrics").mkdir()
    for name, values in {
        "preference": {"val_reward_accuracy": 0.655},
        "reward": {"val_accuracy": 0.7037, "val_accuracy_before": 0.5},
        "rl": {
            "heldout_reward": 1.6107,
            "heldout_reward_before": 0.078,
            "token_f1_sft": 0.59,
            "token_f1_rl": 0.612,
            "distinct_share_sft": 0.95,
            "distinct_share_rl": 0.9,
        },
        "register": {"rl.version": 2, "rl.champion": 1, "reward.version": 1, "reward.champion": 0},
    }.items():
        (tmp_path / "metrics" / f"{name}.json").write_text(json.dumps(values))
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "rl_responses.jsonl").write_text("{}\n")
    lines = closing_summary(PipelineReport(stages=[]), tmp_path)
    # no params.yaml: the defaults, where the chain starts from the GPT pretrained here
    assert lines[2] == "  gptforge's GPT, pretrained here from scratch:"
    assert "    DPO reward accuracy (val)      0.655" in lines
    assert "    reward model accuracy (val)    0.500 -> 0.704" in lines
    assert "    RL held-out reward             0.078 -> 1.611" in lines
    assert "    RL answers' token F1           0.590 -> 0.612" in lines
    assert "    RL answers' distinct tokens    0.950 -> 0.900" in lines
    assert not any(line.strip().startswith("DPO answers'") for line in lines)  # not in rl.json: no line
    assert "  registered models                reward v1 challenger, rl v2 champion" in lines
    assert any(line.startswith("Reports: reports/rl_responses.jsonl") for line in lines)
