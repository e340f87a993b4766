"""Progress moves with tokens (issue 22.8): a bar on a terminal that advances before the first row
finishes, and plain periodic lines when stderr is a log file.

No test here depends on how fast the machine is (issue 36): Progress is driven directly with a manual
clock and a bar that redraws on every update; the worker's wiring is checked in process by recording
what it reports; the command's own output is checked only for the draws and lines it makes whatever
the timing (the first and last draw of the bar, the last plain line).
"""
from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pyarrow.parquet as pq

import kvbatch.pipeline.actions as actions
from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.progress import Progress
from tests.conftest import ManualClock

ROW = '{"id": "long", "prompt": "Tell me a long story."}\n'  # the tiny model runs it to max_tokens
# one bar draw: "<tokens>/<budget> [... rows <done>/<total>, ...]"
DRAW = re.compile(r"(\d+(?:\.\d+)?[kMG]?)/(\d+(?:\.\d+)?[kMG]?) \[[^\]]*?rows (\d+)/(\d+)")
LINE = re.compile(r"kvbatch: progress: (\d+)/(\d+) rows, (\d+)/(\d+) tokens, ([\d.]+) tok/s, elapsed (\S+), "
                  r"ETA (\S+), rss \S+")


def _args(tmp_path, model_cache_dir, *more):
    (tmp_path / "long.jsonl").write_text(ROW)
    return [sys.executable, "-m", "kvbatch", "model=tiny", f"model.cache_dir={model_cache_dir}",
            f"output.root={tmp_path / 'out'}", f"job.input={tmp_path / 'long.jsonl'}", "job.max_tokens=1500", *more]


def _count(text: str) -> float:
    """tqdm's unit-scaled count: '850' -> 850, '1.20k' -> 1200."""
    scale = {"k": 1e3, "M": 1e6, "G": 1e9}
    return float(text[:-1]) * scale[text[-1]] if text[-1] in scale else float(text)


# ---- Progress itself, on a manual clock ------------------------------------------------------------

def test_the_bar_redraws_with_every_steps_tokens_before_the_row_finishes():
    stream = io.StringIO()  # not a terminal: progress=on draws the bar anyway
    p = Progress(1, 1500, "on", stream=stream, clock=ManualClock(0.0), redraw_s=0)
    for _ in range(3):
        p.tokens(100)  # one engine step's tokens
    p.row_done(unused_budget=1500 - 300)  # the row stopped early: the total shrinks to what it made
    p.close()
    draws = [(_count(n), _count(total), int(rows), int(of)) for n, total, rows, of in DRAW.findall(stream.getvalue())]
    assert draws[:4] == [(0, 1500, 0, 1), (100, 1500, 0, 1), (200, 1500, 0, 1), (300, 1500, 0, 1)], draws
    assert draws[4:] and set(draws[4:]) == {(300, 300, 1, 1)}, draws
    assert "kvbatch: progress" not in stream.getvalue()  # a bar, no plain lines


def test_plain_lines_every_interval_on_the_clock():
    stream, clock = io.StringIO(), ManualClock(0.0)
    p = Progress(2, 200, "auto", every_s=1.0, stream=stream, clock=clock)  # a StringIO is no terminal: lines
    p.tokens(10)  # 0 s in: no line yet
    clock.advance(1)
    p.tokens(10)  # 1 s: a line
    clock.advance(0.5)
    p.tokens(10)  # 1.5 s: not yet
    clock.advance(0.5)
    p.tokens(10)  # 2 s: a line
    p.row_done(unused_budget=70)  # 200 - 70: the ETA tightens
    clock.advance(3)
    p.row_done()  # 5 s: a line, and close() writes the last one
    p.close()
    p.close()  # twice on Ctrl-C paths: one last line
    text = stream.getvalue()
    assert LINE.findall(text) == [
        ("0", "2", "20", "200", "20.0", "1s", "9s"),
        ("0", "2", "40", "200", "20.0", "2s", "8s"),
        ("2", "2", "40", "130", "8.0", "5s", "11s"),
        ("2", "2", "40", "130", "8.0", "5s", "11s"),
    ], text
    assert len(text.splitlines()) == 4 and "\r" not in text and "|" not in text


def test_lines_off_on_a_terminal_and_with_progress_off():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    for mode, stream in (("off", io.StringIO()), ("off", Tty()), ("auto", Tty())):
        clock = ManualClock(0.0)
        p = Progress(1, 100, mode, every_s=1.0, stream=stream, clock=clock, redraw_s=0)
        clock.advance(5)
        p.tokens(100)
        p.row_done()
        p.close()
        assert "kvbatch: progress" not in stream.getvalue(), (mode, stream.getvalue())
        assert ("rows 1/1" in stream.getvalue()) == (mode == "auto"), (mode, stream.getvalue())


