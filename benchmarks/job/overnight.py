"""An overnight-shaped job: stopped by its deadline half-way, then run again to the end, against one run.

The job (whole `kvbatch` processes, prompts of mixed length, greedy, EOS ignored so every row is long) runs
uninterrupted (wall W; the first round's W sets the deadline of every round), then in a fresh folder with
`worker.deadline` at `--at` x W (a night that ends early: rows in flight are checkpointed at the deadline) and once
more without a deadline (the next night: those rows continue from their checkpoints), twice: with the rows' K/V
pages kept at the stop (`worker.keep_kv=true`: the second night loads them and prefills only the rest) and without
(it re-prefills prompt + kept tokens). The two alternate with each other and with the uninterrupted run over
`--repeat` rounds, and each round's ratios are to its own uninterrupted run (on a shared machine the load drifts
more than the effect). Reported per variant: the two runs' total wall / W (1.0 = nothing lost but a second start),
the same for the workers' own time (process start and model load left out: an overnight job amortizes them) and
the processes' CPU seconds (what a shared machine's load moves less), tokens carried over, tokens generated in all
(= tokens out: nothing generated twice), the K/V files (count, bytes, seconds to write them, tokens loaded and
seconds to load them), each night's prefill and decode seconds, and whether the outputs equal the uninterrupted
run's. The nights depend on each other; run it more than once on a shared machine.

    python -m benchmarks job.overnight --model smollm2 --rows 64 --new 4096 --at 0.5
"""
from __future__ import annotations

import json
import shlex
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import children_cpu_s
from benchmarks.job.job_vs_mlx_lm import prompts, run_kvbatch

SMOKE = ["--model", "tiny", "--rows", "2", "--new", "8", "--max-words", "5", "--wall", "2", "--variants", "kept_kv"]


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
    ap.add_argument("--variants", default="both", choices=["both", *VARIANTS],
                    help="the nights with their K/V pages kept at the stop (worker.keep_kv), re-prefilling, or both")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of the nights (each variant once a round, alternating)")
    ap.add_argument("--kvbatch-args", default="")
    ap.add_argument("--kvbatch-cmd", default=f"{sys.executable} -m kvbatch")


VARIANTS = {"kept_kv": ["worker.keep_kv=true"], "re_prefill": ["worker.keep_kv=false"]}


def _whole(a, cmd, inp, folder: Path, margs: dict, extra: list[str]) -> dict:
    """One uninterrupted run in `folder`: its wall, CPU seconds, worker wall, engine figures and outputs."""
    c0 = children_cpu_s()
    whole = run_kvbatch(cmd, inp, folder, a.model, margs, a.new, extra)
    s0 = json.loads((folder / "summary.json").read_text())
    return {"wall_s": whole["wall_s"], "cpu_s": children_cpu_s() - c0, "outputs": whole["outputs"],
            "worker_wall_s": s0["this_run"]["wall_s"],
            "engine": {f: (s0.get("engine") or {}).get(f) for f in ("prefill_s", "decode_s", "prefill_tokens_total",
                                                                    "generated_tokens")}}


