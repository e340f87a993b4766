"""Where the rewrite job's time goes in the engine, with and without n-gram speculation: the issue-41
rewrite prompts (pydoc passages, greedy) through one Engine per side, under cProfile, after an
untimed warm-up of the same engine. Prints each side's engine figures (prefill and decode seconds,
verification passes, acceptance, MLX buffer-cache trims) and the functions with the most own time:
a host-bound side shows Python and graph building there, a device-bound side its waits (tolist,
eval).

    python -m benchmarks gpu.spec_profile --rows 128 --max-tokens 512
"""
from __future__ import annotations

import cProfile
import io
import json
import pstats
import time

import mlx.core as mx

from benchmarks import harness as h
from benchmarks.job.speculative import INSTRUCTION, passages
from kvbatch.engine.engine import Engine
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request

SMOKE = ["--model", "tiny", "--rows", "2", "--max-tokens", "4", "--warm", "1", "--top", "3", "--min-chars", "100",
         "--max-chars", "200"]


def add_args(ap) -> None:
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--mode", default="none", help="KV mode (harness.parse_mode), e.g. q8")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--warm", type=int, default=8, help="rows of the untimed warm-up run")
    ap.add_argument("--sides", default="spec,plain")
    ap.add_argument("--num-tokens", type=int, default=4)
    ap.add_argument("--top", type=int, default=25, help="functions listed per side")
    ap.add_argument("--min-chars", type=int, default=1200, help="shortest passage (~300 tokens)")
    ap.add_argument("--max-chars", type=int, default=6000, help="longest passage (~1,500 tokens)")


def _requests(tok, n: int, max_tokens: int, tag: str, chars: tuple[int, int]) -> list[Request]:
    texts = passages(n, 0, *chars)
    return [Request(f"{tag}{i}", tok.encode(INSTRUCTION + t), SamplingParams(max_tokens=max_tokens))
            for i, t in enumerate(texts)]


def run(a) -> dict:
    model, tok, spec = h.load(a.model)
    out = {}
    for side in a.sides.split(","):
        sp = {"method": "ngram", "num_tokens": a.num_tokens} if side == "spec" else None
        eng = Engine(model, tok, spec, h.mode_config(a.mode, speculative=sp, max_batch="auto"))
        chars = (a.min_chars, a.max_chars)
        eng.generate(_requests(tok, a.warm, 32, "w", chars))
        s0 = eng.stats()
        prof = cProfile.Profile()
        trims = [0]
        clear = mx.clear_cache

        def counted() -> None:
            trims[0] += 1
            clear()
        mx.clear_cache = counted  # type: ignore[assignment]  (counts the engine's buffer-cache trims)
        t0 = time.perf_counter()
        prof.enable()
        res = eng.generate(_requests(tok, a.rows, a.max_tokens, "r", chars))
        prof.disable()
        wall = time.perf_counter() - t0
        mx.clear_cache = clear  # type: ignore[assignment]
        s1 = eng.stats()
        figs = {k: (s1.get(k) or 0) - (s0.get(k) or 0) for k in ("prefill_s", "decode_s", "spec_passes",
                                                                 "spec_proposed", "spec_accepted")}
        tokens = sum(len(r.tokens) for r in res)
        rec = {"side": side, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "trims": trims[0],
               "max_batch": s1.get("max_batch"), **figs}
        print(json.dumps(rec), flush=True)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(a.top)
        print(buf.getvalue(), flush=True)
        out[side] = rec
    return out
