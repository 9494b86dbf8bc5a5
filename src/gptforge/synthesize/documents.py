"""A user's documents read as text: a folder of Markdown, plain-text and PDF files, or one file.

`read_documents(path, param=...)` returns one `Document` per file that has text, in a stable
order (sorted by posix path relative to the folder). Markdown (`.md`, `.markdown`) and text
(`.txt`) files must be UTF-8; a PDF is read with pypdf, its pages' texts joined by a blank line.
Line endings become "\\n" and nothing else is changed, so that character offsets into
`Document.text` (the chunks' spans) are the same on every platform.

In a folder, hidden files and folders are skipped, and so are files of other types (images
beside Markdown are normal): one warning counts them. A document without text (an empty file,
a scanned PDF without a text layer) is skipped with a warning. Everything the user must fix is
a one-line `BadInput` that starts with `param`, the name of the setting that gave `path`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from gptforge.errors import BadInput

log = logging.getLogger("gptforge")

KINDS = {".md": "markdown", ".markdown": "markdown", ".txt": "text", ".pdf": "pdf"}
SUFFIXES = ", ".join(KINDS)


@dataclass(frozen=True)
class Document:
    source: str  # posix path relative to the folder given (the file's name when one file was given)
    text: str
    kind: str  # "markdown" | "text" | "pdf"


def read_documents(path: str | os.PathLike, *, param: str) -> list[Document]:
    """The documents in folder `path` (recursively) or the one file `path`; see the module doc."""
    root = Path(path)
    if not root.exists():
        raise BadInput(f"{param}: {path} not found")
    if root.is_dir():
        files, others = _list_folder(root)
        if others:
            names = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            log.warning(
                "%s: skipped %d file%s in %s that %s not %s: %s",
                param,
                len(others),
                "s" if len(others) != 1 else "",
                path,
                "are" if len(others) != 1 else "is",
                SUFFIXES,
                names,
            )
        if not files:
            raise BadInput(f"{param}: no document in {path} (looked for {SUFFIXES} files, hidden ones aside)")
    else:
        suffix = root.suffix.lower()
        if suffix not in KINDS:
            raise BadInput(f"{param}: cannot read {root.name}: {suffix or '(no suffix)'} is not one of {SUFFIXES}")
        files = [(root.name, root)]

    docs, empty = [], []
    for source, file in files:
        kind = KINDS[file.suffix.lower()]
        text = _read_pdf(file, param) if kind == "pdf" else _read_text(file, param)
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        if not text.strip():
            empty.append((source, kind))
            continue
        docs.append(Document(source=source, text=text, kind=kind))

    if empty:
        why = _why_empty(empty)
        if not docs:
            where = f"in {path} " if root.is_dir() else ""
            raise BadInput(f"{param}: no document {where}has text: {why}")
        log.warning(
            "%s: skipped %d document%s without text: %s", param, len(empty), "s" if len(empty) != 1 else "", why
        )
    return docs


def _list_folder(root: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    """(source, file) for the readable files under `root`, sorted by source; and the sources of
    the files of other types. Hidden files and anything under a hidden folder are left out."""
    files, others = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                continue
            file = Path(dirpath, name)
            if not file.is_file():
                continue
            source = file.relative_to(root).as_posix()
            if file.suffix.lower() in KINDS:
                files.append((source, file))
            else:
                others.append(source)
    files.sort(key=lambda item: item[0])
    others.sort()
    return files, others


def _read_text(file: Path, param: str) -> str:
    try:
        data = file.read_bytes()
    except OSError as e:
        raise BadInput(f"{param}: cannot read {file}: {e.strerror or type(e).__name__}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadInput(
            f"{param}: cannot read {file}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
            f"{e.start}); save it as UTF-8"
        ) from None


def _read_pdf(file: Path, param: str) -> str:
    import pypdf

    try:
        reader = pypdf.PdfReader(file)
        if reader.is_encrypted and not reader.decrypt(""):
            raise BadInput(f"{param}: cannot read {file}: the PDF is encrypted with a password")
        pages = [page.extract_text() or "" for page in reader.pages]
    except BadInput:
        raise
    except OSError as e:
        raise BadInput(f"{param}: cannot read {file}: {e.strerror or type(e).__name__}") from None
    except Exception as e:  # pypdf raises PdfReadError, but also ValueError, KeyError, ... on broken files
        reason = " ".join(str(e).split())[:120] or type(e).__name__
        raise BadInput(f"{param}: cannot read {file}: not a readable PDF ({reason})") from None
    return "\n\n".join(pages)


def _why_empty(empty: list[tuple[str, str]]) -> str:
    """`a.pdf (no text layer: OCR it first), b.md (empty)`, at most 3 named."""
    parts = [f"{s} ({'no text layer: OCR it first' if k == 'pdf' else 'empty'})" for s, k in empty[:3]]
    more = f" and {len(empty) - 3} more" if len(empty) > 3 else ""
    return ", ".join(parts) + more
