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
