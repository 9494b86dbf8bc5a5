"""Errors a user can act on. The CLI prints them as one line, without a traceback.

`BadInput` (exit code 2) is something the user gave us: params, files, arguments.
`SourceUnreachable` and `StageFailed` (exit code 1) are failures of the run itself.
"""


class GptforgeError(Exception):
    exit_code = 1


class BadInput(GptforgeError):
    exit_code = 2


class SourceUnreachable(GptforgeError):
    """A remote source (URL, hub dataset, tokenizer download) could not be read."""


class StageFailed(GptforgeError):
    pass


class Stopped(KeyboardInterrupt):
    """A run stopped on request (SIGINT/SIGTERM) after saving what it needs to resume.

    A KeyboardInterrupt, so MLflow marks the run KILLED and nothing treats it as a failure; the
    CLI exits with 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
