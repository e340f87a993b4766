"""The `kvbatch` command's decode against its engine's at the same batch and context (issue 42).

The same rows (--rows prompts of --prompt tokens, --new tokens each, EOS ignored, greedy) run twice, each side a
process of its own: through the command (queue, worker, progress, checkpoints, Parquet parts), and through the
engine alone (`Engine.generate` with the engine config the command composes from the same overrides). Decode
tok/s on each side = generated tokens / (the side's generation wall - its engine's prefill seconds): for the
command, the worker's run (`summary.json` this_run.wall_s), so whatever the worker does between the engine's
steps counts against it. The sides alternate, order reversed every other round; each round's figures are kept,
the medians are the numbers (`command_share`: the command's decode tok/s over the engine's).

    python -m benchmarks job.command_vs_engine --rows 32 --prompt 128 --new 256 --rounds 2
"""
from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ROOT
from benchmarks.job.job_vs_mlx_lm import token_prompts

SMOKE = ["--rows", "2", "--prompt", "8", "--new", "4", "--rounds", "1"]

ENGINE = r"""
import json, sys, time
from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.config import engine_config
from kvbatch.pipeline.prompts import encode
from kvbatch.engine import Engine, load_model
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
a = json.loads(sys.argv[1])
cfg = compose_config(a["overrides"])
model, tok, spec = load_model(cfg.model)
eng = Engine(model, tok, spec, engine_config(cfg))
rows = [json.loads(line) for line in open(a["input"])]
reqs = [Request(r["id"], encode(tok, {"prompt": r["prompt"]}, cfg.job),
                SamplingParams(max_tokens=a["new"], ignore_eos=True)) for r in rows]
t0 = time.perf_counter()
res = eng.generate(reqs)
wall = time.perf_counter() - t0
s = eng.summary()
print(json.dumps({"wall_s": wall, "tokens": sum(len(r.tokens) for r in res), "prefill_s": s["prefill_s"],
                  "decode_s": s["decode_s"],
                  "engine_decode_tps": s["decode_tokens_per_s"], "max_batch": eng.max_batch}))
"""


def add_args(ap) -> None:
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt", default="128",
                    help="prompt tokens per row: N, or LO-HI (uniform, as the whole-job benchmark's rows)")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model-args", default="", help="model=tiny geometry: 'num_layers=16 ...'")
    ap.add_argument("--kvbatch-args", default="", help="overrides for both sides (kv=q8, engine.max_batch=...)")
    ap.add_argument("--python", default=sys.executable)


def _overrides(a, inp: Path) -> list[str]:
    model = [f"model.{kv}" for kv in shlex.split(a.model_args)]
    return ["model=tiny", *model, f"job.input={inp}", f"job.max_tokens={a.new}", "job.ignore_eos=true",
            f"engine.max_batch={a.rows}", *shlex.split(a.kvbatch_args)]


def command(a, inp: Path, out: Path) -> dict:
    p = subprocess.run([a.python, "-m", "kvbatch", *_overrides(a, inp), f"output.dir={out}", "output.progress=off"],
                       capture_output=True, text=True, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"kvbatch failed ({p.returncode}):\n{p.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    run, eng = s["this_run"], s["engine"]
    return {"wall_s": run["wall_s"], "tokens": run["generated_tokens"], "prefill_s": eng["prefill_s"],
            "decode_s": eng["decode_s"],
            "engine_decode_tps": eng["decode_tokens_per_s"], "max_batch": eng.get("max_batch")}


def engine(a, inp: Path) -> dict:
    p = subprocess.run([a.python, "-c", ENGINE, json.dumps({"overrides": _overrides(a, inp), "input": str(inp),
                                                             "new": a.new})],
                       capture_output=True, text=True, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"engine side failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run(a) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvbatch-cve-"))
    inp = tmp / "rows.jsonl"
    model_cfg = {"source": "tiny", "name": "tiny",
                 **{k: (int(v) if v.lstrip("-").isdigit() else v)
                    for k, v in (kv.split("=", 1) for kv in shlex.split(a.model_args))}}
    lo, _, hi = a.prompt.partition("-")
    texts = token_prompts(a.rows, 11, int(lo), int(hi or lo), model_cfg)
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    rounds = []
    for k in range(a.rounds):
        order = ["command", "engine"] if k % 2 == 0 else ["engine", "command"]
        sides = {}
        for side in order:
            t0 = time.perf_counter()
            sides[side] = command(a, inp, tmp / f"out{k}") if side == "command" else engine(a, inp)
            sides[side]["process_s"] = time.perf_counter() - t0
            v = sides[side]
            v["decode_tps"] = v["tokens"] / max(v["wall_s"] - v["prefill_s"], 1e-9)
        line = {"round": k, "order": order, **sides,
                "command_share": sides["command"]["decode_tps"] / sides["engine"]["decode_tps"]}
        print(json.dumps(line), flush=True)
        rounds.append(line)
    result = {"command_share": statistics.median(r["command_share"] for r in rounds),
              **{f"{s}_decode_tps": statistics.median(r[s]["decode_tps"] for r in rounds)
                 for s in ("command", "engine")},
              "rows": a.rows, "prompt": a.prompt, "new": a.new, "rounds": rounds}
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))
    return result
