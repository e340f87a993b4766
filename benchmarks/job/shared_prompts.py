"""Shared prompt pages (issue 21): whole jobs through the `kvbatch` command, side by side, alternating.

Part 1, a shared system prompt: --rows rows behind one ~--system-tokens system prompt (chat
messages: the system prompt, then a short question of their own), --new new tokens each, greedy.
Sides: kvbatch with `engine.prefix_cache=true`, kvbatch with `engine.prefix_cache=false`, and
mlx-lm's `batch_generate` on the same token ids (a process of its own: kvbatch.engine imported
first for OpenBLAS and kvbatch's model loader, the same weights).

Part 2, n samples: --prompts prompts with `sampling.n=--n`, against the same prompts written as
prompts x n duplicated rows (each its own id, so each its own derived seed), temperature 0.8, the
duplicated rows with the default prefix cache (which already shares their full prompt pages) and
without it (every copy prefilled). The same work (the same number of rows and max_tokens).

Every side is a whole process timed from start to exit; tok/s = generated tokens / wall. The order
of the sides rotates every round; each round's ratios are reported, the median is the number. Each
round also times the floor of a process: the same command on one row for one new token (start-up,
model load, writing the results), and reports the ratios of tok/s past that floor (tokens / (wall -
floor)) beside the whole-job ratios: what the engine's work decides.

    python -m benchmarks job.shared_prompts --rounds 2 --out /tmp/shared_prompts_cpu.json
"""
from __future__ import annotations

import json
import random
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.job.job_vs_mlx_lm import WORDS, run_kvbatch, run_mlx_lm_script

SMOKE = ["--model", "tiny", "--rows", "2", "--system-words", "5", "--new", "2", "--prompts", "1", "--n", "2",
         "--sample-words", "3", "--sample-new", "2", "--rounds", "1", "--parts", "system", "--no-warm", "--no-floor"]

MLX_LM = r"""
import json, sys, time
t0 = time.perf_counter()
import kvbatch.engine as engine  # OpenBLAS before mlx, and kvbatch's model loader (same weights)
from kvbatch.engine.models.config import ModelConfig
from mlx_lm import batch_generate
cfg = json.loads(sys.argv[1])
model, tok, spec = engine.load_model(ModelConfig(**cfg["model"]))
ids = [tok.apply_chat_template(json.loads(l)["messages"], add_generation_prompt=True) for l in open(cfg["input"])]
r = batch_generate(model, tok, ids, max_tokens=cfg["new"], return_token_ids=True)
s = r.stats
print(json.dumps({"outputs": {f"r{i}": list(map(int, t)) for i, t in enumerate(r.token_ids)},
                  "prompt_tokens": sum(map(len, ids)), "prompt_time": s.prompt_time,
                  "generation_time": s.generation_time, "inner_s": time.perf_counter() - t0}))
"""


def run_mlx_lm(python: str, input_path: Path, model_cfg: dict, new: int) -> dict:
    return run_mlx_lm_script(python, MLX_LM, {"input": str(input_path), "model": model_cfg, "new": new})


def text(rnd: random.Random, words: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(words))


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def kv_side(a, inp: Path, out: Path, new: int, extra: list[str]) -> dict:
    r = run_kvbatch([a.python, "-m", "kvbatch"], inp, out, a.model, a.model_args, new, extra)
    e = r["engine"]
    summary = json.loads((out / "summary.json").read_text())
    return {"wall_s": r["wall_s"], "tokens": r["tokens"], "tok_s": r["tok_s"], "ok": r["ok"], "rows": r["rows"],
            "prompt_tokens": summary["prompt_tokens"], "prefilled": e.get("prefill_tokens_total"),
            "cached": e.get("prompt_tokens_cached"), "forks": e.get("forks"), "prefill_s": e.get("prefill_s"),
            "decode_s": e.get("decode_s"), "peak_pages": e.get("peak_pages_in_use"),
            "max_batch": e.get("max_batch"), "peak_concurrency": e.get("peak_concurrency"),
            "outputs": r["outputs"]}


def slim(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "outputs"}


def add_args(ap) -> None:
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--system-words", type=int, default=760, help="~1,000 SmolLM2 tokens")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--sample-words", type=int, default=90)
    ap.add_argument("--sample-new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parts", default="system,samples")
    ap.add_argument("--kvbatch-args", default="")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--model-args", default="", help="model=tiny geometry for both sides: 'num_layers=16 ...'")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--no-warm", action="store_true", help="no untimed first run (that builds or converts the model)")
    ap.add_argument("--no-floor", action="store_true", help="no floor runs (the beyond-floor ratios then use 0 s)")


