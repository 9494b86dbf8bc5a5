"""The whole pipeline, once, the way users run it: deployments from prefect.yaml, a worker,
real servers; then `dvc repro` typed in the same repository.

On 127.0.0.1 only: `prefect server start` (the session's), `mlflow server` (sqlite backend,
artifacts served by it), the `local` process pool and the `gpu` Docker pool, `prefect deploy
--all`, a process worker, and the pipeline deployment triggered with fixture params through
`gptforge pipeline --pool local`. Asserted through the Prefect and MLflow APIs and the files
DVC tracks; the registry as test_dvc.check_registry reads it; triggered again (every stage up
to date); then `dvc repro` as a user types it runs nothing, and after a params change only the
stale stages (the acceptance of the foundation issue). The two UIs are opened in headless
Chromium and screenshotted (test artifacts, under $GPTFORGE_TEST_ARTIFACTS or test-artifacts/).
Servers, worker and browser stop at the end, also when an assertion fails.

One pipeline run serves both the deployment's checks and DVC's: the suite's longest chain was
these two full runs side by side.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from cli_support import BIN, REPO, cli_env, run_cli, set_params, stage_params
from process_support import free_port, stop_process
from test_dvc import check_registry, dvc, ran_stages

from gptforge.modeling.weights import load_model as load_model_folder

pytestmark = pytest.mark.slow

STAGES = [
    "prepare_pretrain",
    "prepare_classify",
    "prepare_instruct",
    "prepare_preference",
    "pretrain",
    "finetune_classify",
    "finetune_instruct",
    "finetune_instruct_variant",
    "finetune_preference",
    "train_reward",
    "finetune_rl",
    "evaluate",
    "evaluate_report",
    "register",
    "register_report",
    "benchmark",
]
# The per-model stages of the quickstart's models (evaluate.models) and of the registry's.
EVALUATED = ("pretrain", "instruct")
REGISTERED = ("pretrain", "classify", "instruct", "preference", "reward", "rl")
# As dvc.yaml names them: the instruct variant of stage_params (tests/cli_support.py), evaluate and
# register are foreach groups, one stage per entry.
ENTRIES = {
    "finetune_instruct_variant": ["tiny"],
    "evaluate": list(EVALUATED),
    "register": list(REGISTERED),
}
DVC_STAGES = [f"{s}@{key}" if s in ENTRIES else s for s in STAGES for key in ENTRIES.get(s, [None])]
# One stage flow run (and MLflow run, by its gptforge.stage tag) per DVC stage: a flow's name
# once per entry of its group.
STAGE_RUNS = [s.partition("@")[0] for s in DVC_STAGES]
EXPERIMENT = "deploy-test"
ARTIFACTS = Path(os.environ.get("GPTFORGE_TEST_ARTIFACTS", REPO / "test-artifacts"))


@pytest.fixture
def registry_names() -> dict[str, str]:
    return {
        model: f"e2e-{model}-{uuid.uuid4().hex[:8]}"
        for model in ("pretrain", "classify", "instruct", "preference", "reward", "rl")
    }


@pytest.fixture
def deployed_repo(repo_copy, tmp_path, small_tokenizer, sms_file, alpaca_file, prefect_api, registry_names):
    """This project's repository with fixture params, its deployments on the server."""
    for code in ("flows", "tasks"):
        shutil.copytree(REPO / code, repo_copy / code, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "prefect.yaml", repo_copy / "prefect.yaml")
    # Its own experiment: the MLflow server's database starts as a copy of the session's,
    # which other tests may already have filled with pipeline runs.
    set_params(
        repo_copy,
        **{
            **stage_params(tmp_path, small_tokenizer, sms_file, alpaca_file),
            "tracking.experiment": EXPERIMENT,
            "registry.names": registry_names,
            "registry.promote": {"classify": {"classify.test_accuracy": ">= 0.0"}},
            # the GPT-2 BPE (embedded): the language models then export to transformers
            "tokenizer.path": "sample://gpt2_tokenizer",
            "model.vocab_size": 50304,
        },
    )
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qam", "fixture params"],
        cwd=repo_copy,
        check=True,
    )
    env = cli_env(PREFECT_API_URL=prefect_api)
    prefect = str(BIN / "prefect")
    for pool, kind in (("local", "process"), ("gpu", "docker"), ("cpu", "docker")):
        subprocess.run(
            [prefect, "work-pool", "create", pool, "--type", kind, "--overwrite"],
            cwd=repo_copy,
            env=env,
            check=True,
            capture_output=True,
            timeout=120,
        )
    out = subprocess.run(
        [prefect, "--no-prompt", "deploy", "--all"], cwd=repo_copy, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return repo_copy


def test_pipeline_on_a_worker_then_dvc_repro_runs_stale_stages_only(
    deployed_repo, prefect_api, mlflow_server, registry_names, tmp_path
):
    repo, names = deployed_repo, registry_names
    api = httpx.Client(base_url=prefect_api, timeout=30)
    deployments = api.post("/deployments/filter", json={}).json()
    # The pipeline and every stage flow, on each pool (deployment name = pool name; synthesize,
    # index and evaluate_qa too, which the quickstart's pipeline does not run: no documents); the
    # nightly schedule is there, off.
    for pool in ("local", "gpu", "cpu"):
        deployed = [
            d["entrypoint"].rsplit(":", 1)[1] for d in deployments if d["name"] == pool and d["work_pool_name"] == pool
        ]
        assert sorted(deployed) == sorted(STAGES + ["synthesize", "index", "evaluate_qa", "pipeline"])
    gpu_pipeline = next(d for d in deployments if d["name"] == "gpu" and d["entrypoint"].endswith(":pipeline"))
    assert gpu_pipeline["job_variables"]["container_create_kwargs"]["device_requests"][0]["driver"] == "nvidia"
    assert [s["active"] for s in gpu_pipeline["schedules"]] == [False]
    # The CPU containers' deployments take the pool's template as it is (docker/cpu-pool.json).
    cpu_pipeline = next(d for d in deployments if d["name"] == "cpu" and d["entrypoint"].endswith(":pipeline"))
    assert cpu_pipeline["job_variables"] == {}

    env = cli_env(
        PREFECT_API_URL=prefect_api,
        MLFLOW_TRACKING_URI=mlflow_server,
        PREFECT_WORKER_QUERY_SECONDS="2",
        PREFECT_WORKER_PREFETCH_SECONDS="5",
    )
    worker_log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(
        [str(BIN / "prefect"), "worker", "start", "--pool", "local", "--name", "test-worker"],
        cwd=repo,
        env=env,
        stdout=worker_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    browser = None
    try:
        start = time.monotonic()
        first = run_cli(["pipeline", "--pool", "local"], repo, env, timeout=900)
        first_seconds = time.monotonic() - start
        assert first.returncode == 0, first.stderr[-4000:] + _tail(tmp_path / "worker.log")

        # Prefect: one pipeline flow run from the deployment, a stage subflow per stage.
        dep_id = next(d["id"] for d in deployments if d["name"] == "local" and d["entrypoint"].endswith(":pipeline"))
        [pipe] = api.post("/flow_runs/filter", json={"flow_runs": {"deployment_id": {"any_": [dep_id]}}}).json()
        assert pipe["state"]["type"] == "COMPLETED"
        trackers = api.post("/task_runs/filter", json={"task_runs": {"flow_run_id": {"any_": [pipe["id"]]}}}).json()
        subflows = api.post(
            "/flow_runs/filter", json={"flow_runs": {"parent_task_run_id": {"any_": [t["id"] for t in trackers]}}}
        ).json()
        flows = {f["id"]: f["name"] for f in api.post("/flows/filter", json={}).json()}
        assert sorted(flows[f["flow_id"]] for f in subflows) == sorted(s.replace("_", "-") for s in STAGE_RUNS)
        assert all(f["state"]["type"] == "COMPLETED" for f in subflows)
        [summary] = api.post(
            "/artifacts/filter",
            json={"artifacts": {"key": {"any_": ["pipeline-summary"]}, "flow_run_id": {"any_": [pipe["id"]]}}},
        ).json()
        assert f"{mlflow_server}/#/experiments/" in summary["data"]
        assert all(f"| `{s}` | ✅ ran |" in summary["data"] for s in DVC_STAGES)

        # MLflow: the pipeline's run, a nested run per stage with its metrics and artifacts.
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=mlflow_server)
        exp = client.get_experiment_by_name(EXPERIMENT)
        [parent] = client.search_runs([exp.experiment_id], "tags.`gptforge.stage` = 'pipeline'")
        assert parent.info.status == "FINISHED" and parent.data.tags["prefect.flow_run_id"] == pipe["id"]
        children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        assert sorted(c.data.tags["gptforge.stage"] for c in children) == sorted(STAGE_RUNS)
        for child in children:
            assert child.info.status == "FINISHED" and child.data.metrics, child.data.tags["gptforge.stage"]
            assert client.list_artifacts(child.info.run_id), child.data.tags["gptforge.stage"]
            assert child.data.tags["prefect.flow_run_id"] in {f["id"] for f in subflows}
        lock = yaml.safe_load((repo / "dvc.lock").read_text())
        assert set(lock["stages"]) == set(DVC_STAGES)
        check_stage_outputs(repo)
        check_stage_runs(client, exp.experiment_id)
        # Stage register: four registered models, lineage on each version, the gate's alias.
        check_registry(repo, client, names, env)

        # Triggered again with no change: DVC finds every stage up to date and rewrites no output.
        outputs = stage_outputs(repo)
        start = time.monotonic()
        second = run_cli(["pipeline", "--pool", "local"], repo, env, timeout=600)
        second_seconds = time.monotonic() - start
        assert second.returncode == 0, second.stderr[-4000:]
        runs = client.search_runs(
            [exp.experiment_id], "tags.`gptforge.stage` = 'pipeline'", order_by=["attributes.start_time DESC"]
        )
        assert len(runs) == 2
        assert runs[0].data.metrics["stages_ran"] == 0 and runs[0].data.metrics["stages_up_to_date"] == len(DVC_STAGES)
        assert stage_outputs(repo) == outputs
        # Reported, not asserted: both include the worker's polling and each flow run's start-up,
        # which a loaded machine stretches; what "up to date" means is checked just above.
        print(f"first pipeline run {first_seconds:.1f} s, second (all up to date) {second_seconds:.1f} s")

        # `dvc repro` typed by a user in the same repository: nothing is stale.
        typed = dvc(repo, "repro", env=env)
        assert typed.returncode == 0 and ran_stages(typed.stdout) == [], typed.stdout
        again = run_cli(["register"], repo, env, timeout=300)  # forced: same weights, so no new version
        assert again.returncode == 0, again.stderr[-2000:]
        assert {m: len(client.search_model_versions(f"name = '{n}'")) for m, n in names.items()} == {
            "pretrain": 1,
            "classify": 1,
            "instruct": 1,
            "preference": 1,
            "reward": 1,
            "rl": 1,
        }
        check_stale_stages_rerun(repo, client, names, env)

        # The two UIs, as a user sees them.
        from browser import Browser, find_chromium

        binary = find_chromium()
        if binary is None:
            pytest.skip("no chromium on this machine (CI installs it: apt-get install -y chromium)")
        browser = Browser(binary, free_port())
        ui = prefect_api.removesuffix("/api")
        browser.page_text_and_screenshot(
            f"{ui}/runs/flow-run/{pipe['id']}", [pipe["name"], "pipeline"], ARTIFACTS / "prefect-pipeline-flow-run.png"
        )
        ids = [parent.info.run_id] + [c.info.run_id for c in children]
        compare = (
            f"{mlflow_server}/#/compare-runs?runs=[{','.join(repr(i) for i in ids)}]"
            f"&experiments=[{exp.experiment_id!r}]"
        ).replace("'", '"')
        text = browser.page_text_and_screenshot(
            compare, ["pipeline", "pretrain", "finetune_classify"], ARTIFACTS / "mlflow-compare-runs.png"
        )
        assert all(s in text for s in STAGES)
    finally:
        if browser is not None:
            browser.close()
        stop_process(worker)
        worker_log.close()
        api.close()


def check_stage_outputs(repo: Path) -> None:
    """What each stage wrote, as DVC tracks it."""
    assert json.loads((repo / "data/pretrain/manifest.json").read_text())["tokens"]["val"] == 500
    for folder in ("classify", "instruct"):
        assert {p.name for p in (repo / "data" / folder).iterdir()} == {"train.jsonl", "val.jsonl", "test.jsonl"}
    evaluated = json.loads((repo / "metrics/evaluate.json").read_text())
    assert {f"{m}.hellaswag.acc_norm" for m in ("pretrain", "instruct")} <= set(evaluated)  # the quickstart's two
    # The preference stage on the embedded pairs (ch. 7's 1,100, 6 identical ones dropped by the data stage).
    prepared = json.loads((repo / "metrics/prepare_preference.json").read_text())
    assert prepared["records"] == 1100 and prepared["identical"] == 6
    preference = json.loads((repo / "metrics/preference.json").read_text())
    assert preference["train_pairs"] == 8 and preference["val_reward_accuracy_before"] == 0
    assert len((repo / "reports/preference_responses.jsonl").read_text().splitlines()) == 2
    assert load_model_folder(repo / "checkpoints/preference/final").config.n_embd == 32
    # The reward model on the same 8 pairs, and two GRPO steps from the SFT model against it.
    reward = json.loads((repo / "metrics/reward.json").read_text())
    assert reward["train_pairs"] == 8 and reward["steps"] == 2 and "val_accuracy_before" in reward
    assert (repo / "checkpoints/reward/final/config.json").is_file()
    rl = json.loads((repo / "metrics/rl.json").read_text())
    assert rl["steps"] == 2 and {"heldout_reward", "heldout_reward_before", "heldout_reward_model"} <= set(rl)
    assert len((repo / "reports/rl_responses.jsonl").read_text().splitlines()) == 2
    assert load_model_folder(repo / "checkpoints/rl/final").config.n_embd == 32
    assert "| baseline |" in (repo / "reports/benchmark.md").read_text()
    assert {"test_accuracy", "precision", "recall", "f1"} <= set(
        json.loads((repo / "metrics/classify.json").read_text())
    )
    assert len((repo / "reports/instruct_responses.jsonl").read_text().splitlines()) == 2
    assert set(json.loads((repo / "metrics/pretrain.json").read_text())) >= {
        "train_loss",
        "val_loss",
        "tokens",
        "tokens_per_sec",
        "mfu",
    }
    assert (repo / "checkpoints/pretrain/final/model.safetensors").is_file()
    assert (repo / "plots/pretrain.csv").read_text().startswith("step,train_loss,val_loss,lr")


def check_stage_runs(client, experiment_id: str) -> None:
    """Each stage run is an MLflow run tagged with its DVC stage and its Prefect flow run."""
    runs = client.search_runs([experiment_id], "tags.`dvc.stage` != ''", order_by=["attributes.start_time ASC"])
    by_stage = {r.data.tags["dvc.stage"]: r for r in runs}  # the newest run of each stage
    assert set(DVC_STAGES) <= set(by_stage)
    trained = by_stage["pretrain"]
    assert trained.info.status == "FINISHED"
    logged_steps = {m.step for m in client.get_metric_history(trained.info.run_id, "train_loss")}
    assert {1, 2, 3, 4} <= logged_steps  # per step (log_interval 1), plus the final value
    assert trained.data.params["model.n_embd"] == "32"
    artifacts = {a.path for a in client.list_artifacts(trained.info.run_id)}
    assert {"checkpoint", "pretrain.csv", "pretrain.png", "pretrain.json"} <= artifacts
    pretrain = by_stage["prepare_pretrain"]
    assert pretrain.info.status == "FINISHED" and pretrain.data.metrics["tokens_per_sec"] > 0
    assert pretrain.data.tags["prefect.flow_run_id"] and pretrain.data.tags["git.commit"]
    assert "manifest.json" in [a.path for a in client.list_artifacts(pretrain.info.run_id)]


def check_stale_stages_rerun(repo: Path, client, names: dict, env: dict) -> None:
    """After a params change, `dvc repro` runs only the stages it makes stale."""
    # A gate the new classifier fails: it becomes the challenger, the champion stays version 1.
    set_params(
        repo,
        **{
            "data.classify.splits": [0.6, 0.2, 0.2],
            "registry.promote": {"classify": {"classify.test_accuracy": ">= 2.0"}},
        },
    )
    third = dvc(repo, "repro", env=env)
    assert third.returncode == 0, third.stdout + third.stderr
    # and what depends on it: the report of the classifier's test metrics, every registration
    # (registry.promote is a param of each) and the registry's report; no evaluation re-runs
    assert sorted(ran_stages(third.stdout)) == sorted(
        ["prepare_classify", "finetune_classify", "evaluate_report"]
        + [f"register@{m}" for m in REGISTERED]
        + ["register_report"]
    ), third.stdout
    metrics = json.loads((repo / "metrics/prepare_classify.json").read_text())
    assert metrics["val"] == int(24 * 0.2)
    assert client.get_model_version_by_alias(names["classify"], "champion").version == "1"
    challenger = client.get_model_version_by_alias(names["classify"], "challenger")
    assert challenger.version == "2" and challenger.tags["gptforge.gate"].startswith("failed: classify.test_accuracy")
    assert json.loads((repo / "metrics/register.json").read_text())["classify.champion"] == 0

    set_params(repo, **{"classify.lr": 1e-4})
    fourth = dvc(repo, "repro", env=env)
    assert fourth.returncode == 0 and sorted(ran_stages(fourth.stdout)) == sorted(
        ["finetune_classify", "evaluate_report", "register@classify", "register_report"]
    ), fourth.stdout

    shown = dvc(repo, "metrics", "show", "--json", env=env)
    assert shown.returncode == 0 and "prepare_classify.json" in shown.stdout


def stage_outputs(repo: Path) -> dict[str, int]:
    """Every file the stages in dvc.lock wrote, with its modification time (ns)."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    paths = [repo / out["path"] for stage in lock["stages"].values() for out in stage.get("outs", [])]
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*"))) if f.is_file()]
    assert files
    return {str(f.relative_to(repo)): f.stat().st_mtime_ns for f in files}


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""
