"""Speculative decoding on a rewrite job: the `kvbatch` command with `speculative.method=ngram`, the
same command without it, and mlx-lm's `batch_generate`, side by side.

Each row asks the model to rewrite a passage of the Python documentation that ships with every
Python (`pydoc_data.topics`): passages of about 300 to 1,500 tokens (paragraphs joined, ~4
characters a token), greedy, up to --max-tokens new tokens each. A rewrite copies much of its
source, which is what n-gram proposals from the row's own prompt find. All sides are whole
processes timed from start to exit; the order rotates every round (so drift on a shared machine is
spread over all of them); each round's ratios are reported and their medians are the numbers to
read. `identical_rows`: rows whose tokens are the same with and without speculation.

    python -m benchmarks job.speculative --rows 16 --max-tokens 256 --rounds 2 --out /tmp/spec_cpu.json
"""
from __future__ import annotations

import json
import random
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.job.job_vs_mlx_lm import run_kvbatch, run_mlx_lm

SMOKE = ["--model", "tiny", "--rows", "2", "--max-tokens", "4", "--min-chars", "200", "--max-chars", "400",
         "--rounds", "1", "--no-warm", "--no-mlx-lm"]
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
    ap.add_argument("--kvbatch-args", default="", help="both kvbatch sides")
    ap.add_argument("--kvbatch-cmd", default=f"{sys.executable} -m kvbatch")
    ap.add_argument("--python", default=sys.executable, help="runs the mlx-lm side")
    ap.add_argument("--no-mlx-lm", action="store_true", help="only the two kvbatch sides")
    ap.add_argument("--no-warm", action="store_true", help="no untimed first run (that builds or converts the model)")


def _side(a, side: str, k: int, inp: Path, tmp: Path, model_cfg: dict) -> dict:
    if side == "mlx_lm":
        return run_mlx_lm(a.python, inp, model_cfg, a.max_tokens, None)
    extra = shlex.split(a.kvbatch_args) + (shlex.split(a.spec_args) if side == "spec" else [])
    return run_kvbatch(shlex.split(a.kvbatch_cmd), inp, tmp / f"{side}{k}", a.model, {}, a.max_tokens, extra)


def _round(a, k: int, inp: Path, tmp: Path, model_cfg: dict) -> dict:
    sides = ["spec", "plain"] + ([] if a.no_mlx_lm else ["mlx_lm"])
    order = sides[k % len(sides):] + sides[:k % len(sides)]
    rnd = {side: _side(a, side, k, inp, tmp, model_cfg) for side in order}
    sp, pl = rnd["spec"], rnd["plain"]
    eng = sp["engine"]
    line = {"round": k, "order": order, "spec_tok_s": sp["tok_s"], "plain_tok_s": pl["tok_s"],
            "ratio_plain": sp["tok_s"] / pl["tok_s"], "spec_wall_s": sp["wall_s"], "plain_wall_s": pl["wall_s"],
            "spec_tokens": sp["tokens"], "plain_tokens": pl["tokens"],
            "identical_rows": sum(sp["outputs"].get(key) == t for key, t in pl["outputs"].items()),
            "rows": len(pl["outputs"]), "spec_acceptance": eng.get("spec_acceptance"),
            "spec_proposed": eng.get("spec_proposed"), "spec_accepted": eng.get("spec_accepted"),
            "spec_decode_s": eng.get("decode_s"), "plain_decode_s": pl["engine"].get("decode_s"),
            "max_batch": eng.get("max_batch"), "peak_concurrency": eng.get("peak_concurrency")}
    if "mlx_lm" in rnd:
        ml = rnd["mlx_lm"]
        line.update(mlx_lm_tok_s=ml["tok_s"], ratio_mlx_lm=sp["tok_s"] / ml["tok_s"], mlx_lm_tokens=ml["tokens"],
                    identical_rows_mlx_lm=sum(sp["outputs"].get(key) == t for key, t in ml["outputs"].items()))
    print(json.dumps(line), flush=True)
    return line


def run(a) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvbatch-spec-"))
    inp = tmp / "prompts.jsonl"
    with open(inp, "w") as f:
        for i, text in enumerate(passages(a.rows, 7, a.min_chars, a.max_chars)):
            f.write(json.dumps({"id": f"r{i}", "prompt": f"Document {i}. {INSTRUCTION}{text}"}) + "\n")
    model_cfg = {} if a.model == "smollm2" else {"source": "tiny", "name": "tiny"}
    if not a.no_warm:  # untimed: builds or converts the model into its cache once
        warm = tmp / "warm.jsonl"
        warm.write_text(inp.read_text().splitlines()[0] + "\n")
        run_mlx_lm(a.python, warm, model_cfg, 1, None)
    rounds = [_round(a, k, inp, tmp, model_cfg) for k in range(a.rounds)]
    result = {"median_ratio_plain": statistics.median(r["ratio_plain"] for r in rounds),
              "identical_rows": min(r["identical_rows"] for r in rounds), "rows": a.rows,
              "spec_acceptance": rounds[-1]["spec_acceptance"], "rounds": rounds}
    if not a.no_mlx_lm:
        result["median_ratio_mlx_lm"] = statistics.median(r["ratio_mlx_lm"] for r in rounds)
    print(json.dumps({k: result[k] for k in result if k != "rounds"}))
    return result
