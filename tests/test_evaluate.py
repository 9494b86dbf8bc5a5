"""Stage `evaluate`: lm-eval in-process on a tiny GPT, offline, on local HellaSwag and MMLU files.

What lm-eval got through our `LM`, and each accuracy the stage reports, are checked against an
independent float64 computation from the model's logits; MLflow gets one run per model, nested
under the stage's. The tiny GPT, the data writers and that computation are here; the `LM` itself
and pretraining's in-loop HellaSwag evaluator are checked in tests/test_evaluate_lm.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fixture_data import FakeRun

from gptforge import evaluate as ev
from gptforge.config.load import validate
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.modeling.tokenizer import load_tokenizer
from gptforge.modeling.weights import load_model, save_model

BLOCK = 64


# rowanz-format HellaSwag: [title]/[header] tags as in the WikiHow part, one label as a string,
# and contexts long enough (small BPE: ~1 token per character) to exceed block_size.
HELLASWAG = [
    {
        "ind": i,
        "activity_label": label,
        "ctx_a": ctx_a,
        "ctx_b": ctx_b,
        "ctx": f"{ctx_a} {ctx_b}",
        "endings": endings,
        "label": lab,
        "split": "val",
        "split_type": "indomain",
        "source_id": f"x~{i}",
    }
    for i, (label, ctx_a, ctx_b, endings, lab) in enumerate(
        [
            (
                "Roof shingle removal",
                "A man is sitting on a roof.",
                "he",
                [
                    "is using wrap to wrap a pair of skis.",
                    "is ripping level tiles off.",
                    "is holding a rubik's cube.",
                    "starts pulling up roofing on a roof.",
                ],
                3,
            ),
            (
                "Cleaning windows",
                "[header] How to clean windows [title] Mix the water and soap.",
                "then",
                ["wipe the glass.", "eat the soap.", "the dog ran away.", "paint the wall."],
                0,
            ),
            (
                "Baking",
                "She puts the cake in the oven and waits for an hour while it bakes slowly.",
                "the cake",
                ["burns.", "is ready and she takes it out.", "flies away.", "sings."],
                "1",
            ),
            (
                "Running",
                "The runner ties his shoes.",
                "he",
                ["runs.", "sleeps.", "is done and the race is over before it began.", "eats"],
                2,
            ),
            (
                "Swimming",
                "A girl jumps into the pool [step] and swims.",
                "she",
                ["reaches the end.", "flies.", "reads a book.", "is dry."],
                0,
            ),
            (
                "Cooking",
                "The chef chops the onions.",
                "then he",
                ["cries.", "adds them to the pan.", "leaves.", "sleeps."],
                1,
            ),
            (
                "Gardening",
                "The gardener waters the plants in the morning.",
                "the plants",
                ["grow.", "run.", "talk.", "melt."],
                0,
            ),
            ("Reading", "A boy opens a book.", "he", ["reads it.", "eats it.", "throws it.", "sells it."], 0),
        ]
    )
]


SUBJECTS = ["abstract_algebra", "high_school_biology"]


def mmlu_rows(split: str) -> list[dict]:
    rows = []
    for s, subject in enumerate(SUBJECTS):
        for i in range(3 if split == "dev" or s == 0 else 4):  # unequal subjects: weighting shows
            n = 10 * s + i + (100 if split == "dev" else 0)
            rows.append(
                {
                    "question": f"{split} question {n}: what is {n} + 1?",
                    "subject": subject,
                    "choices": [str(n), str(n + 1), str(n + 2), "none of these"],
                    "answer": (n + 1) % 4,
                }
            )
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_mmlu(folder: Path, fmt: str, test: list | None = None, dev: list | None = None) -> Path:
    write = write_jsonl if fmt == "jsonl" else write_parquet
    write(folder / f"test.{fmt}", mmlu_rows("test") if test is None else test)
    write(folder / f"dev.{fmt}", mmlu_rows("dev") if dev is None else dev)
    return folder


@pytest.fixture(scope="module")
def enc(small_tokenizer):
    return load_tokenizer(str(small_tokenizer))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, enc) -> Path:
    torch.manual_seed(0)
    # vocab_size > n_vocab: the padded logit columns are -inf and must not leak into scores.
    model = GPT(
        GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=enc.n_vocab + 7, n_vocab=enc.n_vocab)
    )
    return save_model(model, tmp_path_factory.mktemp("ckpt") / "final")


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint).eval()


@pytest.fixture
def no_network(monkeypatch):
    """Offline env and a socket guard: any connection off the loopback raises and is recorded."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    attempts = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def local(address) -> bool:
        if isinstance(address, (str, bytes)):  # AF_UNIX
            return True
        return str(address[0]) in ("127.0.0.1", "::1", "localhost")

    def connect(self, address):
        if not local(address):
            attempts.append(address)
            raise OSError(f"test: network call to {address} blocked")
        return real_connect(self, address)

    def connect_ex(self, address):
        if not local(address):
            attempts.append(address)
            raise OSError(f"test: network call to {address} blocked")
        return real_connect_ex(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    return attempts


def make_cfg(small_tokenizer, *, models, hellaswag=None, mmlu=None, tasks=("hellaswag", "mmlu"), **evaluate):
    return validate(
        {
            "tokenizer": {"path": str(small_tokenizer)},
            "tracking": {"enabled": False},
            "evaluate": {
                "tasks": list(tasks),
                "models": {k: str(v) for k, v in models.items()},
                "hellaswag": {"source": None if hellaswag is None else str(hellaswag)},
                "mmlu": {"source": None if mmlu is None else str(mmlu)},
                "batch_size": 8,
                **evaluate,
            },
        }
    )


# --------------------------------------------------------------------------------------------
# An independent computation of what lm-eval should get


def encode_pair(enc, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's causal tokenization: the whole string, split at the context's token count;
    trailing context spaces belong to the continuation; an empty context is <|endoftext|>."""
    if context == "":
        return [enc.eot_token], enc.encode_ordinary(continuation)
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = enc.encode_ordinary(context + continuation)
    ctx = enc.encode_ordinary(context)
    return ctx, whole[len(ctx) :]


def direct_loglikelihood(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """Sum of float64 log-probs (over the real vocabulary) of `cont` after the last tokens of `ctx`."""
    seq = (ctx + cont)[-(model.config.block_size + 1) :]
    with torch.no_grad():
        logits, _ = model(torch.tensor([seq[:-1]]))
    logits = logits[0, :, : model.config.n_vocab].double()
    logp = F.log_softmax(logits, dim=-1)[-len(cont) :]
    targets = torch.tensor(seq[1:][-len(cont) :])
    total = float(logp.gather(1, targets[:, None]).sum())
    return total, bool((logits[-len(cont) :].argmax(-1) == targets).all())


# --------------------------------------------------------------------------------------------
# The stage, end to end


def scores_from_samples(folder: Path, loglikelihood, tol: float = 1e-4) -> dict[str, dict[str, float]]:
    """Each task's accuracies recomputed from the requests lm-eval logged (`samples_TASK.jsonl`):
    `loglikelihood(context, continuation)` gives `(logprob, greedy)` (greedy None: not checked),
    which every logged answer must equal. `acc` picks the highest log-likelihood, `acc_norm` the
    highest per character of the choice (lm-eval's: the continuation without its leading space)."""
    scores = {}
    files = sorted(folder.glob("samples_*.jsonl"))
    assert files
    for f in files:
        correct = correct_norm = n = 0
        for line in f.read_text(encoding="utf-8").splitlines():
            sample = json.loads(line)
            lls = []
            for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
                ref_lp, ref_greedy = loglikelihood(context, continuation)
                lp, greedy = resp[0]
                assert lp == pytest.approx(ref_lp, abs=tol)
                assert ref_greedy is None or greedy == ref_greedy
                lls.append(ref_lp)
            lengths = [len(c) - 1 for _, c in sample["arguments"]]
            acc = max(range(len(lls)), key=lambda i: lls[i]) == sample["target"]
            acc_norm = max(range(len(lls)), key=lambda i: lls[i] / lengths[i]) == sample["target"]
            assert sample["acc"] == float(acc) and sample.get("acc_norm", float(acc_norm)) == float(acc_norm)
            correct, correct_norm, n = correct + acc, correct_norm + acc_norm, n + 1
        scores[f.stem.removeprefix("samples_")] = {"acc": correct / n, "acc_norm": correct_norm / n, "n": n}
    return scores


def check_samples_against_model(folder: Path, model, enc) -> tuple[int, dict[str, dict[str, float]]]:
    """`scores_from_samples` with our GPT's float64 log-probs, and how many requests had more
    tokens than the model's window."""
    long = 0

    def loglikelihood(context: str, continuation: str) -> tuple[float, bool]:
        nonlocal long
        ctx, cont = encode_pair(enc, context, continuation)
        long += len(ctx) + len(cont) > BLOCK + 1
        return direct_loglikelihood(model, ctx, cont)

    scores = scores_from_samples(folder, loglikelihood)
    return long, scores


def run_evaluate(tmp_path, small_tokenizer, checkpoint, fmt: str, fewshot: int | None = None) -> dict:
    """The stage on the fixture data (MMLU in `fmt`), with its per-run checks; cwd is tmp_path."""
    hs_file = write_jsonl(tmp_path / "data" / "hellaswag_val.jsonl", HELLASWAG)
    mmlu = write_mmlu(tmp_path / "data" / f"mmlu_{fmt}", fmt)
    # `again`, the same checkpoint evaluated second, gets lm-eval's task objects after `pretrain`
    # used them (they are loaded once a stage): its results must be the first model's, few-shot
    # examples included.
    cfg = make_cfg(
        small_tokenizer,
        models={"pretrain": checkpoint, "again": checkpoint, "instruct": tmp_path / "absent"},
        hellaswag=hs_file,
        mmlu=mmlu,
        num_fewshot=fewshot,
    )
    run = FakeRun()
    metrics = ev.evaluate(cfg, run=run)
    timings = ("examples_per_sec", "seconds", "model_seconds")
    first = {
        k.removeprefix("pretrain."): v
        for k, v in metrics.items()
        if k.startswith("pretrain.") and not k.endswith(timings)
    }
    assert first == {
        k.removeprefix("again."): v for k, v in metrics.items() if k.startswith("again.") and not k.endswith(timings)
    }
    for f in Path("reports/evaluate/pretrain").glob("samples_*.jsonl"):

        def arguments(path: Path) -> list:
            return [json.loads(line)["arguments"] for line in path.read_text(encoding="utf-8").splitlines()]

        assert arguments(f) == arguments(Path("reports/evaluate/again") / f.name)
    metrics = {k: v for k, v in metrics.items() if not k.startswith("again.")}
    written = {
        k: v for k, v in json.loads(Path("metrics/evaluate.json").read_text()).items() if not k.startswith("again.")
    }
    assert written == pytest.approx(metrics)
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
    assert [{k: v for k, v in m.items() if not k.startswith("again.")} for m in run.metrics] == [metrics]
    assert {p.as_posix() for p in run.artifacts} == {"metrics/evaluate.json", "reports/evaluate.md", "reports/evaluate"}
    assert not [k for k in metrics if k.startswith("instruct.")]  # its folder does not exist: skipped
    return metrics


@pytest.mark.slow
def test_parquet_scores_as_jsonl_and_few_shot_uses_dev(tmp_path, monkeypatch, no_network, small_tokenizer, checkpoint):
    monkeypatch.chdir(tmp_path)
    jsonl = run_evaluate(tmp_path, small_tokenizer, checkpoint, "jsonl")
    parquet = run_evaluate(tmp_path, small_tokenizer, checkpoint, "parquet")
    assert {k: v for k, v in parquet.items() if ".acc" in k} == pytest.approx(
        {k: v for k, v in jsonl.items() if ".acc" in k}
    )
    run_evaluate(tmp_path, small_tokenizer, checkpoint, "parquet", fewshot=2)
    prompt = json.loads(
        Path("reports/evaluate/pretrain/samples_mmlu_high_school_biology.jsonl").read_text().splitlines()[0]
    )["arguments"][0][0]
    # first_n of the subject's dev questions, after the standard description
    assert prompt.startswith(
        "The following are multiple choice questions (with answers) about high "
        "school biology.\n\ndev question 110: what is 110 + 1?\nA. 110\nB. 111\n"
    )
    assert "dev question 111" in prompt and "dev question 112" not in prompt
    assert "dev question 100" not in prompt  # the other subject's
    assert prompt.endswith("test question 10: what is 10 + 1?\nA. 10\nB. 11\nC. 12\nD. none of these\nAnswer:")
    assert no_network == []


def test_evaluate_offline_end_to_end(tmp_path, monkeypatch, no_network, small_tokenizer, checkpoint, model, enc):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "classify.json").write_text(
        json.dumps(
            {
                "train_accuracy": 0.99,
                "val_accuracy": 0.97,
                "test_accuracy": 0.9625,
                "precision": 0.95,
                "recall": 0.97,
                "f1": 0.96,
            }
        )
    )
    (tmp_path / "metrics" / "instruct.json").write_text(json.dumps({"val_loss": 1.5, "test_loss": 1.4321}))
    metrics = run_evaluate(tmp_path, small_tokenizer, checkpoint, "jsonl")
    # What lm-eval got through our LM equals the direct computation, left-truncation included;
    # each accuracy is the one the direct log-likelihoods give.
    long, direct = check_samples_against_model(Path("reports/evaluate/pretrain"), model, enc)
    assert long > 0
    subjects = [direct[f"mmlu_{s}"] for s in SUBJECTS]
    direct["mmlu"] = {"acc": sum(d["acc"] * d["n"] for d in subjects) / 7, "n": 7}
    for task, n in (("hellaswag", 8), ("mmlu", 7), ("mmlu_abstract_algebra", 3), ("mmlu_high_school_biology", 4)):
        assert metrics[f"pretrain.{task}.n"] == direct[task]["n"] == n
        assert metrics[f"pretrain.{task}.acc"] == pytest.approx(direct[task]["acc"]), task
        assert f"pretrain.{task}.acc_stderr" in metrics
    assert metrics["pretrain.hellaswag.acc_norm"] == pytest.approx(direct["hellaswag"]["acc_norm"])
    assert "pretrain.hellaswag.acc_norm_stderr" in metrics
    subject_accs = [metrics[f"pretrain.mmlu_{s}.acc"] for s in SUBJECTS]
    assert subject_accs[0] != subject_accs[1]  # else the two averages below cannot differ
    assert metrics["pretrain.mmlu.acc_subject_mean"] == pytest.approx(sum(subject_accs) / 2)
    assert metrics["pretrain.mmlu.acc"] == pytest.approx((3 * subject_accs[0] + 4 * subject_accs[1]) / 7)  # lm-eval's
    assert metrics["pretrain.examples_per_sec"] > 0

    # lm-eval's full results and every sample; its hellaswag processing of the tags.
    results = json.loads(Path("reports/evaluate/pretrain/results.json").read_text())
    assert {"hellaswag", "mmlu", "mmlu_abstract_algebra"} <= set(results["results"])
    assert results["config"]["model"] == "GptforgeLM" and "samples" not in results
    first = [
        json.loads(line) for line in Path("reports/evaluate/pretrain/samples_hellaswag.jsonl").read_text().splitlines()
    ]
    assert len(first) == 8
    by_ind = {s["doc"]["ind"]: s for s in first}
    assert by_ind[1]["arguments"][0][0] == "Cleaning windows: How to clean windows. Mix the water and soap. Then"
    assert by_ind[4]["arguments"][0] == ["Swimming: A girl jumps into the pool and swims. She", " reaches the end."]
    assert by_ind[2]["target"] == 1  # the "1" label

    report = Path("reports/evaluate.md").read_text()
    assert "| pretrain | hellaswag | acc_norm |" in report and "0.3114" in report
    assert f"| pretrain | mmlu | acc | {metrics['pretrain.mmlu.acc']:.4f} |" in report
    assert "chance 0.25" in report and "| high_school_biology |" in report
    assert (
        "| spam classifier | test_accuracy | 0.9625 |" in report
        and "| instruction model | test_loss | 1.4321 |" in report
    )
    assert "examples/s" in report
    assert no_network == []


# --------------------------------------------------------------------------------------------
# MLflow: one run per model, nested under the stage's run


@pytest.mark.slow
def test_one_mlflow_run_per_model(tmp_path, monkeypatch, no_network, mlflow_uri, small_tokenizer, checkpoint):
    import shutil

    from mlflow.tracking import MlflowClient

    from gptforge.runtime import mlflow_values, tracking

    monkeypatch.chdir(tmp_path)
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_uri[len("sqlite:///") :], db)
    uri = f"sqlite:///{db}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv(mlflow_values.PARENT_ENV, raising=False)
    second = tmp_path / "ckpt2"
    shutil.copytree(checkpoint, second)
    hs_file = write_jsonl(tmp_path / "hellaswag_val.jsonl", HELLASWAG[:4])
    cfg = validate(
        {
            **make_cfg(
                small_tokenizer,
                models={"pretrain": checkpoint, "instruct": second},
                hellaswag=hs_file,
                tasks=["hellaswag"],
            ).model_dump(),
            "tracking": {"enabled": True, "experiment": "t"},
        }
    )
    with tracking.start_run(enabled=True, experiment="t", stage="evaluate") as stage_run:
        metrics = ev.evaluate(cfg, run=stage_run)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("t")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"evaluate", "evaluate:pretrain", "evaluate:instruct"}
    for name in ("pretrain", "instruct"):
        r = runs[f"evaluate:{name}"]
        assert r.data.tags["mlflow.parentRunId"] == stage_run.run_id
        assert r.data.metrics["hellaswag.acc_norm"] == pytest.approx(metrics[f"{name}.hellaswag.acc_norm"])
        assert r.data.params["model"] == name
        assert {a.path for a in client.list_artifacts(r.info.run_id, "lm_eval")} >= {
            "lm_eval/results.json",
            "lm_eval/samples_hellaswag.jsonl",
        }
    assert runs["evaluate"].data.metrics["pretrain.hellaswag.acc"] == pytest.approx(metrics["pretrain.hellaswag.acc"])
    assert os.environ.get(mlflow_values.PARENT_ENV) is None  # restored


