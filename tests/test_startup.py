"""Start-up and wrap-up of the `gptforge` process: each DVC stage is its own process, so what a
command imports before it works, and what it prints after, counts.

Module checks run in a fresh interpreter (this test process has long imported torch): `--help`
loads no torch, Prefect, MLflow, transformers or pydantic; the data stages never load torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from cli_support import cli_env, run_cli
from process_support import prefect_home

from gptforge.cli import main

HEAVY = ("torch", "prefect", "mlflow", "transformers", "datasets", "pydantic")


def loaded_after(calls: list[list[str]], cwd: Path, **env: str) -> dict:
    """Run `gptforge.cli.main(args)` for each of `calls` in one fresh interpreter; return the exit
    codes and which of HEAVY (top-level packages) were imported by the end."""
    script = f"""
import contextlib, io, json, sys
from gptforge.cli import main
codes = []
for args in {calls!r}:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            codes.append(main(args))
        except SystemExit as e:
            codes.append(e.code)
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r}))
print(json.dumps({{"codes": codes, "loaded": loaded}}))
"""
    r = subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, env=cli_env(**env), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# --help


HELP_CALLS = [
    ["--help"],
    ["--version"],
    ["prepare", "--help"],
    ["prepare", "pretrain", "--help"],
    ["prepare", "classify", "--help"],
    ["prepare", "instruct", "--help"],
    ["pretrain", "--help"],
    ["finetune", "classify", "--help"],
    ["finetune", "instruct", "--help"],
    ["evaluate", "--help"],
    ["pipeline", "--help"],
    ["config", "show", "--help"],
    ["classify", "--help"],
    ["generate", "--help"],
    ["export", "--help"],
]


def test_help_loads_no_heavy_package(tmp_path):
    result = loaded_after(HELP_CALLS, tmp_path)
    assert result["codes"] == [0] * len(HELP_CALLS)
    assert result["loaded"] == []


def test_benchmark_help_still_lists_the_variant_grid(capsys):
    # Its grid comes from gptforge.bench.grid (which imports torch), read only when this help is shown.
    with pytest.raises(SystemExit) as e:
        main(["benchmark", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Variants" in out and "baseline: fp32" in out and "fused_ce:" in out


def test_help_names_the_default_params_file(capsys):
    from gptforge.cli.parsing import DEFAULT_PARAMS_HELP
    from gptforge.config.load import DEFAULT_PARAMS

    assert DEFAULT_PARAMS_HELP == DEFAULT_PARAMS
    with pytest.raises(SystemExit):
        main(["config", "show", "--help"])
    assert f"default: {DEFAULT_PARAMS}" in capsys.readouterr().out


def test_a_usage_error_loads_nothing_heavy_either(tmp_path):
    result = loaded_after([["prepare", "clasify"]], tmp_path)
    assert result["codes"] == [2] and result["loaded"] == []


# ---------------------------------------------------------------------------------------------
# Data stages: the real recipes, in-process, without Prefect


def test_data_stages_never_load_torch(tmp_path, small_tokenizer, sms_file, alpaca_file):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat and the dog\n" * 200)
    off = ["-S", "tracking.enabled=false"]
    calls = [
        [
            "prepare",
            "pretrain",
            *off,
            "-S",
            f"tokenizer.path={small_tokenizer}",
            "-S",
            f"data.pretrain.source={corpus}",
            "-S",
            "data.pretrain.val_tokens=100",
            "-S",
            "data.pretrain.shard_tokens=1000",
            "-S",
            "data.pretrain.workers=1",
        ],
        ["prepare", "classify", *off, "-S", f"data.classify.source={sms_file}"],
        ["prepare", "instruct", *off, "-S", f"data.instruct.source={alpaca_file}"],
    ]
    result = loaded_after(calls, tmp_path, GPTFORGE_PREFECT="0")
    assert result["codes"] == [0, 0, 0]
    for out in ("data/pretrain/manifest.json", "data/classify/train.jsonl", "data/instruct/train.jsonl"):
        assert (tmp_path / out).is_file()
    # No torch or transformers; no MLflow with tracking off; no Prefect with GPTFORGE_PREFECT=0.
    assert result["loaded"] == ["pydantic"]


@pytest.mark.slow
def test_a_recorded_data_stage_loads_neither_mlflow_nor_prefect_nor_torch(tmp_path, sms_file, mlflow_uri, prefect_api):
    # Its MLflow run and Prefect flow run go through its journal; the recorder makes them.
    result = loaded_after(
        [["prepare", "classify", "-S", f"data.classify.source={sms_file}"]],
        tmp_path,
        MLFLOW_TRACKING_URI=mlflow_uri,
        PREFECT_API_URL=prefect_api,
    )
    assert result["codes"] == [0]
    assert not {"mlflow", "prefect", "torch"} & set(result["loaded"]), result["loaded"]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name("gptforge")
    [run] = client.search_runs([exp.experiment_id], f"params.`data.classify.source` = '{sms_file}'")
    assert run.info.status == "FINISHED" and run.data.tags["device"] == "cpu"
    assert run.data.tags["prefect.flow_run_id"]


# ---------------------------------------------------------------------------------------------
# Wrap-up: the error is the last line


@pytest.mark.slow
def test_with_no_prefect_server_a_failed_stage_is_one_line_and_its_flow_run_goes_to_the_recorders_server(tmp_path):
    """With no PREFECT_API_URL the stage starts no Prefect server of its own (that used to cost
    ~15 s and print "Stopping temporary server" after the CLI's error line): its error is the
    only line, and the recorder delivers its Failed flow run to the recorder's own local server."""
    (tmp_path / "params.yaml").write_text("data:\n  classify:\n    source: broken.zip\ntracking:\n  enabled: false\n")
    (tmp_path / "broken.zip").write_bytes(b"not a zip at all")
    env = cli_env(PREFECT_HOME=str(prefect_home(tmp_path / "prefect-home")))
    env.pop("PREFECT_API_URL", None)
    env.pop("GPTFORGE_PREFECT", None)
    r = run_cli(["prepare", "classify"], cwd=tmp_path, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr == "gptforge: error: broken.zip: not a valid zip archive (File is not a zip file)\n"
    assert not list((tmp_path / ".gptforge" / "records").glob("*.jsonl"))  # delivered (GPTFORGE_WAIT_FOR_RECORDS)
    url = json.loads((tmp_path / ".gptforge" / "recorder" / "state.json").read_text())["prefect_api_url"]
    request = urllib.request.Request(
        f"{url}/flow_runs/filter", data=b"{}", method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        [flow_run] = json.loads(response.read())
    assert flow_run["state"]["type"] == "FAILED" and "not a valid zip archive" in flow_run["state"]["message"]
