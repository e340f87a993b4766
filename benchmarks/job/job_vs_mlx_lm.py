"""The whole job a user runs: the `kvbatch` command against mlx-lm's `batch_generate`, side by side.

Both sides are whole processes, timed from start to exit (model load, tokenizing, prefill,
decode and, for kvbatch, the queue and the Parquet results included), on the same prompts of
mixed length (a few words to ~600 tokens; --prompt-tokens 32-1999: uniform token counts),
greedy, the same max_tokens, EOS honoured on both
sides. Output tok/s = generated tokens / process wall time. The sides alternate (kvbatch,
mlx-lm, mlx-lm, kvbatch, ...) so drift on a shared machine is spread over both; each round's
ratio is reported and the median of those ratios is the number to read (with each side's median tok/s and
wall; the prompts' token lengths in `prompt_tokens`).

With --other-args, a second kvbatch side (the same overrides plus these, e.g. kv=q8) runs in the same
alternation, and its wall is compared with the first side's (`other_vs_kvbatch_wall`); --no-mlx-lm then
leaves mlx-lm out (the two kvbatch sides alone: a mode against another at a third of the device time).

mlx-lm runs at its defaults and, with --match, also with completion_batch_size set to the batch
kvbatch ran at (read from its summary.json).

    python -m benchmarks job.job_vs_mlx_lm --rows 64 --new 256 --rounds 2 --out /tmp/job_cpu.json \
        [--kvbatch-args "engine.max_batch=32"]
"""
from __future__ import annotations

import json
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ROOT

SMOKE = ["--model", "tiny", "--rows", "2", "--new", "4", "--prompt-tokens", "8-40", "--rounds", "1", "--no-warm",
         "--other-args", "kv=q8"]
WORDS = ("the of and to in is that for it as with was on be by at this from or an which are have not can all "
         "water river mountain history science market engine garden music theory village storm letter window "
         "explain describe compare why how what summarize list write story poem plan steps reasons example").split()


def prompts(n: int, seed: int, max_words: int) -> list[str]:
    """Mixed lengths: a few words to ~max_words words (about 1.3 tokens each), most of them short."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        words = max(3, int(max_words * rnd.random() ** 2))
        body = " ".join(rnd.choice(WORDS) for _ in range(words))
        out.append(f"Question {i}: {body}. Answer in detail.")
    return out


def token_prompts(n: int, seed: int, lo: int, hi: int, model_cfg: dict) -> list[str]:
    """Prompts of lo..hi tokens of the model's own tokenizer (uniform), as the GPU's whole-job figures use:
    a text of words cut at its target token count."""
    from kvbatch.engine.models.config import ModelConfig
    from kvbatch.engine.models.fast_tokenizer import fast_tokenizer
    from kvbatch.engine.models.sources import resolve_model_dir

    path = resolve_model_dir(ModelConfig(**model_cfg))
    tok = fast_tokenizer(path, json.loads((path / "config.json").read_text()))
    if tok is None:
        raise SystemExit(f"--prompt-tokens needs a tokenizer.json tokenizer ({path})")
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        target, words = rnd.randint(lo, hi), [f"Question {i}:"]
        while True:
            words += [rnd.choice(WORDS) for _ in range(max(8, target // 2))]
            ids = tok.encode(" ".join(words), add_special_tokens=False)
            if len(ids) >= target:
                break
        out.append(tok.decode(ids[:target]))
    return out


def prompt_lengths(texts: list[str], model_cfg: dict) -> dict:
    """min / median / max tokens of the prompts as both sides send them (chat template applied)."""
    from kvbatch.engine.models.config import ModelConfig
    from kvbatch.engine.models.fast_tokenizer import fast_tokenizer
    from kvbatch.engine.models.sources import resolve_model_dir

    path = resolve_model_dir(ModelConfig(**model_cfg))
    tok = fast_tokenizer(path, json.loads((path / "config.json").read_text()))
    if tok is None:
        return {}
    n = sorted(len(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True))
               for t in texts)
    return {"min": n[0], "median": statistics.median(n), "max": n[-1], "total": sum(n)}


class Cut(subprocess.TimeoutExpired):
    """A kvbatch side stopped at its time limit. `partial`: what its run did until then, as the queue's record of
    the worker session keeps it (the line `action=status` prints as "last run"): `cut_rows` finished, `cut_tokens`
    generated (rows in flight included), `cut_tok_s` over the process's wall, and the engine's summary."""

    def __init__(self, cmd: list[str], timeout: float, partial: dict):
        super().__init__(cmd, timeout)
        self.partial = partial


def _last_session(out_dir: Path) -> dict:
    """The last worker session in a run's queue (rows, tokens, engine summary), {} when there is none."""
    import sqlite3

    path = out_dir / "queue.sqlite"
    if not path.exists():
        return {}
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        row = db.execute("SELECT rows, tokens, summary FROM workers ORDER BY started_at DESC LIMIT 1").fetchone()
    return {"rows": row[0], "tokens": row[1], "engine": json.loads(row[2]) if row[2] else {}} if row else {}


