"""prepare_instruct: Alpaca-style records (JSON, JSONL, hub) -> validated, shuffled jsonl splits."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from fixture_data import FakeRun
from test_sources import https_to_loopback, server  # noqa: F401  (fixtures: a counting loopback server)

from gptforge.config.load import load_config
from gptforge.data.instruct import prepare_instruct
from gptforge.errors import BadInput, SourceUnreachable


def alpaca(n: int) -> list[dict]:
    return [
        {"instruction": f"Do task {i}.", "input": f"x={i}" if i % 3 == 0 else "", "output": f"Done {i}."}
        for i in range(n)
    ]


def write_json(path: Path, records) -> Path:
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


def run_prepare(tmp_path: Path, source, *overrides: str, **kwargs) -> dict:
    cfg = load_config(None, [f"data.instruct.source={source}", *overrides])
    kwargs.setdefault("raw_dir", tmp_path / "raw")
    return prepare_instruct(
        cfg, out_dir=tmp_path / "out", metrics_path=tmp_path / "metrics" / "prepare_instruct.json", **kwargs
    )


def read_split(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]


def test_json_list_source(tmp_path):
    records = alpaca(100)
    run = FakeRun()
    metrics = run_prepare(tmp_path, write_json(tmp_path / "alpaca_data.json", records), run=run)

    assert metrics == {"records": 100, "invalid": 0, "dropped_empty": 0, "train": 85, "val": 5, "test": 10}
    saved = json.loads((tmp_path / "metrics" / "prepare_instruct.json").read_text())
    assert saved == metrics
    assert run.metrics == [metrics] and run.artifacts == [tmp_path / "metrics" / "prepare_instruct.json"]
    out = [r for s in ("train", "val", "test") for r in read_split(tmp_path, s)]
    assert all(list(r) == ["instruction", "input", "output"] for r in out)
    assert sorted(out, key=lambda r: r["instruction"]) == sorted(records, key=lambda r: r["instruction"])
    assert read_split(tmp_path, "train") != records[:85]  # shuffled


def test_jsonl_source_same_as_json_and_seeded(tmp_path):
    records = alpaca(40)
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    run_prepare(tmp_path / "j", jsonl)
    run_prepare(tmp_path / "k", write_json(tmp_path / "a.json", records))
    run_prepare(tmp_path / "s", jsonl, "data.instruct.seed=99")
    assert read_split(tmp_path / "j", "train") == read_split(tmp_path / "k", "train")
    assert read_split(tmp_path / "j", "train") != read_split(tmp_path / "s", "train")


def test_invalid_and_empty_records_are_counted_and_skipped(tmp_path, caplog):
    records = alpaca(20) + [
        {"instruction": "no output"},  # invalid: missing key
        {"instruction": 5, "input": "", "output": "x"},  # invalid: not a string
        ["a", "list"],  # invalid: not an object
        {"instruction": "   ", "input": "", "output": "x"},  # empty
        {"instruction": "Say hi.", "output": ""},  # empty
        {"instruction": "No input key.", "output": "ok", "text": "extra keys are dropped"},
        {"instruction": "Null input.", "input": None, "output": "ok"},
    ]
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        metrics = run_prepare(
            tmp_path, write_json(tmp_path / "d.json", records), "data.instruct.splits=[0.5,0.25,0.25]"
        )
    assert metrics == {"records": 27, "invalid": 3, "dropped_empty": 2, "train": 11, "val": 5, "test": 6}
    assert "skipped 3 invalid records of 27 (first: record 21: no 'output')" in caplog.text
    out = {r["instruction"]: r for s in ("train", "val", "test") for r in read_split(tmp_path, s)}
    assert out["No input key."] == {"instruction": "No input key.", "input": "", "output": "ok"}
    assert out["Null input."]["input"] == ""


def test_missing_field_in_most_records_is_refused(tmp_path):
    records = [{"prompt": f"p{i}", "completion": f"c{i}", "instruction": "i"} for i in range(5)] + alpaca(2)
    with pytest.raises(BadInput) as info:
        run_prepare(tmp_path, write_json(tmp_path / "other.json", records))
    msg = str(info.value)
    assert "field 'output' is missing in 5 of 7 records (first: record 1)" in msg
    assert msg.startswith("data.instruct.source ") and "expected objects with instruction, input, output" in msg


def test_all_records_invalid(tmp_path):
    records = [{"instruction": ["a"], "input": "", "output": 1}] * 3
    with pytest.raises(BadInput, match=r"all 3 records are invalid \(first: record 1: 'instruction' is list"):
        run_prepare(tmp_path, write_json(tmp_path / "d.json", records))


def test_nothing_left_after_dropping_empty(tmp_path):
    records = [{"instruction": " ", "input": "", "output": "x"}, {"instruction": "y", "input": "", "output": "\n"}]
    with pytest.raises(BadInput, match="no records left after dropping 2 with an empty instruction or output"):
        run_prepare(tmp_path, write_json(tmp_path / "d.json", records))


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"instruction": "x", "output": "y"}', "expected a JSON list of records, got dict"),
        ("[]", "no records"),
        ("[{]", "not valid JSON"),
    ],
)
def test_bad_json_files(tmp_path, content, message):
    f = tmp_path / "d.json"
    f.write_text(content)
    with pytest.raises(BadInput, match=message):
        run_prepare(tmp_path, f)
    assert not (tmp_path / "out").exists()


def test_jsonl_bad_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(alpaca(1)[0]) + "\n{oops\n")
    with pytest.raises(BadInput, match="data.instruct.source .*d.jsonl: line 2 is not valid JSON"):
        run_prepare(tmp_path, f)


def test_missing_local_file_and_folder(tmp_path):
    with pytest.raises(BadInput, match="data.instruct.source: local source not found"):
        run_prepare(tmp_path, tmp_path / "nope.json")
    with pytest.raises(BadInput, match="is a folder"):
        run_prepare(tmp_path, tmp_path)


def test_hub_source(tmp_path, monkeypatch):
    import datasets

    calls = []

    def fake_load(repo, name, split, streaming):
        calls.append((repo, name, split, streaming))
        rows = [dict(r, text="### Instruction: ...") for r in alpaca(20)]
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    metrics = run_prepare(tmp_path, "hf://tatsu-lab/alpaca", "data.instruct.split=train[:20]")
    assert calls == [("tatsu-lab/alpaca", None, "train[:20]", False)]
    assert metrics["records"] == 20 and metrics["train"] + metrics["val"] + metrics["test"] == 20
    assert all(list(r) == ["instruction", "input", "output"] for r in read_split(tmp_path, "train"))


def test_hub_unreachable(tmp_path, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'tatsu-lab/alpaca' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(
        SourceUnreachable,
        match=r"cannot load hf://tatsu-lab/alpaca .*Couldn't reach.*"
        r"set data.instruct.source to a local copy",
    ):
        run_prepare(tmp_path, "hf://tatsu-lab/alpaca")


def test_url_source_goes_through_the_download_cache(tmp_path, server, https_to_loopback):
    """The first run downloads from the loopback server, the second reads the download cache alone."""
    payload = json.dumps(alpaca(20)).encode()  # 20 records: every split gets one
    server.files["/tatsu-lab/stanford_alpaca/main/alpaca_data.json"] = payload
    url = f"https://{server.base}/tatsu-lab/stanford_alpaca/main/alpaca_data.json"

    first = run_prepare(tmp_path / "a", url, raw_dir=tmp_path / "raw")
    assert server.requests == [("/tatsu-lab/stanford_alpaca/main/alpaca_data.json", None)]
    assert (tmp_path / "raw" / "alpaca_data.json").read_bytes() == payload
    assert first["records"] == 20
    records = [r for s in ("train", "val", "test") for r in read_split(tmp_path / "a", s)]
    assert sorted(records, key=lambda r: r["instruction"]) == sorted(alpaca(20), key=lambda r: r["instruction"])

    second = run_prepare(tmp_path / "b", url, raw_dir=tmp_path / "raw")
    assert len(server.requests) == 1  # no second request: the cached, sha256-verified file
    assert second == first
    assert all(read_split(tmp_path / "b", s) == read_split(tmp_path / "a", s) for s in ("train", "val", "test"))


# ---------------------------------------------------------------------------------------------
# synthetic://NAME: the pairs the synthesize stage kept


SYNTHETIC = [
    "synthesize.documents={docs: manual}",
    "synthesize.endpoint.url=http://127.0.0.1:9/v1",
    "synthesize.endpoint.model=m",
]


def test_synthetic_source_reads_the_kept_pairs_and_keeps_their_provenance(tmp_path):
    kept = [
        {
            "instruction": f"What is point {i}?",
            "input": "",
            "output": f"Point {i} is a fact.",
            "source": "guide.md",
            "chunk": f"guide.md#{i // 3}",
            "span": [i * 10, i * 10 + 40],
            "scores": {"grounding": 1.0},
        }
        for i in range(20)
    ]
    folder = tmp_path / "synthetic" / "docs"
    folder.mkdir(parents=True)
    (folder / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    metrics = run_prepare(tmp_path, "synthetic://docs", *SYNTHETIC, synthetic_root=tmp_path / "synthetic")
    assert metrics["records"] == 20 and metrics["invalid"] == 0
    records = [r for s in ("train", "val", "test") for r in read_split(tmp_path, s)]
    assert sorted(records, key=lambda r: r["span"]) == kept  # every key, provenance included


def test_synthetic_source_not_made_yet_names_the_command(tmp_path):
    with pytest.raises(
        BadInput,
        match=r"synthetic://docs reads .*qa.jsonl, which does not exist: run "
        r"`gptforge synthesize -S synthesize.only=docs`",
    ):
        run_prepare(tmp_path, "synthetic://docs", *SYNTHETIC, synthetic_root=tmp_path / "synthetic")


def test_synthetic_source_must_name_a_documents_entry():
    with pytest.raises(
        BadInput,
        match=r"data.instruct.source: synthetic://other names no entry of "
        r"synthesize.documents \(entries: docs\)",
    ):
        load_config(None, ["data.instruct.source=synthetic://other", *SYNTHETIC])


def test_a_split_that_would_be_empty_is_refused_with_the_record_count(tmp_path):
    before = list((tmp_path / "out").rglob("*")) if (tmp_path / "out").exists() else []
    with pytest.raises(BadInput) as refused:
        run_prepare(tmp_path, write_json(tmp_path / "few.json", alpaca(12)))
    assert str(refused.value) == (
        "data.instruct.splits: 12 records leave the val split (0.05) empty: give it a "
        "larger share or the source more records"
    )
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").rglob("*")) == before
