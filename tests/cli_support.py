"""Running `gptforge` as a user does, and reading what it left, for the tests.

`REPO` is this checkout and `BIN` the virtual environment's scripts; `cli_env` and `run_cli` run
the command line in a process of its own (a fork of a warm server: tests/cli_zygote.py);
`error_lines` and `last_error_line` read its one-line errors; `snapshot` shows that a failed run
changed nothing; `set_params` edits a repository's params.yaml, and `stage_params` makes every
stage of the pipeline run on local fixtures in seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def cli_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.update(extra)
    return env


def run_cli(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300, fresh: bool = False
) -> subprocess.CompletedProcess:
    """`gptforge ARGS` in `cwd` with `env`: a process of its own, forked from this worker's warm
    fork server (tests/cli_zygote.py: torch, transformers, peft and trl already imported), or a
    fresh interpreter when `fresh` or when `env` changes what those libraries read at import."""
    argv = [str(BIN / "gptforge"), *args]
    if not fresh:
        from cli_zygote import run_forked

        done = run_forked(argv, cwd, env, timeout)
        if done is not None:
            return done
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("gptforge: error:")]


def last_error_line(stderr: str) -> str:
    """The last line printed, which must be the command's error. Under the pipeline, the failed
    stage's own error line comes before it, as `dvc repro` shows it."""
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("gptforge: error:"), stderr[-2000:]
    return last


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes, to show that a failed run changed nothing."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def set_params(repo: Path, **dotted) -> None:
    """Set dotted keys in a repository's params.yaml."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for key, value in dotted.items():
        node = params
        *parents, last = key.split(".")
        for part in parents:
            node = node[part]
        node[last] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def write_hellaswag(path: Path, n: int) -> Path:
    """A HellaSwag file of `n` rows in the dataset's own fields (one right ending of four)."""
    endings = ["puts them in a pan.", "sings a song.", "rides a bike.", "reads a book."]
    rows = [
        {
            "activity_label": "Cooking",
            "ctx_a": f"A man cuts onion number {i}.",
            "ctx_b": "he",
            "ctx": f"A man cuts onion number {i}. he",
            "label": i % 4,
            "endings": endings,
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def stage_params(tmp_path: Path, small_tokenizer: Path, sms_file: Path, alpaca_file: Path) -> dict[str, Any]:
    """Params (dotted keys) that run every stage of the pipeline on local fixtures in seconds."""
    hellaswag = write_hellaswag(tmp_path / "hellaswag.jsonl", 6)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat and the dog\n" * 400)
    return {
        "tokenizer.path": str(small_tokenizer),
        "data.pretrain.source": str(corpus),
        "data.pretrain.val_tokens": 500,
        "data.pretrain.shard_tokens": 2000,
        "data.pretrain.workers": 1,
        "data.classify.source": str(sms_file),
        "data.instruct.source": str(alpaca_file),
        # a small, short pretraining run on the small tokenizer (281 ids)
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.n_embd": 32,
        "model.block_size": 128,
        "model.vocab_size": 320,
        "pretrain.batch_size": 2,
        "pretrain.batch_tokens": 256,
        "pretrain.max_steps": 4,
        "pretrain.warmup_steps": 1,
        "pretrain.eval_interval": 2,
        "pretrain.eval_steps": 1,
        "pretrain.ckpt_interval": 2,
        "pretrain.log_interval": 1,
        # one short epoch of each fine-tuning on the fixtures
        "classify.epochs": 1,
        "classify.batch_size": 4,
        "classify.eval_interval": 2,
        "classify.eval_batches": 1,
        "instruct.epochs": 1,
        "instruct.batch_size": 4,
        "instruct.eval_interval": 2,
        "instruct.eval_batches": 1,
        "instruct.n_responses": 2,
        "instruct.max_new_tokens": 8,
        # the quickstart aligns SmolLM2's SFT (chat template, LoRA, bf16): here the tiny GPT's SFT in
        # its own template, full fine-tuning, fp32, at the model's positions
        **{
            f"{section}.{key}": value
            for section in ("preference", "reward", "rl")
            for key, value in (
                ("init_from", "checkpoints/instruct/final"),
                ("template", None),
                ("method", "full"),
                ("max_length", None),
                ("precision", "auto"),
            )
        },
        "rl.max_heldout": None,
        # the quickstart's lm-eval and lever table of SmolLM2 are left out with it
        "evaluate.models": {"pretrain": "checkpoints/pretrain/final", "instruct": "checkpoints/instruct/final"},
        "synthesize.documents": {},
        "evaluate_qa.questions": {},
        "evaluate_qa.models": None,
        # DPO on a few of the embedded preference pairs (the data stage reads the whole sample)
        "preference.max_samples": 8,
        "preference.batch_size": 4,
        "preference.n_responses": 2,
        "preference.max_new_tokens": 8,
        "preference.eval_interval": 1000,
        "data.preference.splits": [0.97, 0.01, 0.02],
        # a reward model on the same few pairs, and two GRPO steps of 2 prompts x 2 short answers
        "reward.max_samples": 8,
        "reward.batch_size": 4,
        "reward.eval_interval": 1000,
        "rl.max_prompts": 4,
        "rl.batch_size": 4,
        "rl.num_generations": 2,
        "rl.max_completion_length": 8,
        "rl.max_new_tokens": 8,
        "rl.n_responses": 2,
        "benchmark.variants": ["baseline", "sdpa"],
        "benchmark.steps": 1,
        "benchmark.warmup": 1,
        "benchmark.attention_seq_lens": [16],
        "benchmark.ce_vocab_sizes": [512],
        "benchmark.ce_rows": 32,
        "benchmark.profile_steps": 1,
        "evaluate.tasks": ["hellaswag"],
        "evaluate.hellaswag.source": str(hellaswag),
        "evaluate.batch_size": 4,
        "instruct.template": "phi3",  # Alpaca's preamble is ~130 ids with the byte-level test tokenizer
        # the quickstart's real model (SmolLM2 from its GGUF file: tests/test_gguf_in.py) is left out;
        # an instruct variant of the tiny GPT stands in for its SFT, scored before and after
        "base.models": {},
        "instruct_variants.models": {
            "tiny": {
                "init_from": "checkpoints/pretrain/final",
                "max_samples": 8,
                "score_before": True,
                "n_responses": 1,
            }
        },
    }
