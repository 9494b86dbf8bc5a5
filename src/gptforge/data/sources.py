"""Where data comes from, and the record files that data stages read and write.

A source string from `params.yaml` is `hf://OWNER/NAME` (see `load_hf`), an `https://` URL or a
local path (see `materialize`). Downloads go to `data/raw/<file name>` through `.part` files:
an interrupted download resumes with an HTTP Range request, a finished one is checked against
its sha256 and kept with a `<file>.sha256` sidecar, so the next run reuses it without the
network. Nothing half-downloaded or half-extracted is ever left under its final name.

The second half holds what both fine-tuning data stages share: seeded shuffle-and-split and
writing `{train,val,test}.jsonl` as one atomic folder.
"""

from __future__ import annotations

import csv
import http.client
import json
import logging
import os
import random
import re
import stat
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Any, Sequence

from tqdm import tqdm

import gptforge
from gptforge.config.data_schema import DownloadConfig
from gptforge.errors import BadInput, SourceUnreachable
from gptforge.io import atomic_dir, atomic_file, data_suffix, is_gzip, open_data, sha256_file
from gptforge.runtime.steps import DIRECT, Retry, Steps, retryable

log = logging.getLogger("gptforge")

SPLITS = ("train", "val", "test")
_CHUNK = 1 << 16
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


class HTTPClientError(SourceUnreachable):
    """A 4xx answer: the URL is wrong or needs credentials, so trying again rarely helps.

    `retryable = False` is a hint for `Steps`; today it retries every non-`BadInput` error.
    """

    retryable = False

    def __init__(self, url: str, code: int, reason: str) -> None:
        self.reason = f"HTTP {code} {reason}".strip()
        super().__init__(f"cannot download {url}: {self.reason}")


# ---------------------------------------------------------------------------------------------
# Sources


def is_hf(source: str) -> bool:
    return source.lower().startswith("hf://")


def is_url(source: str) -> bool:
    return source.lower().startswith(("https://", "http://"))


def materialize(
    source: str,
    *,
    param: str,
    sha256: str | None,
    download: DownloadConfig,
    steps: Steps = DIRECT,
    raw_dir: str | os.PathLike = "data/raw",
) -> Path:
    """A local file for a URL or local source: the path itself, or the (cached) download.

    `param` is the dotted key the source came from, so every error tells the user what to edit.
    """
    if is_hf(source):
        raise BadInput(f"{param}: {source} is a hub dataset, not a file (load it with load_hf)")
    sha_param = param.rsplit(".", 1)[0] + ".sha256"
    if sha256 is not None and not _SHA256.fullmatch(sha256):
        raise BadInput(f"{sha_param}: expected 64 hex digits, got {sha256!r}")
    if not is_url(source):
        path = Path(source).expanduser()
        if not path.exists():
            raise BadInput(f"{param}: local source not found: {path}")
        return path

    dest = Path(raw_dir) / cache_name(source)
    if _cached(dest, source, sha256):
        log.info("using cached %s (sha256 verified)", dest)
        return dest
    try:
        steps(
            download_url,
            source,
            dest,
            sha256=sha256,
            timeout=download.timeout,
            retry=Retry(download.retries, download.backoff),
        )
    except BadInput as e:  # the only one is a checksum mismatch: the pin or the URL is wrong
        raise BadInput(f"{e} (check {sha_param} and {param})") from None
    except Exception as e:
        _part(dest).unlink(missing_ok=True)
        attempts = download.retries + 1 if retryable(e) else 1
        raise SourceUnreachable(
            f"cannot download {source}: {_reason(e, download.timeout)} (after {attempts} attempt"
            f"{'s' if attempts != 1 else ''}); set {param} to a local copy"
        ) from None
    return dest


def cache_name(url: str) -> str:
    """The URL's file name, unquoted, reduced to characters that are safe on every filesystem."""
    name = urllib.parse.unquote(PurePosixPath(urllib.parse.urlparse(url).path).name)
    # A leading dot would hide the file (and '..' would climb out of raw_dir).
    name = re.sub(r"[^A-Za-z0-9._+-]", "_", name).lstrip(".")[:200]
    return name or "download"


