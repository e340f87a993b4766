"""The host's share of a decode step at large batches: the engine's own Python work a step (scheduler,
cache bookkeeping, the route's step arrays, output), without the device's.

At batch 1,024 on the H200 a SmolLM2 decode step waits ~8.5 ms for the GPU and spends ~15 ms on the host
(docs/performance.md), so the rewrite job's speed follows the host's work a step. This measures that work
on any machine: a one-layer model 64 wide (its forward is a small part of the step), `--rows` rows of mixed
prompt lengths, each generating `--new` tokens, the lookahead stepper (the GPU backends' decode loop) with
every evaluation made synchronous and timed apart. `host_ms_per_step` = (the decode steps' wall - time
inside mx.eval / mx.async_eval) / steps, the median over rounds; `prefill_host_ms_per_pass` the same for the
steps that ran a prefill pass (admission, the pass's chunks and prefix-cache bookkeeping, the decode step
beside it), over their passes. With speculation, `critical_ms_per_pass`
is the median host time from a verification pass's tokens read to the next forward handed to the device:
the part of a pass's host work the device waits for (the rest runs while the next pass computes, where
the backend overlaps them, engine.options.lookahead). `step_ms` is a decode step's whole time, evaluations
included: on the CPU what a step costs, so work moved from the host into an evaluation (MLX freeing or mapping
buffers inside an allocation) shows there and not in `host_ms_per_step`.

`--ngram-search device` searches on the device, and its passes are chained (speculative.chain; `--chain off`: not):
a chained pass is handed to the device before the pass it is built from is read, so no host time lies between a
read and the next hand-off; `critical_ms_per_pass` then times the read to the hand-off of the pass after next.

`--spec ngram` measures the same with n-gram speculation (fixed: `speculative.adaptive=false`), a step being a
verification pass or a plain step: the random model's greedy tokens fall into loops its own n-grams predict, so
most proposals are accepted, as in a rewrite job. `tokens_per_step` is the output tokens a decode step.

`--base COMMIT` measures that commit's tree too, side by side in one run (alternating order, each side a
process of its own, the same rows): `base_over_head` is the median of the rounds' base/head ratios, and the
tokens of both sides are compared.

    python -m benchmarks engine.host_step --rows 1024 --new 64 --base HEAD --rounds 3
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMOKE = ["--rows", "8", "--new", "4", "--rounds", "1"]
NANO = dict(hidden_size=64, num_hidden_layers=1, intermediate_size=128, num_attention_heads=1, num_key_value_heads=1,
            head_dim=64, vocab_size=512, rope_theta=10000.0, tie_word_embeddings=True)
ROOT = Path(__file__).resolve().parents[2]


def add_args(ap) -> None:
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64, help="tokens each row generates")
    ap.add_argument("--mode", default="none", help="a KV mode (none, q8, q4, k8v4)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prompt-tokens", default="8-90", help="each row's prompt length, drawn from MIN-MAX")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spec", default="", help="a speculative.method (ngram), fixed, or none")
    ap.add_argument("--lookahead", default="on", choices=("on", "off"),
                    help="engine.options.lookahead (on: the GPUs' loop; off: the CPU's)")
    ap.add_argument("--prefill", default="65536/auto",
                    help="CHUNK/TOKENS: engine.prefill_chunk / engine.prefill_tokens (the CUDA defaults: 512/8192)")
    ap.add_argument("--ngram-search", default="host", choices=("host", "device"),
                    help="speculative.ngram_search with --spec ngram (device: the search's time is the device's)")
    ap.add_argument("--chain", default="on", choices=("on", "off"),
                    help="speculative.chain with --ngram-search device (off: each pass built after the last is read)")
    ap.add_argument("--base", default="", help="a commit measured side by side with this tree")
    ap.add_argument("--side", action="store_true", help="(internal) one measurement, one JSON line")


def measure(rows: int, new: int, mode: str, page_size: int, spec_method: str = "", prompt_tokens: str = "8-90",
            lookahead: str = "on", prefill: str = "65536/auto", ngram_search: str = "host", chain: str = "on") -> dict:
    """One engine run in this process: host ms a decode step and a digest of every row's tokens."""
    import mlx.core as mx
    from mlx_lm.models import llama

    from benchmarks import harness as h
    from kvbatch.engine.models.spec import model_spec

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, max_position_embeddings=131072,
                                        **NANO))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    spec = model_spec("llama-nano-random", model, dict(NANO, model_type="llama", max_position_embeddings=131072))
    rng = random.Random(0)
    lo, hi = (int(x) for x in prompt_tokens.split("-"))
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(rows)]
    chunk, tokens = prefill.split("/")
    kv, opts = h.parse_mode(mode)
    opts.lookahead = lookahead
    speculative = {"method": spec_method, "adaptive": False} if spec_method else None
    if speculative is not None and ngram_search != "host":  # (a tree before the option has only the host's)
        speculative["ngram_search"] = ngram_search
    if speculative is not None and chain == "off":  # (likewise)
        speculative["chain"] = False
    eng = h.engine(model, h.NoEos(), spec, mode, options=opts, page_size=page_size, max_batch=rows,
                   prefill_chunk=int(chunk), prefill_tokens=tokens if tokens == "auto" else int(tokens),
                   memory_budget=int(8e9), allow_unvalidated=True, speculative=speculative)
    device = [0.0]
    real_eval, real_async = mx.eval, mx.async_eval
    # a verification pass's critical path: from its tokens read to the next forward handed to the device
    # (the device waits meanwhile); work after that hand-off runs while the device computes
    landed: list[float] = []
    critical: list[float] = []

    def timed_eval(*a):
        t = time.perf_counter()
        if landed:
            critical.append(t - landed.pop())
        real_eval(*a)
        device[0] += time.perf_counter() - t

    verifier = eng.speculator.verifier if eng.speculator is not None else None
    if verifier is not None and hasattr(verifier, "land"):  # a tree whose passes are read by Verifier.land
        real_land = verifier.land

        def timed_land(p):
            out = real_land(p)
            landed[:] = [time.perf_counter()]
            return out
        verifier.land = timed_land  # type: ignore[method-assign]

    mx.eval = mx.async_eval = timed_eval  # every evaluation synchronous, its time apart from the host's
    try:
        for r in h.requests(prompts, new):
            eng.add(r)
        results, wall, steps, made, pre_wall, passes, step_wall = [], 0.0, 0, 0, 0.0, 0, 0.0
        while eng.has_unfinished():
            decoding = not any(row.prefilling for row in eng.scheduler.running) and not eng.scheduler.waiting
            before, t = device[0], time.perf_counter()
            out_before, passes_before = eng.output.generated_tokens, eng.runner.times.prefill_passes
            results += eng.step()
            now = time.perf_counter()
            host = now - t - (device[0] - before)
            if decoding:  # steps of decode alone: every row past its prompt
                wall += host
                step_wall += now - t
                steps += 1
                made += eng.output.generated_tokens - out_before
            elif eng.runner.times.prefill_passes > passes_before:  # a step with a prefill pass (and decode)
                pre_wall += host
                passes += eng.runner.times.prefill_passes - passes_before
    finally:
        mx.eval, mx.async_eval = real_eval, real_async
    tokens = [r.tokens for r in sorted(results, key=lambda r: int(r.key))]
    assert all(len(t) == new for t in tokens), "every row generates --new tokens"
    stats = eng.summary()
    return {"host_ms_per_step": wall / max(steps, 1) * 1e3, "steps": steps,
            "step_ms": step_wall / max(steps, 1) * 1e3,
            "prefill_host_ms_per_pass": pre_wall / max(passes, 1) * 1e3, "prefill_passes": passes,
            "critical_ms_per_pass": statistics.median(critical) * 1e3 if critical else None,
            "tokens_per_step": made / max(steps, 1),
            **{k: stats[k] for k in ("spec_passes", "spec_acceptance", "spec_passes_chained", "ngram_prepared",
                                     "ngram_prepared_used") if k in stats},
            "tokens_sha": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]}


