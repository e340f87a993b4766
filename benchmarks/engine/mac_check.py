"""One command for a Mac (MLX's Metal backend): the engine's tests, speed against mlx-lm, a 30k-token answer.

No machine here is a Mac, so kvbatch's Metal figures come from Mac users. This runs, in order, and writes one
JSON record (paste it into an issue, docs/performance.md says how):

1. tests: the engine's tests on this backend (`pytest tests/engine`): pass/fail counts and the failures;
2. workspace: one decode step of the portable route, pages read in place against gathered, at 4k and 16k
   context, batch 8 (engine.portable_decode: ms and workspace as a share of the KV);
3. speed: kvbatch on the portable route (what Metal runs: kv none, q8, q4) against mlx-lm's BatchGenerator at
   1k, 8k and 16k context, batch 1, 8 and 32: every side alive at once, decode steps with the whole batch decoding
   timed in order-alternating blocks (engine.vs_mlx_lm --interleave: decode tok/s, ratios round by round, same
   tokens; the rows generate enough tokens to decode as a whole batch after the last one's prefill). Batch 32 at
   16k holds every side's KV at once: ~50 GB at the default 1B geometry (`--batches 1,8` on a smaller Mac);
4. long: one 30,000-token greedy answer on the portable route: whether it completes (Metal counts buffers, and a
   lazy graph that grows with the answer fails at ~10k tokens with `[metal::malloc] Resource limit`), its
   decode tok/s, and every 1,000 tokens the live mx.arrays and MLX's active memory less the KV pages;
5. ceiling: decode tok/s as the batch grows (engine.batch_ceiling): where `engine.max_batch: auto` should stop
   on this backend (engine/batch_limits.py BATCH_CEILING, the ceiling it uses now, is in the record).

    python -m benchmarks mac_check --out mac_check.json       # ~1 h on an M-series Mac with 32 GB or more
    python -m benchmarks mac_check --parts speed,long --model smollm2

--smoke runs every part on this machine at tiny sizes (a check of the command, not a measurement).
"""
from __future__ import annotations

import argparse
import gc
import re
import shlex
import subprocess
import sys
import time

import mlx.core as mx

from benchmarks import harness as h
from benchmarks.engine import batch_ceiling, portable_decode, vs_mlx_lm
from kvbatch.engine.backend import backend
from kvbatch.engine.batch_limits import BATCH_CEILING

PARTS = ("tests", "workspace", "speed", "long", "ceiling")
MODES = "none@route=portable,q8@route=portable,q4@route=portable"
SMOKE = ["--model", "tiny", "--workspace-contexts", "128", "--contexts", "24", "--batches", "2", "--new", "4",
         "--block", "2", "--modes", "none@route=portable,q8@route=portable", "--rounds", "1", "--answer", "300",
         "--probe-every", "100", "--ceiling-batches", "1,2", "--ceiling-prompt", "8", "--ceiling-new", "3",
         "--tests=--collect-only tests/engine/test_paged_decode.py"]


def add_args(ap) -> None:
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    ap.add_argument("--model", default="random-1b", help=f"speed, long and ceiling: {', '.join(h.MODEL_NAMES)}")
    ap.add_argument("--tests", default="tests/engine", help="pytest arguments of the tests part")
    ap.add_argument("--workspace-contexts", default="4096,16384", help="workspace: stored tokens per row")
    ap.add_argument("--contexts", default="1024,8192,16384", help="speed: prompt tokens")
    ap.add_argument("--batches", default="1,8,32", help="speed: rows")
    ap.add_argument("--modes", default=MODES, help="speed: kvbatch sides (engine.vs_mlx_lm --modes)")
    ap.add_argument("--new", type=int, default=128, help="speed: tokens generated per row (at least)")
    ap.add_argument("--block", type=int, default=16,
                    help="speed: decode steps a side runs in turn; 0 = each side's whole run on its own, one after the "
                         "other (decode counters then mix in the steps run while other rows prefill)")
    ap.add_argument("--rounds", type=int, default=2, help="speed and ceiling: order-alternating rounds")
    ap.add_argument("--answer", type=int, default=30000, help="long: tokens of the one answer")
    ap.add_argument("--probe-every", type=int, default=1000, help="long: tokens between probes")
    ap.add_argument("--ceiling-batches", default="32,64,128,256", help="ceiling: rows")
    ap.add_argument("--ceiling-prompt", type=int, default=128, help="ceiling: prompt tokens per row")
    ap.add_argument("--ceiling-new", type=int, default=64, help="ceiling: tokens per row")