def sidecar(dest: Path) -> Path:
    return dest.with_name(dest.name + ".sha256")


def _part(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def _cached(dest: Path, url: str, sha256: str | None) -> bool:
    """A finished download of this URL: checked against the pin, or against its own sidecar."""
    if not dest.is_file():
        return False
    if sha256 is not None:
        ok = sha256_file(dest) == sha256.lower()
        if not ok:
            log.warning("cached %s does not match the pinned sha256; downloading again", dest)
        return ok
    side = sidecar(dest)
    if not side.is_file():
        return False  # a download interrupted between rename and sidecar, or a stray file
    lines = side.read_text(encoding="utf-8").splitlines()
    recorded = lines[0].split()[0] if lines and lines[0].split() else ""
    # Two URLs can share a file name; the sidecar remembers which one this file came from.
    source = next((ln[len("# source: ") :] for ln in lines if ln.startswith("# source: ")), None)
    return source == url and recorded == sha256_file(dest)


def download_url(url: str, dest: str | os.PathLike, *, sha256: str | None = None, timeout: float = 30.0) -> Path:
    """One download attempt into `dest.part`, resuming it when it exists; `Steps` retries.

    Transient failures (connection, timeout, 5xx, short body) raise non-`BadInput` errors and
    keep the `.part` for the next attempt; a checksum mismatch deletes it and raises `BadInput`.
    """
    dest = Path(dest)
    part = _part(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    offset = part.stat().st_size if part.exists() else 0
    resp, offset = _request(url, part, offset, timeout)
    with resp:
        mode = "ab" if offset else "wb"
        length = resp.headers.get("Content-Length")
        length = int(length) if length and length.isdigit() else None
        received = 0
        with (
            open(part, mode) as f,
            tqdm(
                total=offset + length if length is not None else None,
                initial=offset,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=dest.name,
                disable=None,
                leave=False,
            ) as bar,
        ):
            while chunk := resp.read(_CHUNK):
                f.write(chunk)
                received += len(chunk)
                bar.update(len(chunk))
    if length is not None and received < length:
        raise ConnectionError(f"connection closed after {offset + received} of {offset + length} bytes")

    digest = sha256_file(part)
    if sha256 is not None and digest != sha256.lower():
        part.unlink(missing_ok=True)
        raise BadInput(f"checksum mismatch for {url}: expected {sha256.lower()}, got {digest}")
    side = sidecar(dest)
    side.unlink(missing_ok=True)  # never let an old sidecar vouch for the new file
    os.replace(part, dest)
    with atomic_file(side, "w", encoding="utf-8") as f:
        f.write(f"{digest}  {dest.name}\n# source: {url}\n")
    log.info("downloaded %s -> %s (sha256 %s)", url, dest, digest)
    return dest


def _request(url: str, part: Path, offset: int, timeout: float) -> tuple[http.client.HTTPResponse, int]:
    """Open `url` from byte `offset` (0: the whole file); returns the response and the offset it honours."""
    req = urllib.request.Request(url, headers={"User-Agent": f"gptforge/{gptforge.__version__}"})
    if offset:
        req.add_header("Range", f"bytes={offset}-")
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        e.close()
        if e.code == 416 and offset:
            # The server will not serve from our offset: the .part is stale or already too long.
            log.warning("%s: server refused to resume at byte %d; starting over", url, offset)
            part.unlink(missing_ok=True)
            return _request(url, part, 0, timeout)
        if 400 <= e.code < 500 and e.code not in (408, 429):
            raise HTTPClientError(url, e.code, str(e.reason)) from None
        raise
    if resp.status != 206:
        return resp, 0  # a server that ignores Range sends the whole file again
    if not offset or _range_start(resp.headers.get("Content-Range")) != offset:
        resp.close()
        part.unlink(missing_ok=True)
        raise ConnectionError(f"server answered with an unexpected range ({resp.headers.get('Content-Range')})")
    return resp, offset


def _range_start(content_range: str | None) -> int | None:
    m = re.match(r"bytes (\d+)-", content_range or "")
    return int(m.group(1)) if m else None


def _reason(e: BaseException, timeout: float) -> str:
    if isinstance(e, HTTPClientError):
        text = e.reason
    elif isinstance(e, urllib.error.HTTPError):
        text = f"HTTP {e.code} {e.reason}"
    elif isinstance(e, urllib.error.URLError):
        r = e.reason
        text = f"timed out after {timeout:g}s" if isinstance(r, TimeoutError) else str(r)
    elif isinstance(e, TimeoutError):
        text = f"timed out after {timeout:g}s"
    else:
        text = f"{type(e).__name__}: {e}"
    return one_line(text)


def one_line(text: Any, limit: int = 200) -> str:
    """First line of a message, shortened: user-facing errors are one line."""
    lines = str(text).strip().splitlines()
    first = " ".join(lines[0].split()) if lines else ""
    return first if len(first) <= limit else first[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Archives


def safe_extract_zip(zip_path: str | os.PathLike, dest_dir: str | os.PathLike) -> list[Path]:
    """Extract every file of a zip into `dest_dir` (replaced as a whole), refusing unsafe members.

    A member that is absolute, climbs with `..`, names a drive or is a symlink could write
    outside `dest_dir` (zip-slip): the whole archive is refused before anything is written.
    """
    zip_path, dest_dir = Path(zip_path), Path(dest_dir)
    try:
        zf = zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise BadInput(f"{zip_path}: not a valid zip archive ({one_line(e)})") from None
    with zf:
        members = zf.infolist()
        for info in members:
            problem = _unsafe_member(info)
            if problem:
                raise BadInput(f"{zip_path}: refusing unsafe member {info.filename!r} ({problem})")
        try:
            with atomic_dir(dest_dir) as tmp:
                for info in members:
                    zf.extract(info, tmp)
        except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as e:
            raise BadInput(f"{zip_path}: not a valid zip archive ({one_line(e)})") from None
    return [dest_dir / info.filename for info in members if not info.is_dir()]


def _unsafe_member(info: zipfile.ZipInfo) -> str | None:
    name = info.filename.replace("\\", "/")
    if not name.strip("/"):
        return "empty name"
    if name.startswith("/"):
        return "absolute path"
    if re.match(r"^[A-Za-z]:", name):
        return "drive letter"
    if ".." in name.split("/"):
        return "'..' in path"
    if stat.S_ISLNK(info.external_attr >> 16):
        return "symlink"
    return None


# ---------------------------------------------------------------------------------------------
# Record files


def read_records(path: str | os.PathLike, *, param: str) -> list[Any]:
    """Records from `.json` (a list), `.jsonl`, `.csv` (header row) or `.parquet`; the first
    three also gzip-compressed (`.jsonl.gz`).

    The container is checked here; the fields of each record are the caller's to validate (a
    stage counts bad records rather than failing on the first), so items come back as parsed.
    """
    path = Path(path)
    where = f"{param} {path}"
    if not path.is_file():
        raise BadInput(f"{where}: not a file")
    suffix = data_suffix(path)
    if is_gzip(path) and suffix == ".parquet":
        raise BadInput(f"{where}: parquet is compressed already; give the .parquet file itself")
    try:
        if suffix == ".json":
            return _read_json(path, where)
        if suffix == ".jsonl":
            return _read_jsonl(path, where)
        if suffix == ".csv":
            return _read_csv(path, where)
        if suffix == ".parquet":
            return _read_parquet(path, where)
    except UnicodeDecodeError as e:
        raise BadInput(f"{where}: not UTF-8 text ({one_line(e)})") from None
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise BadInput(f"{where}: cannot read it ({one_line(e)})") from None
    raise BadInput(
        f"{where}: unsupported file type {suffix or '(none)'!r}; expected .json, .jsonl, .csv or "
        ".parquet (the first three may be .gz)"
    )


def _read_json(path: Path, where: str) -> list[Any]:
    try:
        with open_data(path, "r", encoding="utf-8-sig") as f:
            data = json.loads(f.read())
    except json.JSONDecodeError as e:
        raise BadInput(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(data, list):
        raise BadInput(f"{where}: expected a JSON list of records, got {type(data).__name__}")
    return data


def _read_jsonl(path: Path, where: str) -> list[Any]:
    records = []
    with open_data(path, "r", encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise BadInput(f"{where}: line {lineno} is not valid JSON ({e.msg} at column {e.colno})") from None
    return records


def _read_csv(path: Path, where: str) -> list[Any]:
    with open_data(path, "r", encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        try:
            return [dict(row) for row in reader]
        except csv.Error as e:
            raise BadInput(f"{where}: bad CSV at line {reader.line_num} ({one_line(e)})") from None


def _read_parquet(path: Path, where: str) -> list[Any]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a bad file
        raise BadInput(f"{where}: not a readable parquet file ({one_line(e)})") from None


def load_hf(source: str, *, name: str | None = None, split: str = "train", streaming: bool = False, param: str):
    """A Hugging Face hub dataset split (`hf://OWNER/NAME`), through `datasets.load_dataset`."""
    repo = source[len("hf://") :] if is_hf(source) else source
    try:
        import datasets  # heavy import: only the stages that read the hub pay for it

        return datasets.load_dataset(repo, name, split=split, streaming=streaming)
    except Exception as e:  # offline, unknown repo, bad config name or split: all end here
        what = f"{source}" + (f" (name={name}, split={split})" if name else f" (split={split})")
        reason = one_line(e) or type(e).__name__
        raise SourceUnreachable(f"cannot load {what}: {reason}; set {param} to a local copy") from None


def load_hf_records(source: str, *, split: str, param: str) -> list[Any]:
    """Every row of a hub dataset split as a plain dict."""
    return [dict(r) for r in load_hf(source, split=split, param=param)]


def source_records(
    source: str,
    *,
    param: str,
    split: str,
    sha256: str | None,
    download: DownloadConfig,
    steps: Steps = DIRECT,
    raw_dir: str | os.PathLike = "data/raw",
) -> list[Any]:
    """The records of a record-file source (the instruct and preference data stages): a hub
    dataset's `split`, or a downloaded or local .json / .jsonl / .csv / .parquet file (a folder
    is refused in one line naming `param`). Each part runs as a step (a Prefect task)."""
    if is_hf(source):
        return steps(load_hf_records, source, split=split, param=param)
    path = materialize(source, param=param, sha256=sha256, download=download, steps=steps, raw_dir=raw_dir)
    if path.is_dir():
        raise BadInput(f"{param}: {path} is a folder; expected a .json, .jsonl, .csv or .parquet file")
    return steps(read_records, path, param=param)


# ---------------------------------------------------------------------------------------------
# Splits


def split_counts(n: int, fractions: Sequence[float]) -> tuple[int, int, int]:
    """train = int(n*f0), val = int(n*f1), test = the rest, so the three always sum to n."""
    # The epsilon keeps 100 * 0.29 = 28.999999999999996 from losing an example to rounding.
    train = int(n * fractions[0] + 1e-9)
    val = min(int(n * fractions[1] + 1e-9), n - train)
    return train, val, n - train - val


def shuffle_split(items: Sequence[Any], fractions: Sequence[float], seed: int) -> dict[str, list[Any]]:
    """Seeded shuffle, then contiguous train/val/test slices sized by `split_counts`."""
    items = list(items)
    random.Random(seed).shuffle(items)
    train, val, _ = split_counts(len(items), fractions)
    return {"train": items[:train], "val": items[train : train + val], "test": items[train + val :]}


def write_splits(splits: dict[str, list[dict]], out_dir: str | os.PathLike) -> dict[str, int]:
    """`out_dir/{train,val,test}.jsonl`, replacing the folder as a whole: no mix of two runs."""
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        for name in SPLITS:
            with open(tmp / f"{name}.jsonl", "w", encoding="utf-8") as f:
                for record in splits.get(name, []):
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return {name: len(splits.get(name, [])) for name in SPLITS}
