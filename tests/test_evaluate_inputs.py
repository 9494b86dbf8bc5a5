"""Stage `evaluate`'s bad inputs: each is one BadInput line (SourceUnreachable for a hub task
offline), raised before lm-eval or any model is loaded, with nothing written. The tiny GPT, the
data writers and the network guard are tests/test_evaluate.py's."""

from __future__ import annotations

import pytest
from test_evaluate import (  # noqa: F401 - fixtures
    HELLASWAG,
    checkpoint,
    enc,
    make_cfg,
    mmlu_rows,
    no_network,
    write_jsonl,
    write_mmlu,
)

from gptforge import evaluate as ev
from gptforge.errors import BadInput, SourceUnreachable


@pytest.fixture
def never_evaluated(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("lm-eval was reached")

    monkeypatch.setattr(ev, "evaluate_model", fail)


def run_bad(tmp_path, monkeypatch, cfg):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInput) as e:
        ev.evaluate(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    assert not (tmp_path / "metrics" / "evaluate.json").exists()
    return msg


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_mmlu_answer_out_of_range(tmp_path, monkeypatch, never_evaluated, small_tokenizer, checkpoint, fmt):
    test = mmlu_rows("test")
    test[1]["answer"] = 4
    mmlu = write_mmlu(tmp_path / "mmlu", fmt, test=test)
    msg = run_bad(
        tmp_path, monkeypatch, make_cfg(small_tokenizer, models={"pretrain": checkpoint}, mmlu=mmlu, tasks=["mmlu"])
    )
    where = "test.jsonl:2" if fmt == "jsonl" else "test.parquet: record 2"
    assert where in msg and "answer 4 is out of range 0-3" in msg and "evaluate.mmlu.source" in msg


@pytest.mark.parametrize(
    "row, why",
    [
        ({"question": "q?", "subject": "anatomy", "choices": ["a", "b", "c", "d"]}, "missing field answer"),
        ({"question": "q?", "subject": "anatomy", "choices": ["a", "b", "c"], "answer": 0}, "choices must hold 4"),
        ({"question": "q?", "choices": ["a", "b", "c", "d"], "answer": 0}, "missing field subject"),
        (
            {"question": "q?", "subject": "anatomy", "choices": ["a", "b", "c", "d"], "answer": "B"},
            "answer must be an integer",
        ),
    ],
)
def test_mmlu_bad_records(tmp_path, monkeypatch, never_evaluated, small_tokenizer, checkpoint, row, why):
    mmlu = write_mmlu(tmp_path / "mmlu", "jsonl", dev=mmlu_rows("dev")[:2] + [row])
    msg = run_bad(
        tmp_path, monkeypatch, make_cfg(small_tokenizer, models={"pretrain": checkpoint}, mmlu=mmlu, tasks=["mmlu"])
    )
    assert "dev.jsonl:3" in msg and why in msg


def test_mmlu_missing_test_file_and_too_few_dev_questions(
    tmp_path, monkeypatch, never_evaluated, small_tokenizer, checkpoint
):
    folder = tmp_path / "mmlu"
    write_jsonl(folder / "dev.jsonl", mmlu_rows("dev"))
    cfg = make_cfg(small_tokenizer, models={"pretrain": checkpoint}, mmlu=folder, tasks=["mmlu"])
    assert "no test file in" in run_bad(tmp_path, monkeypatch, cfg)
    write_jsonl(folder / "test.jsonl", mmlu_rows("test"))
    cfg = make_cfg(small_tokenizer, models={"pretrain": checkpoint}, mmlu=folder, tasks=["mmlu"], num_fewshot=5)
    msg = run_bad(tmp_path, monkeypatch, cfg)
    assert "subject 'abstract_algebra' has 3 dev question(s), evaluate.num_fewshot=5" in msg
    cfg = make_cfg(small_tokenizer, models={"pretrain": checkpoint}, mmlu=tmp_path / "nowhere", tasks=["mmlu"])
    assert "evaluate.mmlu.source: MMLU folder not found" in run_bad(tmp_path, monkeypatch, cfg)


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda r: r.pop("ctx_a"), "hellaswag_val.jsonl:3: missing field ctx_a"),
        (lambda r: r.update(label=4), "hellaswag_val.jsonl:3: label 4 is out of range 0-3"),
        (lambda r: r.update(endings=r["endings"][:3]), "hellaswag_val.jsonl:3: endings must hold 4 strings"),
    ],
)
def test_hellaswag_bad_records(tmp_path, monkeypatch, never_evaluated, small_tokenizer, checkpoint, change, why):
    rows = [dict(r) for r in HELLASWAG]
    change(rows[2])
    path = write_jsonl(tmp_path / "hellaswag_val.jsonl", rows)
    msg = run_bad(
        tmp_path,
        monkeypatch,
        make_cfg(small_tokenizer, models={"pretrain": checkpoint}, hellaswag=path, tasks=["hellaswag"]),
    )
    assert why in msg and "evaluate.hellaswag.source" in msg


