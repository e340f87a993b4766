"""`n` samples of one prompt, and seeds that differ by default.

`samples(req, n)` makes the n requests of one prompt: keys `KEY#s0`..`KEY#s{n-1}`, one group
(the engine prefills the prompt once and forks the rest from it, engine/sharing.py), and a seed
each. `derive_seed` is how a seed is made from a base seed and a key: a row without a seed of its
own gets one from the job's seed and its row key, so duplicated prompts and samples differ,
while the same job run again draws the same tokens.
"""
from __future__ import annotations

import hashlib
from dataclasses import replace

from kvbatch.engine.types import Request

SEED_BITS = 63  # derived seeds fit a signed 64-bit column


def derive_seed(base: int, key: str) -> int:
    """A seed in [0, 2**63) from a base seed and a key (BLAKE2b of both: stable across runs,
    machines and Python versions, unlike hash())."""
    digest = hashlib.blake2b(f"{int(base)}\x00{key}".encode("utf-8", "backslashreplace"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


def sample_key(key: str, i: int) -> str:
    """The row key of sample i of row `key`."""
    return f"{key}#s{i}"


def samples(req: Request, n: int) -> list[Request]:
    """n requests drawing samples of req's prompt: sample 0 keeps req's seed, sample i > 0 uses
    derive_seed(seed, its key). n == 1: [req] itself."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1:
        return [req]
    seed = req.sampling.seed
    out = []
    for i in range(n):
        key = sample_key(req.key, i)
        s = seed if i == 0 else derive_seed(seed, key)
        out.append(Request(key, req.prompt_tokens, replace(req.sampling, seed=s), group=req.key))
    return out
