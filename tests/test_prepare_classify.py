"""prepare_classify: SMS Spam Collection (zip, plain file, folder, CSV/JSONL) -> balanced jsonl splits."""

from __future__ import annotations

import json
import logging
import socket
import zipfile
from pathlib import Path

import pytest
from fixture_data import FakeRun

from gptforge.config.load import load_config
from gptforge.data import sources
from gptforge.data.classify import prepare_classify
from gptforge.errors import BadInput, SourceUnreachable
from gptforge.runtime.steps import Steps

METRIC_KEYS = {
    "total_lines",
    "bad_lines",
    "train_ham",
    "train_spam",
    "val_ham",
    "val_spam",
    "test_ham",
    "test_spam",
    "train",
    "val",
    "test",
}


class RecordingSteps(Steps):
    def __init__(self):
        self.names: list[str] = []

    def __call__(self, fn, /, *args, retry=None, **kwargs):
        self.names.append(fn.__name__)
        return super().__call__(fn, *args, retry=retry, **kwargs)


def sms_bytes(ham: int = 40, spam: int = 10, extra: list[bytes] = ()) -> bytes:
    lines = [f"ham\tsee you at {i} o'clock".encode() for i in range(ham)]
    lines += [f"spam\tWIN a prize number {i}! call now".encode() for i in range(spam)]
    return b"\n".join(lines + list(extra)) + b"\n"


def sms_zip(path: Path, data: bytes, member: str = "SMSSpamCollection") -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, data)
        zf.writestr("readme", "the UCI readme")
    return path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cfg_for(source, *overrides: str):
    return load_config(None, [f"data.classify.source={source}", *overrides])


def run_prepare(tmp_path: Path, source, *overrides: str, **kwargs) -> dict:
    return prepare_classify(
        cfg_for(source, *overrides),
        out_dir=tmp_path / "out",
        metrics_path=tmp_path / "metrics" / "prepare_classify.json",
        raw_dir=tmp_path / "raw",
        **kwargs,
    )


def read_split(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]


def test_zip_source_balanced_split(tmp_path):
    z = sms_zip(tmp_path / "sms+spam+collection.zip", sms_bytes(40, 10))
    run, steps = FakeRun(), RecordingSteps()
    metrics = run_prepare(tmp_path, z, run=run, steps=steps)

    # 10 spam + 10 sampled ham = 20: 14 / 2 / 4 with splits 0.7 / 0.1 / 0.2.
    assert set(metrics) == METRIC_KEYS
    assert (metrics["total_lines"], metrics["bad_lines"]) == (50, 0)
    assert (metrics["train"], metrics["val"], metrics["test"]) == (14, 2, 4)
    assert sum(metrics[f"{s}_ham"] for s in ("train", "val", "test")) == 10
    assert sum(metrics[f"{s}_spam"] for s in ("train", "val", "test")) == 10
    for name in ("train", "val", "test"):
        rows = read_split(tmp_path, name)
        assert len(rows) == metrics[name]
        assert all(set(r) == {"text", "label"} and r["label"] in (0, 1) for r in rows)
        assert sum(r["label"] for r in rows) == metrics[f"{name}_spam"]
    assert all(r["label"] == 1 for r in read_split(tmp_path, "train") if r["text"].startswith("WIN"))

    saved = json.loads((tmp_path / "metrics" / "prepare_classify.json").read_text())
    assert saved == metrics and all(isinstance(v, int) for v in saved.values())
    assert run.metrics == [metrics] and run.artifacts == [tmp_path / "metrics" / "prepare_classify.json"]
    assert {"find_sms_file", "read_labelled", "balance_and_split", "write_splits"} <= set(steps.names)
    assert (tmp_path / "raw" / "sms+spam+collection.extracted" / "SMSSpamCollection").is_file()


@pytest.mark.parametrize("layout", ["plain", "tsv", "folder"])
def test_extracted_file_or_folder_gives_the_same_splits_as_the_zip(tmp_path, layout):
    data = sms_bytes(30, 12)
    zipped = run_prepare(tmp_path / "z", sms_zip(tmp_path / "s.zip", data))
    src = tmp_path / "src"
    src.mkdir()
    if layout == "plain":
        source = src / "SMSSpamCollection"
    elif layout == "tsv":
        source = src / "sms.tsv"
    else:
        (src / "smsspamcollection").mkdir()
        source = src
    (src / "smsspamcollection" / "SMSSpamCollection" if layout == "folder" else source).write_bytes(data)
    assert run_prepare(tmp_path / "p", source) == zipped
    assert read_split(tmp_path / "p", "train") == read_split(tmp_path / "z", "train")


def test_same_seed_same_splits_other_seed_other_splits(tmp_path):
    f = tmp_path / "SMSSpamCollection"
    f.write_bytes(sms_bytes(60, 20))
    run_prepare(tmp_path / "a", f)
    run_prepare(tmp_path / "b", f)
    run_prepare(tmp_path / "c", f, "data.classify.seed=7")
    assert read_split(tmp_path / "a", "train") == read_split(tmp_path / "b", "train")
    assert read_split(tmp_path / "a", "train") != read_split(tmp_path / "c", "train")


def test_no_balance_keeps_every_message_and_decodes_latin1_lines(tmp_path):
    f = tmp_path / "SMSSpamCollection"
    f.write_bytes(sms_bytes(40, 10, extra=[b"ham\tcaf\xe9 at 5?", "spam\tfree \u00a3100 now".encode()]))
    metrics = run_prepare(tmp_path, f, "data.classify.balance=false")
    assert metrics["train"] + metrics["val"] + metrics["test"] == 52
    assert sum(metrics[f"{s}_spam"] for s in ("train", "val", "test")) == 11
    texts = {r["text"] for s in ("train", "val", "test") for r in read_split(tmp_path, s)}
    assert {"café at 5?", "free £100 now"} <= texts


