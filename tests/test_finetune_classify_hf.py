"""Classification fine-tuning from any Hugging Face causal LM (a tiny random Llama here): the
recipe trains exactly what `classify.trainable` names, the head reads the final hidden state of
each row's last real token (checked against transformers' own outputs), the saved folder is an
ordinary Hugging Face folder that `load_classifier` and `classify_texts` read with its own
tokenizer, and a model that is not a causal LM stops the run in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixture_data import SMS_LINES, FakeRun
from hf_models import make_tiny_causal_lm, make_tiny_encoder
from safetensors.torch import load_file
from test_finetune_classify import RecordingSteps, outputs

from gptforge.config.load import validate
from gptforge.errors import BadInput
from gptforge.finetune import classifier as clf_model
from gptforge.finetune import classify as clf
from gptforge.finetune import classify_data as clf_data
from gptforge.modeling.tokenizer import load_tokenizer

SEED = 7
HIDDEN = 64  # make_tiny_causal_lm's hidden_size (2 layers)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """The base model (random, 2 blocks, hidden 64, GPT-2 tokenizer): ~4-8 s once per module,
    most of it importing transformers."""
    return make_tiny_causal_lm(tmp_path_factory.mktemp("hf") / "llama", "llama")


@pytest.fixture
def data_dir(tmp_path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    for name, copies in (("train", 4), ("val", 1), ("test", 2)):
        with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for i in range(copies):
                for label, text in SMS_LINES:
                    f.write(json.dumps({"text": f"{text} #{i}", "label": int(label == "spam")}) + "\n")
    return folder


def make_cfg(init_from: Path, tokenizer: str = "/nowhere/tokenizer.tiktoken", **classify):
    # tokenizer.path points nowhere: a Hugging Face model brings its own tokenizer.
    section = {
        "init_from": str(init_from),
        "trainable": "head",
        "epochs": 1,
        "lr": 1e-2,
        "weight_decay": 0.0,
        "batch_size": 8,
        "eval_interval": 100,
        "eval_batches": 1,
        "device": "cpu",
        "precision": "fp32",
        "seed": SEED,
        "lora": {"r": 4, "alpha": 8},
    }
    section.update(classify)
    return validate({"tokenizer": {"path": tokenizer}, "classify": section})


def initial_head() -> torch.nn.Linear:
    torch.manual_seed(SEED)  # what build_classifier seeds the head's init with
    return torch.nn.Linear(HIDDEN, 2)


def changed_tensors(base: Path, final: Path) -> set[str]:
    before, after = load_file(str(base / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert before.keys() == after.keys()
    return {k for k in before if not torch.equal(before[k], after[k])}


@pytest.mark.parametrize(
    "trainable, expected",
    [
        ("head", set()),
        ("last_block", {"model.layers.1.", "model.norm."}),  # the last of 2 blocks and the final norm
    ],
)
def test_only_the_trainable_part_changes(llama, data_dir, tmp_path, trainable, expected):
    from transformers import AutoModelForCausalLM

    out = outputs(tmp_path)
    metrics = clf.finetune_classify(make_cfg(llama, trainable=trainable), data_dir=data_dir, run=FakeRun(), **out)
    final = out["out_dir"] / "final"
    assert {"config.json", "model.safetensors", "tokenizer.json", "classifier.json", "classifier.safetensors"} <= {
        p.name for p in final.iterdir()
    }
    assert json.loads((final / "classifier.json").read_text())["backbone"] == "hf"
    AutoModelForCausalLM.from_pretrained(str(final))  # an ordinary Hugging Face folder

    changed = changed_tensors(llama, final)
    should = {k for k in load_file(str(llama / "model.safetensors")) if k.startswith(tuple(expected))}
    assert changed == should and (should or trainable == "head")  # every other tensor bitwise equal
    head = load_file(str(final / "classifier.safetensors"))
    assert not torch.equal(head["weight"], initial_head().weight)  # the head trained
    assert metrics["trainable_params"] == 2 * HIDDEN + 2 + sum(
        v.numel() for k, v in load_file(str(llama / "model.safetensors")).items() if k in should
    )


@pytest.mark.slow  # ~3-5 s: importing peft, a LoRA run, a CLI call
def test_lora_merges_round_trips_and_classifies_with_its_own_tokenizer(
    llama, data_dir, tmp_path, small_tokenizer, monkeypatch, capsys
):
    from gptforge.cli import main

    out, steps = outputs(tmp_path), RecordingSteps()
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from gptforge.training import parallelize

    checkpointed, real = [], parallelize.checkpoint_activations  # wrapped layers, per call
    monkeypatch.setattr(
        parallelize, "checkpoint_activations", lambda m: checkpointed.append(real(m)) or checkpointed[-1]
    )
    cfg = make_cfg(llama, tokenizer=str(small_tokenizer), trainable="lora", gradient_checkpointing=True)
    clf.finetune_classify(cfg, steps=steps, data_dir=data_dir, run=FakeRun(), **out)
    s = steps.results["train"]  # its classifier merged by finish
    assert isinstance(s.classifier, clf_model.HFClassifier)
    n_layers = len(s.classifier.lm.model.layers) if hasattr(s.classifier.lm, "model") else None
    assert [len(layers) for layers in checkpointed] == [n_layers]  # it was on, for every decoder layer
    assert not any(isinstance(m, CheckpointWrapper) for m in s.classifier.modules())  # and off once trained
    final = out["out_dir"] / "final"

    # Merged LoRA: exactly the blocks' Linear weights moved; embeddings, norms, lm_head did not.
    linears = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    should = {
        k
        for k in load_file(str(llama / "model.safetensors"))
        if k.startswith("model.layers.") and k.split(".")[-2] in linears
    }
    assert changed_tensors(llama, final) == should

    # Round trip: the loaded classifier gives the trained (merged) model's logits.
    saved = clf_model.load_classifier(final)
    assert isinstance(saved, clf_model.HFClassifier) and saved.labels == ["ham", "spam"]
    examples = s.data["test"]
    want, _ = clf_data.predict(s.classifier, examples, 8, s.pad_id, s.rt)
    got, _ = clf_data.predict(saved, examples, 8, s.pad_id, s.rt)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # classify_texts reads the texts with the folder's tokenizer, not the tiktoken one it is given
    # (which the CLI passes: tokenizer.path), whose ids would give other probabilities.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(final))
    texts = [text for _, text in SMS_LINES[:4]]
    tiktoken = load_tokenizer(str(small_tokenizer))
    assert tiktoken.encode_ordinary(texts[0]) != tok(texts[0], add_special_tokens=False)["input_ids"]
    predicted = clf_model.classify_texts(saved, texts, tiktoken, "cpu")
    for text, (label, prob) in zip(texts, predicted):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            probs = saved(torch.tensor([ids]), torch.tensor([len(ids)]))[0].softmax(-1)
        assert label == int(probs.argmax()) and prob == pytest.approx(float(probs.max()), abs=1e-6)

    # The CLI, unchanged, classifies with it too.
    monkeypatch.chdir(tmp_path)
    assert main(["classify", texts[1], "--checkpoint", str(final), "-S", f"tokenizer.path={small_tokenizer}"]) == 0
    label, prob = capsys.readouterr().out.strip().split("\t")
    assert label == saved.labels[predicted[1][0]] and float(prob) == pytest.approx(predicted[1][1], abs=1e-4)


def test_the_head_reads_the_last_real_tokens_final_hidden_state(llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = AutoModelForCausalLM.from_pretrained(str(llama)).eval()
    tok = AutoTokenizer.from_pretrained(str(llama))
    torch.manual_seed(0)
    classifier = clf_model.HFClassifier(lm, 3).eval()
    texts = ["Ok lar... Joking wif u oni...", "WINNER!! You have won a 1000 cash prize. Call now", "Hi"]
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width, pad = max(map(len, rows)), tok.eos_token_id
    idx = torch.tensor([r + [pad] * (width - len(r)) for r in rows])  # right-padded
    lengths = torch.tensor([len(r) for r in rows])
    assert len(set(lengths.tolist())) == 3

    with torch.no_grad():
        got = classifier(idx, lengths)
        for i, ids in enumerate(rows):
            ref = lm(input_ids=torch.tensor([ids]), output_hidden_states=True)  # alone, unpadded, no mask
            final = ref.hidden_states[-1]
            # hidden_states[-1] is after the final norm in transformers 5: the LM head reads it.
            torch.testing.assert_close(lm.lm_head(final), ref.logits, atol=1e-5, rtol=0)
            torch.testing.assert_close(got[i], classifier.head(final[0, -1]), atol=1e-5, rtol=0)
        # The pooled position matters: the padded rows' last column gives other logits.
        at_end = classifier(idx, torch.full_like(lengths, width))
    assert not torch.allclose(at_end[2], got[2], atol=1e-4)


def test_a_model_that_is_not_a_causal_lm_stops_in_one_line(data_dir, tmp_path):
    bert = make_tiny_encoder(tmp_path / "bert")
    out = outputs(tmp_path)
    with pytest.raises(BadInput, match=r"classify\.init_from: .*bert is a BertModel model, not a causal") as err:
        clf.finetune_classify(make_cfg(bert), data_dir=data_dir, **out)
    assert "\n" not in str(err.value)
    assert not any(Path(p).exists() for p in out.values())
