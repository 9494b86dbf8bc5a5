"""The bad-input catalogue: every way a user can get params, data files, checkpoints or CLI
arguments wrong, run through `gptforge` end to end.

The contract for each case: exit code 2, exactly one `gptforge: error:` line that names the
problem (the key, the file or the argument), no traceback, and nothing written or removed in
the working directory (whose data/, checkpoints/ and metrics/ already hold a previous run's
files, so a wipe would show).

The cases run in-process without Prefect (`GPTFORGE_PREFECT=0`), each in a fresh copy of one
working directory that is built once for the module (a prepared pretrain corpus, classify
splits, a small saved model and a resumable checkpoint).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from bad_input_workdir import build_workdir
from cli_support import error_lines, snapshot

from gptforge.cli import main


@pytest.fixture(scope="module")
def template(tmp_path_factory, small_tokenizer) -> Path:
    """The working directory every case starts from (built once; each case gets a copy)."""
    return build_workdir(tmp_path_factory.mktemp("bad-inputs") / "work", small_tokenizer)


@pytest.fixture
def workdir(template, tmp_path, monkeypatch) -> Path:
    work = tmp_path / "work"
    shutil.copytree(template, work)
    monkeypatch.chdir(work)
    monkeypatch.setenv("GPTFORGE_PREFECT", "0")
    monkeypatch.delenv("GPTFORGE_DEBUG", raising=False)  # it adds the traceback
    return work


# ---------------------------------------------------------------------------------------------
# Preparations a case makes on its copy of the working directory before the snapshot


def _truncate_weights(work: Path) -> None:
    weights = work / "ckpt/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])


def _drop_config(work: Path) -> None:
    (work / "ckpt/config.json").unlink()


def _flip_resumable_weights(work: Path) -> None:
    """Same size, other bytes: only the checksum can tell."""
    weights = work / "resumable/step_00000001/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    weights.write_bytes(bytes(data))


def _drop_manifest(work: Path) -> None:
    (work / "data/pretrain/manifest.json").unlink()


def _files(work: Path) -> dict[str, bytes]:
    """Every file of the working directory (outputs, inputs, params.yaml) but the run locks in
    .gptforge/, which a stage takes (and leaves, unlocked) before it reads its inputs."""
    return {name: data for name, data in snapshot(work).items() if not name.startswith(".gptforge/")}


@dataclass(frozen=True)
class Case:
    group: str  # params | data | checkpoint | cli
    name: str
    args: list[str]
    fragment: str  # what the one error line must contain
    prep: Callable[[Path], None] | None = None


CASES = [
    # --- params: the params file, -S overrides, and the values in them --------------------------
    Case(
        "params",
        "unknown key with suggestion",
        ["prepare", "classify", "-S", "data.classify.splts=[1,0,0]"],
        "unknown key 'data.classify.splts' (did you mean 'data.classify.splits'?)",
    ),
    Case("params", "mistyped section", ["config", "show", "-S", "trackng.enabled=false"], "did you mean 'tracking'"),
    Case(
        "params",
        "wrong type",
        ["prepare", "pretrain", "-S", "data.pretrain.max_tokens=lots"],
        "data.pretrain.max_tokens: expected int, got 'lots'",
    ),
    Case(
        "params", "negative learning rate", ["pretrain", "-S", "pretrain.lr=-1"], "pretrain.lr: expected float, got -1"
    ),
    Case(
        "params",
        "n_embd not divisible by n_head",
        ["pretrain", "-S", "model.n_embd=100", "-S", "model.n_head=3"],
        "model.n_embd (100) is not divisible by model.n_head (3)",
    ),
    Case(
        "params",
        "min_lr above lr",
        ["pretrain", "-S", "pretrain.lr=0.001", "-S", "pretrain.min_lr=0.01"],
        "pretrain.min_lr (0.01) is above pretrain.lr (0.001)",
    ),
    Case(
        "params",
        "bad precision literal",
        ["pretrain", "-S", "pretrain.precision=fp8"],
        "pretrain.precision: expected one of 'auto', 'fp32', 'bf16', 'fp16', got 'fp8'",
    ),
    Case(
        "params",
        "splits not summing to 1",
        ["prepare", "classify", "-S", "data.classify.splits=[0.5,0.1,0.1]"],
        "data.classify.splits: fractions must sum to 1",
    ),
    Case(
        "params",
        "malformed YAML params file",
        ["config", "show", "--params", "params_bad.yaml"],
        "params_bad.yaml: not valid YAML",
    ),
    Case(
        "params",
        "params file whose top level is a list",
        ["pretrain", "--params", "params_list.yaml"],
        "params_list.yaml: expected a mapping of sections at the top level, got list",
    ),
    Case(
        "params", "missing params file", ["config", "show", "--params", "nope.yaml"], "params file not found: nope.yaml"
    ),
    Case(
        "params",
        "overlay whose extends come back to it",
        ["pretrain", "--params", "overlay_loop.yaml"],
        "overlay_back.yaml: extends makes a cycle: overlay_loop.yaml -> overlay_back.yaml -> overlay_loop.yaml",
    ),
    Case(
        "params",
        "overlay of a missing base",
        ["prepare", "classify", "--params", "overlay_orphan.yaml"],
        "overlay_orphan.yaml: extends: configs/gone.yaml is not found (configs/gone.yaml)",
    ),
    Case(
        "params",
        "override without =",
        ["config", "show", "-S", "data.pretrain.max_tokens"],
        "override 'data.pretrain.max_tokens' is not KEY=VALUE",
    ),
    Case(
        "params",
        "override with invalid YAML",
        ["prepare", "classify", "-S", "data.classify.splits=[0.5, 0.5"],
        "override data.classify.splits: value '[0.5, 0.5' is not valid YAML",
    ),
    Case(
        "params",
        "section overridden by a value",
        ["pretrain", "-S", "model=3"],
        "model: expected a section (mapping), got 3",
    ),
    Case(
        "params",
        "value used as a section",
        ["pretrain", "-S", "tokenizer.path.x=1"],
        "override tokenizer.path.x: tokenizer.path is a value, not a section",
    ),
    Case(
        "params",
        "tokenizer too large for uint16",
        ["prepare", "pretrain", "-S", "data.pretrain.source=a.txt", "-S", "tokenizer.path=big.tiktoken"],
        "more than uint16",
    ),
    Case(
        "params",
        "batch_tokens not a multiple of batch_size*block_size",
        ["pretrain", "-S", "pretrain.batch_tokens=50"],
        "pretrain.batch_tokens (50) is not divisible by batch_size*block_size*processes (2*16*1 = 32)",
    ),
    Case(
        "params",
        "nnodes above 1 without rdzv_endpoint",
        ["pretrain", "-S", "distributed.nnodes=2"],
        "distributed.rdzv_endpoint is required when distributed.nnodes > 1",
    ),
    Case(
        "params",
        "DPO batch not shared evenly by its processes",
        ["finetune", "preference", "-S", "preference.nproc_per_node=2", "-S", "preference.batch_size=5"],
        "preference.batch_size (5) is the whole batch, shared by the 2 processes",
    ),
    Case(
        "params",
        "RL reward name that does not exist",
        ["finetune", "rl", "-S", "rl.rewards={reward_modle: 1.0}"],
        "unknown reward 'reward_modle' (did you mean reward_model?); the rewards are reward_model, length, format, "
        "judge",
    ),
    Case(
        "params",
        "GRPO with one answer per prompt",
        ["finetune", "rl", "-S", "rl.num_generations=1"],
        "rl.num_generations must be at least 2 for grpo (got 1)",
    ),
    Case(
        "params",
        "RL batch not whole groups",
        ["finetune", "rl", "-S", "rl.batch_size=6"],
        "rl.batch_size (6) must be a multiple of rl.num_generations (4)",
    ),
    Case(
        "params",
        "GRPO under fsdp",
        ["finetune", "rl", "-S", "rl.strategy=fsdp"],
        "rl.strategy: fsdp is not available for GRPO: trl's trainer runs the processes through accelerate's DDP",
    ),
    Case(
        "params",
        "reward model batch not shared evenly by its processes",
        ["finetune", "reward", "-S", "reward.nproc_per_node=2", "-S", "reward.batch_size=5"],
        "reward.batch_size (5) is the whole batch, shared by the 2 processes",
    ),
    Case(
        "params",
        "http source",
        ["prepare", "instruct", "-S", "data.instruct.source=http://example.com/a.json"],
        "data.instruct.source: only https://, hf://, sample:// and local sources are accepted, got 'http://example.com/a.json'",
    ),
    Case(
        "params",
        "ftp source",
        ["prepare", "classify", "-S", "data.classify.source=ftp://example.com/sms.zip"],
        "data.classify.source: only https://, hf://, sample:// and local sources are accepted, got 'ftp://example.com/sms.zip'",
    ),
    Case(
        "params",
        "malformed hf source",
        ["prepare", "pretrain", "-S", "data.pretrain.source=hf://fineweb-edu"],
        "data.pretrain.source: hf:// sources are hf://OWNER/NAME, got 'hf://fineweb-edu'",
    ),
    Case(
        "params",
        "bad sha256 string",
        ["prepare", "classify", "-S", "data.classify.sha256=abc123"],
        "data.classify.sha256: expected 64 hex digits, got 'abc123'",
    ),
    # --- data files: sources, archives, records, prepared data ---------------------------------
    Case(
        "data",
        "missing local file",
        ["prepare", "classify", "-S", "data.classify.source=missing.zip"],
        "data.classify.source: local source not found: missing.zip",
    ),
    Case(
        "data",
        "corrupt zip",
        ["prepare", "classify", "-S", "data.classify.source=corrupt.zip"],
        "corrupt.zip: not a valid zip archive",
    ),
    Case(
        "data",
        "zip member escaping with ..",
        ["prepare", "classify", "-S", "data.classify.source=escape.zip"],
        "escape.zip: refusing unsafe member '../evil'",
    ),
    Case(
        "data",
        "zip member with an absolute path",
        ["prepare", "classify", "-S", "data.classify.source=absolute.zip"],
        "absolute.zip: refusing unsafe member '/tmp/evil'",
    ),
    Case(
        "data",
        "JSON that is not a list",
        ["prepare", "instruct", "-S", "data.instruct.source=dict.json"],
        "expected a JSON list of records",
    ),
    Case(
        "data",
        "records missing fields",
        ["prepare", "instruct", "-S", "data.instruct.source=nofields.json"],
        "nofields.json: field 'output' is missing in 5 of 5 records",
    ),
    Case("data", "empty corpus", ["prepare", "pretrain", "-S", "data.pretrain.source=empty.txt"], "empty corpus"),
    Case(
        "params",
        "unknown pretrain executor",
        ["prepare", "pretrain", "-S", "data.pretrain.executor=spark"],
        "data.pretrain.executor",
    ),
    Case(
        "data",
        "a source whose documents are all filtered out",
        ["prepare", "pretrain", "-S", "data.pretrain.filters.min_chars=100000000"],
        "empty corpus",
    ),
    Case(
        "data",
        "too many malformed SMS lines",
        ["prepare", "classify", "-S", "data.classify.source=SMSSpamCollection"],
        "2 of 4 lines malformed (50.0%) in SMSSpamCollection, above data.classify.max_bad_fraction",
    ),
    Case(
        "data",
        "malformed pretrain HellaSwag file",
        ["pretrain", "-S", "pretrain.hellaswag.source=hellaswag_bad.jsonl"],
        "hellaswag_bad.jsonl:2: endings must hold 4 strings, got 3 (set pretrain.hellaswag.source",
    ),
    Case(
        "data",
        "missing pretrain HellaSwag file",
        ["pretrain", "-S", "pretrain.hellaswag.source=nope.jsonl"],
        "pretrain.hellaswag.source: local source not found: nope.jsonl",
    ),
    Case(
        "data",
        "malformed evaluate HellaSwag file",
        [
            "evaluate",
            "-S",
            "evaluate.tasks=[hellaswag]",
            "-S",
            "evaluate.models={pretrain: ckpt}",
            "-S",
            "evaluate.hellaswag.source=hellaswag_bad.jsonl",
        ],
        "hellaswag_bad.jsonl:2: endings must hold 4 strings, got 3 (evaluate.hellaswag.source",
    ),
    Case(
        "data",
        "pretrain without prepared data",
        ["pretrain"],
        "data/pretrain/manifest.json not found: run `gptforge prepare pretrain` first",
        prep=_drop_manifest,
    ),
    # --- checkpoints: model folders, classifiers, resumable state -------------------------------
    Case(
        "checkpoint",
        "generate from a missing folder",
        ["generate", "x", "--checkpoint", "nowhere"],
        "model folder not found: nowhere",
    ),
    Case(
        "checkpoint",
        "generate from truncated weights",
        ["generate", "x", "--checkpoint", "ckpt"],
        "ckpt/model.safetensors: not a readable safetensors file",
        prep=_truncate_weights,
    ),
    Case(
        "checkpoint",
        "generate from a folder without config.json",
        ["generate", "x", "--checkpoint", "ckpt"],
        "ckpt/config.json: not found",
        prep=_drop_config,
    ),
    Case(
        "checkpoint",
        "classify with a model that is not a classifier",
        ["classify", "hi", "--checkpoint", "ckpt"],
        "ckpt/classifier.json: not found (a classifier folder holds",
    ),
    Case(
        "checkpoint",
        "classify from a missing folder",
        ["classify", "hi", "--checkpoint", "nowhere"],
        "classifier folder not found: nowhere",
    ),
    Case(
        "checkpoint",
        "export of a damaged checkpoint",
        ["export", "--checkpoint", "ckpt", "--out", "hf"],
        "ckpt/model.safetensors: not a readable safetensors file",
        prep=_truncate_weights,
    ),
    Case(
        "checkpoint",
        "resume from a folder that is not a checkpoint",
        ["pretrain", "-S", "pretrain.resume=not_a_checkpoint"],
        "pretrain.resume: cannot resume from not_a_checkpoint: not_a_checkpoint/checksums.json is missing",
    ),
    Case(
        "checkpoint",
        "resume from a missing folder",
        ["pretrain", "-S", "pretrain.resume=nowhere"],
        "pretrain.resume: cannot resume from nowhere: nowhere is not a folder",
    ),
    Case(
        "checkpoint",
        "resume from a corrupted checkpoint",
        ["pretrain", "-S", "pretrain.resume=resumable/step_00000001"],
        "resumable/step_00000001/model.safetensors fails its checksum",
        prep=_flip_resumable_weights,
    ),
    Case(
        "checkpoint",
        "fine-tune from a missing folder",
        ["finetune", "classify", "-S", "classify.init_from=nowhere"],
        "classify.init_from: checkpoint folder nowhere not found",
    ),
    # --- CLI arguments ----------------------------------------------------------------------------
    Case("cli", "unknown command", ["frobnicate"], "invalid choice: 'frobnicate'"),
    Case("cli", "unknown subcommand", ["prepare", "everything"], "invalid choice: 'everything'"),
    Case(
        "cli",
        "missing required argument",
        ["export", "--checkpoint", "ckpt"],
        "the following arguments are required: --out",
    ),
    Case(
        "cli",
        "non-integer --max-new-tokens",
        ["generate", "x", "--checkpoint", "ckpt", "--max-new-tokens", "many"],
        "argument --max-new-tokens: invalid int value: 'many'",
    ),
    Case(
        "cli",
        "zero --max-new-tokens",
        ["generate", "x", "--checkpoint", "ckpt", "--max-new-tokens", "0"],
        "--max-new-tokens must be > 0, got 0",
    ),
    Case(
        "cli",
        "negative --temperature",
        ["generate", "x", "--checkpoint", "ckpt", "--temperature", "-1"],
        "--temperature must be >= 0 (0 = greedy), got -1.0",
    ),
    Case(
        "cli",
        "pipeline with an unknown stage",
        ["pipeline", "prepare_classify", "nosuchstage"],
        "unknown stage 'nosuchstage'; stages in dvc.yaml: prepare_base, synthesize, index, evaluate_qa, "
        "prepare_pretrain",
    ),
    Case(
        "cli",
        "--params naming a folder",
        ["config", "show", "--params", "params_dir"],
        "params file params_dir is a folder, not a YAML file",
    ),
    Case(
        "cli",
        "pipeline --params naming a folder",
        ["pipeline", "--params", "params_dir"],
        "params file params_dir is a folder, not a YAML file",
    ),
    Case(
        "cli",
        "plan with an unreadable GPU memory",
        ["plan", "--gpu-memory", "lots"],
        "--gpu-memory: expected a size such as 80GB or 24GiB, got 'lots'",
    ),
    Case(
        "cli",
        "plan for a model it cannot see offline",
        ["plan", "--stage", "instruct", "-S", "instruct.init_from=someone/unknown-7b"],
        "plan: instruct.init_from someone/unknown-7b has no config.json here and someone/unknown-7b is not among "
        "the known architectures",
    ),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{c.group}: {c.name}") for c in CASES])
def test_bad_input(case, workdir, capsys):
    if case.prep is not None:
        case.prep(workdir)
    before = _files(workdir)
    rc = main(case.args)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert case.fragment in lines[0], err
    assert _files(workdir) == before


def test_catalogue_covers_every_group():
    names = [(c.group, c.name) for c in CASES]
    assert len(set(names)) == len(names) >= 30
    assert {c.group for c in CASES} == {"params", "data", "checkpoint", "cli"}