def test_missing_checkpoint_folders(tmp_path, monkeypatch, never_evaluated, small_tokenizer):
    cfg = make_cfg(small_tokenizer, models={"pretrain": tmp_path / "ckpt" / "final"}, tasks=["hellaswag"])
    msg = run_bad(tmp_path, monkeypatch, cfg)
    assert msg == f"evaluate.models.pretrain: checkpoint folder {tmp_path / 'ckpt' / 'final'} not found"
    cfg = make_cfg(small_tokenizer, models={"pretrain": "a/final", "instruct": "b/final"}, tasks=["hellaswag"])
    msg = run_bad(tmp_path, monkeypatch, cfg)
    assert "none of the checkpoint folders exists: pretrain (a/final), instruct (b/final)" in msg


def test_hub_task_offline_names_the_source_param(tmp_path, monkeypatch, no_network, small_tokenizer, checkpoint):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))  # nothing cached
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", tmp_path / "hf-datasets", raising=False)
    cfg = make_cfg(small_tokenizer, models={"pretrain": checkpoint}, tasks=["hellaswag"])
    with pytest.raises(SourceUnreachable) as e:
        ev.evaluate(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "'hellaswag'" in msg and "set evaluate.hellaswag.source to a local copy" in msg
    assert no_network == []


@pytest.mark.slow
def test_unknown_task_name_lists_close_matches(tmp_path, monkeypatch, never_evaluated, small_tokenizer, checkpoint):
    # An unknown name needs lm-eval's full task index (about 10 s here).
    hs_file = write_jsonl(tmp_path / "hellaswag_val.jsonl", HELLASWAG)
    cfg = make_cfg(small_tokenizer, models={"pretrain": checkpoint}, hellaswag=hs_file, tasks=["hellaswag", "helaswag"])
    msg = run_bad(tmp_path, monkeypatch, cfg)
    assert msg.startswith("evaluate.tasks: unknown lm-eval task 'helaswag'; did you mean hellaswag")


def test_a_local_source_is_cut_to_its_first_records(tmp_path, small_tokenizer, checkpoint):
    # evaluate.hellaswag.limit: the file's first rows; evaluate.mmlu.limit: each subject's first
    # questions (lm-eval's own `limit` is the same for every task)
    import json

    from gptforge.config.load import validate
    from gptforge.evaluate.task_data import plan_tasks

    hs = write_jsonl(tmp_path / "data" / "hellaswag_val.jsonl", HELLASWAG)
    mmlu = write_mmlu(tmp_path / "data" / "mmlu", "jsonl")
    cfg = make_cfg(small_tokenizer, models={"pretrain": checkpoint}, hellaswag=hs, mmlu=mmlu)
    tree = cfg.model_dump()
    tree["evaluate"]["hellaswag"]["limit"] = 3
    tree["evaluate"]["mmlu"]["limit"] = 2
    plan = plan_tasks(validate(tree), tmp_path / "work")
    assert plan.local == {"hellaswag": f"{hs} (3 examples)", "mmlu": f"{mmlu} (4 examples)"}
    written = [json.loads(line) for line in (tmp_path / "work/data/hellaswag.jsonl").read_text().splitlines()]
    assert [r["ctx_a"] for r in written] == [r["ctx_a"] for r in HELLASWAG[:3]]
    biology = (tmp_path / "work/data/mmlu_high_school_biology.test.jsonl").read_text().splitlines()
    assert [json.loads(line)["question"] for line in biology] == [
        r["question"] for r in mmlu_rows("test") if r["subject"] == "high_school_biology"
    ][:2]
    tree["evaluate"]["hellaswag"] = {"source": None, "limit": 3}
    with pytest.raises(BadInput, match=r"evaluate.hellaswag: .*limit sizes a local source: set source too"):
        validate(tree)