def run_kvbatch(kvbatch: list[str], input_path: Path, out_dir: Path, model: str, model_args: dict, new: int,
                extra: list[str], timeout: float | None = None, grace: float = 60.0) -> dict:
    """The kvbatch side as a whole process. Past `timeout` seconds it gets SIGTERM (the command stops at its next
    step, hands its rows back and records its session; up to `grace` seconds more, then SIGKILL), and Cut is
    raised with what the run did until then."""
    cmd = [*kvbatch, f"model={model}", *[f"model.{k}={v}" for k, v in model_args.items()], f"job.input={input_path}",
           "job.name=bench", f"job.max_tokens={new}", f"output.dir={out_dir}", "output.progress=off", *extra]
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            wall = time.perf_counter() - t0
            proc.terminate()
            try:
                proc.communicate(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            last = _last_session(out_dir)
            partial = {"wall_s": wall, "cut_rows": last.get("rows"), "cut_tokens": last.get("tokens"),
                       "cut_tok_s": last["tokens"] / wall if last.get("tokens") else None,
                       "engine": last.get("engine") or {}}
            raise Cut(cmd, timeout or 0.0, partial) from None
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"kvbatch failed ({proc.returncode}):\n{stderr[-3000:]}")
    import pyarrow.parquet as pq

    t = pq.read_table(out_dir / "results.parquet").to_pylist()
    summary = json.loads((out_dir / "summary.json").read_text())
    eng = (summary.get("engine") or {})
    tokens = sum(r["output_tokens"] for r in t)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "rows": len(t),
            "ok": sum(r["error_code"] is None for r in t), "engine": eng,
            "outputs": {r["row_key"]: r["output_token_ids"] for r in t},
            "plan": next((ln for ln in stderr.splitlines() + stdout.splitlines() if "memory plan" in ln), None)}


MLX_LM = r"""
import json, sys, time
t0 = time.perf_counter()
import kvbatch.engine as engine  # OpenBLAS before mlx, and kvbatch's model loader (same weights)
from kvbatch.engine.models.config import ModelConfig
from mlx_lm import batch_generate
cfg = json.loads(sys.argv[1])
model, tok, spec = engine.load_model(ModelConfig(**cfg["model"]))
texts = [json.loads(l)["prompt"] for l in open(cfg["input"])]
ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
kw = {"completion_batch_size": cfg["batch"]} if cfg["batch"] else {}
r = batch_generate(model, tok, ids, max_tokens=cfg["new"], return_token_ids=True, **kw)
s = r.stats
print(json.dumps({"outputs": {f"r{i}": list(map(int, t)) for i, t in enumerate(r.token_ids)},
                  "prompt_tps": s.prompt_tps, "generation_tps": s.generation_tps, "prompt_time": s.prompt_time,
                  "generation_time": s.generation_time, "inner_s": time.perf_counter() - t0}))
"""


def run_mlx_lm_script(python: str, script: str, cfg: dict, timeout: float | None = None) -> dict:
    """An mlx-lm side as a whole process: `script` run with `cfg` (JSON), timed from start to exit; the
    JSON it prints last, with wall seconds, generated tokens and tok/s (subprocess.TimeoutExpired past
    `timeout` seconds)."""
    t0 = time.perf_counter()
    p = subprocess.run([python, "-c", script, json.dumps(cfg)], capture_output=True, text=True, cwd=ROOT,
                       timeout=timeout)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"mlx-lm failed ({p.returncode}):\n{p.stderr[-3000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    tokens = sum(len(t) for t in res["outputs"].values())
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, **res}


