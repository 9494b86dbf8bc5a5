"""The quickstart's embedded samples, and the `sample://NAME` form params use to name them.

The files beside this module are small real public datasets (see NOTICE): the GPT-2 tokenizer,
FineWeb-Edu, the SMS Spam Collection, instruction and preference records, HellaSwag and MMLU.
They ship as package data, so an installed gptforge finds them wherever it runs; the config
resolves `sample://NAME` to the file's path here when params are validated. Standard library only.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

SCHEME = "sample://"
FOLDER = Path(__file__).resolve().parent


def is_sample(value: object) -> bool:
    return isinstance(value, str) and value.startswith(SCHEME)


def available() -> list[str]:
    """The names `sample://NAME` accepts (files and folders, relative to this package)."""
    names = []
    for p in sorted(FOLDER.rglob("*")):
        rel = p.relative_to(FOLDER).as_posix()
        if p.name.startswith(("_", ".")) or p.name == "NOTICE" or "__pycache__" in rel:
            continue
        names.append(rel)
    return names


def resolve(value: str) -> str:
    """`sample://NAME` -> the absolute path of the embedded file or folder NAME; other values
    are returned unchanged. Raises ValueError for a name that is not embedded."""
    if not is_sample(value):
        return value
    name = value[len(SCHEME) :]
    parts = PurePosixPath(name).parts
    path = FOLDER.joinpath(*parts) if parts else FOLDER
    if not parts or ".." in parts or name.startswith("/") or not path.exists():
        raise ValueError(f"no embedded sample {name!r}; embedded: {', '.join(available())}")
    return str(path)
