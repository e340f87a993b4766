"""Stable row-level error codes (docs/errors.md) and the start-up error type.

Row errors never raise out of the engine: they end one row. Config errors
(`KvbatchConfigError`) are raised before any work starts, with one line that
names what to fix. A device that stops evaluating (`DeviceFailure`) is no row's
error: it raises out of the engine, so its rows can run again in a fresh process.
"""
from __future__ import annotations

INVALID_INPUT = "invalid_input"
PROMPT_TOO_LONG = "prompt_too_long"
INSUFFICIENT_MEMORY = "insufficient_memory"
NON_FINITE_LOGITS = "non_finite_logits"
INTERNAL_ERROR = "internal_error"

ERROR_CODES = (INVALID_INPUT, PROMPT_TOO_LONG, INSUFFICIENT_MEMORY, NON_FINITE_LOGITS, INTERNAL_ERROR)

# Errors that are a property of the row itself: retrying cannot help.
DETERMINISTIC_ERRORS = frozenset({INVALID_INPUT, PROMPT_TOO_LONG, INSUFFICIENT_MEMORY})


class KvbatchConfigError(Exception):
    """A bad config, missing file or unsupported model/mode: fail at start, one line."""


class DeviceFailure(RuntimeError):
    """The device stopped evaluating (a CUDA fault that poisons the process): no row is at fault and nothing
    more runs in this process; the caller hands its rows back, uncharged, for a fresh process."""

    def __init__(self, failure: str):
        super().__init__(f"the device stopped working: {failure}")


class CacheLost(RuntimeError):
    """A failed pass left the KV cache's buffers holding its failed computation (MLX arrays keep a failed graph
    and raise again whenever read), so no row in this engine can run on: the caller runs the rows again in a new
    engine (the worker retries them)."""

    def __init__(self, failure: str):
        super().__init__(f"a failed pass left the KV cache unreadable: {failure}")


class UnreservedWriteError(RuntimeError):
    """A KV write touched a slot that was not reserved before the forward pass."""


class RowError(Exception):
    """Ends one row with a stable error code; the batch goes on."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
