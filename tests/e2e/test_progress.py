"""Progress moves with tokens (issue 22.8): a bar on a terminal that advances before the first row
finishes, and plain periodic lines when stderr is a log file."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

ROW = '{"id": "long", "prompt": "Tell me a long story."}\n'  # the tiny model runs it to max_tokens


def _args(tmp_path, model_cache_dir, *more):
    (tmp_path / "long.jsonl").write_text(ROW)
    return [sys.executable, "-m", "kvbatch", "model=tiny", f"model.cache_dir={model_cache_dir}",
            f"output.root={tmp_path / 'out'}", f"job.input={tmp_path / 'long.jsonl'}", "job.max_tokens=1500", *more]


def _count(text: str) -> float:
    """tqdm's unit-scaled count: '850' -> 850, '1.20k' -> 1200."""
    scale = {"k": 1e3, "M": 1e6, "G": 1e9}
    return float(text[:-1]) * scale[text[-1]] if text[-1] in scale else float(text)


def test_bar_on_a_terminal_counts_tokens_before_the_first_row_finishes(tmp_path, model_cache_dir):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a terminal has a size
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(_args(tmp_path, model_cache_dir), stdin=slave, stdout=slave, stderr=slave,
                            cwd=tmp_path, env=env, close_fds=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 240
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
    # every redraw of the bar: "<tokens>/<budget> [... rows <done>/<total>, ...]"
    draws = re.findall(r"(\d+(?:\.\d+)?[kMG]?)/(\d+(?:\.\d+)?[kMG]?) \[[^\]]*?rows (\d+)/1", text)
    before = [_count(n) for n, total, rows in draws if rows == "0"]
    assert len(set(before)) >= 2 and max(before) > 0, text[-2000:]  # moved while 0 of 1 rows were done
    assert sorted(before) == before and _count(draws[0][1]) == 1500
    assert ("1.50k", "1.50k", "1") in draws, draws[-3:]


def test_plain_progress_lines_when_stderr_is_not_a_terminal(tmp_path, model_cache_dir):
    log = tmp_path / "run.log"
    with open(log, "w") as fh:
        # 10 layers: the 1,500 tokens take several seconds on any host (2 layers took 2 s: one line before the end)
        p = subprocess.run(_args(tmp_path, model_cache_dir, "output.progress_every=1s", "model.num_layers=10"),
                           stdout=fh, stderr=fh, cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"},
                           timeout=240)
    text = log.read_text()
    assert p.returncode == 0, text
    lines = re.findall(r"kvbatch: progress: (\d+)/1 rows, (\d+)/(\d+) tokens, ([\d.]+) tok/s, "
                       r"elapsed \S+, ETA (\S+)", text)
    during = [int(t) for rows, t, _, _, _ in lines if rows == "0"]
    assert len(during) >= 2 and sorted(during) == during and during[0] > 0, text
    assert lines[-1][:3] == ("1", "1500", "1500"), text
    assert "\r" not in text and "|" not in text.replace("kvbatch: progress", "")  # no bar in a log file