def _tree(commit: str) -> Path:
    """A checkout of `commit` (its src/ is put first on the side's path)."""
    d = Path(tempfile.gettempdir()) / f"kvbatch-host-step-{commit}"
    if not d.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(d), commit], check=True,
                       capture_output=True)
    return d


def _side(src: Path, a) -> dict:
    # the tree's src/ first, then this checkout, then what the path held (a GPU machine's staged MLX)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "benchmarks.engine.host_step", "--side", "--rows", str(a.rows), "--new", str(a.new),
           "--mode", a.mode, "--page-size", str(a.page_size), "--spec", a.spec, "--prompt-tokens", a.prompt_tokens,
           "--lookahead", a.lookahead, "--prefill", a.prefill]
    cmd += ["--ngram-search", a.ngram_search] if a.ngram_search != "host" else []
    cmd += ["--chain", a.chain] if a.chain != "on" else []
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def run(a) -> dict:
    from benchmarks import harness as h

    sides = {"head": lambda: _side(ROOT / "src", a)}
    if a.base:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", a.base], check=True,
                                capture_output=True, text=True).stdout.strip()
        base_src = _tree(commit) / "src"
        sides = {"base": lambda: _side(base_src, a), **sides}
    runs = h.alternate(sides, a.rounds)
    out: dict = {"rows": a.rows, "new": a.new, "mode": a.mode, "page_size": a.page_size, "spec": a.spec,
                 "prompt_tokens": a.prompt_tokens, "lookahead": a.lookahead, "ngram_search": a.ngram_search,
                 "chain": a.chain}
    for name, rs in runs.items():
        out[name] = h.median_run(rs, "host_ms_per_step")
    if a.base:
        out["base_commit"] = commit
        pairs = [(b, x) for b, x in zip(runs["base"], runs["head"]) if "error" not in b and "error" not in x]
        for key, name in (("host_ms_per_step", "base_over_head"),
                          ("prefill_host_ms_per_pass", "prefill_base_over_head"),
                          ("step_ms", "step_base_over_head")):
            ratios = [b[key] / x[key] for b, x in pairs]
            out[name] = statistics.median(ratios) if ratios else None
            out[f"{name}_runs"] = ratios
        out["same_tokens"] = len({r["tokens_sha"] for r in runs["base"] + runs["head"] if "tokens_sha" in r}) == 1
    return out


if __name__ == "__main__":  # one side (--side): the measurement of the tree on PYTHONPATH
    import argparse

    import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)

    ap = argparse.ArgumentParser()
    add_args(ap)
    args = ap.parse_args()
    print(json.dumps(measure(args.rows, args.new, args.mode, args.page_size, args.spec, args.prompt_tokens,
                             args.lookahead, args.prefill, args.ngram_search, args.chain)))
