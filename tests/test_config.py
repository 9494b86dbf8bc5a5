"""Config: params.yaml matches the schema, bad input fails with one-line messages, -S overrides."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from gptforge.config.load import apply_overrides, dump_yaml, load_config, parse_override, read_params, validate
from gptforge.config.schema import Config, flatten
from gptforge.errors import BadInput

REPO = Path(__file__).resolve().parents[1]


def bad(tree=None, *, overrides=(), params=None) -> str:
    """The BadInput message for an invalid tree, params file or overrides; fails if none is raised."""
    with pytest.raises(BadInput) as info:
        if tree is not None:
            validate(tree)
        else:
            load_config(params, list(overrides))
    msg = str(info.value)
    assert "\n" not in msg and "\r" not in msg, msg
    return msg


def write(tmp_path: Path, text: str, name: str = "params.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# The repo's params.yaml


def test_schema_defaults_are_the_cpu_hub_config():
    # params.yaml is the offline quickstart (tests/test_quickstart.py); the schema's built-in
    # defaults are the CPU-sized run on the real sources, shipped as configs/cpu-hub.yaml.
    from_file = load_config(REPO / "configs" / "cpu-hub.yaml")
    defaults = load_config(None)
    assert from_file == defaults
    # Both files name every key the schema has (nothing left implicit in code only); a name table
    # (base.models, instruct_variants.models, ...) counts as one key, whatever its entries.
    for name in ("params.yaml", "configs/cpu-hub.yaml"):
        assert schema_keys(flatten(read_params(REPO / name))) == schema_keys(defaults.flat()), name


def schema_keys(flat: dict) -> set[str]:
    """The dotted keys cut where the path leaves the schema's sections (at a name table)."""
    from gptforge.config.load import _is_section

    keys = set()
    for key in flat:
        parts = key.split(".")
        depth = 1
        while depth < len(parts) and _is_section(tuple(parts[:depth])):
            depth += 1
        keys.add(".".join(parts[:depth]))
    return keys


def test_defaults_are_a_config_with_the_documented_keys():
    cfg = load_config(None)
    assert isinstance(cfg, Config)
    flat = cfg.flat()
    for key in (
        "tokenizer.path",
        "data.pretrain.source",
        "data.pretrain.name",
        "data.pretrain.max_tokens",
        "data.pretrain.shard_tokens",
        "data.pretrain.val_tokens",
        "data.classify.source",
        "data.classify.splits",
        "data.classify.max_bad_fraction",
        "data.instruct.source",
        "data.instruct.splits",
        "tracking.enabled",
        "tracking.experiment",
    ):
        assert key in flat, key


# ---------------------------------------------------------------------------------------------
# Unknown keys and wrong types


@pytest.mark.parametrize(
    "tree, key, suggestion",
    [
        ({"data": {"pretrain": {"max_tokns": 5}}}, "data.pretrain.max_tokns", "data.pretrain.max_tokens"),
        ({"trackng": {"enabled": False}}, "trackng", "tracking"),
        ({"data": {"classfy": {}}}, "data.classfy", "data.classify"),
        ({"tracking": {"experimnt": "x"}}, "tracking.experimnt", "tracking.experiment"),
        ({"data": {"download": {"retrys": 1}}}, "data.download.retrys", "data.download.retries"),
    ],
)
def test_unknown_key_names_path_and_closest_key(tree, key, suggestion):
    msg = bad(tree)
    assert f"unknown key '{key}'" in msg
    assert f"did you mean '{suggestion}'" in msg


def test_unknown_key_without_close_match_lists_valid_keys():
    msg = bad({"data": {"zzzzqqq": 1}})
    assert "unknown key 'data.zzzzqqq'" in msg
    assert "valid keys: download, pretrain, classify, instruct" in msg
    msg = bad({"qwxz": 1})
    assert (
        "valid keys: tokenizer, data, model, pretrain, classify, instruct, preference, reward, rl, evaluate, "
        "benchmark, base, synthesize, index, evaluate_qa, instruct_variants, tracking, registry, distributed" in msg
    )


def test_unknown_key_with_newline_stays_one_line():
    msg = bad({"data": {"a\nb": 1}})
    assert "a\\nb" in msg


