"""The tasks lm-eval gets: local HellaSwag and MMLU data checked, task configs written, the index built.

`plan_tasks` checks `evaluate.tasks` and the local files record by record before lm-eval starts,
writes a normalised copy (labels as integers, MMLU split by subject) and task yaml files
(templates from `gptforge/lm_eval_tasks/` plus the data paths) into the run's temporary folder,
and indexes them with an lm-eval `TaskManager`; `load_task_objects` loads them. May import
`gptforge.errors`, `gptforge.io` and, when a plan is made, lm-eval's task code; no torch, no
model code, nothing from the other `gptforge.evaluate` modules.

Tasks. `evaluate.tasks` (default hellaswag, mmlu) may name any lm-eval task, group or tag.
- `hellaswag` with `evaluate.hellaswag.source` set to a local rowanz-format jsonl (fields
  activity_label, ctx_a, ctx_b, endings (4), label (0-3); ctx and others are ignored): the task
  config shipped in `gptforge/lm_eval_tasks/hellaswag.yaml` reads it, with lm-eval's own
  `process_docs` (query "activity_label: ctx_a Ctx_b", `[...]` tags stripped) and metrics acc
  and acc_norm (length-normalised by characters). This is NOT build-nanogpt's completion-style
  score that pretraining reports (`gptforge.training.hellaswag`: raw `ctx`, loss per token): the two
  numbers differ and only this one compares with lm-eval's published 0.3114 for GPT-2 124M.
  The reader is not `gptforge.training.hellaswag.load_examples` either: that one needs `ctx` and keeps
  only ctx, endings and label, this one needs the fields lm-eval's query is built from.
- `mmlu` with `evaluate.mmlu.source` set to a folder (or its `all/` subfolder) holding `test`
  and `dev` files (`test.jsonl`, `test.parquet` or Hugging Face shards `test-*.parquet`; same
  for dev) of cais/mmlu `all` records {question, subject, choices (4), answer (0-3)}: one task
  per subject (`mmlu_<subject>`) with lm-eval's standard prompt and " A".." D" targets, few-shot
  examples from that subject's dev questions (first N, as lm-eval does), grouped as `mmlu`.
- without a local source, lm-eval's own `hellaswag` / `mmlu` and their hub data: offline this
  fails with a one-line SourceUnreachable naming the `evaluate.*.source` param to set.
- any other name goes to lm-eval's default task index (about 15 s to build); a name it does not
  know is a BadInput that lists the closest ones.
The `datasets` cache for the run lives in the same temporary folder, so nothing is written to
~/.cache.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from gptforge.errors import BadInput, SourceUnreachable
from gptforge.io import atomic_file, data_suffix, open_data

log = logging.getLogger("gptforge")

TASKS_DIR = Path(__file__).parent.parent / "lm_eval_tasks"
N_CHOICES = 4


# =============================================================================================
# Local data: read, check, normalise


def read_records(path: Path) -> Iterable[tuple[str, Any]]:
    """(where, record) for each record of a .jsonl/.json-lines or .parquet file; `where` names
    the file and line (or record number) for messages. Unreadable input is a BadInput."""
    if data_suffix(path) == ".parquet":
        try:
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        except Exception as e:
            raise BadInput(f"{path}: not a readable parquet file ({type(e).__name__}: {_one_line(e)})") from None
        for n, row in enumerate(rows, 1):
            yield f"{path}: record {n}", row
        return
    with open_data(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise BadInput(f"{where}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise BadInput(f"{where}: bad JSON ({e.msg} at column {e.colno})") from None


def _index(value: Any) -> int | None:
    """An answer/label index: int, or a digit string (Hugging Face's hellaswag); None if not one."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _check_fields(where: str, obj: Any, fields: Mapping[str, type], hint: str) -> dict:
    if not isinstance(obj, dict):
        raise BadInput(f"{where}: expected a JSON object, got {type(obj).__name__} ({hint})")
    missing = [k for k in fields if k not in obj or obj[k] is None]
    if missing:
        raise BadInput(f"{where}: missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)} ({hint})")
    for key, kind in fields.items():
        if kind is str and not isinstance(obj[key], str):
            raise BadInput(f"{where}: {key} must be a string, got {type(obj[key]).__name__} ({hint})")
    return obj


def _check_choices(where: str, value: Any, key: str, hint: str) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(c, str) for c in value):
        raise BadInput(f"{where}: {key} must be a list of {N_CHOICES} strings ({hint})")
    if len(value) != N_CHOICES:
        raise BadInput(f"{where}: {key} must hold {N_CHOICES} strings, got {len(value)} ({hint})")
    return list(value)


