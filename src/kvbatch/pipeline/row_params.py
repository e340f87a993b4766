"""The per-row parameters on the pipeline's side: read from a row, checked, defaulted, recorded.

Every function loops over engine/params.py's PARAMS, the one definition of each parameter: `parse`
reads a row's values (JSONL, CSV, Parquet) into its queue payload, `check_config` checks the job's
values, `sampling` makes the SamplingParams a row runs with, and `columns` its results columns.
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable, Optional

from kvbatch.engine.models.config import ADAPTER_NAME
from kvbatch.engine.params import PARAMS, RowParam, SamplingParams
from kvbatch.pipeline import response_format

# `cfg` below: a pipeline Config (pipeline/config.py imports this module, so it is not named here)
Config = Any


def _int(name: str, v: Any) -> int:
    if isinstance(v, str):
        try:
            v = float(v.strip()) if "." in v or "e" in v.lower() else int(v.strip())
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return int(v)


def _float(name: str, v: Any) -> float:
    """A finite number."""
    try:
        if isinstance(v, bool):
            raise ValueError
        f = float(v.strip() if isinstance(v, str) else v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {v!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    return f


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _bool(name: str, v: Any) -> bool:
    """true/false (JSONL, Parquet), or in text (CSV): true/false, 1/0, yes/no."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE:
        return v.strip().lower() in _TRUE
    raise ValueError(f"{name} must be true or false, got {v!r:.80}")


def _ids(name: str, v: Any) -> list[int]:
    """A list of token ids (JSONL, Parquet), one id, or in text a JSON list such as [2, 50] (CSV)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            raise ValueError(f"{name} must be a list of token ids, got {v!r:.80}") from None
    ids = [v] if isinstance(v, int) and not isinstance(v, bool) else v
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids (integers >= 0), got {v!r:.80}")
    return list(ids)


def _strings(name: str, v: Any) -> list[str]:
    """A list of strings (JSONL, Parquet), or a string: one string, or a JSON list of them (CSV). Taken
    as the file holds them (its own escapes), not decoded again."""
    if isinstance(v, str) and v.lstrip().startswith("["):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            pass
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, (list, tuple)):
        raise ValueError(f"{name} must be a non-empty string or a list of non-empty strings, got {v!r:.80}")
    return list(stops)


def _format(name: str, v: Any) -> Any:
    return response_format.resolve(v, files=False)  # its checks and messages are its module's; rows never name files


def _name(name: str, v: Any) -> str:
    """A name (an adapter's): letters, digits, '_', '-', '.'."""
    if not isinstance(v, str) or not ADAPTER_NAME.fullmatch(v):
        raise ValueError(f"{name} must be a name (letters, digits, '_', '-', '.'), got {v!r:.80}")
    return v


_READERS: dict[str, Callable[[str, Any], Any]] = {"int": _int, "float": _float, "bool": _bool, "ids": _ids,
                                                  "strings": _strings, "format": _format, "name": _name}
# a list value out of range: the reader's own message (which says what the whole value must be)
_LIST_PROBLEM = {"ids": "must be a list of token ids (integers >= 0)",
                 "strings": "must be a non-empty string or a list of non-empty strings"}


def parse(row: dict) -> dict:
    """A row's own parameter values (None, a missing value, leaves the job's), read and range-checked;
    raises ValueError naming the first bad one."""
    out: dict = {}
    for p in PARAMS:
        raw = row.get(p.name)
        if raw is None:
            continue
        v = _READERS[p.kind](p.name, raw)
        problem = p.check(v) if p.check is not None else None
        if problem:
            if p.kind in _LIST_PROBLEM:
                raise ValueError(f"{p.name} {_LIST_PROBLEM[p.kind]}, got {raw!r:.80}")
            raise ValueError(f"{p.name} {problem}, got {v!r}")
        out[p.name] = v
    return out


def job_value(cfg: Config, p: RowParam) -> Any:
    """The job's value of a parameter (its config key: section.name)."""
    return getattr(getattr(cfg, p.section), p.name)


def config_problem(cfg: Config) -> Optional[tuple[str, Any, str]]:
    """(config key, value, why) of the first job value out of range, or None. response_format is
    checked by its own module."""
    for p in PARAMS:
        value = job_value(cfg, p)
        problem = p.check(value) if p.check is not None else None
        if problem:
            return f"{p.section}.{p.name}", value, problem
    return None


def sampling(payload: dict, cfg: Config, **fixed: Any) -> SamplingParams:
    """The SamplingParams a queue row runs with: its own values, else the job's; `fixed` values as given
    (those worked out elsewhere: the row's derived seed, the grammar made from its response format)."""
    values = {p.name: payload.get(p.name, job_value(cfg, p)) for p in PARAMS if p.engine and p.name not in fixed}
    for p in PARAMS:
        if p.kind in ("ids", "strings") and p.name in values:
            values[p.name] = tuple(values[p.name])
    return SamplingParams(**values, **fixed)


def columns(params: SamplingParams, **pipeline_values: Any) -> dict[str, Any]:
    """A row's results columns of its parameters: the values it ran with (`pipeline_values`: those
    of parameters the engine does not take, as they are to be recorded)."""
    out = {}
    for p in PARAMS:
        if p.column is None:
            continue
        v = getattr(params, p.name) if p.engine else pipeline_values.get(p.name)
        out[p.name] = list(v) if isinstance(v, tuple) else v
    return out

