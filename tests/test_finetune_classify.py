"""Classification fine-tuning: it learns, its metrics add up, it trains exactly what it says,
LoRA merges exactly, bad inputs stop it before it writes anything, and the saved classifier
predicts what the trained one did."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from fixture_data import FakeRun

from gptforge.config.load import validate
from gptforge.errors import BadInput
from gptforge.finetune import classifier as clf_model
from gptforge.finetune import classify as clf
from gptforge.finetune import classify_data as clf_data
from gptforge.finetune.common import merge_lora
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.modeling.tokenizer import load_tokenizer
from gptforge.modeling.weights import load_model, save_model
from gptforge.runtime.steps import Steps

BLOCK = 32
# Two disjoint marker alphabets and a filler alphabet shared by both classes: every text has
# filler words around one marker word at a random place, so the last token is usually filler
# and the class can only be read through attention, not from the pooled token alone. Byte-level
# BPE on these letters gives marker and filler tokens that never overlap (the small tokenizer's
# merges are all of other letters or of spaces), and at most 6 words of <= 4 letters stay under
# BLOCK tokens, so truncation never cuts the marker off.
HAM_LETTERS, SPAM_LETTERS, FILLER_LETTERS = "bcdfg", "kmpvw", "aeiou"


def _text(rng: random.Random, label: int) -> str:
    n = rng.randint(3, 6)
    marker = rng.randrange(n)
    words = []
    for i in range(n):
        letters = (SPAM_LETTERS if label else HAM_LETTERS) if i == marker else FILLER_LETTERS
        words.append("".join(rng.choice(letters) for _ in range(rng.randint(2, 4))))
    return " ".join(words)


def write_split(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"text": _text(rng, i % 2), "label": i % 2}) + "\n")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A small random GPT saved as a checkpoint folder (the fine-tuning's init_from)."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("base") / "final"
    save_model(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=320, n_vocab=281)), folder)
    return folder


@pytest.fixture
def data_dir(tmp_path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    for name, n, seed in (("train", 320, 1), ("val", 64, 2), ("test", 100, 3)):
        write_split(folder / f"{name}.jsonl", n, seed)
    return folder


def make_cfg(tokenizer: Path, init_from: Path, **classify):
    section = {
        "init_from": str(init_from),
        "trainable": "all",
        "epochs": 4,
        "lr": 3e-3,
        "weight_decay": 0.0,
        "batch_size": 16,
        "eval_interval": 10,
        "eval_batches": 2,
        "device": "cpu",
        "precision": "fp32",
        "seed": 7,
        "lora": {"r": 4, "alpha": 8},
    }
    section.update(classify)
    return validate({"tokenizer": {"path": str(tokenizer)}, "classify": section})


def outputs(tmp_path: Path) -> dict:
    return dict(
        out_dir=tmp_path / "ckpt", metrics_path=tmp_path / "metrics" / "classify.json", plots_dir=tmp_path / "plots"
    )


class RecordingSteps(Steps):
    """Runs each step directly and keeps its result, so a test can look at the trained model."""

    def __init__(self):
        self.results = {}

    def __call__(self, fn, /, *args, retry=None, **kwargs):
        self.results[fn.__name__] = result = super().__call__(fn, *args, retry=retry, **kwargs)
        return result


@pytest.mark.slow
def test_learns_the_marker_and_metrics_add_up(small_tokenizer, base, data_dir, tmp_path):
    cfg = make_cfg(small_tokenizer, base)
    run, steps, out = FakeRun(), RecordingSteps(), outputs(tmp_path)
    metrics = clf.finetune_classify(cfg, steps=steps, run=run, data_dir=data_dir, **out)

    # Chance is 0.5 (balanced). The marker alphabets are disjoint, so a model that attends to
    # the marker word separates the classes perfectly; 4 epochs of 20 steps reach ~1.0 here
    # (seeded), and 0.9 leaves room for a platform's different float rounding.
    assert metrics["test_accuracy"] >= 0.9 and metrics["train_accuracy"] >= 0.9
    on_disk = json.loads(out["metrics_path"].read_text())
    assert on_disk == pytest.approx(metrics)
    for key in (
        "train_accuracy",
        "val_accuracy",
        "test_accuracy",
        "precision",
        "recall",
        "f1",
        "test_tp",
        "test_fp",
        "test_tn",
        "test_fn",
        "trainable_params",
        "seconds_per_epoch",
    ):
        assert isinstance(on_disk[key], (int, float)), key
    assert metrics["trainable_params"] == metrics["total_params"] > 0  # trainable=all
    assert metrics["seconds_per_epoch"] > 0

    # Recompute from an independent prediction pass of the saved classifier.
    enc = load_tokenizer(str(small_tokenizer))
    saved = clf_model.load_classifier(out["out_dir"] / "final")
    for split in ("train", "val", "test"):
        records = [json.loads(line) for line in (data_dir / f"{split}.jsonl").read_text().splitlines()]
        predicted = clf_model.classify_texts(saved, [r["text"] for r in records], enc, "cpu")
        gold = [r["label"] for r in records]
        pred = [label for label, _ in predicted]
        assert metrics[f"{split}_accuracy"] == pytest.approx(sum(p == g for p, g in zip(pred, gold)) / len(gold))
    tp = sum(p == 1 and g == 1 for p, g in zip(pred, gold))
    fp = sum(p == 1 and g == 0 for p, g in zip(pred, gold))
    fn = sum(p == 0 and g == 1 for p, g in zip(pred, gold))
    tn = sum(p == 0 and g == 0 for p, g in zip(pred, gold))
    assert (metrics["test_tp"], metrics["test_fp"], metrics["test_fn"], metrics["test_tn"]) == (tp, fp, fn, tn)
    assert metrics["precision"] == pytest.approx(tp / (tp + fp))
    assert metrics["recall"] == pytest.approx(tp / (tp + fn))
    p, r = metrics["precision"], metrics["recall"]
    assert metrics["f1"] == pytest.approx(2 * p * r / (p + r))

    # Round trip: the loaded classifier gives the trained model's logits.
    trained = steps.results["train"].classifier
    test_examples = steps.results["setup"].data["test"]
    rt = steps.results["setup"].rt
    want, _ = clf_data.predict(trained, test_examples, 16, enc.eot_token, rt)
    got, _ = clf_data.predict(saved, test_examples, 16, enc.eot_token, rt)
    # Same weights, same code; only float rounding may differ (MKL's kernels can depend on the
    # buffers' memory alignment), far below what a wrong or missing weight would change.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert saved.labels == ["ham", "spam"] and saved.max_length == BLOCK

    # What the run saw: per-step curves, the parameter count, the artifacts.
    logged = {k for m in run.metrics for k in m}
    assert {"train_loss", "val_loss", "val_accuracy", "trainable_params", "total_params"} <= logged
    assert sum("train_loss" in m for m in run.metrics) == 4 * 20  # one per optimizer step
    names = {p.name for p in run.artifacts}
    assert {"classify_loss.png", "classify_accuracy.png", "final", "classify.json"} <= names
    for png in ("classify_loss.png", "classify_accuracy.png"):
        assert (out["plots_dir"] / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    final = out["out_dir"] / "final"
    assert sorted(p.name for p in final.iterdir()) == [
        "classifier.json",
        "classifier.safetensors",
        "config.json",
        "model.safetensors",
    ]
    assert load_model(final).config == load_model(base).config  # the backbone is a plain gptforge GPT


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_padding_does_not_change_a_rows_logits(attention):
    torch.manual_seed(0)
    gpt = GPT(
        GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=320, n_vocab=281, attention=attention)
    )
    model = clf_model.GPTClassifier(gpt, 2).eval()
    short, long = clf_data.Example([5, 9, 17], 0), clf_data.Example(list(range(40, 60)), 1)
    alone = model(*clf_data.collate([short], 280, torch.device("cpu"))[:2])
    idx, lengths, _ = clf_data.collate([short, long], 280, torch.device("cpu"))
    assert idx.shape == (2, 20) and (idx[0, 3:] == 280).all()  # right-padded to the longest row
    batched = model(idx, lengths)
    torch.testing.assert_close(batched[0], alone[0], atol=1e-5, rtol=1e-5)  # other shapes: rounding only
    # The pooled position matters: the padded row's last column gives other logits.
    assert not torch.allclose(model(idx, torch.tensor([20, 20]))[0], alone[0], atol=1e-4)


@pytest.mark.parametrize(
    "trainable, expected",
    [
        ("head", {"head."}),
        ("last_block", {"head.", "gpt.transformer.h.1.", "gpt.transformer.ln_f."}),
    ],
)
def test_only_the_trainable_part_changes(small_tokenizer, base, data_dir, trainable, expected):
    cfg = make_cfg(small_tokenizer, base, trainable=trainable, epochs=1)
    s = clf.setup(cfg, data_dir)
    before = {k: v.clone() for k, v in s.model.state_dict().items()}
    clf.train(s, cfg)
    after = s.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    should = {k for k in before if k.startswith(tuple(expected))}
    assert should and changed == should  # every expected tensor moved, every other is bitwise equal


@pytest.mark.slow  # ~5 s, most of it importing peft (and transformers) the first time
def test_lora_trains_adapters_and_head_only_and_merges_exactly(small_tokenizer, base, data_dir, tmp_path):
    cfg = make_cfg(small_tokenizer, base, trainable="lora", epochs=1, lr=1e-2)
    run = FakeRun()
    s = clf.setup(cfg, data_dir, run)
    start_head = {k: v.clone() for k, v in s.classifier.head.state_dict().items()}
    clf.train(s, cfg, run)

    base_state = load_model(base).state_dict()
    for name, tensor in s.model.state_dict().items():
        plain = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if "lora_" in name:
            continue
        if plain.startswith("head."):
            assert not torch.equal(tensor, start_head[plain.removeprefix("head.")]), name
        else:
            assert torch.equal(tensor, base_state[plain.removeprefix("gpt.")]), name  # frozen base, bitwise
    lora_b = [p for n, p in s.model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # B starts at 0: nonzero means it trained
    counts = next(m for m in run.metrics if "trainable_params" in m)
    assert 0 < counts["trainable_params"] < counts["total_params"]
    assert counts["trainable_params"] == sum(
        p.numel() for n, p in s.model.named_parameters() if "lora_" in n or ".head." in n
    )

    examples = s.data["test"][:32]
    adapter_logits, _ = clf_data.predict(s.model, examples, 16, 280, s.rt)
    merged = merge_lora(s.model)
    assert merged is s.classifier and not any("lora_" in n for n, _ in merged.named_parameters())
    merged_logits, _ = clf_data.predict(merged, examples, 16, 280, s.rt)
    torch.testing.assert_close(merged_logits, adapter_logits, atol=1e-5, rtol=0)


def _hf_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_layer": 2})
    )
    return folder


@pytest.mark.parametrize("case", ["hf_config", "missing_init", "vocab", "label", "empty_split", "max_length"])
def test_bad_input_stops_before_writing(small_tokenizer, base, data_dir, tmp_path, case):
    init_from, extra = base, {}
    if case == "hf_config":
        init_from, pattern = _hf_folder(tmp_path), r"hf/config\.json is a Hugging Face GPT2LMHeadModel config"
    elif case == "missing_init":
        init_from, pattern = tmp_path / "nowhere", r"classify\.init_from: .*nowhere not found; run `gptforge pretrain`"
    elif case == "vocab":
        init_from = tmp_path / "other_vocab"
        save_model(
            GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=320, n_vocab=300)), init_from
        )
        pattern = r"vocabulary of 300 tokens, the tokenizer .* 281"
    elif case == "label":
        lines = (data_dir / "train.jsonl").read_text().splitlines()
        lines[2] = json.dumps({"text": "abc", "label": 2})
        (data_dir / "train.jsonl").write_text("\n".join(lines) + "\n")
        pattern = r"train\.jsonl: record 3: label 2 is outside \[0, 2\)"
    elif case == "empty_split":
        (data_dir / "val.jsonl").write_text("")
        pattern = r"val\.jsonl has no examples"
    else:
        extra, pattern = {"max_length": 64}, r"classify\.max_length \(64\) is above the model's 32 positions"
    cfg = make_cfg(small_tokenizer, init_from, **extra)
    out = outputs(tmp_path)
    with pytest.raises(BadInput, match=pattern) as err:
        clf.finetune_classify(cfg, data_dir=data_dir, **out)
    assert "\n" not in str(err.value)
    assert not any(Path(p).exists() for p in out.values())


def test_load_classifier_names_what_is_missing(base, tmp_path):
    with pytest.raises(BadInput, match="classifier.json: not found"):
        clf_model.load_classifier(base)  # a plain model folder has no head


def test_binary_report_counts_and_formulas():
    # Asymmetric on purpose: precision != recall and tp != tn, so a swap of any two shows.
    report = clf_data.binary_report(pred=[1, 1, 1, 1, 0, 0], gold=[1, 1, 0, 0, 1, 0])
    assert (report["test_tp"], report["test_fp"], report["test_fn"], report["test_tn"]) == (2, 2, 1, 1)
    assert report["precision"] == pytest.approx(2 / 4) and report["recall"] == pytest.approx(2 / 3)
    assert report["f1"] == pytest.approx(2 * (1 / 2) * (2 / 3) / (1 / 2 + 2 / 3))
    # No positive predictions: 0, not a division error (metrics files hold numbers).
    assert clf_data.binary_report([0, 0], [1, 0])["precision"] == 0 == clf_data.binary_report([0, 0], [1, 0])["f1"]
    # More classes: class 1 against the rest.
    three = clf_data.binary_report(pred=[2, 1, 0, 1], gold=[1, 1, 2, 0])
    assert (three["test_tp"], three["test_fp"], three["test_fn"], three["test_tn"]) == (1, 1, 1, 1)


def test_long_texts_keep_their_first_max_length_tokens(small_tokenizer):
    enc = load_tokenizer(str(small_tokenizer))
    long_text = " ".join(["the cat is in the garden and the dog is on the sofa"] * 5)
    ids = enc.encode_ordinary(long_text)
    assert len(ids) > BLOCK
    (example, empty), cut = clf_data.encode([{"text": long_text, "label": 1}, {"text": "", "label": 0}], enc, 8)
    assert example.tokens == ids[:8] and cut == 1
    assert empty.tokens == [enc.eot_token]  # an empty text still has a last token to read
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=320, n_vocab=281))
    model = clf_model.GPTClassifier(gpt, 2, max_length=8).eval()
    ((label, prob),) = clf_model.classify_texts(model, [long_text], enc, "cpu")  # longer than the model: no error
    with torch.no_grad():
        want = model(torch.tensor([ids[:8]]), torch.tensor([8]))[0].softmax(-1)
    assert label == int(want.argmax()) and prob == pytest.approx(float(want.max()), abs=1e-6)


def test_classify_command_labels_text_and_stdin_lines(small_tokenizer, base, data_dir, tmp_path, monkeypatch, capsys):
    import io

    from gptforge.cli import main

    cfg = make_cfg(small_tokenizer, base, epochs=1)
    clf.finetune_classify(cfg, data_dir=data_dir, **outputs(tmp_path))
    folder = tmp_path / "ckpt" / "final"
    enc = load_tokenizer(str(small_tokenizer))
    texts = [json.loads(line)["text"] for line in (data_dir / "test.jsonl").read_text().splitlines()[:3]]
    expected = clf_model.classify_texts(clf_model.load_classifier(folder), texts, enc, "cpu")
    labels = clf_model.load_classifier(folder).labels

    monkeypatch.chdir(tmp_path)
    assert main(["classify", texts[0], "--checkpoint", str(folder), "-S", f"tokenizer.path={small_tokenizer}"]) == 0
    label, prob = capsys.readouterr().out.strip().split("\t")
    assert label == labels[expected[0][0]] and float(prob) == pytest.approx(expected[0][1], abs=1e-4)

    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(texts) + "\n\n"))
    assert main(["classify", "--checkpoint", str(folder), "-S", f"tokenizer.path={small_tokenizer}"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.strip().splitlines()]
    assert [(r[0], r[2]) for r in rows] == [(labels[e[0]], t) for e, t in zip(expected, texts)]

    assert (
        main(["classify", "x", "--checkpoint", str(tmp_path / "nowhere"), "-S", f"tokenizer.path={small_tokenizer}"])
        == 2
    )
    assert "nowhere" in capsys.readouterr().err