def test_cached_templates_render_as_lm_eval_does():
    """template_cache.apply_template against lm-eval's own, on the shipped HellaSwag and MMLU
    templates and on lm-eval's filters (regex_replace)."""
    from gptforge.evaluate import template_cache

    template_cache.install()
    template_cache.install()  # idempotent: the original is kept
    original = template_cache.original()
    assert original is not template_cache.apply_template
    docs = [
        {
            "query": "Q: a {b} c",
            "choices": ["w", "x", "y", "z"],
            "question": " Why? ",
            "gold": 1,
            "label": 2,
            "ctx": "It rains.  ",
            "answer": 2,
        },
        {"query": "", "choices": ["", "1", "2", "3"], "question": "", "gold": 0, "label": 0, "ctx": "", "answer": 0},
    ]
    templates = [
        "{{query}}",
        "{{choices}}",
        "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nAnswer:",
        "{{ctx | regex_replace('  ', ' ')}}",
        "{{gold}}",
    ]
    folder = Path(ev.__file__).parent.parent / "lm_eval_tasks"
    shipped = [
        json.loads(f'"{t}"')
        for path in folder.glob("*.yaml")
        for t in re.findall(r'^doc_to_\w+: "(.*\{\{.*)"$', path.read_text(), re.M)
    ]
    assert len(shipped) >= 3  # HellaSwag's text and target, MMLU's question
    templates += shipped
    for template in templates:
        for doc in docs:
            try:
                expected = original(template, doc)
            except Exception as e:  # noqa: BLE001 - a template needing other fields: the same error
                with pytest.raises(type(e)):
                    template_cache.apply_template(template, doc)
                continue
            assert template_cache.apply_template(template, doc) == expected
            assert template_cache.apply_template(template, doc) == expected  # from the cache