def _check_answer(where: str, value: Any, key: str, hint: str) -> int:
    index = _index(value)
    if index is None:
        raise BadInput(f"{where}: {key} must be an integer 0-{N_CHOICES - 1}, got {value!r} ({hint})")
    if not 0 <= index < N_CHOICES:
        raise BadInput(f"{where}: {key} {index} is out of range 0-{N_CHOICES - 1} ({hint})")
    return index


HELLASWAG_PARAM = "evaluate.hellaswag.source"
MMLU_PARAM = "evaluate.mmlu.source"
HELLASWAG_FIELDS = {"activity_label": str, "ctx_a": str, "ctx_b": str, "endings": list, "label": int}
MMLU_FIELDS = {"question": str, "subject": str, "choices": list, "answer": int}


def load_hellaswag(path: str | Path) -> list[dict]:
    """Checked HellaSwag records (rowanz format) with the fields lm-eval's hellaswag uses;
    `label` made an int. BadInput names the file, the line and the param to fix."""
    p = Path(path)
    hint = f"{HELLASWAG_PARAM} must be a HellaSwag jsonl in the rowanz format"
    if not p.is_file():
        raise BadInput(f"{HELLASWAG_PARAM}: HellaSwag file not found: {path}")
    docs = []
    for where, obj in read_records(p):
        obj = _check_fields(where, obj, HELLASWAG_FIELDS, hint)
        doc = {k: obj[k] for k in ("ind", "activity_label", "ctx_a", "ctx_b", "ctx", "source_id", "split") if k in obj}
        doc["endings"] = _check_choices(where, obj["endings"], "endings", hint)
        doc["label"] = _check_answer(where, obj["label"], "label", hint)
        docs.append(doc)
    if not docs:
        raise BadInput(f"{HELLASWAG_PARAM}: no examples in {path}")
    return docs


def mmlu_files(source: str | Path) -> dict[str, Path]:
    """{'test': file, 'dev': file} in an MMLU folder (or its `all/` subfolder, cais/mmlu's layout):
    `<split>.jsonl`, `<split>.parquet` or `<split>-*.parquet` (one shard). `dev` may be absent."""
    folder = Path(source)
    if not folder.is_dir():
        raise BadInput(
            f"{MMLU_PARAM}: MMLU folder not found: {source} (a folder with test and dev files, .jsonl or .parquet)"
        )
    if (folder / "all").is_dir() and not _split_files(folder, "test"):
        folder = folder / "all"
    found = {}
    for split in ("test", "dev"):
        files = _split_files(folder, split)
        if len(files) > 1:
            raise BadInput(
                f"{MMLU_PARAM}: {folder} holds several {split} files ({', '.join(f.name for f in files)}); keep one"
            )
        if files:
            found[split] = files[0]
    if "test" not in found:
        raise BadInput(f"{MMLU_PARAM}: no test file in {folder} (expected test.jsonl or test.parquet)")
    return found


def _split_files(folder: Path, split: str) -> list[Path]:
    names = [f"{split}.jsonl", f"{split}.json", f"{split}.parquet", f"{split}.jsonl.gz", f"{split}.json.gz"]
    files = [folder / n for n in names if (folder / n).is_file()]
    return files + sorted(p for p in folder.glob(f"{split}-*.parquet") if p.is_file())


