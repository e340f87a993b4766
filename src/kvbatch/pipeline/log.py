"""kvbatch's logging: the library speaks through the standard `logging` module, never `print`.

Two loggers: `kvbatch` (and its children) for what a person watching the run reads (the plan, notes,
warnings), and `kvbatch.out` for what the command writes on stdout for a person or a script (the
summary line, the results path, status reports). The library configures neither: under
`kvbatch.generate` they are silent unless the caller configures logging (warnings still reach
stderr through Python's last-resort handler). The command calls `configure_command`: `kvbatch` on
stderr, `kvbatch.out` on stdout, each message as it is, one a line, so a terminal and a cron log
read the same lines.
"""
from __future__ import annotations

import logging
import sys

log = logging.getLogger("kvbatch")
out = logging.getLogger("kvbatch.out")
out.propagate = False  # stdout's lines never also reach the stderr handler


class _LiveStream(logging.StreamHandler):
    """A handler on sys.stdout or sys.stderr as it is when a record is written (not when the handler
    was made), so a redirected stream (a test, a notebook) gets the lines."""

    def __init__(self, name: str):
        super().__init__()
        self._name = name

    @property
    def stream(self):  # type: ignore[override]
        return getattr(sys, self._name)

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it; the live stream wins
        pass


def configure_command() -> None:
    """The command's logging: `kvbatch` INFO and above on stderr, `kvbatch.out` on stdout (idempotent)."""
    for logger, name in ((log, "stderr"), (out, "stdout")):
        for h in [h for h in logger.handlers if isinstance(h, _LiveStream)]:
            logger.removeHandler(h)
        handler = _LiveStream(name)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def unconfigure_command() -> None:
    """Remove the handlers configure_command added (tests that run the command in process)."""
    for logger in (log, out):
        for h in [h for h in logger.handlers if isinstance(h, _LiveStream)]:
            logger.removeHandler(h)
        logger.setLevel(logging.NOTSET)
