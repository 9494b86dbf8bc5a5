"""Continued pretraining of a Hugging Face Llama folder in our loop (issue 48; the real SmolLM2
run is benchmarks/check_continue_smollm2.py): `tokenizer.path` naming the folder tokenizes with
its own tokenizer (here the GPT-2 BPE as a transformers tokenizer, so tiktoken's GPT-2 shards are
the independent reference, id for id), `pretrain.init_from` naming it gives an `arch: llama` GPT
whose loss on the loader's first batch is transformers' on the same batch, and `gptforge pretrain`
from it lowers the validation loss."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from cli_support import cli_env, run_cli
from hf_models import make_tiny_causal_lm

from gptforge.config.load import load_config
from gptforge.data.pretrain_stage import prepare_pretrain
from gptforge.errors import BadInput
from gptforge.modeling.tokenizer import load_tokenizer
from gptforge.training import loop

DOCS = [f"Document {i}: the cat and the dog ran off in the rain, {i * 7} times.\n" * (1 + i % 5) for i in range(200)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_causal_lm(tmp_path_factory.mktemp("hf") / "llama", "llama", max_positions=64)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return path


def _prepare(corpus: Path, tokenizer: str, out: Path) -> np.ndarray:
    cfg = load_config(
        None, [f"data.pretrain.source={corpus}", f"tokenizer.path={tokenizer}", "data.pretrain.val_tokens=1024"]
    )
    prepare_pretrain(cfg, out_dir=out, metrics_path=out.parent / f"{out.name}.json")
    manifest = json.loads((out / "manifest.json").read_text())
    return manifest, np.concatenate([np.load(out / s["file"]) for s in manifest["shards"]])


def test_a_hugging_face_folder_tokenizes_as_its_tokenizer_does(folder, corpus, tmp_path, gpt2_tokenizer_dir):
    manifest, ids = _prepare(corpus, str(folder), tmp_path / "hf")
    assert manifest["tokenizer"] == {"name": f"Hugging Face tokenizer from {folder}", "n_vocab": 50257, "eot": 50256}
    _, reference = _prepare(corpus, str(gpt2_tokenizer_dir), tmp_path / "tiktoken")
    np.testing.assert_array_equal(ids, reference)  # the same BPE through transformers and through tiktoken
    enc = load_tokenizer(str(folder))
    assert 50256 not in enc.encode_ordinary("a <|endoftext|> b")  # document text is never a separator


def test_a_folder_without_a_readable_tokenizer_is_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(BadInput, match=r"^tokenizer.path .*: cannot read its tokenizer \(") as err:
        load_tokenizer(str(tmp_path))
    assert "\n" not in str(err.value)


def test_continued_pretraining_starts_at_transformers_loss_and_lowers_it(folder, corpus, tmp_path):
    data = tmp_path / "data/pretrain"
    _prepare(corpus, str(folder), data)
    over = [
        f"tokenizer.path={folder}",
        f"pretrain.init_from={folder}",
        "model.block_size=32",
        "pretrain.batch_size=4",
        "pretrain.batch_tokens=128",
        "pretrain.max_steps=30",
        "pretrain.eval_interval=10",
        "pretrain.eval_steps=4",
        "pretrain.warmup_steps=3",
        "pretrain.lr=0.003",
        "pretrain.precision=fp32",
        "pretrain.compile=false",
        "tracking.enabled=false",
    ]
    s = loop.setup(load_config(None, over), data, tmp_path / "probe")
    assert s.raw_model.config.arch == "llama" and s.raw_model.config.n_kv_head == 2
    assert not s.raw_model.config.tie_embeddings  # the folder's own untied head
    x, y = s.train_loader.next_batch(s.rt.device)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        ours = s.raw_model.eval()(x, y)[1].item()
        want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert abs(ours - want) <= 1e-5, (ours, want)

    done = run_cli(["pretrain", *(f"-S={o}" for o in over)], tmp_path, cli_env(GPTFORGE_PREFECT="0"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Hugging Face Llama folder" in done.stderr
    with open(tmp_path / "plots/pretrain.csv") as f:
        rows = list(csv.DictReader(f))
    assert abs(float(rows[0]["train_loss"]) - want) <= 1e-4  # the run's first step: the same batch
    val = {int(r["step"]): float(r["val_loss"]) for r in rows if r["val_loss"] and r["train_loss"]}
    assert sorted(val) == [0, 10, 20] and val[20] < val[0] - 1.0, val
