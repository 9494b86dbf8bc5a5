"""Params files as overlays: `extends: FILE` merges a file's own keys over another's, the named
configs are overlays of quickstart.yaml, and `gptforge pipeline` writes the merged whole to
params.yaml (DVC reads that file itself)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from gptforge.cli import main
from gptforge.config.load import EXTENDS, bases, load_config, merge, read_params, read_yaml, validate
from gptforge.config.schema import Config
from gptforge.errors import BadInput
from gptforge.pipeline.run import apply_params

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
OVERLAYS = sorted(p for p in (REPO / "configs").glob("*.yaml") if p != QUICKSTART)


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def one_line_error(path: Path, capsys) -> str:
    """`gptforge config show --params PATH` fails with exit code 2 and one error line."""
    assert main(["config", "show", "--params", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    [line] = captured.err.strip().splitlines()
    assert line.startswith("gptforge: error: ")
    return line[len("gptforge: error: ") :]


def keys(tree: dict, prefix: str = "") -> set[str]:
    """The dotted keys of a params tree, descending into sections only (a table of names such as
    base.models is one key)."""
    out = set()
    for key, value in tree.items():
        here = prefix + key
        out |= keys(value, here + ".") if isinstance(value, dict) and here in SECTIONS else {here}
    return out


def _sections(model: type[BaseModel] = Config, prefix: str = "") -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out |= {prefix + name} | _sections(field.annotation, f"{prefix}{name}.")
    return out


SECTIONS = _sections()


# ---------------------------------------------------------------------------------------------
# Merge rules


def test_sections_merge_key_by_key_and_values_replace():
    base = {
        "pretrain": {"max_steps": 60, "lr": 0.002, "betas": [0.9, 0.95], "hellaswag": {"source": "a", "limit": 5}},
        "tracking": {"enabled": True},
    }
    overlay = {"pretrain": {"max_steps": 10, "betas": [0.8], "hellaswag": {"limit": 7}}}
    merged = merge(base, overlay)
    assert merged == {
        "pretrain": {"max_steps": 10, "lr": 0.002, "betas": [0.8], "hellaswag": {"source": "a", "limit": 7}},
        "tracking": {"enabled": True},
    }
    # neither input changed, and the result shares nothing with them
    assert base["pretrain"]["max_steps"] == 60 and overlay == {
        "pretrain": {"max_steps": 10, "betas": [0.8], "hellaswag": {"limit": 7}}
    }
    merged["tracking"]["enabled"] = False
    assert base["tracking"]["enabled"] is True


@pytest.mark.parametrize(
    "table",
    ["base.models", "evaluate.models", "synthesize.documents", "rl.rewards", "registry.names", "registry.promote"],
)
def test_tables_of_names_replace_whole(table):
    section, key = table.split(".")
    base = {section: {key: {"a": "x", "b": "y"}}}
    merged = merge(base, {section: {key: {"c": "z"}}})
    assert merged[section][key] == {"c": "z"}
    # and an empty table empties it
    assert merge(base, {section: {key: {}}})[section][key] == {}


def test_null_is_a_value_not_a_deletion():
    base = {"tokenizer": {"path": "sample://gpt2_tokenizer"}, "evaluate": {"limit": 100}}
    merged = merge(base, {"tokenizer": {"path": None}, "evaluate": {"limit": None}})
    assert merged == {"tokenizer": {"path": None}, "evaluate": {"limit": None}}
    # a section set to null or a value replaces the base's mapping (validation then says what is wrong)
    assert merge(base, {"tokenizer": None}) == {"tokenizer": None, "evaluate": {"limit": 100}}


def test_unknown_keys_replace_and_are_named_with_their_path(tmp_path):
    write(tmp_path, "base.yaml", "pretrain: {max_steps: 60}\n")
    path = write(tmp_path, "run.yaml", "extends: base.yaml\npretrain: {max_stepz: 3}\n")
    with pytest.raises(
        BadInput,
        match=r"run.yaml: unknown key 'pretrain.max_stepz' "
        r"\(did you mean 'pretrain.max_steps'\?\)$",
    ):
        load_config(path)
    # an unknown key in the base is named too
    write(tmp_path, "base.yaml", "pretrain: {max_steps: 60}\ndata: {classfy: {seed: 1}}\n")
    with pytest.raises(BadInput, match=r"unknown key 'data.classfy' \(did you mean 'data.classify'\?\)"):
        load_config(write(tmp_path, "run.yaml", "extends: base.yaml\n"))


# ---------------------------------------------------------------------------------------------
# Files: relative paths, chains, overrides


def test_base_path_is_relative_to_the_file_not_the_working_directory(tmp_path, monkeypatch):
    write(tmp_path, "shared/base.yaml", "pretrain: {max_steps: 60, lr: 0.002}\nclassify: {epochs: 4}\n")
    overlay = write(tmp_path, "runs/deep/run.yaml", "extends: ../../shared/base.yaml\npretrain: {max_steps: 5}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(Path("..") / "runs" / "deep" / "run.yaml")
    assert (cfg.pretrain.max_steps, cfg.pretrain.lr, cfg.classify.epochs) == (5, 0.002, 4)
    assert read_params(overlay) == {"pretrain": {"max_steps": 5, "lr": 0.002}, "classify": {"epochs": 4}}
    assert EXTENDS not in read_params(overlay) and read_yaml(overlay)[EXTENDS] == "../../shared/base.yaml"


def test_nested_extends_nearest_file_wins(tmp_path):
    write(tmp_path, "a.yaml", "pretrain: {max_steps: 1, lr: 0.1, min_lr: 0.01}\nclassify: {epochs: 1}\n")
    write(tmp_path, "sub/b.yaml", "extends: ../a.yaml\npretrain: {max_steps: 2, lr: 0.2}\n")
    c = write(tmp_path, "sub/c.yaml", "extends: b.yaml\npretrain: {max_steps: 3}\n")
    assert read_params(c) == {"pretrain": {"max_steps": 3, "lr": 0.2, "min_lr": 0.01}, "classify": {"epochs": 1}}
    assert bases(c) == [tmp_path / "sub" / "b.yaml", tmp_path / "sub" / ".." / "a.yaml"]
    assert bases(tmp_path / "a.yaml") == []


def test_overrides_apply_to_the_merged_tree(tmp_path):
    write(tmp_path, "base.yaml", "pretrain: {max_steps: 60, lr: 0.002}\n")
    path = write(tmp_path, "run.yaml", "extends: base.yaml\npretrain: {max_steps: 5}\n")
    cfg = load_config(path, ["pretrain.max_steps=7"])
    assert (cfg.pretrain.max_steps, cfg.pretrain.lr) == (7, 0.002)
    with pytest.raises(BadInput, match=r"run.yaml with -S overrides: pretrain.max_steps: expected int"):
        load_config(path, ["pretrain.max_steps=many"])


def test_an_overlay_of_nothing_is_its_base(tmp_path):
    base = write(tmp_path, "base.yaml", QUICKSTART.read_text(encoding="utf-8"))
    assert load_config(write(tmp_path, "run.yaml", "extends: base.yaml\n")) == load_config(base)


# ---------------------------------------------------------------------------------------------
# Bad bases: one line, exit code 2 through the CLI


@pytest.mark.parametrize(
    "files, expected",
    [
        (
            {"a.yaml": "extends: b.yaml\n", "b.yaml": "extends: a.yaml\n"},
            r"^{d}/b.yaml: extends makes a cycle: {d}/a.yaml -> {d}/b.yaml -> {d}/a.yaml$",
        ),
        ({"a.yaml": "extends: ./a.yaml\n"}, r"^{d}/a.yaml: extends makes a cycle: {d}/a.yaml -> {d}/a.yaml$"),
        ({"a.yaml": "extends: nope.yaml\n"}, r"^{d}/a.yaml: extends: nope.yaml is not found \({d}/nope.yaml\)$"),
        ({"a.yaml": "extends: sub\n", "sub/x.yaml": ""}, r"^{d}/a.yaml: extends: sub is a folder \({d}/sub\)$"),
        (
            {"a.yaml": "extends: b.yaml\n", "b.yaml": "- 1\n- 2\n"},
            r"^{d}/b.yaml: expected a mapping of sections at the top level, got list \(the base {d}/a.yaml extends\)$",
        ),
        (
            {"a.yaml": "extends: b.yaml\n", "b.yaml": "pretrain: [\n"},
            r"^{d}/b.yaml: not valid YAML \(.*\) \(the base {d}/a.yaml extends\)$",
        ),
        (
            {"a.yaml": "extends: [b.yaml]\n"},
            r"^{d}/a.yaml: extends must name a params file \(a path relative to this one\), got \['b.yaml'\]$",
        ),
        ({"a.yaml": "extends: ''\n"}, r"^{d}/a.yaml: extends must name a params file .*, got ''$"),
        ({"a.yaml": 'extends: "x\\ny.yaml"\n'}, r"^{d}/a.yaml: extends: x\\ny.yaml is not found \(.*\)$"),
    ],
    ids=["cycle", "self", "missing", "folder", "not-a-mapping", "invalid-yaml", "not-a-string", "empty", "newline"],
)
def test_bad_base_is_one_line_and_exit_code_2(tmp_path, capsys, files, expected):
    for name, text in files.items():
        write(tmp_path, name, text)
    line = one_line_error(tmp_path / "a.yaml", capsys)
    assert re.match(expected.format(d=re.escape(str(tmp_path))), line), line
    with pytest.raises(BadInput):
        read_params(tmp_path / "a.yaml")


def test_config_show_prints_the_merged_result(tmp_path, capsys):
    write(tmp_path, "base.yaml", "pretrain: {max_steps: 60, lr: 0.002}\nbase: {models: {a: org/a, b: org/b}}\n")
    path = write(tmp_path, "run.yaml", "extends: base.yaml\npretrain: {max_steps: 5}\nbase: {models: {c: org/c}}\n")
    assert main(["config", "show", "--params", str(path), "-S", "classify.epochs=9"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert EXTENDS not in shown
    assert (shown["pretrain"]["max_steps"], shown["pretrain"]["lr"], shown["classify"]["epochs"]) == (5, 0.002, 9)
    assert shown["base"]["models"] == {"c": "org/c"}
    assert shown == load_config(path, ["classify.epochs=9"]).model_dump(mode="json")


# ---------------------------------------------------------------------------------------------
# The shipped configs


@pytest.mark.parametrize("path", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_every_named_config_is_an_overlay_of_the_quickstart(path):
    own = read_yaml(path)
    # The quickstart directly, or through one named config that does (a variant of a run that
    # changes one thing, as llama-124m-fineweb.yaml is gpt2-124m-fineweb.yaml with the llama arch).
    base = path.parent / own[EXTENDS]
    assert own[EXTENDS] == "quickstart.yaml" or read_yaml(base)[EXTENDS] == "quickstart.yaml"
    assert bases(path)[-1] == path.parent / "quickstart.yaml" and len(bases(path)) <= 2
    quickstart = read_yaml(QUICKSTART)
    merged = read_params(path)
    # the merged tree: its base with the config's own keys over it, naming no key the
    # quickstart does not (params.yaml, its copy, names every key: test_config.py)
    assert merged == merge(read_params(base), {k: v for k, v in own.items() if k != EXTENDS})
    assert keys(merged) == keys(quickstart)
    assert load_config(path) == validate(merged)
    quickstart = read_params(base)  # what the overlay's keys must differ from

    # only what differs: no key of the overlay restates the quickstart's value
    def restated(node: dict, base: dict, prefix: str = "") -> list[str]:
        out = []
        for key, value in node.items():
            here = f"{prefix}{key}"
            if isinstance(value, dict) and isinstance(base.get(key), dict) and here in SECTIONS:
                out += restated(value, base[key], here + ".")
            elif key in base and base[key] == value:
                out.append(here)
        return out

    assert restated({k: v for k, v in own.items() if k != EXTENDS}, quickstart) == []


# ---------------------------------------------------------------------------------------------
# The pipeline writes the merged whole to params.yaml


def test_pipeline_writes_the_merged_tree_to_params_yaml(tmp_path):
    config = REPO / "configs" / "gpt2-124m-fineweb.yaml"
    target = tmp_path / "params.yaml"
    cfg = apply_params(config, ["pretrain.max_steps=7"], target)
    text = target.read_text(encoding="utf-8")
    assert text.splitlines()[0] == (
        f"# Written by `gptforge pipeline` from {config} merged over "
        f"{REPO / 'configs' / 'quickstart.yaml'} with pretrain.max_steps=7."
    )
    written = yaml.safe_load(text)
    expected = read_params(config)
    expected["pretrain"]["max_steps"] = 7
    assert written == expected and EXTENDS not in written
    assert cfg == load_config(target) == load_config(config, ["pretrain.max_steps=7"])
    # the same request again leaves the file alone
    before = target.stat().st_mtime_ns
    apply_params(config, ["pretrain.max_steps=7"], target)
    assert target.stat().st_mtime_ns == before


def test_pipeline_refuses_an_overlay_as_params_yaml(tmp_path):
    write(tmp_path, "configs/quickstart.yaml", QUICKSTART.read_text(encoding="utf-8"))
    target = write(tmp_path, "params.yaml", "extends: configs/quickstart.yaml\npretrain: {max_steps: 5}\n")
    before = target.read_bytes()
    for params in (None, target):
        with pytest.raises(
            BadInput,
            match=r"params.yaml is an overlay \(extends\), but DVC reads it itself .*"
            r"pass it as --params",
        ):
            apply_params(params, [], target)
    assert target.read_bytes() == before


def _starts_from_hub(path: Path) -> bool:
    from gptforge.pipeline.run import PRETRAIN_OUT, _inside, start_folders

    return not any(_inside(folder, PRETRAIN_OUT) for folder in start_folders(load_config(path)).values())


HUB_CONFIGS = [p for p in OVERLAYS if _starts_from_hub(p)]


def test_some_named_configs_start_from_hub_weights():
    assert {p.name for p in HUB_CONFIGS} >= {"qwen2.5-0.5b-lora.yaml", "smollm2-135m-cpu.yaml"}


@pytest.mark.parametrize("path", HUB_CONFIGS, ids=[p.name for p in HUB_CONFIGS])
def test_a_named_config_that_starts_from_hub_weights_pretrains_nothing(path):
    # register@pretrain and evaluate@NAME of checkpoints/pretrain depend on the pretrained
    # folder: a config whose stages all start elsewhere must not name it, or DVC pretrains the
    # quickstart's tiny GPT only to register or score it.
    from gptforge.pipeline.run import PRETRAIN_OUT, _inside

    cfg = load_config(path)
    assert "pretrain" not in cfg.registry.names
    assert not [f for f in cfg.evaluate.models.values() if _inside(f, PRETRAIN_OUT)]
