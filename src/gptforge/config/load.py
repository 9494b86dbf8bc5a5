"""Loading the configuration: `params.yaml` plus `-S key=value` overrides, validated against the
schema (`gptforge.config.schema`) before any work starts.

A params file may be an overlay: a top-level `extends: FILE` (a path relative to the file that
names it) reads FILE first, itself possibly an overlay, and merges the file's own keys over it.
Sections (the schema's nested models: `pretrain`, `data.pretrain`, ...) merge key by key; every
other value replaces the base's whole: scalars, lists, and the tables of names (`base.models`,
`evaluate.models`, `synthesize.documents`, `rl.rewards`, `registry.*`), so an overlay states a
table entire and an entry it leaves out is gone. `null` is an ordinary value (many keys mean
something by it: `tokenizer.path: null` is tiktoken's encoding), never a deletion. The `-S`
overrides apply to the merged tree, then it is validated.

Unknown keys are named with their dotted path and the closest valid key; wrong types with the
key, the value and the expected type. Every error is one `BadInput` line: so is an `extends`
that names no file, a base that is not a mapping, and a chain of bases that comes back to itself.
"""

from __future__ import annotations

import copy
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ValidationError

from gptforge.config.schema import Config
from gptforge.errors import BadInput

DEFAULT_PARAMS = "params.yaml"
EXTENDS = "extends"  # the top-level key naming the file an overlay merges over


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=VALUE` with VALUE parsed as YAML (`-S data.classify.splits=[0.8,0.1,0.1]`)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise BadInput(f"override {text!r} is not KEY=VALUE with a dotted KEY (e.g. -S data.pretrain.max_tokens=1000)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise BadInput(f"override {_printable(key)}: value {raw!r} is not valid YAML ({_one_line(e)})") from None
    return key, value


def apply_overrides(tree: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    tree = copy.deepcopy(tree)
    for text in overrides:
        key, value = parse_override(text)
        node = tree
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                section = _printable(".".join(parts[: i + 1]))
                raise BadInput(f"override {_printable(key)}: {section} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return tree


def read_yaml(path: str | os.PathLike) -> dict:
    """One params file's own tree, as written (an overlay's `extends` key included)."""
    path = Path(path)
    if path.is_dir():
        raise BadInput(f"params file {path} is a folder, not a YAML file")
    if not path.is_file():
        raise BadInput(f"params file not found: {path}")
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: not valid YAML ({_one_line(e)})") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise BadInput(f"{path}: expected a mapping of sections at the top level, got {type(tree).__name__}")
    return tree


def read_params(path: str | os.PathLike) -> dict:
    """The params tree of `path`: its own keys merged over the chain of files it `extends`."""
    chain = _chain(Path(path))
    tree = chain[-1][1]
    for _, overlay in reversed(chain[:-1]):
        tree = merge(tree, {k: v for k, v in overlay.items() if k != EXTENDS})
    return tree


def bases(path: str | os.PathLike) -> list[Path]:
    """The files `path` extends, nearest first (none for a complete file)."""
    return [p for p, _ in _chain(Path(path))[1:]]


def _chain(path: Path) -> list[tuple[Path, dict]]:
    """`path` and its own tree, then each file it extends with its tree, nearest first."""
    chain = [(path, read_yaml(path))]
    while (base := _base_of(*chain[-1], [p for p, _ in chain])) is not None:
        try:
            chain.append((base, read_yaml(base)))
        except BadInput as e:
            raise BadInput(f"{e} (the base {chain[-1][0]} extends)") from None
    return chain


def _base_of(path: Path, tree: dict, chain: list[Path]) -> Path | None:
    """The file `tree` (read from `path`, reached through `chain`) extends; BadInput when it
    names none that can be read, or one already in the chain."""
    if EXTENDS not in tree:
        return None
    name = tree[EXTENDS]
    if not isinstance(name, str) or not name.strip():
        raise BadInput(f"{path}: {EXTENDS} must name a params file (a path relative to this one), got {name!r}")
    base = path.parent / name
    if not base.is_file():
        what = "a folder" if base.is_dir() else "not found"
        raise BadInput(f"{path}: {EXTENDS}: {_printable(name)} is {what} ({_printable(str(base))})")
    if any(base.resolve() == p.resolve() for p in chain):
        loop = " -> ".join(str(p) for p in [*chain, base])
        raise BadInput(f"{path}: {EXTENDS} makes a cycle: {loop}")
    return base


def merge(base: dict, overlay: dict, path: tuple[str, ...] = ()) -> dict:
    """`overlay` over `base` (neither changed): a key whose value is a section in both (by the
    schema) merges key by key, any other value replaces the base's."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        here = (*path, str(key))
        if isinstance(value, dict) and isinstance(out.get(key), dict) and _is_section(here):
            out[key] = merge(out[key], value, here)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _is_section(loc: tuple[str, ...]) -> bool:
    parent = _model_at(list(loc[:-1]))
    if parent is None or loc[-1] not in parent.model_fields:
        return False
    field = _unwrap(parent.model_fields[loc[-1]].annotation)
    return isinstance(field, type) and issubclass(field, BaseModel)


def load_config(
    params: str | os.PathLike | None = DEFAULT_PARAMS, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Read `params` (None: defaults only), apply overrides, validate. Raises BadInput."""
    tree = read_params(params) if params is not None else {}
    tree = apply_overrides(tree, list(overrides))
    origin = str(params) if params is not None else "config"
    if overrides:
        origin += " with -S overrides"
    return validate(tree, origin)


def validate(tree: dict, origin: str = "config") -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        err = e.errors()[0]
        more = f" (+{e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise BadInput(f"{origin}: {_describe(err)}{more}") from None


def _describe(err: dict) -> str:
    loc = [str(p) for p in err["loc"]]
    key = _printable(".".join(loc))
    if err["type"] == "extra_forbidden":
        parent_model = _model_at(loc[:-1])
        hint = ""
        if parent_model is not None:
            valid = list(parent_model.model_fields)
            close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
            prefix = ".".join(loc[:-1] + [""])
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f" (valid keys: {', '.join(valid)})"
        return f"unknown key '{key}'{hint}"
    expected = _expected_type(loc)
    value = err.get("input")
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    got = f"{value!r} ({type(value).__name__})"
    if err["type"] == "value_error":
        return msg if not key or msg.startswith(f"{key}.") else f"{key}: {msg}"
    if expected and err["type"] != "missing":
        return f"{key}: expected {expected}, got {got}: {msg}"
    return f"{key}: {msg}"


def _model_at(loc: list[str]):
    model: Any = Config
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        model = _unwrap(model.model_fields[part].annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(annotation):
    """Optional[Model] -> Model, so nested look-ups see through optional sections."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _expected_type(loc: list[str]) -> str | None:
    parent = _model_at(loc[:-1]) if loc else None
    if parent is None or loc[-1] not in parent.model_fields:
        return None
    return _type_name(parent.model_fields[loc[-1]].annotation)


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if origin is dict:
        return "a mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a section (mapping)"
    return getattr(annotation, "__name__", str(annotation))


def _printable(text: str) -> str:
    """A user's key may hold newlines or other control characters: escape them, keep one line."""
    return text if text.isprintable() else repr(text)[1:-1]


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)
