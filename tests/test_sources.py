"""Sources: resumable, retried, checksum-verified downloads from a loopback server; zip and record files."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import socket
import stat
import threading
import urllib.request
import zipfile
from collections import defaultdict
from pathlib import Path

import pytest

from gptforge.config.data_schema import DownloadConfig
from gptforge.data import sources
from gptforge.data.sources import (
    cache_name,
    download_url,
    load_hf,
    materialize,
    read_records,
    safe_extract_zip,
    shuffle_split,
    split_counts,
    write_splits,
)
from gptforge.errors import BadInput, SourceUnreachable
from gptforge.runtime.steps import DIRECT, Retry

BODY = bytes(range(256)) * 600  # 150 KiB: several read chunks
BODY_SHA = hashlib.sha256(BODY).hexdigest()
FAST = DownloadConfig(retries=2, backoff=0.01, timeout=5)


class Handler(http.server.BaseHTTPRequestHandler):
    """Serves `state.files`; `state.script[path]` lists what successive requests get instead of a normal answer."""

    def do_GET(self):  # noqa: N802 (http.server's naming)
        state = self.server.state
        path = self.path.split("?")[0]
        state.requests.append((path, self.headers.get("Range")))
        script = state.script[path]
        action = script.pop(0) if script else "ok"
        if path not in state.files or action == "404":
            self.send_error(404)
            return
        if action in ("500", "416"):
            self.send_error(int(action))
            return
        body = state.files[path]
        start = 0
        m = re.match(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if m and action == "wrong-range":  # 206, but from byte 0 whatever was asked
            self.send_response(206)
            self.send_header("Content-Range", f"bytes 0-{len(body) - 1}/{len(body)}")
        elif m and action != "ignore-range":
            start = int(m.group(1))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        payload = body[start:]
        if action == "wrong-length":  # a complete-looking answer that is 1000 bytes short
            payload = payload[:-1000]
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if action == "truncate":  # promise the whole body, send half, hang up
            self.wfile.write(payload[: len(payload) // 2])
            self.close_connection = True
            return
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


class State:
    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.script: dict[str, list[str]] = defaultdict(list)
        self.requests: list[tuple[str, str | None]] = []


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.state = State()
    httpd.state.files["/files/data.bin"] = BODY
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    httpd.state.base = f"127.0.0.1:{httpd.server_address[1]}"
    yield httpd.state
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def https_to_loopback(monkeypatch):
    """Config only accepts https:// sources; send https://127.0.0.1 requests to the plain-HTTP test server."""
    real = urllib.request.urlopen

    def urlopen(req, *args, **kwargs):
        if req.full_url.startswith("https://127.0.0.1:"):
            req.full_url = "http://" + req.full_url[len("https://") :]
        return real(req, *args, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# download_url: one attempt


def test_download_writes_file_and_sidecar(server, tmp_path):
    dest = tmp_path / "raw" / "data.bin"
    assert download_url(f"http://{server.base}/files/data.bin", dest) == dest
    assert dest.read_bytes() == BODY
    assert sources.sidecar(dest).read_text().split()[0] == BODY_SHA
    assert not sources._part(dest).exists()


def test_interrupted_download_resumes_with_range(server, tmp_path):
    url = f"http://{server.base}/files/data.bin"
    dest = tmp_path / "data.bin"
    server.script["/files/data.bin"] = ["truncate"]
    with pytest.raises(Exception) as info:
        download_url(url, dest)
    assert not isinstance(info.value, BadInput)  # so Steps retries it
    part = sources._part(dest)
    half = part.stat().st_size
    assert 0 < half < len(BODY) and not dest.exists()

    download_url(url, dest, sha256=BODY_SHA)
    assert dest.read_bytes() == BODY
    assert server.requests[-1] == ("/files/data.bin", f"bytes={half}-")


def test_server_ignoring_range_restarts_from_zero(server, tmp_path):
    dest = tmp_path / "data.bin"
    sources._part(dest).write_bytes(b"stale bytes from another file")
    server.script["/files/data.bin"] = ["ignore-range"]
    download_url(f"http://{server.base}/files/data.bin", dest, sha256=BODY_SHA)
    assert dest.read_bytes() == BODY


def test_refused_resume_starts_over(server, tmp_path):
    dest = tmp_path / "data.bin"
    sources._part(dest).write_bytes(BODY + b"longer than the file")
    server.script["/files/data.bin"] = ["416"]
    download_url(f"http://{server.base}/files/data.bin", dest, sha256=BODY_SHA)
    assert dest.read_bytes() == BODY
    assert [r for _, r in server.requests] == [f"bytes={len(BODY) + 20}-", None]


def test_500_then_200_is_retried(server, tmp_path):
    server.script["/files/data.bin"] = ["500", "500"]
    dest = tmp_path / "data.bin"
    DIRECT(download_url, f"http://{server.base}/files/data.bin", dest, retry=Retry(2, 0.01))
    assert dest.read_bytes() == BODY
    assert len(server.requests) == 3


def test_checksum_mismatch_leaves_no_file(server, tmp_path):
    dest = tmp_path / "data.bin"
    with pytest.raises(BadInput, match=f"checksum mismatch for .*: expected {'0' * 64}, got {BODY_SHA}"):
        download_url(f"http://{server.base}/files/data.bin", dest, sha256="0" * 64)
    assert list(tmp_path.iterdir()) == []


def test_wrong_length_is_caught_by_the_checksum_and_leaves_nothing(server, https_to_loopback, tmp_path):
    """A server whose answer looks complete but is short (its Content-Length agrees with what it
    sends): only the pinned sha256 can tell, and then nothing corrupt stays in the cache."""
    server.script["/files/data.bin"] = ["wrong-length"]
    with pytest.raises(BadInput, match=r"checksum mismatch .*\(check p.sha256 and p.source\)"):
        materialize(
            f"https://{server.base}/files/data.bin", param="p.source", sha256=BODY_SHA, download=FAST, raw_dir=tmp_path
        )
    assert list(tmp_path.iterdir()) == []
    # The next run downloads it again, whole.
    path = materialize(
        f"https://{server.base}/files/data.bin", param="p.source", sha256=BODY_SHA, download=FAST, raw_dir=tmp_path
    )
    assert path.read_bytes() == BODY


def test_drop_then_wrong_range_then_good_answer_ends_verified(server, https_to_loopback, tmp_path):
    """Dropped mid-file, then a resume answered from the wrong offset (appending it would corrupt
    the file): the bad part is discarded, the retry starts over, the result verifies."""
    server.script["/files/data.bin"] = ["truncate", "wrong-range"]
    path = materialize(
        f"https://{server.base}/files/data.bin", param="p.source", sha256=BODY_SHA, download=FAST, raw_dir=tmp_path
    )
    assert path.read_bytes() == BODY
    ranges = [r for _, r in server.requests]
    assert ranges[0] is None and ranges[1] is not None and ranges[2] is None  # resumed once, then from zero


# ---------------------------------------------------------------------------------------------
# materialize: retries, cache, messages


def test_materialize_downloads_with_retries_then_reuses_the_cache(server, https_to_loopback, tmp_path):
    server.files["/static/sms%2Bspam.zip"] = BODY
    server.script["/static/sms%2Bspam.zip"] = ["500", "truncate"]
    url = f"https://{server.base}/static/sms%2Bspam.zip"
    path = materialize(url, param="data.classify.source", sha256=None, download=FAST, raw_dir=tmp_path)
    assert path == tmp_path / "sms+spam.zip" and path.read_bytes() == BODY
    assert len(server.requests) == 3 and server.requests[-1][1] is not None  # the third resumed

    again = materialize(url, param="data.classify.source", sha256=None, download=FAST, raw_dir=tmp_path)
    assert again == path and len(server.requests) == 3  # no network the second time
    materialize(url, param="data.classify.source", sha256=BODY_SHA.upper(), download=FAST, raw_dir=tmp_path)
    assert len(server.requests) == 3


def test_cached_file_from_another_url_is_not_reused(server, https_to_loopback, tmp_path):
    server.files["/v2/data.bin"] = BODY[::-1]
    url1, url2 = f"https://{server.base}/files/data.bin", f"https://{server.base}/v2/data.bin"
    materialize(url1, param="p.source", sha256=None, download=FAST, raw_dir=tmp_path)
    path = materialize(url2, param="p.source", sha256=None, download=FAST, raw_dir=tmp_path)
    assert path.read_bytes() == BODY[::-1]


def test_corrupted_cache_is_downloaded_again(server, https_to_loopback, tmp_path):
    url = f"https://{server.base}/files/data.bin"
    path = materialize(url, param="p.source", sha256=None, download=FAST, raw_dir=tmp_path)
    path.write_bytes(b"bit rot")
    assert materialize(url, param="p.source", sha256=None, download=FAST, raw_dir=tmp_path).read_bytes() == BODY
    assert len(server.requests) == 2


def test_unreachable_host_names_the_param_and_leaves_nothing(tmp_path):
    url = f"https://127.0.0.1:{closed_port()}/static/sms.zip"
    with pytest.raises(SourceUnreachable) as info:
        materialize(url, param="data.classify.source", sha256=None, download=FAST, raw_dir=tmp_path)
    msg = str(info.value)
    assert msg.startswith(f"cannot download {url}: ") and "\n" not in msg
    assert "(after 3 attempts); set data.classify.source to a local copy" in msg
    assert list(tmp_path.iterdir()) == []


def test_always_short_body_gives_up_and_deletes_the_part(server, https_to_loopback, tmp_path):
    server.script["/files/data.bin"] = ["truncate"] * 3
    with pytest.raises(SourceUnreachable, match=r"connection closed after .* \(after 3 attempts\); set p.source"):
        materialize(
            f"https://{server.base}/files/data.bin", param="p.source", sha256=None, download=FAST, raw_dir=tmp_path
        )
    assert list(tmp_path.iterdir()) == []


def test_http_404_is_a_clear_source_error(server, https_to_loopback, tmp_path):
    with pytest.raises(SourceUnreachable, match=r"cannot download https://.*/missing.zip: HTTP 404 .*set p.source"):
        materialize(
            f"https://{server.base}/missing.zip",
            param="p.source",
            sha256=None,
            download=DownloadConfig(retries=0),
            raw_dir=tmp_path,
        )
    with pytest.raises(SourceUnreachable, match="HTTP 404"):
        download_url(f"http://{server.base}/missing.zip", tmp_path / "m.zip")


def test_checksum_mismatch_through_materialize_names_the_sha_param(server, https_to_loopback, tmp_path):
    with pytest.raises(BadInput, match=r"checksum mismatch .*check data.instruct.sha256"):
        materialize(
            f"https://{server.base}/files/data.bin",
            param="data.instruct.source",
            sha256="a" * 64,
            download=FAST,
            raw_dir=tmp_path,
        )
    assert list(tmp_path.iterdir()) == []
    assert len(server.requests) == 1  # a wrong checksum is not retried


def test_malformed_sha256_is_refused_before_downloading(tmp_path):
    with pytest.raises(BadInput, match="data.classify.sha256: expected 64 hex digits"):
        materialize(
            "https://127.0.0.1:1/x.zip", param="data.classify.source", sha256="abc", download=FAST, raw_dir=tmp_path
        )


def test_local_sources(tmp_path):
    f = tmp_path / "local.jsonl"
    f.write_text("{}\n")
    assert materialize(str(f), param="p.source", sha256=None, download=FAST) == f
    with pytest.raises(BadInput, match="p.source: local source not found: .*nope.jsonl"):
        materialize(str(tmp_path / "nope.jsonl"), param="p.source", sha256=None, download=FAST)
    with pytest.raises(BadInput, match="hub dataset"):
        materialize("hf://a/b", param="p.source", sha256=None, download=FAST)


@pytest.mark.parametrize(
    "url, name",
    [
        ("https://archive.ics.uci.edu/static/public/228/sms+spam+collection.zip", "sms+spam+collection.zip"),
        ("https://h/a/my%20data%3F.json?token=1", "my_data_.json"),
        ("https://h/..%2F..%2Fetc%2Fpasswd", "_.._etc_passwd"),
        ("https://h/", "download"),
    ],
)
def test_cache_name_is_filesystem_safe(url, name):
    assert cache_name(url) == name


# ---------------------------------------------------------------------------------------------
# Zip archives


def make_zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_safe_extract_zip(tmp_path):
    z = make_zip(tmp_path / "a.zip", {"SMSSpamCollection": b"ham\thi\n", "sub/readme": b"r"})
    dest = tmp_path / "out"
    files = safe_extract_zip(z, dest)
    assert sorted(files) == [dest / "SMSSpamCollection", dest / "sub/readme"]
    assert (dest / "SMSSpamCollection").read_bytes() == b"ham\thi\n"


@pytest.mark.parametrize(
    "member, problem",
    [
        ("../evil", "'..' in path"),
        ("a/../../evil", "'..' in path"),
        ("/etc/evil", "absolute path"),
        ("C:/evil", "drive letter"),
    ],
)
def test_unsafe_zip_members_are_refused(tmp_path, member, problem):
    z = make_zip(tmp_path / "bad.zip", {"ok.txt": b"fine", member: b"pwned"})
    with pytest.raises(BadInput, match=re.escape(f"refusing unsafe member {member!r} ({problem})")):
        safe_extract_zip(z, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "evil").exists()


def test_zip_symlink_member_is_refused(tmp_path):
    z = tmp_path / "link.zip"
    info = zipfile.ZipInfo("innocent")
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr(info, "/etc/passwd")
    with pytest.raises(BadInput, match=r"refusing unsafe member 'innocent' \(symlink\)"):
        safe_extract_zip(z, tmp_path / "out")


def test_corrupt_zip(tmp_path):
    z = tmp_path / "corrupt.zip"
    z.write_bytes(b"<html>rate limited</html>")
    with pytest.raises(BadInput, match=f"{re.escape(str(z))}: not a valid zip archive"):
        safe_extract_zip(z, tmp_path / "out")


def test_zip_with_damaged_data_leaves_nothing_half_extracted(tmp_path):
    z = make_zip(tmp_path / "d.zip", {"a.txt": b"A" * 1000, "b.txt": b"B" * 1000})
    data = bytearray(z.read_bytes())
    i = data.index(b"B" * 100)
    data[i : i + 10] = b"X" * 10  # stored (uncompressed) member: its CRC check fails on extraction
    z.write_bytes(bytes(data))
    with pytest.raises(BadInput, match="not a valid zip archive"):
        safe_extract_zip(z, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.zip"]


# ---------------------------------------------------------------------------------------------
# Record files and hub datasets


def test_read_records_formats(tmp_path):
    rows = [{"text": "hi", "label": "ham"}, {"text": "win", "label": "spam"}]
    (tmp_path / "r.json").write_text(json.dumps(rows))
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "r.csv").write_text("text,label\nhi,ham\nwin,spam\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "r.parquet")
    for suffix in ("json", "jsonl", "csv", "parquet"):
        assert read_records(tmp_path / f"r.{suffix}", param="p") == rows, suffix


def test_json_that_is_not_a_list(tmp_path):
    f = tmp_path / "d.json"
    f.write_text('{"instruction": "x"}')
    with pytest.raises(BadInput, match=f"{re.escape(str(f))}: expected a JSON list of records, got dict"):
        read_records(f, param="data.instruct.source")


def test_invalid_json(tmp_path):
    f = tmp_path / "d.json"
    f.write_text("[{]")
    with pytest.raises(BadInput, match="not valid JSON .*line 1"):
        read_records(f, param="p")


def test_jsonl_bad_line_is_named(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(BadInput, match="line 2 is not valid JSON"):
        read_records(f, param="p")


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("d.xml", b"<a/>", "unsupported file type '.xml'"),
        ("d.parquet", b"not parquet", "not a readable parquet file"),
        ("d.csv", b"text,label\n\xff\xfe,1\n", "not UTF-8 text"),
    ],
)
def test_unreadable_record_files(tmp_path, name, content, message):
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(BadInput, match=message):
        read_records(f, param="p")
    with pytest.raises(BadInput, match="not a file"):
        read_records(tmp_path / "missing.json", param="p")


def test_load_hf_passes_arguments_and_wraps_failures(monkeypatch):
    import datasets

    calls = []

    def fake(repo, name, split, streaming):
        calls.append((repo, name, split, streaming))
        if repo == "down/repo":
            raise ConnectionError("Couldn't reach 'down/repo' on the Hub (LocalEntryNotFoundError)\nTraceback...")
        return [{"x": 1}]

    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert load_hf("hf://tatsu-lab/alpaca", split="train", param="p") == [{"x": 1}]
    assert calls[-1] == ("tatsu-lab/alpaca", None, "train", False)
    with pytest.raises(SourceUnreachable) as info:
        load_hf("hf://down/repo", name="sample-10BT", streaming=True, param="data.pretrain.source")
    msg = str(info.value)
    assert "\n" not in msg and "hf://down/repo (name=sample-10BT, split=train)" in msg
    assert "Couldn't reach 'down/repo'" in msg and msg.endswith("set data.pretrain.source to a local copy")


# ---------------------------------------------------------------------------------------------
# Splits


def test_split_counts_sum_to_n():
    for n in range(0, 300):
        for fractions in ([0.7, 0.1, 0.2], [0.85, 0.05, 0.10], [1.0, 0.0, 0.0], [0.71, 0.29, 0.0]):
            counts = split_counts(n, fractions)
            assert sum(counts) == n and min(counts) >= 0
    assert split_counts(1494, [0.7, 0.1, 0.2]) == (1045, 149, 300)  # Raschka ch06's numbers
    assert split_counts(100, [0.71, 0.29, 0.0]) == (71, 29, 0)


def test_shuffle_split_is_seeded():
    items = list(range(50))
    a, b = shuffle_split(items, [0.6, 0.2, 0.2], 1), shuffle_split(items, [0.6, 0.2, 0.2], 1)
    assert a == b and a != shuffle_split(items, [0.6, 0.2, 0.2], 2)
    assert sorted(a["train"] + a["val"] + a["test"]) == items


def test_write_splits_replaces_the_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.jsonl").write_text("old")
    counts = write_splits({"train": [{"t": "é"}], "val": [], "test": [{"t": 1}, {"t": 2}]}, out)
    assert counts == {"train": 1, "val": 0, "test": 2}
    assert sorted(p.name for p in out.iterdir()) == ["test.jsonl", "train.jsonl", "val.jsonl"]
    assert (out / "train.jsonl").read_text(encoding="utf-8") == '{"t": "é"}\n'