@pytest.mark.parametrize(
    "tree, parts",
    [
        ({"data": {"pretrain": {"max_tokens": "abc"}}}, ["data.pretrain.max_tokens", "'abc'", "int"]),
        ({"tracking": {"enabled": [1]}}, ["tracking.enabled", "[1]", "bool"]),
        ({"data": {"classify": {"splits": 5}}}, ["data.classify.splits", "5", "list"]),
        ({"data": {"download": {"timeout": "soon"}}}, ["data.download.timeout", "'soon'", "float"]),
        ({"tokenizer": {"path": 3.5}}, ["tokenizer.path", "3.5", "str or null"]),
        ({"data": {"pretrain": 3}}, ["data.pretrain", "3", "section"]),
    ],
)
def test_wrong_type_names_key_value_and_expected_type(tree, parts):
    msg = bad(tree)
    for part in parts:
        assert part in msg, (part, msg)


def test_range_checks():
    assert "data.pretrain.max_tokens" in bad({"data": {"pretrain": {"max_tokens": 0}}})
    assert "data.classify.max_bad_fraction" in bad({"data": {"classify": {"max_bad_fraction": 1.5}}})
    assert "data.download.retries" in bad({"data": {"download": {"retries": -1}}})


def test_several_errors_report_the_first_and_a_count():
    msg = bad({"data": {"pretrain": {"max_tokens": "x", "val_tokens": "y"}}})
    assert "(+1 more)" in msg


# ---------------------------------------------------------------------------------------------
# -S overrides


@pytest.mark.parametrize(
    "text, key, value",
    [
        ("data.pretrain.max_tokens=1000", "data.pretrain.max_tokens", 1000),
        ("pretrain.lr=1.0e-3", "pretrain.lr", 1.0e-3),
        ("data.classify.splits=[0.8,0.1,0.1]", "data.classify.splits", [0.8, 0.1, 0.1]),
        ("tokenizer.path=null", "tokenizer.path", None),
        ("tokenizer.path=", "tokenizer.path", None),
        ("tracking.enabled=false", "tracking.enabled", False),
        ("tracking.experiment=a=b", "tracking.experiment", "a=b"),
        (" data.pretrain.name = sample-100BT", "data.pretrain.name", "sample-100BT"),
    ],
)
def test_parse_override_reads_yaml_values(text, key, value):
    assert parse_override(text) == (key, value)


@pytest.mark.parametrize("text", ["foo", "=3", "a..b=1", ".a=1", "a.=1"])
def test_parse_override_rejects_malformed(text):
    with pytest.raises(BadInput) as info:
        parse_override(text)
    assert "\n" not in str(info.value)
    assert "KEY=VALUE" in str(info.value)


def test_parse_override_rejects_invalid_yaml():
    with pytest.raises(BadInput) as info:
        parse_override("data.classify.splits=[0.8, 0.1")
    assert "data.classify.splits" in str(info.value) and "\n" not in str(info.value)


def test_overrides_land_in_the_config():
    cfg = load_config(
        None,
        [
            "data.pretrain.max_tokens=1000",
            "data.classify.splits=[0.8,0.1,0.1]",
            "data.download.backoff=1.0e-3",
            "tokenizer.path=null",
            "data.pretrain.name=null",
            "tracking.enabled=false",
        ],
    )
    assert cfg.data.pretrain.max_tokens == 1000
    assert cfg.data.classify.splits == [0.8, 0.1, 0.1]
    assert cfg.data.download.backoff == pytest.approx(1e-3)
    assert cfg.tokenizer.path is None
    assert cfg.data.pretrain.name is None
    assert cfg.tracking.enabled is False
    # The rest keeps its defaults.
    assert cfg.data.pretrain.shard_tokens == load_config(None).data.pretrain.shard_tokens


def test_overrides_win_over_the_file(tmp_path):
    params = write(tmp_path, "data:\n  pretrain:\n    max_tokens: 50\n    val_tokens: 7\n")
    cfg = load_config(params, ["data.pretrain.max_tokens=60"])
    assert cfg.data.pretrain.max_tokens == 60
    assert cfg.data.pretrain.val_tokens == 7
    assert load_config(params).data.pretrain.max_tokens == 50


def test_later_override_wins():
    cfg = load_config(None, ["data.pretrain.max_tokens=5", "data.pretrain.max_tokens=6"])
    assert cfg.data.pretrain.max_tokens == 6


def test_override_creating_unknown_keys_is_rejected_as_unknown():
    msg = bad(overrides=["data.foo.bar=1"])
    assert "unknown key 'data.foo'" in msg
    msg = bad(overrides=["data.pretrain.max_tokns=1"])
    assert "did you mean 'data.pretrain.max_tokens'" in msg
    assert "-S" in msg  # the origin says the overrides were involved


def test_override_replacing_a_section_with_a_value_is_rejected():
    msg = bad(overrides=["data.pretrain=3"])
    assert "data.pretrain" in msg and "section" in msg


