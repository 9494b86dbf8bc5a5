"""prepare_preference: ch. 7 and Hugging Face preference records -> validated, shuffled jsonl splits."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from fixture_data import FakeRun

from gptforge.config.load import load_config
from gptforge.data.preference import prepare_preference
from gptforge.errors import BadInput

FIELDS = ["instruction", "input", "chosen", "rejected"]
SPLITS = ("train", "val", "test")


def ch7(n: int, start: int = 0) -> list[dict]:
    return [
        {
            "instruction": f"Rewrite sentence {i}.",
            "input": f"s{i}" if i % 2 else "",
            "output": f"Out {i}.",
            "chosen": f"Polite {i}.",
            "rejected": f"Rude {i}.",
        }
        for i in range(start, start + n)
    ]


def hf(n: int, start: int = 0) -> list[dict]:
    """UltraFeedback-shaped rows: chosen/rejected are the whole [user, assistant] conversation."""
    rows = []
    for i in range(start, start + n):
        prompt = f"Question {i}?"
        rows.append(
            {
                "prompt": prompt,
                "prompt_id": f"id{i}",
                "score_chosen": 8.0,
                "score_rejected": 3.0,
                "chosen": [
                    {"role": "user", "content": prompt + " "},
                    {"role": "assistant", "content": f"Good answer {i}."},
                ],
                "rejected": [{"role": "user", "content": prompt}, {"role": "assistant", "content": f"Bad answer {i}."}],
                "messages": [{"role": "user", "content": prompt}],
            }
        )
    return rows


def write_json(path: Path, records) -> Path:
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def metrics_file(tmp_path: Path) -> Path:
    return tmp_path / "metrics" / "prepare_preference.json"


def run_prepare(tmp_path: Path, source, *overrides: str, **kwargs) -> dict:
    cfg = load_config(None, [f"data.preference.source={source}", *overrides])
    return prepare_preference(
        cfg, out_dir=tmp_path / "out", metrics_path=metrics_file(tmp_path), raw_dir=tmp_path / "raw", **kwargs
    )


def read_split(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]


def read_all(tmp_path: Path) -> list[dict]:
    return [r for s in SPLITS for r in read_split(tmp_path, s)]


def test_embedded_sample(tmp_path, caplog):
    run = FakeRun()
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        metrics = run_prepare(tmp_path, "sample://instruction-data-with-preference.json.gz", run=run)

    assert {k: metrics[k] for k in ("records", "invalid", "identical", "dropped_empty")} == {
        "records": 1100,
        "invalid": 0,
        "identical": 6,
        "dropped_empty": 0,
    }
    assert metrics["train"] + metrics["val"] + metrics["test"] == 1094
    assert (metrics["train"], metrics["val"]) == (int(1094 * 0.85), int(1094 * 0.10))
    assert list(metrics) == ["records", "invalid", "identical", "dropped_empty", "train", "val", "test"]
    assert json.loads(metrics_file(tmp_path).read_text()) == metrics
    assert run.metrics == [metrics] and run.artifacts == [metrics_file(tmp_path)]
    out = read_all(tmp_path)
    assert len(out) == 1094 and all(list(r) == FIELDS for r in out)
    assert all(all(isinstance(v, str) for v in r.values()) and r["chosen"] != r["rejected"] for r in out)
    assert (
        "dropped 6 records with identical chosen and rejected of 1100 "
        "(first: record 123: chosen and rejected are identical)"
    ) in caplog.text


def test_hf_jsonl_with_message_lists_and_string_prompts(tmp_path):
    rows = hf(20)
    rows[3]["chosen"], rows[3]["rejected"] = "Plain good.", "Plain bad."  # strings are accepted too
    rows[4]["prompt"] = [{"role": "user", "content": "Prompt as messages?"}]
    metrics = run_prepare(tmp_path, write_jsonl(tmp_path / "prefs.jsonl", rows))

    assert metrics == {
        "records": 20,
        "invalid": 0,
        "identical": 0,
        "dropped_empty": 0,
        "train": 17,
        "val": 2,
        "test": 1,
    }
    out = {r["instruction"]: r for r in read_all(tmp_path)}
    assert all(list(r) == FIELDS for r in out.values())
    assert out["Question 0?"] == {
        "instruction": "Question 0?",
        "input": "",
        "chosen": "Good answer 0.",
        "rejected": "Bad answer 0.",
    }
    assert out["Question 3?"]["chosen"] == "Plain good." and out["Question 3?"]["rejected"] == "Plain bad."
    assert out["Prompt as messages?"]["chosen"] == "Good answer 4."


def test_json_mixing_both_formats(tmp_path):
    records = ch7(10) + hf(10)
    records[0].pop("input")
    records[1]["input"] = None
    metrics = run_prepare(tmp_path, write_json(tmp_path / "mixed.json", records))

    assert metrics["records"] == 20 and metrics["train"] + metrics["val"] + metrics["test"] == 20
    out = {r["instruction"]: r for r in read_all(tmp_path)}
    assert out["Rewrite sentence 0."] == {
        "instruction": "Rewrite sentence 0.",
        "input": "",
        "chosen": "Polite 0.",
        "rejected": "Rude 0.",
    }
    assert out["Rewrite sentence 1."]["input"] == ""
    assert out["Rewrite sentence 3."]["input"] == "s3"
    assert out["Question 5?"] == {
        "instruction": "Question 5?",
        "input": "",
        "chosen": "Good answer 5.",
        "rejected": "Bad answer 5.",
    }


def test_seeded_splits(tmp_path):
    src = write_json(tmp_path / "d.json", ch7(60))
    run_prepare(tmp_path / "a", src)
    run_prepare(tmp_path / "b", src)
    run_prepare(tmp_path / "c", src, "data.preference.seed=7")
    assert read_split(tmp_path / "a", "train") == read_split(tmp_path / "b", "train")
    assert read_split(tmp_path / "a", "train") != read_split(tmp_path / "c", "train")
    assert read_split(tmp_path / "a", "train") != [
        {k: r.get(k) or "" for k in FIELDS} for r in ch7(60)[:51]
    ]  # shuffled


def test_too_many_bad_records_writes_nothing(tmp_path):
    records = ch7(5)
    records[1].pop("rejected")
    records[3]["rejected"] = records[3]["chosen"]
    records.append({"prompt": "Same?", "chosen": "Yes.", "rejected": "Yes."})
    with pytest.raises(BadInput) as info:
        run_prepare(tmp_path, write_json(tmp_path / "bad.json", records))
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("data.preference.source ") and "bad.json" in msg
    assert (
        "3 of 6 records are unusable (1 invalid, 2 with identical chosen and rejected; "
        "first: record 2: no 'rejected'); at most data.preference.max_bad_fraction=0.01 may be"
    ) in msg
    assert not (tmp_path / "out").exists()
    assert not metrics_file(tmp_path).exists()


def test_failed_run_leaves_prior_output_untouched(tmp_path):
    good = write_json(tmp_path / "good.json", ch7(20))
    first = run_prepare(tmp_path, good)
    before = {s: (tmp_path / "out" / f"{s}.jsonl").read_bytes() for s in SPLITS}
    saved = metrics_file(tmp_path).read_text()

    bad = write_json(tmp_path / "bad.json", [{"instruction": "x", "chosen": "a", "rejected": "a"}] * 3 + ch7(3))
    with pytest.raises(BadInput, match="3 of 6 records are unusable"):
        run_prepare(tmp_path, bad)
    assert {s: (tmp_path / "out" / f"{s}.jsonl").read_bytes() for s in SPLITS} == before
    assert json.loads(metrics_file(tmp_path).read_text()) == first and metrics_file(tmp_path).read_text() == saved


def test_bad_records_below_the_limit_are_dropped_and_counted(tmp_path, caplog):
    records = ch7(20) + [
        ["not", "an", "object"],
        {"instruction": "No rejected.", "chosen": "a"},
        {"prompt": 3, "chosen": "a", "rejected": "b"},
        {"chosen": "a", "rejected": "b"},
        {"instruction": " ", "chosen": "a", "rejected": "b"},
        {"prompt": "Blank answer.", "chosen": "a", "rejected": "\n"},
        {"instruction": "Same.", "chosen": "a", "rejected": "a "},
    ]
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        metrics = run_prepare(
            tmp_path,
            write_json(tmp_path / "d.json", records),
            "data.preference.max_bad_fraction=0.3",
            "data.preference.splits=[0.5,0.25,0.25]",
        )
    assert metrics == {
        "records": 27,
        "invalid": 4,
        "identical": 1,
        "dropped_empty": 2,
        "train": 10,
        "val": 5,
        "test": 5,
    }
    assert "dropped 4 invalid records of 27 (first: record 21: a list, expected an object)" in caplog.text
    assert "dropped 1 record with identical chosen and rejected of 27 (first: record 27" in caplog.text
    assert (
        "dropped 2 records with a blank instruction, chosen or rejected of 27 (first: record 25: blank 'instruction')"
    ) in caplog.text
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 3


@pytest.mark.parametrize(
    "change, reason",
    [
        (
            {
                "chosen": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "q2"},
                    {"role": "assistant", "content": "a2"},
                ]
            },
            "chosen is a 4-message conversation; one user turn and one assistant turn are supported",
        ),
        (
            {"rejected": [{"role": "user", "content": "q"}, {"role": "user", "content": "a"}]},
            "rejected is a conversation of user then user; one user turn and one assistant turn are supported",
        ),
        (
            {
                "chosen": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"},
                ]
            },
            "chosen is a 3-message conversation; one user turn and one assistant turn are supported",
        ),
        (
            {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ["a"]}]},
            "chosen assistant content is list, expected a string",
        ),
        ({"rejected": 5}, "'rejected' is int, expected a string or a list of messages"),
    ],
)
def test_unsupported_conversations_are_invalid(tmp_path, change, reason):
    records = hf(4)
    records[2].update(change)
    with pytest.raises(BadInput) as info:
        run_prepare(tmp_path, write_json(tmp_path / "d.json", records))
    assert f"1 of 4 records are unusable (1 invalid; first: record 3: {reason})" in str(info.value)


def test_no_records_and_all_dropped(tmp_path):
    with pytest.raises(BadInput, match=r"data.preference.source .*empty.json: no records$"):
        run_prepare(tmp_path, write_json(tmp_path / "empty.json", []))
    same = write_json(tmp_path / "same.json", [{"prompt": "p", "chosen": "x", "rejected": "x"}])
    with pytest.raises(BadInput, match="no records left after dropping 1 unusable ones"):
        run_prepare(tmp_path, same, "data.preference.max_bad_fraction=1")
    assert not (tmp_path / "out").exists() and not metrics_file(tmp_path).exists()


def test_folder_is_refused(tmp_path):
    with pytest.raises(BadInput, match="data.preference.source: .* is a folder; expected a .json"):
        run_prepare(tmp_path, tmp_path)


def test_hub_source(tmp_path, monkeypatch):
    import datasets

    calls = []

    def fake_load(repo, name, split, streaming):
        calls.append((repo, name, split, streaming))
        return datasets.Dataset.from_list(hf(20))

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    metrics = run_prepare(tmp_path, "hf://HuggingFaceH4/ultrafeedback_binarized")
    assert calls == [("HuggingFaceH4/ultrafeedback_binarized", None, "train_prefs", False)]
    assert metrics["records"] == 20 and metrics["train"] + metrics["val"] + metrics["test"] == 20
    out = read_all(tmp_path)
    assert all(list(r) == FIELDS for r in out)
    assert {r["chosen"] for r in out} == {f"Good answer {i}." for i in range(20)}
