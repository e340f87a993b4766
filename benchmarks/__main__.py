"""`python -m benchmarks --list` | `python -m benchmarks NAME [--smoke] [--out FILE] [options]`.

NAME: area.name (or the name alone where it is unique). --smoke runs the benchmark's SMOKE options (the tiny
random model, a couple of steps) before yours. Every run writes one JSON record (benchmarks/harness.py:
record) to --out, default /tmp/kvbatch-bench/NAME-<UTC time>.json, and prints its path last.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

from benchmarks import BENCHMARKS


def resolve(name: str) -> str:
    if name in BENCHMARKS:
        return name
    hits = [k for k in BENCHMARKS if k.split(".", 1)[1] == name]
    if len(hits) != 1:
        raise SystemExit(f"benchmarks: unknown benchmark {name!r} (python -m benchmarks --list)")
    return hits[0]


def refusal(needs: str) -> str | None:
    """Why this machine cannot run a benchmark that needs `needs` (None: it can)."""
    if needs == "cuda":
        import mlx.core as mx

        if not mx.cuda.is_available():
            return f"needs MLX's CUDA backend; this machine runs MLX on {mx.default_device()}"
    if needs == "nvcc":
        import shutil

        if not shutil.which("nvcc"):
            return "needs nvcc (the CUDA toolkit) on PATH"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("--list", "-h", "--help"):
        print(__doc__.strip() + "\n")
        for k, v in BENCHMARKS.items():
            print(f"  {k:26s} {v}")
        return 0
    name, rest = resolve(argv[0]), argv[1:]
    mod = importlib.import_module(f"benchmarks.{name}")
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=mod.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help=f"a tiny run first of all: {' '.join(mod.SMOKE)}")
    ap.add_argument("--out", default="", help="the run's JSON record (default: /tmp/kvbatch-bench/NAME-TIME.json)")
    mod.add_args(ap)
    smoke = "--smoke" in rest
    args = ap.parse_args([*(mod.SMOKE if smoke else []), *rest])
    why = refusal(getattr(mod, "NEEDS", ""))
    if why:
        print(f"benchmarks {name}: refused: {why}", file=sys.stderr)
        return 2
    from benchmarks import harness  # (after the refusal: it imports the engine)

    out = args.out or f"/tmp/kvbatch-bench/{name}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}.json"
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    harness._RUN.update(name=name, argv=rest, args=settings, out=out, smoke=smoke)
    result = mod.run(args)
    harness.write_record(harness.record(name, rest, settings, result, smoke), out)
    print(f"record: {out}", flush=True)
    return 1 if isinstance(result, dict) and result.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
