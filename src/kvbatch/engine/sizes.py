"""Byte sizes as people write them (8GiB, 512MiB) and as kvbatch prints them."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(text: str | int | float) -> int:
    """'8GiB' -> 8589934592. Raises ValueError with the accepted forms."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 8GiB, 2GB or a byte count)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    """A byte count in binary units (B, KiB ... TiB), for messages."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return f"{n}"
