"""Durable checkpoints of rows in flight: a stopped row continues on any worker instead of starting over.

The queue's `checkpoints` table holds, per row, the latest checkpoint a worker saved while the row was
leased to it (engine/resume.py says what one is): its tokens as little-endian uint32 bytes, its other
state (output logprobs) as JSON, a checksum over all of it, and the row's fingerprint: what makes kept
tokens valid (the model, the KV settings and engine options that can change tokens, the row's sampling
parameters, its prompt's token ids). A claimed row continues from its checkpoint only when the
checksum and the fingerprint both hold; otherwise the checkpoint is discarded, the reason kept
(`discarded`, shown by status), and the row starts over: a row never continues from garbage or from
tokens another configuration made. When a row's result is durable its tokens are dropped (its
counters stay).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Optional

import numpy as np
import pyarrow as pa

from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import RowCheckpoint
from kvbatch.pipeline.config import Config
from kvbatch.pipeline.queue import Queue

CORRUPT = "corrupt"  # checksum or length does not hold
CHANGED = "config changed"  # model, KV mode, sampling or prompt differ from those that made the tokens
UNUSABLE = "cannot continue"  # the engine refused the kept tokens (engine/resume.py says why)
_EMPTY = b""


def fingerprint(cfg: Config, model: str, params: SamplingParams, prompt_ids: list[int]) -> str:
    """What a row's kept tokens are valid for: model, KV settings, token-changing engine options,
    the row's sampling parameters and its prompt's token ids (hex digest)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps({"model": model, "kv": asdict(cfg.kv), "engine": cfg.engine.options.identity(),
                         "prefix_cache": cfg.engine.prefix_cache, "sampling": asdict(params)},
                        sort_keys=True, default=str).encode())
    h.update(np.asarray(prompt_ids, dtype="<u4").tobytes())
    return h.hexdigest()


