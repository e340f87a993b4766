"""Speculative decoding on a rewrite job: the `kvbatch` command with `speculative.method=ngram`, the
same command without it, and mlx-lm's `batch_generate`, side by side.

Each row asks the model to rewrite a passage of the Python documentation that ships with every
Python (`pydoc_data.topics`): passages of about 300 to 1,500 tokens (paragraphs joined, ~4
characters a token), greedy, up to --max-tokens new tokens each. A rewrite copies much of its
source, which is what n-gram proposals from the row's own prompt find. All sides are whole
processes timed from start to exit; the order rotates every round (so drift on a shared machine is
spread over all of them); each round's ratios are reported and their medians are the numbers to
read. `identical_rows`: rows whose tokens are the same with and without speculation.

The JSON record is rewritten as each side ends (`partial: true` until the run ends), each side with
its figures and a digest of each row's tokens, so a run cut short keeps the sides that ended; --sides
runs some of them only (one per call where a call is short: rows compare across calls by digest),
--side-timeout cuts one side (recorded `timed_out`, with the rows, tokens and engine figures it reached:
SIGTERM stops the command at its next step) and goes on with the next.

    python -m benchmarks job.speculative --rows 16 --max-tokens 256 --rounds 2 --out /tmp/spec_cpu.json
"""
from __future__ import annotations

import gzip
import hashlib
import json
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.job.job_vs_mlx_lm import Cut, profile_kvbatch, run_kvbatch, run_mlx_lm

SMOKE = ["--model", "tiny", "--rows", "2", "--max-tokens", "4", "--min-chars", "200", "--max-chars", "400",
         "--rounds", "1", "--no-warm", "--no-mlx-lm", "--gpu-util"]
INSTRUCTION = "Rewrite the following passage from the Python documentation in clear, plain English. " \
              "Keep every fact, name and code example.\n\n"


def passages(n: int, seed: int, min_chars: int, max_chars: int) -> list[str]:
    """n passages of min_chars to max_chars characters: runs of whole paragraphs of the pydoc topics
    (a paragraph longer than max_chars is cut), in a seeded order; repeated when n asks for more."""
    from pydoc_data.topics import topics

    rnd = random.Random(seed)
    out: list[str] = []
    for name in sorted(topics):
        cur, want = "", rnd.randint(min_chars, max_chars)
        for para in topics[name].split("\n\n"):
            cur = f"{cur}\n\n{para}" if cur else para
            if len(cur) >= want:
                out.append(cur[:max_chars])
                cur, want = "", rnd.randint(min_chars, max_chars)
        if len(cur) >= min_chars:
            out.append(cur)
    rnd.shuffle(out)
    return [out[i % len(out)] for i in range(n)]


def add_args(ap) -> None:
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--min-chars", type=int, default=1200, help="shortest passage (~300 tokens)")
    ap.add_argument("--max-chars", type=int, default=6000, help="longest passage (~1,500 tokens)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spec-args", default="speculative.method=ngram",
                    help="what the speculating side adds (e.g. 'speculative.method=ngram speculative.num_tokens=6')")
    ap.add_argument("--spec-b-args", default="speculative.method=ngram speculative.adaptive=false",
                    help="what a second speculating side, spec_b (in --sides only when named), adds")
    ap.add_argument("--kvbatch-args", default="", help="both kvbatch sides")
    ap.add_argument("--kvbatch-cmd", default=f"{sys.executable} -m kvbatch")
    ap.add_argument("--spec-b-cmd", default="", help="the spec_b side's kvbatch command (default --kvbatch-cmd), "
                    "e.g. another tree's: env PYTHONPATH=TREE/src python -m kvbatch")
    ap.add_argument("--python", default=sys.executable, help="runs the mlx-lm side")
    ap.add_argument("--sides", default=",".join(SIDES[:3]),
                    help="the sides to run, in round 0's order (spec, plain, mlx_lm, spec_b): one a call where a call "
                         "is short")
    ap.add_argument("--no-mlx-lm", action="store_true", help="only the two kvbatch sides")
    ap.add_argument("--side-timeout", type=float, default=0,
                    help="seconds one side may take (0: no limit); a side cut there is recorded as timed_out")
    ap.add_argument("--no-warm", action="store_true", help="no untimed first run (that builds or converts the model)")
    ap.add_argument("--profile", help="first one untimed run of the side --profile-side under cProfile; its top "
                                      "functions to this file")
    ap.add_argument("--profile-side", default="plain", choices=("spec", "plain"))
    ap.add_argument("--gpu-util", action="store_true",
                    help="sample the GPU's busy percent (nvidia-smi) while each side runs (gpu_util_mean, _tenths)")
    ap.add_argument("--keep", help="a folder to keep the prompts and the last round's results in, the plain "
                                   "side's where it ran (for job.ngram_ceiling)")


