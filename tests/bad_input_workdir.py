"""The working directory of the bad-input catalogue (tests/test_bad_inputs.py), built once a module:
its params (a small model on the small test tokenizer, no MLflow), every bad input file a case
names (tokenizers, corpora, archives, records, params files, a HellaSwag file, a damaged
checkpoint's sources), a small saved model and a resumable checkpoint, and a previous run's
outputs in data/, checkpoints/ and metrics/, so that a case that wipes or half-writes shows.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from cli_support import REPO
from fixture_data import SMS_LINES, write_tiktoken

from gptforge.cli import main
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.modeling.weights import save_model
from gptforge.training import checkpoint as ckpt

# The working directory's own params: a small model on the small test tokenizer, no MLflow.
WORKDIR_PARAMS = """\
tokenizer:
  path: small.tiktoken
data:
  pretrain:
    source: corpus.txt
    val_tokens: 200
    shard_tokens: 1000
    workers: 1
  classify:
    source: sms_good.txt
model:
  n_layer: 1
  n_head: 2
  n_embd: 32
  block_size: 16
  vocab_size: 320
pretrain:
  device: cpu
  batch_size: 2
  batch_tokens: 64
  max_steps: 2
classify:
  device: cpu
evaluate:
  device: cpu
tracking:
  enabled: false
"""


def _zip(path: Path, members: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in members.items():
            z.writestr(name, text)
    return path


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=320, n_vocab=281))


def build_workdir(root: Path, small_tokenizer: Path) -> Path:
    """The working directory every case starts from, at `root` (each case gets a copy)."""
    root.mkdir()
    (root / "params.yaml").write_text(WORKDIR_PARAMS)
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")

    # Inputs: tokenizers, corpora, archives, records.
    shutil.copy(small_tokenizer, root / "small.tiktoken")
    write_tiktoken(root / "big.tiktoken", [f"t{i:05d}".encode() for i in range(66_000)])
    (root / "corpus.txt").write_text("the cat and the dog sat on the mat.\n" * 200)
    (root / "a.txt").write_text("hello world")
    (root / "empty.txt").write_text("")
    sms = [f"{label}\t{text} #{i}\n" for i in range(3) for label, text in SMS_LINES]
    (root / "sms_good.txt").write_text("".join(sms))
    (root / "SMSSpamCollection").write_text("ham\thello\nno tab here\nspam\twin\nmaybe\tlabel\n")
    _zip(root / "escape.zip", {"../evil": "x", "SMSSpamCollection": "ham\thi\n"})
    _zip(root / "absolute.zip", {"/tmp/evil": "x", "SMSSpamCollection": "ham\thi\n"})
    (root / "corrupt.zip").write_bytes(b"PK\x03\x04 this is not really a zip")
    (root / "dict.json").write_text('{"instruction": "a", "output": "b"}')
    (root / "nofields.json").write_text(json.dumps([{"instruction": f"i{i}", "input": ""} for i in range(5)]))
    # HellaSwag: line 1 fine, line 2 has three endings.
    good = {
        "activity_label": "Cooking",
        "ctx_a": "A man cuts an onion.",
        "ctx_b": "he",
        "ctx": "A man cuts an onion. he",
        "endings": ["fries it.", "sings.", "runs.", "reads."],
        "label": 0,
    }
    bad = {**good, "endings": ["a", "b", "c"]}
    (root / "hellaswag_bad.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    (root / "params_bad.yaml").write_text("model:\n  n_layer: [1,\n")
    (root / "params_list.yaml").write_text("- model\n- pretrain\n")
    (root / "params_dir").mkdir()
    (root / "overlay_loop.yaml").write_text("extends: overlay_back.yaml\n")
    (root / "overlay_back.yaml").write_text("extends: overlay_loop.yaml\n")
    (root / "overlay_orphan.yaml").write_text("extends: configs/gone.yaml\npretrain: {max_steps: 3}\n")
    (root / "not_a_checkpoint").mkdir()
    (root / "not_a_checkpoint" / "notes.txt").write_text("nothing to resume here\n")

    # A small saved model (weights only) and a resumable training checkpoint.
    save_model(_tiny_gpt(), root / "ckpt")
    ckpt.save_checkpoint(
        root / "resumable", 1, write_model=lambda d: save_model(_tiny_gpt(), d), state={"step": 1}, keep_last=None
    )

    # A previous run's outputs: prepared data (real, so the stages get as far as their checks)
    # and files in checkpoints/ and metrics/ that a wipe would remove.
    cwd = os.getcwd()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPTFORGE_PREFECT", "0")
        os.chdir(root)
        try:
            assert main(["prepare", "pretrain"]) == 0
            assert main(["prepare", "classify"]) == 0
        finally:
            os.chdir(cwd)
    assert (root / "data/pretrain/manifest.json").is_file() and (root / "data/classify/train.jsonl").is_file()
    for out in ("data/classify", "data/instruct", "data/pretrain", "data/raw"):
        (root / out).mkdir(parents=True, exist_ok=True)
        (root / out / "previous.jsonl").write_text("kept\n")
    (root / "checkpoints/pretrain/final").mkdir(parents=True)
    (root / "checkpoints/pretrain/final/previous.txt").write_text("kept\n")
    (root / "metrics").mkdir(exist_ok=True)
    (root / "metrics/previous.json").write_text("{}\n")
    return root
