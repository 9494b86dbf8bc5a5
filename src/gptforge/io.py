"""Atomic writes: a reader (or a killed run) never sees a half-written file or folder. And the
one way data files are opened for reading, so that every reader takes them gzip-compressed too
(`name.jsonl.gz`: the embedded samples are stored so).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Iterator


def umask() -> int:
    """The process's umask (read from /proc where it can be: setting it to read it is not
    thread-safe)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_mode(path: str | os.PathLike, directory: bool = False) -> None:
    """Give a file (or folder) made by mkstemp (mkdtemp), which is private to its owner, the
    mode `open` (`mkdir`) would have given it: what another user or service (Ollama, a web
    server) may read is what the umask says."""
    os.chmod(path, (0o777 if directory else 0o666) & ~umask())


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """Open a temporary sibling of `path` for writing; rename it over `path` on success. The
    file ends with the mode `open` would have given it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    publish_mode(tmp)
    try:
        with os.fdopen(fd, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def entry_path(path: str | os.PathLike, name: str) -> Path:
    """One entry's file of a per-entry stage beside the whole stage's: metrics/evaluate.json ->
    metrics/evaluate/NAME.json."""
    return Path(path).with_suffix("") / f"{name}.json"


def write_json(path: str | os.PathLike, obj, indent: int = 2, default=None) -> None:
    with atomic_file(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent, sort_keys=False, default=default)
        f.write("\n")


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary sibling folder; on success it replaces `path` as a whole.

    On failure the temporary folder is removed and `path` keeps its previous contents.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    publish_mode(tmp, directory=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def is_gzip(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(".gz")


def data_suffix(path: str | os.PathLike) -> str:
    """The suffix that says the format, lower case, under a `.gz`: `a.jsonl.gz` -> `.jsonl`."""
    path = Path(path)
    return (path.with_suffix("") if is_gzip(path) else path).suffix.lower()


def open_data(path: str | os.PathLike, mode: str = "rb", **open_kwargs) -> IO:
    """`open` for reading a data file, through gzip when its name ends in `.gz`."""
    if is_gzip(path):
        return gzip.open(path, mode if "b" in mode else mode.replace("r", "rt"), **open_kwargs)
    return open(path, mode, **open_kwargs)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_json(path: str | os.PathLike, *, missing: str, invalid: str = ""):
    """The JSON in `path`, or a one-line BadInput: `missing` is appended to "PATH" when the file
    is absent, `invalid` to the parse error when it is not readable JSON."""
    from gptforge.errors import BadInput

    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{path}{missing}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"{path}: not readable JSON ({' '.join(str(e).split())}){invalid}") from None
