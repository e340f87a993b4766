"""Progress that moves with tokens: a tqdm bar on a terminal, a plain line every
`output.progress_every` otherwise (cron, systemd, a log file).

The worker reports every engine step's generated tokens (`tokens`), and each row as it is written
(`row_done`). The bar counts tokens against the job's token budget (each queued row's max_tokens); a
row that stops early takes its unused budget off the total. The ETA (`eta_s`) does not wait for the
budget to shrink: once rows have finished it expects every unfinished row to be as long as the
answers seen so far (never more than the budget), at the rate seen so far, so it converges to the
truth as rows finish, however far answers fall short of max_tokens. Rows done/total, tokens/s and the
process's resident memory (`rss`: what the OS holds for it, not MLX's peak) ride along.

Time comes from the constructor: `clock` (seconds, default time.monotonic) times the plain lines and
their rate, `redraw_s` is the bar's least interval between redraws (tqdm's mininterval; 0 redraws on
every update), so a test times the lines with a manual clock and sees every redraw, without sleeping.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO

import psutil
from tqdm import tqdm

from kvbatch.engine.sizes import fmt_bytes


def rss_bytes() -> int:
    """This process's resident memory now."""
    return psutil.Process().memory_info().rss


def row_budget(payload: dict, default_max_tokens: int) -> int:
    """Tokens a queued row may generate (0 for a row the input stage already refused)."""
    if "error" in payload:
        return 0
    if "completion" in payload:  # action=score: one token sampled after the scored text (ignored)
        return 1
    return int(payload.get("max_tokens", default_max_tokens))


def spec_text(spec: Optional[tuple[int, int]]) -> str:
    """The progress line's speculative-decoding part: ", spec acceptance 63%" ("" without proposals)."""
    if not spec or not spec[0]:
        return ""
    return f", spec acceptance {spec[1] / spec[0]:.0%}"


def fmt_duration(s: float) -> str:
    """A duration for people: 1h02m, 3m05s or 42s."""
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


class Progress:
    """The run's progress in tokens: a tqdm bar on a terminal, else a plain line every output.progress_every."""

    def __init__(self, rows: int, token_budget: int, mode: str = "auto", every_s: float = 300.0,
                 stream: Optional[TextIO] = None, clock: Callable[[], float] = time.monotonic,
                 redraw_s: float = 0.5):
        self.stream = stream or sys.stderr
        tty = self.stream.isatty()
        self.bar_on = mode == "on" or (mode == "auto" and tty)
        self.lines_on = mode == "auto" and not tty
        self.rows_total, self.rows = rows, 0
        self.answered_rows, self.answered_tokens = 0, 0  # finished rows that said how long they were
        self.total, self.done_tokens = max(token_budget, 0), 0
        self.every_s = every_s
        self.speculation: Optional[tuple[int, int]] = None  # speculative decoding: (proposed, accepted) tokens
        self.rss: Callable[[], int] = rss_bytes  # the memory shown: this process's (worker processes: theirs too)
        self.clock = clock
        self.t0 = clock()
        self.last_line = self.t0
        # the first draw already carries rows and memory
        self.bar = tqdm(total=self.total, desc="tokens", unit="tok", unit_scale=True, file=self.stream,
                        disable=not self.bar_on, dynamic_ncols=True, leave=True, mininterval=redraw_s,
                        postfix=self._postfix_text() if self.bar_on else None)

    def _postfix_text(self) -> str:
        eta = self.eta_s()
        return (f"rows {self.rows}/{self.rows_total}, ETA {fmt_duration(eta) if eta is not None else '?'}, "
                f"rss {fmt_bytes(self.rss())}{spec_text(self.speculation)}")

    def _postfix(self) -> None:
        if self.bar_on:
            self.bar.set_postfix_str(self._postfix_text(), refresh=False)

    def tokens(self, n: int) -> None:
        """`n` more tokens generated (called every engine step)."""
        if n > 0:
            self.done_tokens += n
            if self.bar_on:
                self.bar.update(n)
        self._maybe_line()

    def row_done(self, unused_budget: int = 0, generated: Optional[int] = None) -> None:
        """A row written; `unused_budget`: its max_tokens it did not generate (it stopped early or failed);
        `generated`: its answer's tokens (None: unknown), what the ETA expects of the rows still to come."""
        self.rows += 1
        if generated is not None:
            self.answered_rows += 1
            self.answered_tokens += generated
        if unused_budget > 0:
            self.total = max(self.total - unused_budget, self.done_tokens)
            if self.bar_on:
                self.bar.total = self.total
        self._postfix()
        if self.bar_on:
            self.bar.refresh()
        self._maybe_line()

    def expected_tokens(self) -> int:
        """Tokens the whole run is expected to generate: the budget until a row has finished, then the
        tokens so far plus, for every unfinished row, the mean answer seen so far less what the rows
        in flight already generated (within [tokens so far, budget])."""
        if not self.answered_rows:
            return self.total
        mean = self.answered_tokens / self.answered_rows
        expected = self.answered_tokens + (self.rows_total - self.rows) * mean
        return int(min(max(expected, self.done_tokens), self.total))

    def eta_s(self) -> Optional[float]:
        """Seconds left (None until a token was generated): the expected tokens left at the token rate so
        far, and once rows have finished at least the rows left at the row rate so far (the last rows
        of a job run with fewer beside them, so tokens alone come out short at the end)."""
        elapsed = self.clock() - self.t0
        if self.done_tokens <= 0 or elapsed <= 0:
            return None
        by_tokens = max(self.expected_tokens() - self.done_tokens, 0) / (self.done_tokens / elapsed)
        by_rows = (self.rows_total - self.rows) * elapsed / self.rows if self.answered_rows else 0.0
        return max(by_tokens, by_rows)

    def line(self) -> str:
        """The plain progress line: rows, tokens, rate, ETA and resident memory."""
        elapsed = max(self.clock() - self.t0, 1e-9)
        rate = self.done_tokens / elapsed
        eta_s = self.eta_s()
        eta = fmt_duration(eta_s) if eta_s is not None else "unknown"
        return (f"kvbatch: progress: {self.rows}/{self.rows_total} rows, {self.done_tokens}/{self.total} tokens, "
                f"{rate:.1f} tok/s, elapsed {fmt_duration(elapsed)}, ETA {eta}, rss {fmt_bytes(self.rss())}"
                f"{spec_text(self.speculation)}")

    def _maybe_line(self) -> None:
        now = self.clock()
        if self.lines_on and now - self.last_line >= self.every_s:
            self.last_line = now
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        """End the progress display (a last plain line when lines are on)."""
        if self.lines_on and self.rows:
            print(self.line(), file=self.stream, flush=True)
            self.lines_on = False  # close() runs twice on Ctrl-C paths: one last line
        self.bar.close()
