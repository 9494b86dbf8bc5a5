"""How gptforge.runtime.tracking meets a failing MLflow server, checked without a server.

Which MLflow failures are worth retrying (`retryable`) and how one is described; the flush bound
(GPTFORGE_TRACKING_FLUSH_SECONDS); what a run's end says, against a fake client, about records the
server rejected or never answered for; how long a run's end waits for each status. A real
`mlflow server` that goes away: tests/test_outage_mlflow.py; the outbox itself: tests/test_outbox.py.
"""

from __future__ import annotations

import logging
import threading

import pytest

from gptforge.runtime import tracking

# ---------------------------------------------------------------------------------------------
# What is worth retrying


def test_retryable_failures_of_mlflow_requests():
    import requests
    from mlflow.exceptions import MlflowException, RestException

    def wrapped(inner: BaseException) -> MlflowException:
        """As mlflow.utils.rest_utils.http_request raises it: inside `except`, so the requests
        error is the context."""
        try:
            try:
                raise inner
            except Exception as e:
                raise MlflowException(f"API request to http://x/api failed with exception {e}")
        except MlflowException as outer:
            return outer

    def response(status: int) -> requests.Response:
        r = requests.Response()
        r.status_code = status
        return r

    assert tracking.retryable(wrapped(requests.ConnectionError("[Errno 111] Connection refused")))
    assert tracking.retryable(wrapped(requests.exceptions.ReadTimeout("read timed out")))
    assert tracking.retryable(wrapped(requests.exceptions.RetryError("too many 503 error responses")))
    assert tracking.retryable(ConnectionResetError(104, "reset"))
    assert tracking.retryable(RestException({"error_code": "INTERNAL_ERROR", "message": "db locked"}))
    assert tracking.retryable(RestException({"error_code": "TEMPORARILY_UNAVAILABLE", "message": "x"}))
    assert tracking.retryable(RestException({"error_code": "REQUEST_LIMIT_EXCEEDED", "message": "x"}))
    assert tracking.retryable(requests.HTTPError("bad gateway", response=response(502)))
    assert not tracking.retryable(RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "x"}))
    assert not tracking.retryable(RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "x"}))
    assert not tracking.retryable(requests.HTTPError("not found", response=response(404)))
    assert not tracking.retryable(FileNotFoundError("final/model.safetensors"))
    assert not tracking.retryable(ValueError("x"))
    assert (
        tracking.describe_failure(
            wrapped(
                requests.ConnectionError(
                    "HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded (Caused by NewConnectionError("
                    '"...: Failed to establish a new connection: [Errno 111] Connection refused"))'
                )
            )
        )
        == "[Errno 111] Connection refused (MlflowException)"
    )


def test_flush_seconds(monkeypatch, caplog):
    monkeypatch.delenv(tracking.FLUSH_ENV, raising=False)
    assert tracking.flush_seconds() == 30
    monkeypatch.setenv(tracking.FLUSH_ENV, "2.5")
    assert tracking.flush_seconds() == 2.5
    monkeypatch.setenv(tracking.FLUSH_ENV, "soon")
    assert tracking.flush_seconds() == 30 and "is not a number of seconds" in caplog.text


class FakeClient:
    """MlflowClient's methods that MlflowRun._send calls; a param valued "bad" is refused as
    the server refuses a changed param (HTTP 400)."""

    def __init__(self, uri=None):
        self.calls = []

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        from mlflow.exceptions import RestException

        if any(p.value == "bad" for p in params):
            raise RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "Changing param values"})
        self.calls.append(
            ("batch", [m.key for m in metrics], {p.key: p.value for p in params}, {t.key: t.value for t in tags})
        )

    def set_terminated(self, run_id, status):
        self.calls.append(("end", status))


def test_a_run_that_lost_records_says_so_and_gets_the_dropped_tag(caplog):
    client = FakeClient()

    class FakeMlflow:
        class tracking:
            MlflowClient = staticmethod(lambda uri: client)

    info = type("Run", (), {"info": type("Info", (), {"run_id": "r" * 32})})()
    run = tracking.MlflowRun(FakeMlflow, info, uri="http://127.0.0.1:1", buffered=True)
    run.log_params({"a": 1, "lr": "bad"})
    run.log_metrics({"train_loss": 1.0, "acc,none": 0.5}, step=1)
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        run.end("FINISHED", timeout=10)
    assert client.calls == [
        ("batch", ["train_loss", "acc_none"], {}, {}),
        ("batch", [], {}, {tracking.DROPPED_TAG: "2"}),
        ("end", "FINISHED"),
    ]
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings[0].startswith("MLflow server at http://127.0.0.1:1 rejected a params record, dropped (")
    assert warnings[-1] == (
        f"MLflow: run {'r' * 32} is recorded but 2 params rejected by the server (tag {tracking.DROPPED_TAG})"
    )


def test_a_request_still_in_flight_at_the_end_is_said_so(caplog):
    """The server took the request and never answered (or MLflow's own retries still run): no
    failure was seen, so the line says the server did not answer, with what was not recorded."""
    gate = threading.Event()
    client = FakeClient()
    client.log_batch = lambda *a, **kw: gate.wait()  # held until the test ends

    class FakeMlflow:
        class tracking:
            MlflowClient = staticmethod(lambda uri: client)

    info = type("Run", (), {"info": type("Info", (), {"run_id": "r" * 32})})()
    run = tracking.MlflowRun(FakeMlflow, info, uri="http://127.0.0.1:1", buffered=True)
    run.log_metrics({"train_loss": 1.0}, step=1)
    try:
        with caplog.at_level(logging.WARNING, logger="gptforge"):
            run.end("FINISHED", timeout=1)
    finally:
        gate.set()
    assert caplog.records[-1].getMessage() == (
        f"MLflow: run {'r' * 32} could not record 1 metric and its status FINISHED: the server at "
        "http://127.0.0.1:1 did not answer (waited 1 s; a request was still in flight)"
    )


# ---------------------------------------------------------------------------------------------
# How long the end of a run waits for its records


def test_a_killed_run_waits_at_most_five_seconds(monkeypatch):
    monkeypatch.setenv(tracking.FLUSH_ENV, "60")
    waits = []

    class Run(tracking.MlflowRun):
        def __init__(self):
            self.failed = False
            self.run_id = "r"

        def _submit(self, kind, payload, size=1):
            pass

        def end(self, status, timeout):
            waits.append((status, timeout))

    monkeypatch.setattr(tracking, "_import_mlflow", lambda: _FakeMlflow)
    monkeypatch.setattr(tracking, "MlflowRun", lambda *a, **kw: Run())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///x.db")
    with pytest.raises(KeyboardInterrupt), tracking.start_run(enabled=True, experiment="e", stage="s"):
        raise KeyboardInterrupt
    with pytest.raises(ValueError), tracking.start_run(enabled=True, experiment="e", stage="s"):
        raise ValueError
    with tracking.start_run(enabled=True, experiment="e", stage="s"):
        pass
    assert waits == [("KILLED", 5.0), ("FAILED", 60.0), ("FINISHED", 60.0)]


class _FakeMlflow:
    """What start_run reaches of mlflow, for the wait bounds alone."""

    @staticmethod
    def set_tracking_uri(uri):
        pass

    @staticmethod
    def get_experiment_by_name(name):
        return object()

    @staticmethod
    def set_experiment(name):
        pass

    @staticmethod
    def start_run(**kw):
        return None