def test_override_of_a_value_child_is_rejected(tmp_path):
    bad(overrides=["data.pretrain.max_tokens.x=1"])
    # With the value present in the file, the override itself is refused.
    params = write(tmp_path, "data:\n  pretrain:\n    max_tokens: 50\n")
    msg = bad(params=params, overrides=["data.pretrain.max_tokens.x=1"])
    assert "data.pretrain.max_tokens is a value, not a section" in msg


def test_override_without_equals_is_bad_input():
    msg = bad(overrides=["foo"])
    assert "'foo'" in msg


def test_apply_overrides_does_not_mutate_its_input():
    tree = {"data": {"pretrain": {"max_tokens": 5}}}
    out = apply_overrides(tree, ["data.pretrain.max_tokens=9", "tracking.enabled=false"])
    assert tree == {"data": {"pretrain": {"max_tokens": 5}}}
    assert out == {"data": {"pretrain": {"max_tokens": 9}}, "tracking": {"enabled": False}}


# ---------------------------------------------------------------------------------------------
# Splits and sources


@pytest.mark.parametrize(
    "splits, words",
    [
        ([0.5, 0.1, 0.1], "sum to 1"),
        ([1.2, -0.1, -0.1], ">= 0"),
        ([0.9, 0.1], "3 fractions"),
        ([0.5, 0.25, 0.125, 0.125], "3 fractions"),
        ([0.0, 0.5, 0.5], "train fraction"),
        ([math.nan, 0.5, 0.5], "sum to 1"),
    ],
)
@pytest.mark.parametrize("section", ["classify", "instruct"])
def test_bad_splits(section, splits, words):
    msg = bad({"data": {section: {"splits": splits}}})
    assert f"data.{section}.splits" in msg
    assert words in msg


def test_good_splits():
    cfg = validate({"data": {"classify": {"splits": [1, 0, 0]}, "instruct": {"splits": [0.6, 0.3, 0.1]}}})
    assert cfg.data.classify.splits == [1.0, 0.0, 0.0]
    assert cfg.data.instruct.splits == [0.6, 0.3, 0.1]


@pytest.mark.parametrize(
    "source",
    ["http://example.com/x.zip", "ftp://example.com/x.zip", "hf://onlyowner", "hf://a/b/c", "hf:///b", "", "  "],
)
@pytest.mark.parametrize("section", ["pretrain", "classify", "instruct"])
def test_bad_sources(section, source):
    msg = bad({"data": {section: {"source": source}}})
    assert f"data.{section}.source" in msg


@pytest.mark.parametrize(
    "source", ["hf://a/b", "https://example.com/x.zip", "data/local.txt", "/abs/folder", "HTTPS://EXAMPLE.COM/x"]
)
def test_good_sources(source):
    cfg = validate({"data": {"pretrain": {"source": source}, "classify": {"source": source}}})
    assert cfg.data.pretrain.source == source
    assert cfg.data.classify.source == source


# ---------------------------------------------------------------------------------------------
# The params file


def test_missing_params_file(tmp_path):
    msg = bad(params=tmp_path / "nope.yaml")
    assert "nope.yaml" in msg and "not found" in msg


def test_params_folder_is_not_a_file(tmp_path):
    assert str(tmp_path) in bad(params=tmp_path)


def test_invalid_yaml(tmp_path):
    params = write(tmp_path, "data:\n  pretrain: [1,\n    max_tokens: 3\n", "broken.yaml")
    msg = bad(params=params)
    assert "broken.yaml" in msg and "not valid YAML" in msg


def test_top_level_list(tmp_path):
    params = write(tmp_path, "- a\n- b\n", "list.yaml")
    msg = bad(params=params)
    assert "list.yaml" in msg and "list" in msg


def test_errors_in_the_file_name_it(tmp_path):
    params = write(tmp_path, "trackng: {}\n", "mine.yaml")
    msg = bad(params=params)
    assert "mine.yaml" in msg and "trackng" in msg


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"])
def test_empty_file_gives_defaults(tmp_path, text):
    assert load_config(write(tmp_path, text)) == load_config(None)


def test_partial_file_keeps_other_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "tracking:\n  experiment: mine\n"))
    assert cfg.tracking.experiment == "mine"
    assert cfg.tracking.enabled is True
    assert cfg.data == load_config(None).data


# ---------------------------------------------------------------------------------------------
# Views and round trips


def test_flat_restricted_to_a_section():
    cfg = load_config(None, ["data.pretrain.max_tokens=123"])
    flat = cfg.flat("data.pretrain")
    assert flat["data.pretrain.max_tokens"] == 123
    assert flat["data.pretrain.source"] == cfg.data.pretrain.source
    assert all(k.startswith("data.pretrain.") for k in flat)
    both = cfg.flat("data.pretrain", "tracking")
    assert both["tracking.experiment"] == "gptforge"
    assert set(both) == set(flat) | {"tracking.enabled", "tracking.experiment"}