def _sub(add, argv: list[str]) -> argparse.Namespace:
    """Another benchmark's options, its defaults but for argv."""
    ap = argparse.ArgumentParser()
    add(ap)
    return ap.parse_args(argv)


def tests(a) -> dict:
    """The tests part: pytest in a child process (its own MLX state), its summary line and failures."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *shlex.split(a.tests)],
                       cwd=h.ROOT, capture_output=True, text=True)
    lines = (r.stdout + r.stderr).strip().splitlines()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", lines[-1])} \
        if lines else {}
    return {"returncode": r.returncode, "counts": counts, "seconds": time.perf_counter() - t0,
            "failures": [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))][:50], "tail": lines[-5:]}


def workspace(a) -> dict:
    """The workspace part: engine.portable_decode, batch 8."""
    sub = _sub(portable_decode.add_args, ["--contexts", a.workspace_contexts, "--batch", "8", "--reps", "5"])
    sub.smoke = a.smoke
    return portable_decode.run(sub)


PREFILL_CHUNK = 2048


def speed(a) -> dict:
    """The speed part: engine.vs_mlx_lm at each context and batch, the portable route's modes."""
    rows = []
    for ctx in map(int, a.contexts.split(",")):
        if a.block <= 0:
            sub = _sub(vs_mlx_lm.add_args, ["--models", a.model, "--batches", a.batches, "--prompt", str(ctx),
                                            "--new", str(a.new), "--modes", a.modes, "--rounds", str(a.rounds)])
            rows += vs_mlx_lm.run(sub)["rows"]
            continue
        for b in map(int, a.batches.split(",")):
            # the first row decodes while the others prefill (a chunk a step each): it must still be running
            # when the batch is whole, for the warm-up and 8 blocks
            new = max(a.new, vs_mlx_lm.warm_tokens(ctx, 1 << 20) + -(-ctx // PREFILL_CHUNK) * (b - 1) + 8 * a.block)
            sub = _sub(vs_mlx_lm.add_args, ["--models", a.model, "--batches", "", "--long", str(ctx),
                                            "--long-batches", str(b), "--long-new", str(new), "--modes", a.modes,
                                            "--interleave", str(a.block), "--prefill-chunk", str(PREFILL_CHUNK)])
            rows += vs_mlx_lm.run(sub)["rows"]
    return {"rows": rows}


def long_answer(a) -> dict:
    """The long part: one greedy answer of --answer tokens on the portable route, probed as it goes."""
    model, _, spec = h.load(a.model)
    eng = h.engine(model, h.NoEos(), spec, "none@route=portable", max_batch=1)
    eng.add(h.requests([[1, 2, 3]], a.answer, "long")[0])
    cache = h.kv_store(eng)
    probes, done, steps, t0 = [], [], 0, time.perf_counter()
    while eng.has_unfinished():
        done += eng.step()
        steps += 1
        if steps % a.probe_every == 0:
            live = sum(1 for o in gc.get_objects() if type(o) is mx.array)
            probes.append({"tokens": steps, "seconds": time.perf_counter() - t0, "live_arrays": live,
                           "active_less_kv": mx.get_active_memory() - cache.capacity_bytes})
    res = done[0]
    s = eng.summary()
    return {"tokens": len(res.tokens), "ok": res.ok, "error": res.error_message, "route": s["route"],
            "decode_tps": s["decode_tokens_per_s"], "seconds": time.perf_counter() - t0, "probes": probes}


def ceiling(a) -> dict:
    """The ceiling part: engine.batch_ceiling on the portable route, and the ceiling kvbatch uses now."""
    sub = _sub(batch_ceiling.add_args, ["--model", a.model, "--batches", a.ceiling_batches, "--prompt",
                                        str(a.ceiling_prompt), "--new", str(a.ceiling_new),
                                        "--kv", "none@route=portable", "--rounds", str(a.rounds)])
    return {"measured": batch_ceiling.run(sub), "batch_ceiling_now": BATCH_CEILING[backend().name]}


def run(a) -> dict:
    parts = [p for p in a.parts.split(",") if p]
    bad = set(parts) - set(PARTS)
    if bad:
        raise SystemExit(f"mac_check: unknown part(s) {sorted(bad)} (--parts: {', '.join(PARTS)})")
    out: dict = {"backend": backend().name, "metal": mx.metal.is_available()}
    if out["metal"]:
        out["device"] = mx.metal.device_info()
    for name, fn in (("tests", tests), ("workspace", workspace), ("speed", speed), ("long", long_answer),
                     ("ceiling", ceiling)):
        if name in parts:
            print(f"mac_check: {name}", flush=True)
            out[name] = h.guarded(lambda: fn(a))
            h.checkpoint(out)  # a run cut short keeps the parts that ran
    return out
