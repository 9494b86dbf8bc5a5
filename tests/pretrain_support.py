"""The small pretraining setup that the training tests share (tests/test_train.py,
test_train_distributed.py, test_launch.py).

`SMALL`: the -S overrides of a small model on the small tokenizer; `shards`: data/pretrain made
by the real prepare stage from a small corpus, once per test module that imports the fixture;
`losses`: a run's train loss per step, read back from its CSV; `_assert_same_final`: two runs
ended with the same final weights, bit for bit, and the same final losses.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gptforge.config.load import load_config
from gptforge.data.pretrain_stage import prepare_pretrain

# A small model on the small tokenizer (281 ids): fast on 2 cores, still every code path.
SMALL = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=16",
    "model.vocab_size=320",
    "pretrain.batch_size=4",
    "pretrain.batch_tokens=64",
    "pretrain.warmup_steps=2",
    "pretrain.lr=0.01",
    "pretrain.min_lr=0.001",
    "pretrain.eval_interval=5",
    "pretrain.eval_steps=2",
    "pretrain.log_interval=1",
    "pretrain.ckpt_interval=5",
    "tracking.enabled=false",
    "pretrain.device=cpu",
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, small_tokenizer) -> Path:
    """data/pretrain/ made by the real prepare stage from a small corpus."""
    root = tmp_path_factory.mktemp("shards")
    corpus = root / "corpus.txt"
    words = "the cat and the dog ran off in the rain of the night and the day is on".split()
    gen = torch.Generator().manual_seed(0)
    text = " ".join(words[i] for i in torch.randint(0, len(words), (30_000,), generator=gen).tolist())
    corpus.write_text(text)
    cfg = load_config(
        None,
        [
            f"data.pretrain.source={corpus}",
            f"tokenizer.path={small_tokenizer}",
            "data.pretrain.val_tokens=2000",
            "data.pretrain.shard_tokens=20000",
            "data.pretrain.workers=1",
            "tracking.enabled=false",
        ],
    )
    prepare_pretrain(cfg, out_dir=root / "data/pretrain", metrics_path=root / "m.json")
    return root / "data/pretrain"


def losses(plots: Path) -> dict[int, float]:
    with open(plots) as f:
        return {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f) if r["train_loss"]}


def _assert_same_final(a_root: Path, b_root: Path) -> None:
    a = load_file(a_root / "checkpoints/pretrain/final/model.safetensors")
    b = load_file(b_root / "checkpoints/pretrain/final/model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ma = json.loads((a_root / "metrics/pretrain.json").read_text())
    mb = json.loads((b_root / "metrics/pretrain.json").read_text())
    assert ma["val_loss"] == mb["val_loss"] and ma["train_loss"] == mb["train_loss"]
