"""The recorder's MLflow side: a stage's journal records (`gptforge.runtime.journal`) made into
MLflow runs through `MlflowClient`, by run id, never through MLflow's active run (the one
exception: the transformers flavor, which `MlflowRun.log_hf_model` drives through it).

`MlflowSink.apply(delivery, group)` applies one group of consecutive records of one journal
(several `params`/`metrics`/`tags` records of one run go out as one `log_batch`, split at
MLflow's limits). It raises what MLflow raised; the recorder (`flows/recorder.py`) tells a
failure worth retrying (the store unreachable, locked, a 5xx) from one that fails the same way
again, which it logs and skips. The ids it makes go into `delivery.state` and are saved at
once (`delivery.save()`), so a recorder killed and started again does not make them twice; a
run whose `create_run` may have reached the store before the recorder went away is looked up
by its `gptforge.journal` tag before it is created again.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
from pathlib import Path
from typing import Any, Callable

from gptforge.runtime.journal import Skip

log = logging.getLogger("gptforge.recorder")

JOURNAL_TAG = "gptforge.journal"  # KEY:RUN, on every run the recorder makes
END_STATUS = {"COMPLETED": "FINISHED", "FAILED": "FAILED", "CRASHED": "KILLED"}
BATCH_KINDS = ("params", "metrics", "tags")


def ms(seconds: float | None) -> int | None:
    return None if seconds is None else int(round(float(seconds) * 1000))


class MlflowSink:
    """MLflow clients (one per tracking URI) and experiment ids, shared by every journal."""

    def __init__(self, transient: Callable[[BaseException], bool]) -> None:
        from gptforge.runtime.tracking import HTTP_ENV_DEFAULTS, _import_mlflow

        self.mlflow = _import_mlflow()
        self._transient = transient
        self._clients: dict[str, Any] = {}
        self._experiments: dict[tuple[str, str], str] = {}
        self._http_defaults = HTTP_ENV_DEFAULTS

    def client(self, uri: str):
        if uri not in self._clients:
            if uri.startswith(("http://", "https://")):
                for name, value in self._http_defaults.items():
                    os.environ.setdefault(name, value)
            self._clients[uri] = self.mlflow.tracking.MlflowClient(uri)
        return self._clients[uri]

    # ---------------------------------------------------------------------------------------

    def apply(self, d, group: list[dict]) -> None:
        """Apply `group` (one record, or consecutive batchable records of one run) of journal `d`."""
        conf = d.state["open"]["mlflow"]
        client = self.client(conf["uri"])
        first = group[0]
        kind = first["kind"]
        if kind in BATCH_KINDS:
            self._log_batch(client, self._run_id(d, first), group)
        elif kind == "run_start":
            self._run_start(d, client, conf, first)
        elif kind == "artifact":
            run_id = self._run_id(d, first)
            local = Path(d.files) / first["path"]
            if local.is_dir():
                client.log_artifacts(run_id, str(local), first.get("artifact_path") or local.name)
            elif local.is_file():
                client.log_artifact(run_id, str(local), first.get("artifact_path"))
            else:
                raise Skip(f"artifact {first['path']} is not in {d.files}")
        elif kind == "text":
            client.log_text(self._run_id(d, first), first["text"], first["name"])
        elif kind == "hf_model":
            self._hf_model(conf["uri"], self._run_id(d, first), first)
        elif kind == "run_end":
            run = first["run"]
            client.set_terminated(self._run_id(d, first), first.get("status") or "FINISHED", end_time=ms(first["time"]))
            if run not in d.state["ended_runs"]:
                d.state["ended_runs"].append(run)
        else:
            raise Skip(f"unknown MLflow record kind {kind!r}")

    def finish(self, d, state: str, end_time: float) -> None:
        """At `close` (or for a journal whose writer was killed): end its runs still open with
        the status that goes with the close's `state` (COMPLETED -> FINISHED, FAILED, CRASHED ->
        KILLED), children before their parents."""
        conf = d.state["open"]["mlflow"]
        status = END_STATUS.get(state, "FAILED")
        left = [run for run in d.state["runs"] if run not in d.state["ended_runs"]]
        for run in reversed(left):
            self.client(conf["uri"]).set_terminated(d.state["runs"][run], status, end_time=ms(end_time))
            d.state["ended_runs"].append(run)
            d.save()

    # ---------------------------------------------------------------------------------------

    def _run_id(self, d, record: dict) -> str:
        run_id = d.state["runs"].get(record.get("run"))
        if run_id is None:
            raise Skip(f"no MLflow run {record.get('run')!r} in this journal (its run_start was not recorded)")
        return run_id

    def experiment_id(self, client, conf: dict) -> str:
        """The experiment `conf["experiment"]`, made when missing (with `artifact_location`; for
        None the one tracking gives a new experiment: `mlartifacts/` beside a SQLite store).
        Another process may make it at the same moment: then it is read again."""
        from gptforge.runtime.mlflow_values import artifact_location

        uri, name = conf["uri"], conf.get("experiment") or "Default"
        if (uri, name) not in self._experiments:
            found = client.get_experiment_by_name(name)
            if found is None:
                location = conf.get("artifact_location") or artifact_location(uri)
                try:
                    client.create_experiment(name, artifact_location=location)
                except Exception as e:
                    if self._transient(e):
                        raise
                found = client.get_experiment_by_name(name)
                if found is None:
                    raise Skip(f"MLflow experiment {name!r} could not be made")
            self._experiments[(uri, name)] = found.experiment_id
        return self._experiments[(uri, name)]

    def _run_start(self, d, client, conf: dict, rec: dict) -> None:
        run, state = rec["run"], d.state
        if run in state["runs"]:
            return
        tags = {str(k): str(v) for k, v in (rec.get("tags") or {}).items() if v is not None}
        parent = conf.get("parent_run_id") if rec.get("parent") is None else state["runs"].get(rec["parent"])
        if rec.get("parent") is not None and parent is None:
            log.warning(
                "journal %s: MLflow run %r made at the top: its parent %r was not recorded", d.key, run, rec["parent"]
            )
        if parent:
            tags["mlflow.parentRunId"] = parent
        if run == "main" and state.get("flow_run_id"):
            tags["prefect.flow_run_id"] = state["flow_run_id"]
            tags["prefect.flow_run_name"] = state.get("flow_run_name") or ""
        with contextlib.suppress(Exception):
            tags.setdefault("mlflow.user", getpass.getuser())
        tags[JOURNAL_TAG] = f"{d.key}:{run}"
        experiment = self.experiment_id(client, conf)
        if state.get("creating") == run:  # a create_run of this run may have reached the store
            found = client.search_runs([experiment], f"tags.`{JOURNAL_TAG}` = '{tags[JOURNAL_TAG]}'", max_results=1)
            if found:
                state["runs"][run] = found[0].info.run_id
                state.pop("creating", None)
                d.save()
                return
        state["creating"] = run
        d.save()
        made = client.create_run(experiment, start_time=ms(rec["time"]), tags=tags, run_name=rec.get("name"))
        state["runs"][run] = made.info.run_id
        state.pop("creating", None)
        d.save()

    def _log_batch(self, client, run_id: str, group: list[dict]) -> None:
        """The group's params, metrics (with their own step and timestamp) and tags, in chunks
        within MLflow's limits (100 params or tags, 1000 metrics a request). A chunk refused for
        good is sent one value at a time, so one bad value costs only itself. A param logged
        again with another value goes on its own, after the first, and is refused as it would
        have been in the stage; a tag set again takes the later value."""
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH

        from gptforge.runtime.mlflow_values import metric_name

        params: dict[str, str] = {}
        again: list = []
        tags: dict[str, str] = {}
        metrics: list = []
        for rec in group:
            if rec["kind"] == "params":
                for k, v in (rec.get("params") or {}).items():
                    k, v = str(k), "null" if v is None else str(v)
                    if params.setdefault(k, v) != v:
                        again.append(Param(k, v))
            elif rec["kind"] == "tags":
                tags.update({str(k): str(v) for k, v in (rec.get("tags") or {}).items() if v is not None})
            else:
                stamp = int(rec.get("timestamp") or ms(rec["time"]))
                step = int(rec.get("step") or 0)
                for name, value in (rec.get("metrics") or {}).items():
                    if isinstance(value, bool) or not isinstance(value, (int, float)):
                        continue
                    metrics.append(Metric(metric_name(str(name)), float(value), stamp, step))
        chunks = [
            ("params", [Param(k, v) for k, v in params.items()], MAX_PARAMS_TAGS_PER_BATCH),
            ("params", again, 1),
            ("tags", [RunTag(k, v) for k, v in tags.items()], MAX_PARAMS_TAGS_PER_BATCH),
            ("metrics", metrics, MAX_METRICS_PER_BATCH),
        ]
        for kind, entities, size in chunks:
            for i in range(0, len(entities), size):
                self._send_batch(client, run_id, kind, entities[i : i + size])

    def _send_batch(self, client, run_id: str, kind: str, entities: list) -> None:
        """One log_batch; refused for good: each value alone, and those refused named in a
        warning. Raises only what is worth retrying."""
        try:
            client.log_batch(run_id, **{kind: entities})
            return
        except Exception as e:
            if self._transient(e):
                raise
            first = e
        refused = []
        for entity in entities:
            try:
                if len(entities) > 1:
                    client.log_batch(run_id, **{kind: [entity]})
                else:
                    raise first
            except Exception as one:
                if self._transient(one):
                    raise
                refused.append(f"{entity.key} ({' '.join(str(one).split())[:200]})")
        if refused:
            log.warning("MLflow run %s refused %d %s: %s", run_id, len(refused), kind, "; ".join(refused[:5]))

    def _hf_model(self, uri: str, run_id: str, rec: dict) -> None:
        """MLflow's transformers flavor through `MlflowRun.log_hf_model`, with the run made the
        active run for the call (the flavor logs through MLflow's fluent API) and taken off the
        active run stack after it without ending it (its end is the journal's `run_end`)."""
        from gptforge.runtime.tracking import MlflowRun, _leave_active_run

        mlflow = self.mlflow
        mlflow.set_tracking_uri(uri)
        active = mlflow.start_run(run_id=run_id, log_system_metrics=False)
        try:
            MlflowRun(mlflow, active, uri=uri).log_hf_model(
                rec["folder"], rec.get("name") or "model", **(rec.get("flavor_kwargs") or {})
            )
        finally:
            _leave_active_run(mlflow, run_id)