def _nights(a, cmd, inp, folder: Path, margs: dict, extra: list[str], deadline: int) -> dict:
    """Night 1 (stopped by the deadline) and night 2 (to the end) in `folder`: their walls, CPU seconds and
    what the second one carried over, loaded and prefilled (ratios to an uninterrupted run: _ratios)."""
    cpu = [children_cpu_s()]
    first = run_kvbatch(cmd, inp, folder, a.model, margs, a.new, extra + [f"worker.deadline={deadline}s"])
    cpu.append(children_cpu_s())
    s1 = json.loads((folder / "summary.json").read_text())
    kv_dir = folder / "kv"
    kv_files = sorted(kv_dir.glob("*.safetensors")) if kv_dir.is_dir() else []
    kv_bytes = sum(f.stat().st_size for f in kv_files)
    second = run_kvbatch(cmd, inp, folder, a.model, margs, a.new, extra)
    cpu.append(children_cpu_s())
    s2 = json.loads((folder / "summary.json").read_text())
    return {"first_wall_s": first["wall_s"], "second_wall_s": second["wall_s"],
            "first_rows_done": first["rows"], "stopped_by_deadline": first["rows"] < a.rows,
            "tokens_carried_over": s2["this_run"]["tokens_carried_over"],
            "tokens_generated": s1["this_run"]["generated_tokens"] + s2["this_run"]["generated_tokens"],
            "tokens_out": second["tokens"],
            # the K/V pages kept at the stop (worker.keep_kv): files, bytes, seconds; tokens loaded next night
            # and the seconds the engine spent reading and placing them
            "kv_files": len(kv_files), "kv_bytes": kv_bytes, "kv_kept_tokens": s1["this_run"].get("kv_kept_tokens"),
            "kv_save_s": s1["this_run"].get("kv_save_s"),
            "kv_restored_tokens": s2["this_run"].get("kv_restored_tokens"),
            "kv_restore_s": (s2.get("engine") or {}).get("kv_restore_s"),
            "outputs": second["outputs"],
            "cpu_s": {"first": cpu[1] - cpu[0], "second": cpu[2] - cpu[1]},
            # where the two nights' time goes: the second one's prefill (re-prefill or only the rest) and decode
            "engine": {k: {f: (s.get("engine") or {}).get(f) for f in ("prefill_s", "decode_s",
                                                                       "prefill_tokens_total", "generated_tokens")}
                       for k, s in (("first", s1), ("second", s2))},
            "worker_wall_s": {"first": s1["this_run"]["wall_s"], "second": s2["this_run"]["wall_s"]}}


def _ratios(n: dict, whole: dict) -> dict:
    """A variant's nights against the uninterrupted run of the same round: total wall, the workers' own time
    (process start and model load left out: a night's job amortizes them), CPU seconds; identical outputs."""
    outputs = n.pop("outputs")
    w, c = n["worker_wall_s"], n["cpu_s"]
    return {**n, "total_vs_uninterrupted": (n["first_wall_s"] + n["second_wall_s"]) / whole["wall_s"],
            "work_vs_uninterrupted": (w["first"] + w["second"]) / whole["worker_wall_s"],
            "total_cpu_vs_uninterrupted": (c["first"] + c["second"]) / whole["cpu_s"],
            "identical": outputs == whole["outputs"]}


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
    names = [v for v in VARIANTS if a.variants in ("both", v)]
    rounds: dict[str, list[dict]] = {v: [] for v in names}
    wholes: list[dict] = []
    deadline = 0
    for i in range(a.repeat):  # alternating, the uninterrupted run too: the load drifts, each sees both ends of it
        order = ["whole", *names] if i % 2 == 0 else [*names[::-1], "whole"]
        whole, nights = None, {}
        for v in order:
            if v == "whole":
                whole = _whole(a, cmd, inp, tmp / f"whole_{i}", margs, extra) if a.wall is None \
                    else {"wall_s": a.wall, "cpu_s": None, "worker_wall_s": None, "outputs": None, "engine": None}
                deadline = deadline or max(1, int(a.at * whole["wall_s"]))  # the first round's, for every round
            else:
                nights[v] = _nights(a, cmd, inp, tmp / f"nights_{v}_{i}", margs, extra + VARIANTS[v], deadline)
        assert whole is not None
        for v, n in nights.items():
            rounds[v].append(_ratios(n, whole) if a.wall is None else {**n, "outputs": None})
        wholes.append({k: whole[k] for k in ("wall_s", "cpu_s", "worker_wall_s", "engine")})
    result = {"uninterrupted": wholes, "deadline_s": deadline, "rounds": rounds,
              "total_vs_uninterrupted": {v: [r.get("total_vs_uninterrupted") for r in rs] for v, rs in rounds.items()},
              "total_cpu_vs_uninterrupted": {v: [r.get("total_cpu_vs_uninterrupted") for r in rs]
                                             for v, rs in rounds.items()},
              "identical": all(r.get("identical") is not False for rs in rounds.values() for r in rs)}
    print(json.dumps(result))
    return result
