"""The whole job a user runs, at two commits of kvbatch side by side: did a change keep speed and outputs?

Each side is the `kvbatch` command of one tree, installed (not editable) into a folder of its own and run
as a whole process from start to exit (model load, queue, prefill, decode, Parquet results), on the same
mixed-length prompts, greedy, the same max_tokens. The sides alternate (base, head, head, base, ...) so
drift on a shared machine is spread over both; each round's head/base ratio of output tok/s is reported,
and the median of those ratios is the number to read. Rows whose tokens are identical on both sides are
counted: a change that keeps behaviour keeps every row.

    python -m benchmarks job.commits --base 67ef5dd --head worktree --rows 64 --new 128 --rounds 3

`worktree` is this checkout's working tree (its src/ as it is, uninstalled); anything else is a commit.
"""
from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import ROOT
from benchmarks.job.job_vs_mlx_lm import prompts, run_kvbatch

SMOKE = ["--base", "HEAD", "--head", "worktree", "--model", "tiny", "--rows", "2", "--new", "4", "--max-words", "5",
         "--rounds", "1"]


def add_args(ap) -> None:
    ap.add_argument("--base", default="HEAD", help="a commit (or `worktree`)")
    ap.add_argument("--head", default="worktree", help="a commit (or `worktree`: this checkout as it is)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--max-words", type=int, default=450)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kvbatch-args", default="", help="options for both sides, e.g. 'kv=q8'")


def install(ref: str, tmp: Path) -> tuple[str, str]:
    """(the folder to put first on PYTHONPATH, the commit) for a commit or `worktree`."""
    if ref == "worktree":
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
        return str(ROOT / "src"), f"{head}+worktree"
    sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    tree, site = tmp / f"tree-{sha}", tmp / f"site-{sha}"
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), sha], cwd=ROOT, check=True)
    try:
        # no build isolation: the installed setuptools builds it, nothing is fetched
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(site), str(tree)], check=True, capture_output=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)
    return str(site), sha


def run(a) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvbatch-commits-"))
    sides = {"base": install(a.base, tmp), "head": install(a.head, tmp)}
    inp = tmp / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": t}) + "\n"
                           for i, t in enumerate(prompts(a.rows, 7, a.max_words))))
    extra = shlex.split(a.kvbatch_args)

    def side(name: str, k: int) -> dict:
        path = sides[name][0]
        cmd = ["env", f"PYTHONPATH={path}", sys.executable, "-m", "kvbatch"]
        return run_kvbatch(cmd, inp, tmp / f"{name}{k}", a.model, {}, a.new, extra)

    side("base", -1)  # untimed: builds or converts the model into its cache once
    rounds = []
    for k in range(a.rounds):
        order = ["base", "head"] if k % 2 == 0 else ["head", "base"]
        r = {name: side(name, k) for name in order}
        b, h = r["base"], r["head"]
        same = sum(h["outputs"].get(key) == toks for key, toks in b["outputs"].items())
        line = {"round": k, "order": order, "base_tok_s": b["tok_s"], "head_tok_s": h["tok_s"],
                "ratio": h["tok_s"] / b["tok_s"], "base_wall_s": b["wall_s"], "head_wall_s": h["wall_s"],
                "tokens": [b["tokens"], h["tokens"]], "identical_rows": same, "rows": len(b["outputs"])}
        print(json.dumps(line), flush=True)
        rounds.append(line)
    return {"base": sides["base"][1], "head": sides["head"][1], "rounds": rounds,
            "median_ratio": statistics.median(r["ratio"] for r in rounds)}
