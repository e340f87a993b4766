"""An overnight-shaped job: stopped by its deadline half-way, then run again to the end, against one run.

The job (whole `kvbatch` processes, prompts of mixed length, greedy, EOS ignored so every row is long) runs once
uninterrupted (wall W), then in a fresh folder with `worker.deadline` at `--at` x W (a night that ends early:
rows in flight are checkpointed at the deadline) and once more without a deadline (the next night: those rows
continue from their checkpoints). Reported: the two runs' total wall / W (1.0 = nothing lost but a second start),
the same for the workers' own time (process start and model load left out: an overnight job amortizes them),
tokens carried over, tokens generated in all (= tokens out: nothing generated twice), and whether the outputs
equal the uninterrupted run's; then the same ratio in the processes' CPU seconds (what a shared machine's load
does not move), and each run's prefill and decode seconds (the second night re-prefills prompt + kept tokens).
Alternates nothing (the runs depend on each other); run it more than once on a shared machine.

    python -m benchmarks job.overnight --model smollm2 --rows 64 --new 4096 --at 0.5
"""
from __future__ import annotations

import json
import resource
import shlex
import sys
import tempfile
from pathlib import Path

from benchmarks.job.job_vs_mlx_lm import prompts, run_kvbatch

def _cpu_s() -> float:
    """CPU seconds of this process's finished children (the kvbatch runs): on a shared machine the work a
    run did, where its wall also counts the other sessions' load."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


SMOKE = ["--model", "tiny", "--rows", "2", "--new", "8", "--max-words", "5", "--wall", "2"]


def add_args(ap) -> None:
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--model-args", default="", help="model=tiny geometry: 'num_layers=16 ...' (the GPU stage's)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--new", type=int, default=4096)
    ap.add_argument("--max-words", type=int, default=200)
    ap.add_argument("--at", type=float, default=0.5, help="the deadline as a fraction of the uninterrupted wall")
    ap.add_argument("--wall", type=float, default=None,
                    help="take this as the uninterrupted wall instead of measuring it (no identity check then)")
    ap.add_argument("--warm", type=int, default=0,
                    help="first a job of this many tokens a row in a folder of its own, unmeasured: on a GPU "
                         "the first process compiles the kernels and would bill them to the uninterrupted run")
    ap.add_argument("--kvbatch-args", default="")
    ap.add_argument("--kvbatch-cmd", default=f"{sys.executable} -m kvbatch")


def run(a) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvbatch-overnight-"))
    inp = tmp / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": t}) + "\n"
                           for i, t in enumerate(prompts(a.rows, 11, a.max_words))))
    extra = [*shlex.split(a.kvbatch_args), "job.ignore_eos=true"]
    cmd = shlex.split(a.kvbatch_cmd)
    margs = dict(kv.split("=", 1) for kv in shlex.split(a.model_args))
    if a.warm:
        run_kvbatch(cmd, inp, tmp / "warm", a.model, margs, a.warm, extra)
    cpu = [_cpu_s()]
    whole = run_kvbatch(cmd, inp, tmp / "whole", a.model, margs, a.new, extra) if a.wall is None \
        else {"wall_s": a.wall, "outputs": None}
    cpu.append(_cpu_s())
    s0 = json.loads((tmp / "whole" / "summary.json").read_text()) if a.wall is None else None
    work = s0["this_run"]["wall_s"] if s0 else None
    deadline = max(1, int(a.at * whole["wall_s"]))
    first = run_kvbatch(cmd, inp, tmp / "nights", a.model, margs, a.new, extra + [f"worker.deadline={deadline}s"])
    cpu.append(_cpu_s())
    s1 = json.loads((tmp / "nights" / "summary.json").read_text())
    second = run_kvbatch(cmd, inp, tmp / "nights", a.model, margs, a.new, extra)
    cpu.append(_cpu_s())
    s2 = json.loads((tmp / "nights" / "summary.json").read_text())
    whole_cpu, first_cpu, second_cpu = (hi - lo for lo, hi in zip(cpu, cpu[1:]))
    result = {"uninterrupted_wall_s": whole["wall_s"], "deadline_s": deadline, "first_wall_s": first["wall_s"],
              "second_wall_s": second["wall_s"], "total_vs_uninterrupted": (first["wall_s"] + second["wall_s"])
              / whole["wall_s"], "first_rows_done": first["rows"], "stopped_by_deadline": first["rows"] < a.rows,
              "tokens_carried_over": s2["this_run"]["tokens_carried_over"],
              "tokens_generated": s1["this_run"]["generated_tokens"] + s2["this_run"]["generated_tokens"],
              "tokens_out": second["tokens"],
              # the workers' own time (model load and process start left out: a night's job amortizes them)
              "work_vs_uninterrupted": (s1["this_run"]["wall_s"] + s2["this_run"]["wall_s"]) / work if work else None,
              "identical": None if whole["outputs"] is None else second["outputs"] == whole["outputs"],
              # the processes' CPU seconds (user + system): the same ratio, robust to other sessions' load
              "cpu_s": {"uninterrupted": whole_cpu, "first": first_cpu, "second": second_cpu},
              "total_cpu_vs_uninterrupted": (first_cpu + second_cpu) / whole_cpu if a.wall is None else None,
              # where the two nights' extra time goes: the re-prefill of prompt + kept tokens, and decode
              "engine": {k: {f: (s.get("engine") or {}).get(f) for f in ("prefill_s", "decode_s",
                                                                       "prefill_tokens_total", "generated_tokens")}
                         for k, s in (("uninterrupted", s0), ("first", s1), ("second", s2)) if s},
              "worker_wall_s": {k: s["this_run"]["wall_s"] for k, s in (("uninterrupted", s0), ("first", s1),
                                                                         ("second", s2)) if s}}
    print(json.dumps(result))
    return result
