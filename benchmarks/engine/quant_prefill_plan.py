"""What building a q8/q4 prefill pass's plan costs the host (`QuantRoute.plan` of a pass of several tokens a row:
each row's segment sources, the pool slots of the pages the pass completes, the tail writes and the mask): the
pass's rows at mixed prompt lengths, first chunks (nothing sealed yet) and later ones (pages sealed, some rows
with tokens left in their tails). The host builds it once a pass, before the device can start the pass.
Reports ms per plan (the best of --reps) for each shape, and a fingerprint of each plan's arrays, so two trees can
be compared for the same plans (PYTHONPATH=<other tree>/src).

    python -m benchmarks engine.quant_prefill_plan --reps 7
"""
from __future__ import annotations

import hashlib
import json
import time

import mlx.core as mx
import numpy as np

from kvbatch.engine.config import EngineOptions
from kvbatch.engine.kv.cache import PagedKVCache
from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.memory import KVLayout

SMOKE = ["--reps", "1", "--shapes", "4x64"]


def add_args(ap) -> None:
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shapes", default="16x1024,64x512,32x1024@later,32x1024@tails",
                    help="ROWSxTOKENS[@later|@tails]: rows of a pass and its longest row's tokens (each row 52 up "
                         "to that many); @later: rows with pages sealed before the pass; @tails: and tokens in "
                         "their tail pages")
    ap.add_argument("--page", type=int, default=16)


def _plan_once(rows: int, L: int, kind: str, P: int, reps: int) -> tuple[float, str]:
    rng = np.random.default_rng(0)
    lay = KVLayout(num_kv_layers=1, num_kv_heads=8, head_dim=64, dtype_bytes=2, mode="q8", group_size=64,
                   page_size=P)
    cache = PagedKVCache(lay, 1, mx.bfloat16, tail_slots=rows, upcast=False, query_heads=32,
                         options=EngineOptions(route="portable"))
    lens = rng.integers(52, L + 1, rows).tolist()
    pos = [0] * rows
    if kind:
        pos = (rng.integers(0, 64, rows) * P + (rng.integers(0, P, rows) if kind == "tails" else 0)).tolist()
    batch = []
    for i, p in enumerate(pos):
        r = CacheRow(f"r{i}")
        cache.admit(r)
        cache.reserve(r, p + max(lens), 1 << 30)
        r.length = p
        batch.append(r)
    best, meta = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        meta = cache.attention.plan(batch, L, pos, lens)
        best = min(best, time.perf_counter() - t0)
        mx.eval([a for a in vars(meta).values() if isinstance(a, mx.array)])
    h = hashlib.sha1()
    for k, v in sorted(vars(meta).items()):
        h.update(k.encode() + (np.array(v).tobytes() if isinstance(v, mx.array) else repr(v).encode()))
    return best * 1e3, h.hexdigest()[:12]


def run(a) -> dict:
    out = {"page": a.page, "shapes": {}}
    for shape in a.shapes.split(","):
        size, _, kind = shape.partition("@")
        rows, L = map(int, size.split("x"))
        ms, fp = _plan_once(rows, L, kind, a.page, a.reps)
        out["shapes"][shape] = {"ms": round(ms, 3), "fingerprint": fp}
        print(json.dumps({"shape": shape, "ms": round(ms, 3), "fingerprint": fp}), flush=True)
    return out
