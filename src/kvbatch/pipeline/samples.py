"""`n` samples per input row: one queue row per (input row, sample), and each sample's seed.

A row with n > 1 (`sampling.n`, or its own `n` column) becomes n queue rows with keys
`KEY#s0`..`KEY#s{n-1}` (more `#` where a real id already has that name), payloads that say
their `sample_index` and `group` (the input row's key: the engine prefills the prompt once and
forks the samples from it, engine/sharing.py). Each sample is claimed, written and acknowledged
on its own, so durability and resume work per sample. A row with n = 1 keeps its key.

Queue positions keep input order and carry the input row: pos = input position x SAMPLE_SLOTS +
sample index (finalize and the worker read row_index = pos // SAMPLE_SLOTS; a queue made before
samples existed has no `sample_slots` meta and pos = input position).

Seeds: a row without a seed of its own gets derive_seed(sampling.seed, its key), so duplicated
prompts and samples draw different tokens and the same job run again draws the same ones; a row
with its own seed keeps it (its samples i > 0: derive_seed(seed, the sample's key)).
"""
from __future__ import annotations

from typing import Optional

from kvbatch.engine.params import MAX_SAMPLES
from kvbatch.engine.samples import derive_seed, sample_key
from kvbatch.pipeline.inputs import InputRow

SAMPLE_SLOTS = MAX_SAMPLES  # queue positions per input row
META = "sample_slots"


def expand(rows: list[InputRow], n: int, temperature: float = 1.0) -> list[InputRow]:
    """The queue rows of these input rows, `n` samples each unless a row says its own (an invalid
    row stays one row: it gets its error once). A row asking for n > 1 greedy samples (its
    temperature, else the job's `temperature`, is 0) is invalid_input: they would be n copies."""
    taken = {r.key for r in rows}
    out: list[InputRow] = []
    for r in rows:
        k = 1 if "error" in r.payload else r.payload.get("n", n)
        if k > 1 and r.payload.get("temperature", temperature) == 0:
            why = greedy_samples(k, "the row's temperature" if "temperature" in r.payload else "temperature")
            out.append(InputRow(r.pos * SAMPLE_SLOTS, r.key, {**r.payload, "error": why}))
            continue
        if k == 1:
            out.append(InputRow(r.pos * SAMPLE_SLOTS, r.key, r.payload))
            continue
        for i in range(k):
            key = sample_key(r.key, i)
            while key in taken:
                key += "#"
            taken.add(key)
            out.append(InputRow(r.pos * SAMPLE_SLOTS + i, key, {**r.payload, "sample_index": i, "group": r.key}))
    return out


def greedy_samples(n: int, which: str = "temperature") -> str:
    """Why n > 1 samples at temperature 0 are refused (config and rows say the same)."""
    return (f"n={n} with {which} 0 (greedy) would give {n} identical samples: set temperature > 0 "
            f"(or n=1)")


def slots_of(meta: Optional[str]) -> int:
    """SAMPLE_SLOTS for a queue whose positions carry samples, 1 for an older queue."""
    return int(meta) if meta else 1


def seed_for(payload: dict, key: str, job_seed: int) -> int:
    """The seed a queue row samples with (see the module docstring)."""
    own = payload.get("seed")
    if own is None:
        return derive_seed(job_seed, key)
    return own if not payload.get("sample_index") else derive_seed(own, key)