def _checksum(fp: str, n: int, tokens: bytes, state: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in (fp.encode(), n.to_bytes(8, "little"), tokens, state.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _state(ck: RowCheckpoint) -> str:
    return json.dumps({"logprobs": ck.logprobs, "top": ck.top} if ck.logprobs is not None else {})


def save(q: Queue, worker: str, items: list[tuple[str, str, RowCheckpoint]]) -> list[str]:
    """Store (key, fingerprint, checkpoint) of rows this worker still holds, in one transaction; returns
    the keys stored (a row no longer leased to it is not: another worker may own it now)."""
    if not items:
        return []
    now, j = q.now(), q.job
    stored: list[str] = []
    with q.s.tx():
        for key, fp, ck in sorted(items, key=lambda x: x[0]):
            tokens = np.asarray(ck.tokens, dtype="<u4").tobytes()
            state = _state(ck)
            n = q.s.execute(
                "INSERT INTO checkpoints(job, key, fingerprint, n, tokens, state, checksum, saves, worker, at) "
                "SELECT ?,?,?,?,?,?,?,1,?,? WHERE EXISTS (SELECT 1 FROM rows WHERE job=? AND key=? "
                "AND state='leased' AND worker=?) ON CONFLICT (job, key) DO UPDATE SET "
                "fingerprint=excluded.fingerprint, n=excluded.n, tokens=excluded.tokens, state=excluded.state, "
                "checksum=excluded.checksum, saves=checkpoints.saves+1, worker=excluded.worker, at=excluded.at",
                (j, key, fp, len(ck.tokens), tokens, state, _checksum(fp, len(ck.tokens), tokens, state), worker,
                 now, j, key, worker)).rowcount
            if n:
                stored.append(key)
    return stored


def load(q: Queue, key: str, fp: str) -> tuple[Optional[RowCheckpoint], int, Optional[str]]:
    """(checkpoint, times saved, why discarded): the row's checkpoint if it holds and was made for `fp`;
    a corrupt or foreign one is discarded here (the row starts over) and the reason returned."""
    row = q.s.execute("SELECT fingerprint, n, tokens, state, checksum, saves FROM checkpoints WHERE job=? AND key=?",
                      (q.job, key)).fetchone()
    if row is None:
        return None, 0, None
    have_fp, n, tokens, state, checksum, saves = row
    if not n:
        return None, int(saves), None
    tokens = bytes(tokens)
    why = None
    if len(tokens) != 4 * n or _checksum(have_fp, n, tokens, state) != checksum:
        why = CORRUPT
    elif have_fp != fp:
        why = CHANGED
    else:
        try:
            d = json.loads(state)
            ck = RowCheckpoint(np.frombuffer(tokens, dtype="<u4").astype(np.int64).tolist(), d.get("logprobs"),
                               [[(int(t), float(v)) for t, v in top] for top in d.get("top", [])])
            return ck, int(saves), None
        except (ValueError, TypeError):
            why = CORRUPT
    discard(q, [key], why)
    return None, int(saves), why


def discard(q: Queue, keys: list[str], why: str) -> None:
    """The rows' checkpoints cannot be used (`why`): their tokens dropped, the reason kept for status."""
    _drop(q, keys, why)


def clear(q: Queue, keys: list[str]) -> None:
    """The rows' results are durable: their kept tokens are no longer needed (their counters stay)."""
    _drop(q, keys, None)


def _drop(q: Queue, keys: list[str], why: Optional[str]) -> None:
    if not keys:
        return
    empty = _checksum("", 0, _EMPTY, "{}")
    with q.s.tx():
        q.s.executemany("UPDATE checkpoints SET n=0, tokens=?, state='{}', checksum=?, "
                        "discarded=COALESCE(?, discarded) WHERE job=? AND key=?",
                        [(_EMPTY, empty, why, q.job, k) for k in sorted(keys)])


def in_progress(q: Queue) -> list[tuple[str, int]]:
    """(key, kept tokens) of the manifest rows still to finish that hold a checkpoint, in input order."""
    return [(k, int(n)) for k, n in q.s.execute(
        "SELECT c.key, c.n FROM checkpoints c JOIN rows r ON r.job=c.job AND r.key=c.key "
        "JOIN manifest m ON m.job=r.job AND m.key=r.key WHERE c.job=? AND c.n > 0 "
        "AND r.state IN ('pending','leased') ORDER BY m.pos", (q.job,))]


def started_over(q: Queue) -> dict[str, int]:
    """Rows whose checkpoint was discarded, by reason (corrupt, config changed, cannot continue)."""
    return {why: int(n) for why, n in q.s.execute(
        "SELECT discarded, COUNT(*) FROM checkpoints WHERE job=? AND discarded IS NOT NULL GROUP BY discarded "
        "ORDER BY 1", (q.job,))}


# A sharded job's checkpoints leave its local queue as a table (pipeline/shards.py): the columns of the
# `checkpoints` table that a claim reads back, checksum included, so a copy is verified like the original.
COLUMNS = ("key", "fingerprint", "n", "tokens", "state", "checksum", "saves")


def kept(q: Queue) -> pa.Table:
    """The checkpoints that hold tokens, as a table of COLUMNS."""
    rows = q.s.execute(f"SELECT {', '.join(COLUMNS)} FROM checkpoints WHERE job=? AND n > 0 ORDER BY key",
                       (q.job,)).fetchall()
    cols = list(zip(*rows)) if rows else [()] * len(COLUMNS)
    types = (pa.string(), pa.string(), pa.int64(), pa.binary(), pa.string(), pa.string(), pa.int64())
    return pa.table({name: pa.array([bytes(v) if t == pa.binary() else v for v in col], t)
                     for name, col, t in zip(COLUMNS, cols, types)})


def restore(q: Queue, table: pa.Table) -> int:
    """Put checkpoints taken with kept() into the queue (rows it holds only); returns how many. A claim
    verifies each (checksum, fingerprint) as it would its own."""
    have = {k for (k,) in q.s.execute("SELECT key FROM rows WHERE job=?", (q.job,))}
    items = [(q.job, *row) for row in zip(*(table.column(c).to_pylist() for c in COLUMNS)) if row[0] in have]
    with q.s.tx():
        q.s.executemany("INSERT INTO checkpoints(job, key, fingerprint, n, tokens, state, checksum, saves) "
                        "VALUES (?,?,?,?,?,?,?,?) ON CONFLICT (job, key) DO NOTHING", items)
    return len(items)
