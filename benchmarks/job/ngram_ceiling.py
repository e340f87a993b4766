"""The most n-gram speculation can gain on a job already run: its rows' greedy outputs replayed through
the n-gram proposer, counting the verification passes each row would take.

Greedy outputs are the same with and without speculation, so a plain run's outputs say exactly what
every pass would accept: at each pass the row's last tokens are looked up in its prompt and output so
far (engine/speculative/ngram.py's `NgramIndex`, the engine's own proposer), the proposed tokens are
compared with the tokens the row really produced next, and the row advances by the accepted prefix
plus one. A pass costs at least a plain decode step (it runs the same rows with more positions), so
a job's decode can gain at most its plain steps over its passes. The job's steps are counted as
continuous batching runs it: rows admitted in input order whenever a slot of --batch frees, every
running row advancing one step (or pass) at a time; prefill is left out (speculation does not change it).
Where a step's cost does not depend on its rows, the job's steps bound the gain (`decode_ceiling`: the
slowest rows set it once the batch empties); where it is in proportion to them, the rows' steps do
(`tokens_per_step`).

Each setting is replayed three ways: every step proposing k tokens (the proposer's best case); under the
engine's own back-off (RowSpec's window and pauses), whose proposed and accepted counts are the engine's
with speculative.adaptive off; and with the host a pass behind (`row_passes_pipelined`: each pass built
before the one in flight is read, assuming it keeps every token, so that no host work waits for the
device; a pass after one that kept part of its proposal is wasted). None has adaptive's plain steps or
disable_by_batch_size. --settings lists k:lookup_min:lookup_max triples to replay.

    python -m benchmarks job.speculative --sides plain --rounds 1 --rows 64 --max-tokens 1024 --keep /tmp/kept
    python -m benchmarks job.ngram_ceiling --kept /tmp/kept --batch 1024 --out /tmp/ceiling.json
"""
from __future__ import annotations

import heapq
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Optional

from kvbatch.engine.speculative.ngram import NgramIndex
from kvbatch.engine.speculative.state import RowSpec

SMOKE = ["--model", "tiny", "--rows", "2", "--max-tokens", "4", "--settings", "4:2:4"]


def row_passes(prompt: list[int], out: list[int], k: int, n_min: int, n_max: int,
               backoff: Optional[int] = None) -> tuple[int, int, int]:
    """(decode steps, tokens proposed, tokens accepted) for one row whose output is `out` (its first token
    from prefill). Without backoff, every step proposes up to k tokens from the row's prompt and output so
    far; backoff=max_tokens replays the engine's own rules (RowSpec's window and pause, window.py's cap at
    max_tokens), so its proposed and accepted counts are those the engine reports."""
    idx = NgramIndex(n_min)
    idx.extend(prompt + out[:1])
    st = RowSpec()
    pos, steps, proposed, accepted = 1, 0, 0, 0
    while pos < len(out):
        prop: list[int] = []
        if backoff is None:
            prop = idx.propose(k, n_max)
        elif st.may_propose():
            want = min(k, st.want, backoff - pos - 1)
            prop = idx.propose(want, n_max) if want > 0 else []
        a = 0
        while a < len(prop) and pos + a < len(out) and prop[a] == out[pos + a]:
            a += 1
        if prop:
            st.verified(len(prop), a)
            proposed += len(prop)
            accepted += a
        got = min(a + 1, len(out) - pos)  # the accepted tokens and the token sampled after them
        idx.extend(out[pos:pos + got])
        pos += got
        steps += 1
    return steps, proposed, accepted


def _propose_after(idx: NgramIndex, extra: list[int], k: int, n_max: int) -> list[int]:
    """idx.propose(k, n_max) as if `extra` followed the indexed tokens; the index is left as it was."""
    n0 = len(idx.toks)
    idx.extend(extra)
    try:
        return idx.propose(k, n_max)
    finally:
        idx.truncate(n0)


def row_passes_pipelined(prompt: list[int], out: list[int], k: int, n_min: int, n_max: int) -> tuple[int, int, int]:
    """(passes, passes wasted, tokens accepted) for one row when the host is a pass behind: pass t+1 is built
    before pass t's tokens are read, assuming pass t keeps every proposed token. Its first input is pass t's
    last sampled token (on the device), its proposals follow the host's guess of that token (the n-gram
    continuation of the row's tokens and pass t's proposal). Where pass t keeps fewer, pass t+1 ran on a
    wrong context: it is wasted, and the row's next pass starts again from its read tokens."""
    idx = NgramIndex(n_min)
    idx.extend(prompt + out[:1])
    N, pos = len(out), 1
    inflight: Optional[tuple[int, list[int]]] = None  # (the output index of its first proposed token, proposal)
    passes = wasted = accepted = 0
    while pos < N or inflight is not None:
        new: Optional[tuple[int, list[int]]] = None
        if inflight is None:
            new = (pos, idx.propose(min(k, N - pos - 1), n_max))
        else:
            b, p = inflight
            base = b + len(p) + 1
            if base < N:  # else the pass in flight ends the row if it keeps every token
                guess = _propose_after(idx, p, min(k + 1, N - base), n_max)
                new = (base, guess[1:])
        passes += new is not None
        if inflight is None:
            inflight = new
            continue
        b, p = inflight
        a = 0
        while a < len(p) and p[a] == out[b + a]:
            a += 1
        accepted += a
        idx.extend(out[b:b + a + 1])
        pos = b + a + 1
        if a < len(p):
            wasted += new is not None
            new = None
        inflight = new
    return passes, wasted, accepted