def run_mlx_lm(python: str, input_path: Path, model_cfg: dict, new: int, batch: int | None,
               timeout: float | None = None) -> dict:
    return run_mlx_lm_script(python, MLX_LM, {"input": str(input_path), "model": model_cfg, "new": new, "batch": batch},
                             timeout)


def profile_kvbatch(python: str, inp: Path, out_dir: Path, model: str, model_args: dict, new: int, extra: list[str],
                    path: str) -> None:
    """One untimed run of the command under cProfile, its top functions to `path`: where the command's own time
    goes (imports, config, model load, queue, engine, results)."""
    import io
    import pstats

    prof = out_dir.parent / f"{out_dir.name}.prof"
    r = run_kvbatch([python, "-m", "cProfile", "-o", str(prof), "-m", "kvbatch"], inp, out_dir, model, model_args, new,
                    extra)
    buf = io.StringIO()
    st = pstats.Stats(str(prof), stream=buf)
    st.sort_stats("cumulative").print_stats(60)
    st.sort_stats("tottime").print_stats(30)
    Path(path).write_text(f"wall {r['wall_s']:.1f}s engine {json.dumps(r['engine'])[:2000]}\n" + buf.getvalue())


def add_args(ap) -> None:
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--max-words", type=int, default=450)
    ap.add_argument("--prompt-tokens", default="",
                    help="LO-HI: prompts of LO..HI tokens (uniform; 32-1999 on the GPU) instead of --max-words")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kvbatch-args", default="")
    ap.add_argument("--model-args", default="", help="model=tiny geometry for both sides: 'num_layers=16 ...'")
    ap.add_argument("--kvbatch-cmd", default=f"{sys.executable} -m kvbatch")
    ap.add_argument("--python", default=sys.executable, help="runs the mlx-lm side")
    ap.add_argument("--match", action="store_true", help="also mlx-lm with completion_batch_size = kvbatch's batch")
    ap.add_argument("--other-args", default="",
                    help="a second kvbatch side with these overrides as well (e.g. kv=q8), in the same alternation")
    ap.add_argument("--profile", help="first one untimed kvbatch run under cProfile; its top functions to this file")
    ap.add_argument("--no-warm", action="store_true", help="no untimed first run (that builds or converts the model)")
    ap.add_argument("--no-mlx-lm", action="store_true",
                    help="with --other-args: only the two kvbatch sides (no mlx-lm side, no ratio to it)")


def _same_rows(a: dict, b: dict) -> int:
    """Rows whose generated tokens are the same on both sides."""
    return sum(a["outputs"].get(key) == toks for key, toks in b["outputs"].items())


def engine_fields(side: dict) -> dict:
    """A kvbatch side's engine figures from its summary.json."""
    return {key: side["engine"].get(key) for key in (
        "max_batch", "peak_concurrency", "prefill_s", "decode_s", "prefill_tokens_per_s", "decode_tokens_per_s",
        "prefill_passes", "prefill_rows_max", "preemptions", "kv_mode", "route", "admission", "cache_clears",
        "mlx_peak_memory_bytes")}


