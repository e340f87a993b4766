"""Workers that claim at the same moment on one PostgreSQL queue (a real server): a claim locks only the
rows it may take, and a worker that finds every pending row locked by another claim claims again
instead of ending with rows left.

Both tests hold the other claim open by hand (a transaction kept open on another connection), so the
moment of contention is the same on any machine, without timers.
"""
from __future__ import annotations

import json

import psycopg

import kvbatch.pipeline.actions as actions
from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.inputs import InputRow
from kvbatch.pipeline.queue import Claimed, Queue, open_store
from kvbatch.pipeline.worker import Worker


def test_a_claim_in_progress_leaves_the_rows_it_does_not_take_to_other_claimers(pg_url, tmp_path):
    first = Queue(open_store(pg_url, tmp_path / "a", "contention-split"))
    first.enqueue([InputRow(i, f"k{i}", {"prompt": f"p{i}"}) for i in range(6)])
    second = Queue(first.s.reopen())
    try:
        with first._tx():  # the first claim's transaction stays open while the second claims
            mine = first.claim("w1", 2, lease_s=60)
            theirs = second.claim("w2", 2, lease_s=60)
        assert [c.key for c in mine] == ["k0", "k1"]
        assert [c.key for c in theirs] == ["k2", "k3"]  # locking a 64-row page gave this claimer nothing
    finally:
        second.close()
        first.close()


class _LockedAtFirst(Queue):
    """The queue while another connection holds every pending row locked (a claim in progress
    elsewhere); the lock ends once this worker's claim came back empty."""

    def __init__(self, store, locker: psycopg.Connection):
        super().__init__(store)
        self.locker = locker
        self.empty_claims = 0

    def claim(self, worker: str, n: int, *args, **kwargs) -> list[Claimed]:
        got = super().claim(worker, n, *args, **kwargs)
        if not got and not self.locker.closed:
            self.empty_claims += 1
            self.locker.commit()
            self.locker.close()
        return got


def test_a_worker_that_finds_the_pending_rows_locked_claims_again_and_does_them(pg_url, tmp_path, model_cache_dir):
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"row {i}"}) + "\n" for i in range(3)))
    cfg = compose_config(["model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={src}",
                          f"output.dir={tmp_path / 'out'}", f"queue.url='{pg_url}'", "job.name=locked_rows",
                          "job.chat_template=false", "job.max_tokens=4", "output.progress=off", "action=work"])
    job = actions.job_for(cfg)
    q, _, _ = actions.enqueue(job)
    locker = psycopg.connect(pg_url)  # not autocommit: the lock lasts until commit
    locker.execute("SELECT key FROM rows WHERE job=%s FOR UPDATE", (q.job,))
    watched = _LockedAtFirst(q.s, locker)
    stats = Worker(cfg, watched, job.out_dir / "parts", actions.load_runtime(cfg)).run()
    assert watched.empty_claims == 1  # it did meet the rows locked
    assert stats.rows == 3 and q.counts() == {"pending": 0, "leased": 0, "done": 3, "error": 0}