# ---- The worker reports every step's tokens (in process, recorded) ------------------------------------

def test_the_worker_reports_tokens_every_step_before_the_row_finishes(tmp_path, model_cache_dir, monkeypatch):
    events: list[tuple[str, int]] = []

    class Recording(Progress):
        def tokens(self, n: int) -> None:
            events.append(("tokens", n))
            super().tokens(n)

        def row_done(self, unused_budget: int = 0, generated=None) -> None:
            events.append(("row", unused_budget))
            super().row_done(unused_budget, generated)

    monkeypatch.setattr(actions, "Progress", Recording)
    (tmp_path / "long.jsonl").write_text(ROW)
    cfg = compose_config(["model=tiny", f"model.cache_dir={model_cache_dir}", f"output.root={tmp_path / 'out'}",
                          f"job.input={tmp_path / 'long.jsonl'}", "job.max_tokens=40", "output.progress=off"])
    path = actions.execute(cfg)
    made = pq.read_table(path).to_pylist()[0]["output_tokens"]
    assert made == 40, json.dumps(events)
    first_row = events.index(next(e for e in events if e[0] == "row"))
    steps = [n for kind, n in events[:first_row] if kind == "tokens" and n > 0]
    assert len(steps) >= 10 and sum(steps) == made, events  # many steps, each reported, before the row is done
    assert events[first_row] == ("row", 0)


# ---- The command: what it writes whatever the timing ------------------------------------------------

def test_bar_on_a_terminal_from_the_empty_job_to_the_finished_row(tmp_path, model_cache_dir):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a terminal has a size
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(_args(tmp_path, model_cache_dir), stdin=slave, stdout=slave, stderr=slave,
                            cwd=tmp_path, env=env, close_fds=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 240  # only a limit on a hung child, never reached by a working run
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=60)
    os.close(master)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-2000:]
    # the first draw (before any token) and the last (the row written) are made however fast the run is;
    # redraws between them depend on the bar's interval, so only their order is checked
    draws = [(_count(n), _count(total), int(rows), int(of)) for n, total, rows, of in DRAW.findall(text)]
    assert draws and draws[0] == (0, 1500, 0, 1), text[-2000:]
    assert draws[-1] == (1500, 1500, 1, 1), draws[-3:]
    counts = [d[0] for d in draws]
    assert sorted(counts) == counts


def test_plain_progress_lines_when_stderr_is_not_a_terminal(tmp_path, model_cache_dir):
    log = tmp_path / "run.log"
    with open(log, "w") as fh:
        p = subprocess.run(_args(tmp_path, model_cache_dir), stdout=fh, stderr=fh, cwd=tmp_path,
                           env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=240)
    text = log.read_text()
    assert p.returncode == 0, text
    lines = LINE.findall(text)  # output.progress_every=5m: only the last line, written at the end of the run
    assert lines and lines[-1][:4] == ("1", "1", "1500", "1500"), text
    assert lines[-1][6] == "0s"  # ETA: nothing left
    assert "\r" not in text and "|" not in text.replace("kvbatch: progress", "")  # no bar in a log file


def test_eta_within_2x_of_the_truth_once_a_quarter_of_the_rows_finished():
    """Answers end at a tenth of max_tokens (5..15 of 100): the ETA follows the answers seen so far,
    not the budget. A simulated batch of 8 makes one token per row per second on a manual clock."""
    clock = ManualClock(0.0)
    rows, max_tokens, slots = 40, 100, 8
    lengths = [5 + (i * 7) % 11 for i in range(rows)]  # 5..15, mean 10
    p = Progress(rows, rows * max_tokens, "off", clock=clock)
    queue, running, etas = list(lengths), {}, []
    t, nxt = 0, 0
    while queue or running:
        while queue and len(running) < slots:
            running[nxt], nxt = [queue.pop(0), 0], nxt + 1
        clock.advance(1)
        t += 1
        p.tokens(len(running))
        for k in list(running):
            running[k][1] += 1
            if running[k][1] == running[k][0]:
                del running[k]
                p.row_done(max_tokens - running.get(k, [0, lengths[k]])[1], lengths[k])
                if rows // 4 <= p.rows <= rows * 3 // 4:
                    etas.append((t, p.eta_s()))
    end = t
    for at, eta in etas:
        truth = end - at
        assert truth / 2 <= eta <= truth * 2, (at, eta, truth)
    assert len(etas) > 10
