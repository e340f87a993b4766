"""What the n-gram proposals of one verification pass cost the host: `NgramProposer.propose` over --rows rows
of the rewrite job's shape (pydoc passages of 300-1,500 word tokens as the prompt; the output copies the passage
with a change every ~20 words), each row gaining 1 + its accepted proposal a step, as a pass keeps them. A pass
waits for its proposals with the device idle, so this is on every step of a speculating job. Reports µs per
row-proposal and ms per pass of --rows rows (median of the steps), and the first pass's ms apart (it indexes
every row's prompt, as a pass does for the rows that joined since the one before).

    python -m benchmarks engine.ngram_cost --rows 512 --steps 200
"""
from __future__ import annotations

import json
import random
import re
import statistics
import time

from kvbatch.engine.config import SpeculativeConfig
from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.row import Row
from kvbatch.engine.sampling import RowSampler
from kvbatch.engine.speculative import make_proposer
from kvbatch.engine.speculative.state import RowSpec
from kvbatch.engine.types import Request

SMOKE = ["--rows", "4", "--steps", "5"]


def add_args(ap) -> None:
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--num-tokens", type=int, default=4)


def _word_ids(n: int, seed: int) -> list[list[int]]:
    """n passages of pydoc topics as word ids (a word-level stand-in for a tokenizer's ids)."""
    from pydoc_data.topics import topics

    vocab: dict[str, int] = {}
    words = [vocab.setdefault(w, len(vocab)) for name in sorted(topics) for w in re.findall(r"\w+|\S", topics[name])]
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        a = rnd.randrange(0, len(words) - 1500)
        out.append(words[a:a + rnd.randint(300, 1500)])
    return out


def run(a) -> dict:
    rnd = random.Random(1)
    passages = _word_ids(a.rows, 0)
    prop = make_proposer(SpeculativeConfig(method="ngram", num_tokens=a.num_tokens))
    assert prop is not None
    rows = []
    for i, p in enumerate(passages):
        row = Row(Request(f"r{i}", p, SamplingParams(max_tokens=1 << 20)), CacheRow(f"r{i}"),
                  RowSampler(SamplingParams()), len(p) + (1 << 20), 0.0, out=[p[0]])
        row.spec = RowSpec()
        rows.append(row)
    per_pass, proposed = [], 0
    for _ in range(a.steps):
        t0 = time.perf_counter()
        props = prop.propose(rows, [a.num_tokens] * len(rows))
        per_pass.append(time.perf_counter() - t0)
        for row, pr in zip(rows, props):
            src = row.req.prompt_tokens
            nxt = src[len(row.out) % len(src)] if rnd.random() > 0.05 else rnd.randrange(50_000)
            keep = [nxt]
            if pr and pr[0] == nxt:  # accepted as far as the copy goes
                keep = [t for j, t in enumerate(pr) if src[(len(row.out) + j) % len(src)] == t][:len(pr)]
                keep.append(src[(len(row.out) + len(keep)) % len(src)])
            row.out += keep
            proposed += len(pr)
    med = statistics.median(per_pass)
    out = {"rows": a.rows, "steps": a.steps, "ms_per_pass": med * 1e3, "us_per_row": med / a.rows * 1e6,
           "first_pass_ms": per_pass[0] * 1e3, "proposed_per_row_step": proposed / a.rows / a.steps}
    print(json.dumps(out))
    return out