SIDES = ("spec", "plain", "mlx_lm", "spec_b")


def _side(a, side: str, k: int, inp: Path, tmp: Path, model_cfg: dict) -> dict:
    """One side's whole process: what it generated and how fast; {"timed_out": ...} when cut at --side-timeout."""
    limit = a.side_timeout or None
    t0 = time.perf_counter()
    with harness.Usage(gpu=a.gpu_util) as use:
        try:
            if side == "mlx_lm":
                got = run_mlx_lm(a.python, inp, model_cfg, a.max_tokens, None, limit)
            else:
                own = {"spec": a.spec_args, "spec_b": a.spec_b_args}.get(side, "")
                extra = shlex.split(a.kvbatch_args) + shlex.split(own)
                cmd = a.spec_b_cmd if side == "spec_b" and a.spec_b_cmd else a.kvbatch_cmd
                got = run_kvbatch(shlex.split(cmd), inp, tmp / f"{side}{k}", a.model, {}, a.max_tokens, extra,
                                  limit)
        except Cut as cut:  # what it did until the limit: rows, tokens and the engine's figures so far
            got = {"timed_out": True, **cut.partial}
        except subprocess.TimeoutExpired:
            got = {"timed_out": True, "wall_s": time.perf_counter() - t0}
    return {**got, **use.result}


def _brief(r: dict) -> dict:
    """A side's record for the JSON: its figures and each row's tokens as a short digest (rows of sides run
    in different calls compare by digest). A side cut at its limit: what it did until then (no digests)."""
    eng = r.get("engine") or {}
    keep = {k: r[k] for k in ("timed_out", "wall_s", "tokens", "tok_s", "rows", "ok", "cut_rows", "cut_tokens",
                              "cut_tok_s", "prompt_tps", "generation_tps", "prompt_time", "generation_time", "cpu_s",
                              "gpu_util", "gpu_util_mean", "gpu_util_samples", "gpu_util_tenths")
            if k in r}
    keep.update({k: eng[k] for k in ("decode_s", "prefill_s", "spec_acceptance", "spec_proposed", "spec_accepted",
                                     "spec_passes", "spec_passes_in_flight", "spec_passes_chained", "spec_plain_steps",
                                     "ngram_search", "spec_chain", "ngram_prepared",
                                     "ngram_prepared_used", "max_batch", "peak_concurrency", "admission",
                                     "preemptions", "prefill_passes", "budget_bytes", "pool_bytes",
                                     "peak_pages_in_use", "mlx_peak_memory_bytes", "cache_clears")
                 if k in eng})
    # the pool's growths (each copies the pool): how many, and the seconds they took in all
    growths = eng.get("growth_events") or []
    keep.update(pool_growths=len(growths), pool_growth_s=sum(g.get("seconds", 0.0) for g in growths))
    if "outputs" in r:
        keep["digests"] = {key: hashlib.sha1(json.dumps(t).encode()).hexdigest()[:10]
                           for key, t in sorted(r["outputs"].items())}
    return keep


def _round(a, k: int, sides: list[str], inp: Path, tmp: Path, model_cfg: dict, done: list[dict]) -> dict:
    """One round, the sides' order rotated by k; the JSON record is rewritten as each side ends."""
    order = sides[k % len(sides):] + sides[:k % len(sides)]
    rnd: dict[str, dict] = {}
    line: dict = {"round": k, "order": order}
    for side in order:
        rnd[side] = _side(a, side, k, inp, tmp, model_cfg)
        line[side] = _brief(rnd[side])
        harness.checkpoint({"rounds": [*done, line]})
        print(json.dumps({"round": k, "side": side, **{x: v for x, v in line[side].items() if x != "digests"}}),
              flush=True)
    ok = {side: r for side, r in rnd.items() if not r.get("timed_out")}
    sp, pl, ml, sb = ok.get("spec"), ok.get("plain"), ok.get("mlx_lm"), ok.get("spec_b")
    if sp and pl:
        line.update(ratio_plain=sp["tok_s"] / pl["tok_s"],
                    identical_rows=sum(sp["outputs"].get(key) == t for key, t in pl["outputs"].items()),
                    rows=len(pl["outputs"]))
    if sb and pl:
        line.update(ratio_spec_b_plain=sb["tok_s"] / pl["tok_s"],
                    identical_rows_spec_b=sum(sb["outputs"].get(key) == t for key, t in pl["outputs"].items()))
    if sp and sb:
        line.update(ratio_spec_spec_b=sp["tok_s"] / sb["tok_s"])
    if sp and ml:
        line.update(ratio_mlx_lm=sp["tok_s"] / ml["tok_s"],
                    identical_rows_mlx_lm=sum(sp["outputs"].get(key) == t for key, t in ml["outputs"].items()))
    print(json.dumps({x: v for x, v in line.items() if x not in SIDES}), flush=True)
    return line