def test_flat_of_everything_keeps_lists_as_values():
    flat = load_config(None).flat()
    assert flat["data.classify.splits"] == [0.7, 0.1, 0.2]
    assert flat["tokenizer.path"] is None
    assert not any(isinstance(v, dict) and v for v in flat.values())  # only an empty mapping (base.models) stays one


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}, "f": None}) == {
        "a.b": 1,
        "a.c.d": [1, 2],
        "e": {},
        "f": None,
    }


def test_dump_yaml_round_trips(tmp_path):
    cfg = load_config(
        None,
        ["data.pretrain.max_tokens=77", "tokenizer.path=tok/gpt2", "data.classify.splits=[0.8,0.1,0.1]"],
    )
    text = dump_yaml(cfg)
    assert validate(yaml.safe_load(text)) == cfg
    assert load_config(write(tmp_path, text)) == cfg
    assert validate(yaml.safe_load(dump_yaml(load_config(None)))) == load_config(None)


# ---------------------------------------------------------------------------------------------
# Properties


def _schema_paths(model: type[BaseModel] = Config, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every section and field path of the schema: ('data',), ('data', 'pretrain', 'max_tokens'), ..."""
    out = []
    for name, field in model.model_fields.items():
        path = prefix + (name,)
        out.append(path)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(_schema_paths(ann, path))
    return out


SCHEMA_PATHS = _schema_paths()
SCHEMA_NAMES = sorted({p[-1] for p in SCHEMA_PATHS})

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**20), max_value=10**20)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["hf://a/b", "https://x/y", "http://x", "ftp://x", "hf://x", "1e3", "true", "null", "3"])
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(SCHEMA_NAMES) | st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
extra_keys = (
    st.text(max_size=8)
    | st.sampled_from(SCHEMA_NAMES)
    | st.sampled_from(["a\nb", "x\r", "\u2028", "tab\t"])  # keys that could break a one-line message
    | st.integers()
    | st.none()
    | st.booleans()
)


def _set(tree: dict, path: tuple, value) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value


@st.composite
def trees(draw):
    tree: dict = {}
    for path in draw(st.lists(st.sampled_from(SCHEMA_PATHS), max_size=8)):
        _set(tree, path, draw(values))
    for path in draw(st.lists(st.sampled_from(SCHEMA_PATHS), max_size=2)):
        _set(tree, path + (draw(extra_keys),), draw(values))
    for key in draw(st.lists(extra_keys, max_size=2)):
        tree[key] = draw(values)
    return tree


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees())
def test_validate_returns_a_config_or_one_line_bad_input(tree):
    try:
        cfg = validate(tree)
    except BadInput as e:
        msg = str(e)
        assert msg and msg.splitlines() == [msg], msg
    else:
        assert isinstance(cfg, Config)
        assert validate(yaml.safe_load(dump_yaml(cfg))) == cfg


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["max_tokens", "shard_tokens"]),
    st.integers(min_value=1, max_value=10**15),
)
def test_valid_int_overrides_land_in_the_config(field, n):
    cfg = load_config(None, [f"data.pretrain.{field}={n}"])
    assert getattr(cfg.data.pretrain, field) == n
    assert cfg.flat("data.pretrain")[f"data.pretrain.{field}"] == n


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=30))
def test_any_override_text_gives_config_or_one_line_bad_input(text):
    try:
        load_config(None, [text])
    except BadInput as e:
        assert str(e).splitlines() == [str(e)]


@pytest.mark.parametrize("param", ["base.models", "synthesize.documents"])
def test_foreach_entry_names_cannot_hold_a_dot(param):
    """DVC reads the param `base.models.qwen2.5-0.5b` as nested keys and fails the stage
    ("Parameters ... are missing"): such a name is refused when the config loads."""
    extra = ["synthesize.endpoint.url=http://127.0.0.1:9/v1", "synthesize.endpoint.model=m"]
    msg = bad(overrides=[f"{param}={{qwen2.5-0.5b: somewhere}}", *extra])
    assert "name 'qwen2.5-0.5b' must be letters, digits, '_' or '-'" in msg and f"{param}.qwen2.5-0.5b" in msg
    ok = load_config(None, [f"{param}={{qwen2_5-0_5b: somewhere}}", *extra])
    assert ok.flat()[f"{param}.qwen2_5-0_5b"] == "somewhere"