def test_csv_and_jsonl_records(tmp_path):
    csv_file = tmp_path / "sms.csv"
    csv_file.write_text(
        "text,label\n"
        + "".join(f'"hello, {i}",ham\n' for i in range(8))
        + "".join(f"prize {i},spam\n" for i in range(4))
    )
    metrics = run_prepare(tmp_path / "csv", csv_file)
    assert metrics["total_lines"] == 12 and metrics["train"] + metrics["val"] + metrics["test"] == 8

    jsonl = tmp_path / "sms.jsonl"
    rows = [{"text": f"msg {i}", "label": i % 2} for i in range(20)] + [{"text": "x", "label": "1"}]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = run_prepare(tmp_path / "jsonl", jsonl, "data.classify.balance=false")
    assert metrics["train"] + metrics["val"] + metrics["test"] == 21
    assert sum(metrics[f"{s}_spam"] for s in ("train", "val", "test")) == 11


def test_too_many_malformed_lines(tmp_path):
    f = tmp_path / "SMSSpamCollection"
    good = sms_bytes(5, 2).splitlines()
    f.write_bytes(b"\n".join(good[:3] + [b"no tab here", b"eggs\tnot a label", b"spam\t   "] + good[3:]) + b"\n")
    with pytest.raises(BadInput) as info:
        run_prepare(tmp_path, f)
    msg = str(info.value)
    assert msg.startswith(f"3 of 10 lines malformed (30.0%) in {f}, above data.classify.max_bad_fraction=0.01")
    assert "(first bad line: 4;" in msg and "\n" not in msg
    assert not (tmp_path / "out").exists()


def test_few_malformed_lines_are_skipped_with_a_warning(tmp_path, caplog):
    f = tmp_path / "SMSSpamCollection"
    f.write_bytes(sms_bytes(40, 10, extra=[b"spam without a tab"]))
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        metrics = run_prepare(tmp_path, f, "data.classify.max_bad_fraction=0.05")
    assert (metrics["total_lines"], metrics["bad_lines"]) == (51, 1)
    assert "skipped 1 malformed lines of 51" in caplog.text and "line 51" in caplog.text


def test_malformed_records_count_too(tmp_path):
    f = tmp_path / "sms.jsonl"
    f.write_text(
        '{"text": "a", "label": "ham"}\n{"text": "b", "label": "maybe"}\n{"label": 1}\n{"text": "c", "label": 1}\n'
    )
    with pytest.raises(BadInput, match=r"2 of 4 records malformed \(50.0%\) .*first bad record: 2"):
        run_prepare(tmp_path, f)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "no lines to read"),
        (b"\n\n", "no lines to read"),
        (b"ham\thello\nham\tthere\n", "needs both ham and spam examples, found only ham \\(2\\)"),
    ],
)
def test_empty_or_single_class_corpus(tmp_path, content, message):
    f = tmp_path / "SMSSpamCollection"
    f.write_bytes(content)
    with pytest.raises(BadInput, match=message):
        run_prepare(tmp_path, f)


def test_zip_without_the_collection(tmp_path):
    z = sms_zip(tmp_path / "other.zip", sms_bytes(), member="data.txt")
    with pytest.raises(
        BadInput,
        match=r"data.classify.source .*other.zip: no SMSSpamCollection file in it "
        r"\(found: data.txt, readme\)",
    ):
        run_prepare(tmp_path, z)


def test_corrupt_zip_source(tmp_path):
    z = tmp_path / "sms.zip"
    z.write_bytes(b"<html>503</html>")
    with pytest.raises(BadInput, match="not a valid zip archive"):
        run_prepare(tmp_path, z)


@pytest.mark.parametrize(
    "source, message",
    [
        ("hf://ucirvine/sms_spam", "data.classify.source: hub datasets are not supported"),
        ("{tmp}/missing.zip", "data.classify.source: local source not found"),
        ("{tmp}/sms.xlsx", "unsupported file type '.xlsx'"),
    ],
)
def test_unusable_sources(tmp_path, source, message):
    (tmp_path / "sms.xlsx").write_bytes(b"PK")
    with pytest.raises(BadInput, match=message):
        run_prepare(tmp_path, source.format(tmp=tmp_path))


def test_url_source_downloads_into_raw_dir(tmp_path, monkeypatch):
    z = sms_zip(tmp_path / "upstream.zip", sms_bytes())
    calls = []

    def fake_download(url, dest, *, sha256=None, timeout=30.0):
        calls.append((url, Path(dest), timeout))
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        Path(dest).write_bytes(z.read_bytes())
        return Path(dest)

    monkeypatch.setattr(sources, "download_url", fake_download)
    metrics = run_prepare(
        tmp_path,
        "https://archive.example/static/sms+spam+collection.zip",
        "data.download.timeout=9",
        "data.download.backoff=0.01",
    )
    assert calls == [
        ("https://archive.example/static/sms+spam+collection.zip", tmp_path / "raw" / "sms+spam+collection.zip", 9.0)
    ]
    assert metrics["total_lines"] == 50


def test_unreachable_url_fails_with_the_param_and_keeps_old_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.jsonl").write_text("previous run\n")
    with pytest.raises(SourceUnreachable, match=r"\(after 2 attempts\); set data.classify.source to a local copy"):
        run_prepare(
            tmp_path,
            f"https://127.0.0.1:{closed_port()}/sms.zip",
            "data.download.retries=1",
            "data.download.backoff=0.01",
        )
    assert (out / "train.jsonl").read_text() == "previous run\n"