def job_steps(costs: list[int], batch: int) -> int:
    """Steps of a job whose rows (in admission order) take costs[i] steps each, at most `batch` at a time."""
    ends: list[int] = []
    for c in costs:
        start = heapq.heappop(ends) if len(ends) >= batch else 0
        heapq.heappush(ends, start + c)
    return max(ends, default=0)


def _replay(args: tuple) -> tuple[int, int, int]:
    return row_passes(*args)


def _replay_pipelined(args: tuple) -> tuple[int, int, int]:
    return row_passes_pipelined(*args)


def ceiling(prompts: list[list[int]], outputs: list[list[int]], settings: list[tuple[int, int, int]], batch: int,
            workers: int = 1, max_tokens: Optional[int] = None) -> dict:
    """The plain job's decode steps against each setting's, per row summed and as the job's steps at `batch`:
    every step proposing (the ceiling), and, given max_tokens, under the engine's back-off."""
    steps = [max(len(o) - 1, 0) for o in outputs]
    plain = job_steps(steps, batch)
    res: dict = {"rows": len(outputs), "tokens": sum(len(o) for o in outputs), "batch": batch,
                 "plain_row_steps": sum(steps), "plain_job_steps": plain, "settings": []}
    for k, n_min, n_max in settings:
        # (policy, replay, its arguments after the row's, what the replay's 2nd and 3rd counts are)
        policies: list[tuple[str, Callable, tuple, tuple[str, str]]] = [
            ("every step", _replay, (None,), ("proposed", "accepted"))]
        if max_tokens:
            policies.append(("engine back-off", _replay, (max_tokens,), ("proposed", "accepted")))
        policies.append(("a pass behind", _replay_pipelined, (), ("wasted_passes", "accepted")))
        for name, replay, extra, counts in policies:
            jobs = [(p, o, k, n_min, n_max, *extra) for p, o in zip(prompts, outputs)]
            if workers > 1:
                with ProcessPoolExecutor(workers) as ex:
                    got = list(ex.map(replay, jobs, chunksize=16))
            else:
                got = [replay(j) for j in jobs]
            passes = [g[0] for g in got]
            spec = job_steps(passes, batch)
            res["settings"].append({
                "k": k, "prompt_lookup_min": n_min, "prompt_lookup_max": n_max, "policy": name,
                "row_steps": sum(passes), "tokens_per_step": sum(steps) / max(sum(passes), 1),
                counts[0]: sum(g[1] for g in got), counts[1]: sum(g[2] for g in got),
                "job_steps": spec, "decode_ceiling": plain / max(spec, 1)})
    return res


def add_args(ap) -> None:
    ap.add_argument("--kept", help="a folder job.speculative --keep wrote (prompts.json.gz, results.parquet); "
                                   "without it, a plain job of --rows x --max-tokens is run first")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--settings", default="4:2:4,8:2:4,4:1:4,8:3:6",
                    help="k:prompt_lookup_min:prompt_lookup_max triples, comma-separated")
    ap.add_argument("--batch", type=int, default=1024, help="the job's engine.max_batch")
    ap.add_argument("--workers", type=int, default=1, help="processes replaying rows")


def _kept(a) -> Path:
    """The folder of a plain job's prompts and results: --kept, or a small job run now."""
    if a.kept:
        return Path(a.kept)
    import argparse
    import tempfile

    from benchmarks.job import speculative
    ap = argparse.ArgumentParser()
    speculative.add_args(ap)
    keep = Path(tempfile.mkdtemp(prefix="kvbatch-ceiling-"))
    sa = ap.parse_args(["--model", a.model, "--rows", str(a.rows), "--max-tokens", str(a.max_tokens), "--rounds", "1",
                        "--sides", "plain", "--no-warm", "--keep", str(keep)]
                       + (["--min-chars", "200", "--max-chars", "400"] if a.model == "tiny" else []))
    speculative.run(sa)
    return keep


def run(a) -> dict:
    import pyarrow.parquet as pq

    import kvbatch.engine as engine
    from benchmarks.job import speculative
    from kvbatch.engine.models.config import ModelConfig
    from kvbatch.pipeline.config import JobConfig
    from kvbatch.pipeline.prompts import encode

    kept = _kept(a)
    meta = json.loads((kept / "kept.json").read_text())
    _, tok, _ = engine.load_model(ModelConfig(**meta["model"]))
    texts = speculative.kept_prompts(kept)
    rows = sorted(pq.read_table(kept / "results.parquet").to_pylist(), key=lambda r: int(r["row_key"][1:]))
    job = JobConfig()
    prompts = [encode(tok, {"prompt": texts[r["row_key"]]}, job) for r in rows]
    # the replay is exact only where the prompt is the one the job ran
    mismatched = sum(len(p) != r["prompt_tokens"] for p, r in zip(prompts, rows))
    settings = [tuple(int(x) for x in s.split(":")) for s in a.settings.split(",") if s]
    res = ceiling(prompts, [list(r["output_token_ids"] or []) for r in rows],
                  [(s[0], s[1], s[2]) for s in settings], a.batch, a.workers, meta.get("max_tokens"))
    res.update(max_tokens=meta.get("max_tokens"), prompt_length_mismatches=mismatched,
               prompt_tokens=sum(len(p) for p in prompts))
    print(json.dumps(res))
    return res
