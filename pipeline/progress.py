"""Progress: a tqdm bar (rows, tokens/s, memory) on a terminal; silent otherwise."""
from __future__ import annotations

import sys
import time

import psutil
from tqdm import tqdm

from kvbatch.engine.sizes import fmt_bytes


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


class Progress:
    def __init__(self, total: int, mode: str = "auto", desc: str = "rows"):
        show = mode == "on" or (mode == "auto" and sys.stderr.isatty())
        self.bar = tqdm(total=total, desc=desc, unit="row", file=sys.stderr, disable=not show,
                        dynamic_ncols=True, leave=True)
        self.t0 = time.perf_counter()

    def update(self, rows: int, tokens: int) -> None:
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{tokens / elapsed:.1f} tok/s, mem {fmt_bytes(rss_bytes())}", refresh=False)
        self.bar.update(rows)

    def close(self) -> None:
        self.bar.close()
