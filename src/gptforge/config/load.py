"""Loading the configuration: `params.yaml` plus `-S key=value` overrides, validated against the
schema (`gptforge.config.schema`) before any work starts.

Unknown keys are named with their dotted path and the closest valid key; wrong types with the
key, the value and the expected type. Every error is one `BadInput` line.
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


def read_params(path: str | os.PathLike) -> dict:
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
