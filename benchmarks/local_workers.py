"""A job run by several worker processes on one device, as a drop-in for the `kvbatch` command in a
benchmark side (`--spec-b-cmd "python -m benchmarks.local_workers --workers 2 --budget 30GiB"`):
`action=enqueue`, then N `action=work` processes at once on the job's queue (each with the fixed memory
budget given, so that together they fit the device), then `action=finalize`. Its stdout and stderr are the
finalize's (the last line: results.parquet's path), so the side reads the results as it reads the command's.

Where one process's host work (graph building, kernel launches) leaves the device idle between steps,
a second process's steps can fill those gaps: this measures how much.

    python -m benchmarks.local_workers --workers 2 --budget 30GiB model=tiny job.name=x ...
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--budget", required=True, help="each worker's memory budget (memory=fixed memory.budget=...)")
    ap.add_argument("--python", default=sys.executable)
    a, args = ap.parse_known_args(argv)
    kvbatch = [a.python, "-m", "kvbatch", *args]
    enq = subprocess.run([*kvbatch, "action=enqueue"], capture_output=True, text=True)
    if enq.returncode:
        sys.stderr.write(enq.stderr)
        return enq.returncode
    work = [*kvbatch, "action=work", "memory=fixed", f"memory.budget={a.budget}"]
    # each worker's stderr to a file: a pipe read only after the worker before it ends could fill and stall it
    logs = [tempfile.TemporaryFile("w+") for _ in range(a.workers)]
    procs = [subprocess.Popen(work, stdout=subprocess.DEVNULL, stderr=log, text=True) for log in logs]

    def forward(sig: int, _frame) -> None:  # a benchmark's cut stops every worker at its next step
        for p in procs:
            p.send_signal(sig)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for p in procs:
        p.wait()
    errs = []
    for log in logs:
        log.seek(0)
        errs.append(log.read())
        log.close()
    for p, err in zip(procs, errs):
        if p.returncode:
            sys.stderr.write(err[-3000:])
            return p.returncode
    fin = subprocess.run([*kvbatch, "action=finalize"], capture_output=True, text=True)
    sys.stdout.write(fin.stdout)
    sys.stderr.write("".join(errs) + fin.stderr)
    return fin.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