def prompt_row(i: int, text: str) -> dict:
    """Row i of the job's input: the instruction and its passage."""
    return {"id": f"r{i}", "prompt": f"Document {i}. {INSTRUCTION}{text}"}


def _keep(a, tmp: Path, texts: list[str], model_cfg: dict) -> None:
    """Copy the last round's kvbatch results to --keep (the plain side's where it ran, else a speculating
    side's: greedy outputs are the same with and without speculation) with the job's passages in
    prompts.json.gz, each once (passages repeat past the topics' count) and the rows' order; pydoc's text
    differs between Pythons, so a run elsewhere keeps its own."""
    done = [tmp / f"{side}{k}" for side in ("spec_b", "spec", "plain") for k in range(a.rounds)
            if (tmp / f"{side}{k}" / "results.parquet").exists()]
    if not done:
        return
    keep = Path(a.keep)
    keep.mkdir(parents=True, exist_ok=True)
    unique = sorted(set(texts))
    at = {t: j for j, t in enumerate(unique)}
    (keep / "prompts.json.gz").write_bytes(gzip.compress(json.dumps(
        {"passages": unique, "order": [at[t] for t in texts]}).encode(), 9))
    shutil.copy(done[-1] / "results.parquet", keep / "results.parquet")
    (keep / "kept.json").write_text(json.dumps({"model": model_cfg, "max_tokens": a.max_tokens, "rows": a.rows,
                                                "side": done[-1].name}))


def kept_prompts(keep: Path) -> dict[str, str]:
    """The prompts of a job kept by --keep, by row id."""
    got = json.loads(gzip.decompress((keep / "prompts.json.gz").read_bytes()))
    rows = [prompt_row(i, got["passages"][j]) for i, j in enumerate(got["order"])]
    return {r["id"]: r["prompt"] for r in rows}


def run(a) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvbatch-spec-"))
    inp = tmp / "prompts.jsonl"
    texts = passages(a.rows, 7, a.min_chars, a.max_chars)
    with open(inp, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps(prompt_row(i, text)) + "\n")
    sides = [s for s in a.sides.split(",") if s and not (a.no_mlx_lm and s == "mlx_lm")]
    bad = [s for s in sides if s not in SIDES]
    if bad or not sides:
        raise SystemExit(f"--sides: {','.join(bad) or 'none'}: choose from {', '.join(SIDES)}")
    model_cfg = {} if a.model == "smollm2" else {"source": "tiny", "name": "tiny"}
    if not a.no_warm:  # untimed: builds or converts the model into its cache once
        warm = tmp / "warm.jsonl"
        warm.write_text(inp.read_text().splitlines()[0] + "\n")
        run_mlx_lm(a.python, warm, model_cfg, 1, None)
    if a.profile:
        extra = shlex.split(a.kvbatch_args) + (shlex.split(a.spec_args) if a.profile_side == "spec" else [])
        profile_kvbatch(a.python, inp, tmp / "profiled", a.model, {}, a.max_tokens, extra, a.profile)
    rounds: list[dict] = []
    for k in range(a.rounds):
        rounds.append(_round(a, k, sides, inp, tmp, model_cfg, rounds))
    result: dict = {"rows": a.rows, "sides": sides, "rounds": rounds}
    if a.keep:
        _keep(a, tmp, texts, model_cfg)
    for key in ("ratio_plain", "ratio_mlx_lm", "ratio_spec_b_plain", "ratio_spec_spec_b"):
        got = [r[key] for r in rounds if key in r]
        if got:
            result["median_" + key] = statistics.median(got)
    for key in ("identical_rows", "identical_rows_mlx_lm", "identical_rows_spec_b"):
        got = [r[key] for r in rounds if key in r]
        if got:
            result[key] = min(got)
    for side in sides:
        tok_s = [r[side]["tok_s"] for r in rounds if "tok_s" in r.get(side, {})]
        if tok_s:
            result[f"median_{side}_tok_s"] = statistics.median(tok_s)
    spec = [r["spec"] for r in rounds if "spec_acceptance" in r.get("spec", {})]
    if spec:
        result["spec_acceptance"] = spec[-1]["spec_acceptance"]
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))
    return result
