"""What checkpointing rows in flight costs a whole `kvbatch` job (worker.checkpoint_every), side by side.

The same job (prompts of mixed length, greedy, whole processes timed from start to exit as in
job.job_vs_mlx_lm) three ways, alternating within each round so drift on a shared machine is spread: periodic
checkpoints off, at the default interval, and at a dense interval (`--dense`, every second: many more
checkpoints than the default makes, so its cost is measurable in a short job). Reported per round: tok/s of each
and the ratios to `off`, the row checkpoints each saved and the share of its wall the worker spent in them
(summary.json), and from the dense side the default's cost at any job length: the dense side's extra share of
time (its wall over `off`'s, and the time measured inside its checkpoints) x dense interval / default
interval. The outputs must be identical on every side (checkpoints never change tokens).

    python -m benchmarks job.checkpoint_cost --model smollm2 --rows 32 --new 256 --rounds 2
"""
from __future__ import annotations

import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.job.job_vs_mlx_lm import prompts, run_kvbatch

SMOKE = ["--model", "tiny", "--rows", "2", "--new", "4", "--max-words", "5", "--rounds", "1", "--sides", "dense"]
OFF = ["worker.checkpoint_every.seconds=0", "worker.checkpoint_every.tokens=0"]


def add_args(ap) -> None:
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--max-words", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dense", type=int, default=1, help="the dense side's worker.checkpoint_every.seconds")
    ap.add_argument("--default-seconds", type=float, default=60.0,
                    help="the default interval the per-checkpoint cost is priced at (worker.checkpoint_every)")
    ap.add_argument("--sides", default="off,default,dense", help="which of off, default, dense to run")
    ap.add_argument("--kvbatch-args", default="")
    ap.add_argument("--kvbatch-cmd", default=f"{sys.executable} -m kvbatch")


def _side(a, name: str, extra: list[str], inp: Path, out: Path) -> dict:
    r = run_kvbatch(shlex.split(a.kvbatch_cmd), inp, out, a.model, {}, a.new, extra)
    s = json.loads((out / "summary.json").read_text())
    r["checkpoints"] = s["this_run"].get("checkpoints", 0)
    r["checkpoint_s"] = s["this_run"].get("checkpoint_s", 0.0)  # measured inside the worker
    return r


def run(a) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvbatch-ckcost-"))
    inp = tmp / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": t}) + "\n"
                           for i, t in enumerate(prompts(a.rows, 7, a.max_words))))
    extra = shlex.split(a.kvbatch_args)
    every = {"off": OFF, "default": [], "dense": [f"worker.checkpoint_every.seconds={a.dense}"]}
    sides = {n: every[n] for n in a.sides.split(",")}
    rounds = []
    for k in range(a.rounds):
        order = list(sides) if k % 2 == 0 else list(reversed(sides))
        got = {name: _side(a, name, extra + sides[name], inp, tmp / f"{name}{k}") for name in order}
        line = {"round": k, "order": order, **{f"{n}_tok_s": got[n]["tok_s"] for n in sides},
                **{f"{n}_wall_s": got[n]["wall_s"] for n in sides},
                **{f"{n}_checkpoints": got[n]["checkpoints"] for n in sides},
                **{f"{n}_checkpoint_share": got[n]["checkpoint_s"] / got[n]["wall_s"] for n in sides},
                "identical": all(got[n]["outputs"] == got[order[0]]["outputs"] for n in sides)}
        off, dense = got.get("off"), got.get("dense")
        if off and "default" in got:
            line["default_vs_off"] = got["default"]["tok_s"] / off["tok_s"]
        if off and dense:
            line["dense_vs_off"] = dense["tok_s"] / off["tok_s"]
            line["dense_extra_share"] = dense["wall_s"] / off["wall_s"] - 1
        print(json.dumps(line), flush=True)
        rounds.append(line)
    def median(key: str):
        vals = [r[key] for r in rounds if key in r]
        return statistics.median(vals) if vals else None

    extra, inside = median("dense_extra_share"), median("dense_checkpoint_share")
    result = {"median_default_vs_off": median("default_vs_off"), "median_dense_vs_off": median("dense_vs_off"),
              "median_dense_extra_share": extra, "median_dense_checkpoint_share": inside,
              "identical": all(r["identical"] for r in rounds), "rounds": rounds}
    # the default's cost at any job length: the dense side's share of time scaled by the intervals' ratio (from
    # the wall difference, and from the time the worker measured inside its checkpoints)
    if extra is not None:
        result["default_cost_share"] = max(extra, 0.0) * a.dense / a.default_seconds
    if inside is not None:
        result["default_cost_share_inside"] = inside * a.dense / a.default_seconds
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))
    return result