def _line(part: str, got: dict, floor: float) -> dict:
    def beyond(x):  # tok/s past the floor
        return x["tokens"] / (x["wall_s"] - floor)

    if part == "system":
        on, off, ml = got["cache_on"], got["cache_off"], got["mlx_lm"]
        return dict(speedup_vs_off=on["tok_s"] / off["tok_s"], speedup_vs_mlx_lm=on["tok_s"] / ml["tok_s"],
                    beyond_floor_vs_off=beyond(on) / beyond(off), prefilled_share=on["prefilled"] / off["prefilled"],
                    same_outputs_on_off=sum(on["outputs"][key] == t for key, t in off["outputs"].items()),
                    same_outputs_mlx_lm=sum(on["outputs"].get(key) == t for key, t in ml["outputs"].items()))
    n, d, d0 = got["n"], got["duplicated"], got["duplicated_no_cache"]
    return dict(speedup=n["tok_s"] / d["tok_s"], prefilled_share=n["prefilled"] / d["prefilled"],
                speedup_vs_no_cache=n["tok_s"] / d0["tok_s"], beyond_floor_vs_no_cache=beyond(n) / beyond(d0),
                prefilled_share_vs_no_cache=n["prefilled"] / d0["prefilled"],
                distinct_outputs_n=len({tuple(t) for t in n["outputs"].values()}),
                distinct_outputs_dup=len({tuple(t) for t in d["outputs"].values()}))


KEYS = {"system": ("speedup_vs_off", "speedup_vs_mlx_lm", "prefilled_share", "beyond_floor_vs_off"),
        "samples": ("speedup", "prefilled_share", "speedup_vs_no_cache", "prefilled_share_vs_no_cache",
                    "beyond_floor_vs_no_cache")}


def run(a) -> dict:
    a.model_args = dict(kv.split("=", 1) for kv in shlex.split(a.model_args))
    typed = {k: (int(v) if v.lstrip("-").isdigit() else v) for k, v in a.model_args.items()}
    model_cfg = {} if a.model == "smollm2" else {"source": "tiny", "name": "tiny", **typed}
    tmp = Path(tempfile.mkdtemp(prefix="kvbatch-shared-"))
    extra = shlex.split(a.kvbatch_args)
    rnd = random.Random(21)
    system = "You answer questions using this reference text.\n" + text(rnd, a.system_words)
    shared = write(tmp / "system.jsonl", [
        {"id": f"r{i}", "messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": f"Question {i}: {text(rnd, 8)}?"}]}
        for i in range(a.rows)])
    questions = [f"Question {i}: {text(rnd, a.sample_words)}. Write a short answer." for i in range(a.prompts)]
    once = write(tmp / "once.jsonl", [{"id": f"q{i}", "messages": [{"role": "user", "content": q}]}
                                      for i, q in enumerate(questions)])
    dup = write(tmp / "dup.jsonl", [{"id": f"q{i}-{j}", "messages": [{"role": "user", "content": q}]}
                                    for i, q in enumerate(questions) for j in range(a.n)])
    sampled = ["sampling.temperature=0.8"]
    warm = write(tmp / "warm.jsonl", [json.loads(shared.read_text().splitlines()[0])])
    if not a.no_warm:
        run_mlx_lm(a.python, warm, model_cfg, 1)  # untimed: builds or converts the model into its cache once
    floor_in = write(tmp / "floor.jsonl", [json.loads(shared.read_text().splitlines()[0])])
    sides = {
        "system": {"cache_on": lambda k: kv_side(a, shared, tmp / f"on{k}", a.new, extra),
                   "cache_off": lambda k: kv_side(a, shared, tmp / f"off{k}", a.new,
                                                  extra + ["engine.prefix_cache=false"]),
                   "mlx_lm": lambda k: run_mlx_lm(a.python, shared, model_cfg, a.new)},
        "samples": {"n": lambda k: kv_side(a, once, tmp / f"n{k}", a.sample_new,
                                           extra + sampled + [f"sampling.n={a.n}"]),
                    "duplicated": lambda k: kv_side(a, dup, tmp / f"dup{k}", a.sample_new, extra + sampled),
                    "duplicated_no_cache": lambda k: kv_side(a, dup, tmp / f"dupoff{k}", a.sample_new,
                                                             extra + sampled + ["engine.prefix_cache=false"])},
    }
    result = {}
    for part in a.parts.split(","):
        names, rounds = list(sides[part]), []
        for k in range(a.rounds):
            order = names[k % len(names):] + names[:k % len(names)]
            got = {name: sides[part][name](k) for name in order}
            floor = 0.0 if a.no_floor else kv_side(a, floor_in, tmp / f"floor{part}{k}", 1, extra)["wall_s"]
            line = {"round": k, "order": order, "floor_s": floor, **{name: slim(r) for name, r in got.items()},
                    **_line(part, got, floor)}
            print(json.dumps({part: line}), flush=True)
            rounds.append(line)
        result[part] = {"median": {k: statistics.median(r[k] for r in rounds) for k in KEYS[part]}, "rounds": rounds}
        print(json.dumps({part: result[part]["median"]}), flush=True)
    return result
