"""`worker.deadline` values: one parser for the config check and for the worker's clock.

A value is a time of day (`07:00`: the next 07:00) or a duration (`6h`, `90m`, `1h30m`,
`45s`: from now). Kept in one place so a value the check accepts is one the worker can use.
"""
from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Optional

_TIME_OF_DAY = re.compile(r"([01]?\d|2[0-3]):([0-5]\d)")
_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
HELP = "use a time of day like 07:00 or a duration like 6h, 90m, 1h30m"


def deadline_at(text: Optional[str], now: Optional[datetime] = None) -> Optional[float]:
    """The deadline as epoch seconds (None for no deadline); ValueError when `text` is neither form."""
    if text is None or str(text).strip() == "":
        return None
    now = now or datetime.now()
    t = str(text).strip()
    if m := _TIME_OF_DAY.fullmatch(t):
        at = now.replace(hour=int(m[1]), minute=int(m[2]), second=0, microsecond=0)
        return (at if at > now else at + timedelta(days=1)).timestamp()
    m = _DURATION.fullmatch(t)
    if not m:
        raise ValueError(HELP)
    h, mi, s = (int(x or 0) for x in m.groups())
    return (now + timedelta(hours=h, minutes=mi, seconds=s)).timestamp()


def seconds(text: str) -> float:
    """A duration (`5m`, `90s`, `1h30m`) in seconds; ValueError for anything else or zero."""
    m = _DURATION.fullmatch(str(text).strip())
    if not m or not any(m.groups()):
        raise ValueError("use a duration like 5m, 90s, 1h30m")
    h, mi, s = (int(x or 0) for x in m.groups())
    total = 3600 * h + 60 * mi + s
    if total <= 0:
        raise ValueError("must be longer than 0s")
    return float(total)