def load_mmlu(path: Path) -> list[dict]:
    """Checked MMLU records {question, subject, choices, answer} from one file."""
    hint = f"{MMLU_PARAM} records are cais/mmlu's question, subject, choices (4), answer (0-3)"
    docs = []
    for where, obj in read_records(path):
        obj = _check_fields(where, obj, MMLU_FIELDS, hint)
        if not obj["subject"].strip():
            raise BadInput(f"{where}: subject is empty ({hint})")
        docs.append(
            {
                "question": obj["question"],
                "subject": obj["subject"],
                "choices": _check_choices(where, obj["choices"], "choices", hint),
                "answer": _check_answer(where, obj["answer"], "answer", hint),
            }
        )
    if not docs:
        raise BadInput(f"{MMLU_PARAM}: no questions in {path}")
    return docs


def subject_task(subject: str) -> str:
    return "mmlu_" + re.sub(r"[^a-z0-9]+", "_", subject.strip().lower()).strip("_")


# =============================================================================================
# Task plan: which names lm-eval gets, from which task index


@dataclass
class TaskPlan:
    names: list[str]  # what simple_evaluate gets, in the order of evaluate.tasks
    include_path: list[str]
    include_defaults: bool
    local: dict[str, str] = field(default_factory=dict)  # task -> local source
    hub: dict[str, str] = field(default_factory=dict)  # task -> the param that would make it local
    manager: Any = None  # the lm-eval TaskManager


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    with atomic_file(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _yaml_str(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a YAML double-quoted scalar


def _task_yaml(template: str, extra: dict[str, Any], cache_dir: Path, data_files: dict[str, Path]) -> str:
    text = (TASKS_DIR / template).read_text(encoding="utf-8").rstrip() + "\n"
    for key, value in extra.items():
        text += f"{key}: {_yaml_str(value) if isinstance(value, str) else json.dumps(value)}\n"
    text += "dataset_kwargs:\n"
    text += f"  cache_dir: {_yaml_str(str(cache_dir))}\n"
    text += "  data_files:\n"
    for split, path in data_files.items():
        text += f"    {split}: {_yaml_str(str(path.resolve()))}\n"
    return text


def write_hellaswag_task(source: str, out: Path, limit: int | None = None) -> int:
    docs = load_hellaswag(source)[:limit]
    data = out / "data" / "hellaswag.jsonl"
    _write_jsonl(data, docs)
    (out / "hellaswag.yaml").write_text(
        _task_yaml("hellaswag.yaml", {}, out / "hf_cache", {"validation": data}), encoding="utf-8"
    )
    return len(docs)


def write_mmlu_tasks(source: str, out: Path, num_fewshot: int | None, limit: int | None = None) -> int:
    files = mmlu_files(source)
    test = load_mmlu(files["test"])
    dev = load_mmlu(files["dev"]) if "dev" in files else []
    by_subject: dict[str, list[dict]] = {}
    for doc in test:
        by_subject.setdefault(doc["subject"], []).append(doc)
    by_subject = {subject: docs[:limit] for subject, docs in by_subject.items()}
    dev_by_subject: dict[str, list[dict]] = {}
    for doc in dev:
        dev_by_subject.setdefault(doc["subject"], []).append(doc)
    tasks: dict[str, str] = {}
    for subject in sorted(by_subject):
        name = subject_task(subject)
        if name in tasks:
            raise BadInput(f"{files['test']}: subjects {tasks[name]!r} and {subject!r} both map to task {name}")
        tasks[name] = subject
        shots = dev_by_subject.get(subject, [])
        if num_fewshot and len(shots) < num_fewshot:
            where = files.get("dev", Path(source) / "dev.jsonl")
            raise BadInput(
                f"{where}: subject {subject!r} has {len(shots)} dev question(s), evaluate.num_fewshot="
                f"{num_fewshot} needs {num_fewshot} ({MMLU_PARAM} dev files give the few-shot examples)"
            )
        data_files = {"test": out / "data" / f"{name}.test.jsonl"}
        _write_jsonl(data_files["test"], by_subject[subject])
        extra: dict[str, Any] = {
            "task": name,
            "task_alias": subject,
            "description": f"The following are multiple choice questions (with answers) about "
            f"{' '.join(subject.split('_'))}.\n\n",
        }
        if shots:
            data_files["dev"] = out / "data" / f"{name}.dev.jsonl"
            _write_jsonl(data_files["dev"], shots)
            extra["fewshot_split"] = "dev"
            extra["fewshot_config"] = {"sampler": "first_n"}
        (out / f"{name}.yaml").write_text(
            _task_yaml("mmlu_subject.yaml", extra, out / "hf_cache", data_files), encoding="utf-8"
        )
    group = (TASKS_DIR / "mmlu_group.yaml").read_text(encoding="utf-8").rstrip() + "\n"
    group += "task:\n" + "".join(f"  - {name}\n" for name in tasks)
    (out / "mmlu.yaml").write_text(group, encoding="utf-8")
    return sum(len(docs) for docs in by_subject.values())


def lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def plan_tasks(cfg, workdir: Path) -> TaskPlan:
    """Check `evaluate.tasks` and the local data, write the per-run task yaml files into
    `workdir`, and index them (and only what else is needed) with an lm-eval TaskManager."""
    from lm_eval.tasks import TaskManager

    ev = cfg.evaluate
    names = list(dict.fromkeys(t.strip() for t in ev.tasks))
    if not names or not all(names):
        raise BadInput(f"evaluate.tasks: expected a list of lm-eval task names, got {list(ev.tasks)!r}")
    plan = TaskPlan(names=names, include_path=[str(workdir)], include_defaults=False)
    sources = {"hellaswag": (ev.hellaswag.source, HELLASWAG_PARAM), "mmlu": (ev.mmlu.source, MMLU_PARAM)}
    others = []
    for name in names:
        if name in sources:
            source, param = sources[name]
            if source is None:
                plan.hub[name] = param
                # lm-eval's own config for just this task: no 15 s index of every task.
                folder = lm_eval_tasks_dir() / ("hellaswag" if name == "hellaswag" else "mmlu/default")
                plan.include_path.append(str(folder))
            elif "://" in source:
                raise BadInput(
                    f"{param}: expected a local path, got {source!r} (null: lm-eval's own data from the hub)"
                )
            else:
                n = (
                    write_hellaswag_task(source, workdir, ev.hellaswag.limit)
                    if name == "hellaswag"
                    else write_mmlu_tasks(source, workdir, ev.num_fewshot, ev.mmlu.limit)
                )
                plan.local[name] = f"{source} ({n} examples)"
        else:
            others.append(name)
    for name, (source, param) in sources.items():
        if source is not None and name not in names:
            log.info("evaluate: %s is set but %s is not in evaluate.tasks; ignored", param, name)
    if others:
        # Any other name needs lm-eval's full index; our local hellaswag/mmlu override its own.
        plan.include_defaults = True
        plan.include_path = [p for p in plan.include_path if not p.startswith(str(lm_eval_tasks_dir()))]
    plan.manager = TaskManager(include_path=plan.include_path, include_defaults=plan.include_defaults)
    known = set(plan.manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, plan.manager.all_tasks, n=5, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise BadInput(f"evaluate.tasks: unknown lm-eval task {name!r}{hint}")
    return plan


def load_task_objects(plan: TaskPlan) -> list:
    """lm-eval Task/Group objects for each name, loaded here so that a data source that cannot
    be reached is a one-line error naming the param, not a traceback from inside lm-eval."""
    objects = []
    for name in plan.names:
        try:
            loaded = plan.manager.load([name])
        except (BadInput, SourceUnreachable):
            raise
        except Exception as e:
            if name in plan.local:
                raise
            param = plan.hub.get(name)
            fix = f"set {param} to a local copy" if param else "check the network or the task's data"
            raise SourceUnreachable(
                f"evaluate: lm-eval task {name!r} could not load its data "
                f"({type(e).__name__}: {_one_line(e)[:300]}); {fix}"
            ) from None
        if name in loaded["groups"]:
            objects.append(loaded["groups"][name])
        elif name in loaded["tasks"]:
            objects.append(loaded["tasks"][name])
        else:  # a tag: its tasks
            objects.extend(loaded["tasks"].values())
    return objects


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