def _round(a, k: int, inp: Path, tmp: Path, model_cfg: dict, model_args: dict, extra: list[str]) -> dict:
    order = ["kvbatch"] + (["other"] if a.other_args else []) + ([] if a.no_mlx_lm else ["mlx_lm"])
    order = order if k % 2 == 0 else order[::-1]
    rnd = {}
    for side in order:
        if side == "mlx_lm":
            rnd["mlx_lm"] = run_mlx_lm(a.python, inp, model_cfg, a.new, None)
        else:
            more = shlex.split(a.other_args) if side == "other" else []
            rnd[side] = run_kvbatch(shlex.split(a.kvbatch_cmd), inp, tmp / f"{side}{k}", a.model, model_args, a.new,
                                    extra + more)
    if a.match:
        rnd["mlx_lm_matched"] = run_mlx_lm(a.python, inp, model_cfg, a.new, rnd["kvbatch"]["engine"].get("max_batch"))
    kv, ml = rnd["kvbatch"], rnd.get("mlx_lm")
    line = {"round": k, "order": order, "kvbatch_tok_s": kv["tok_s"], "kvbatch_wall_s": kv["wall_s"],
            "kvbatch_tokens": kv["tokens"], "kvbatch_engine": engine_fields(kv), "kvbatch_plan": kv["plan"]}
    if ml is not None:
        line.update(mlx_lm_tok_s=ml["tok_s"], ratio=kv["tok_s"] / ml["tok_s"], mlx_lm_wall_s=ml["wall_s"],
                    mlx_lm_tokens=ml["tokens"], identical_rows=_same_rows(kv, ml), mlx_lm_prompt_time=ml["prompt_time"],
                    mlx_lm_generation_time=ml["generation_time"])
    if a.match:
        mm = rnd["mlx_lm_matched"]
        line.update(mlx_lm_matched_tok_s=mm["tok_s"], ratio_matched=kv["tok_s"] / mm["tok_s"])
    if a.other_args:  # the second kvbatch side: its wall against the first's (>= 1: as fast or faster)
        ot = rnd["other"]
        line.update(other_tok_s=ot["tok_s"], other_wall_s=ot["wall_s"], other_tokens=ot["tokens"],
                    other_vs_kvbatch_wall=kv["wall_s"] / ot["wall_s"], other_identical_rows=_same_rows(ot, kv),
                    other_engine=engine_fields(ot), other_plan=ot["plan"])
        if ml is not None:
            line["other_ratio"] = ot["tok_s"] / ml["tok_s"]
    print(json.dumps(line), flush=True)
    return line


def run(a) -> dict:
    if a.no_mlx_lm and (a.match or not a.other_args):
        raise SystemExit("--no-mlx-lm compares two kvbatch sides: give --other-args, and no --match")
    tmp = Path(tempfile.mkdtemp(prefix="kvbatch-job-"))
    inp = tmp / "prompts.jsonl"
    model_args = dict(kv.split("=", 1) for kv in shlex.split(a.model_args))
    typed = {k: (int(v) if v.lstrip("-").isdigit() else v) for k, v in model_args.items()}
    model_cfg = {} if a.model == "smollm2" else {"source": "tiny", "name": "tiny", **typed}
    if a.prompt_tokens:
        lo, hi = map(int, a.prompt_tokens.split("-"))
        texts = token_prompts(a.rows, 7, lo, hi, model_cfg)
    else:
        texts = prompts(a.rows, 7, a.max_words)
    with open(inp, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": f"r{i}", "prompt": t}) + "\n")
    extra = shlex.split(a.kvbatch_args)
    if not a.no_warm:  # untimed: builds or converts the model into its cache once
        warm = tmp / "warm.jsonl"
        warm.write_text(inp.read_text().splitlines()[0] + "\n")
        run_mlx_lm(a.python, warm, model_cfg, 1, None)
    if a.profile:
        profile_kvbatch(a.python, inp, tmp / "profiled", a.model, model_args, a.new, extra, a.profile)
    rounds = [_round(a, k, inp, tmp, model_cfg, model_args, extra) for k in range(a.rounds)]
    sides = ("kvbatch",) if a.no_mlx_lm else ("kvbatch", "mlx_lm")
    keys = ([] if a.no_mlx_lm else ["ratio"]) + [f"{s}_{f}" for s in sides for f in ("tok_s", "wall_s")]
    result = {f"median_{k}": statistics.median(r[k] for r in rounds) for k in keys}
    result.update(prompt_tokens=prompt_lengths(texts, model_cfg), rounds=rounds)
    if a.match:
        result["median_ratio_matched"] = statistics.median(r["ratio_matched"] for r in rounds)
    if a.other_args:
        result.update({f"median_{key}": statistics.median(r[key] for r in rounds)
                       for key in ("other_tok_s", "other_vs_kvbatch_wall") + (() if a.no_mlx_lm else ("other_ratio",))})
    print(json.dumps({k: result[k] for k in result if k != "rounds"}))
    return result
