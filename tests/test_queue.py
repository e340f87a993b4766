"""The SQLite queue: idempotent enqueue, leases (claim, renew, expiry), ack, release, the attempts record."""
from __future__ import annotations

import threading
import time

from pipeline.inputs import InputRow
from pipeline.queue import Queue


def _rows(n, start=0):
    return [InputRow(i, f"k{i}", {"prompt": f"p{i}"}) for i in range(start, start + n)]


def test_enqueue_is_idempotent_and_tracks_the_manifest(tmp_path):
    q = Queue(tmp_path / "q.sqlite")
    assert q.enqueue(_rows(3)) == 3
    assert q.enqueue(_rows(3)) == 0
    assert q.counts() == {"pending": 3, "leased": 0, "done": 0, "error": 0}
    assert q.enqueue(_rows(4)) == 1  # an appended row only
    assert [k for _, k, *_ in q.manifest()] == ["k0", "k1", "k2", "k3"]
    q.enqueue(_rows(2))  # the input shrank: the manifest follows it
    assert q.counts()["pending"] == 2


def test_claim_in_order_ack_and_record(tmp_path):
    q = Queue(tmp_path / "q.sqlite")
    q.enqueue(_rows(5))
    got = q.claim("w1", 3, lease_s=60)
    assert [c.key for c in got] == ["k0", "k1", "k2"] and all(c.attempt == 1 for c in got)
    assert got[0].payload == {"prompt": "p0"}
    assert [c.key for c in q.claim("w2", 10, lease_s=60)] == ["k3", "k4"]
    assert q.claim("w3", 10, lease_s=60) == []
    q.ack("w1", [("k0", None), ("k1", "invalid_input")], "part-a")
    assert q.counts() == {"pending": 0, "leased": 3, "done": 1, "error": 1}
    assert q.error_counts() == {"invalid_input": 1}
    rec = {r[0]: r for r in q.attempts()}
    assert rec["k0"][2] == "w1" and rec["k0"][5] == "done" and rec["k0"][6] == "part-a"
    assert rec["k1"][5] == "error" and rec["k1"][7] == "invalid_input"
    assert rec["k3"][2] == "w2" and rec["k3"][4] is None  # still open


def test_expired_lease_returns_to_the_queue(tmp_path):
    q = Queue(tmp_path / "q.sqlite")
    q.enqueue(_rows(2))
    q.claim("dead", 2, lease_s=0.05)
    time.sleep(0.1)
    again = q.claim("alive", 5, lease_s=60)
    assert [c.key for c in again] == ["k0", "k1"] and all(c.attempt == 2 for c in again)
    outcomes = [(k, w, o) for k, _, w, _, _, o, _, _ in q.attempts("k0")]
    assert outcomes == [("k0", "dead", "expired"), ("k0", "alive", None)]


def test_renew_keeps_the_lease(tmp_path):
    q = Queue(tmp_path / "q.sqlite")
    q.enqueue(_rows(1))
    q.claim("w1", 1, lease_s=0.3)
    for _ in range(3):
        time.sleep(0.15)
        assert q.renew("w1", 0.3) == 1
    assert q.claim("w2", 1, lease_s=60) == []


def test_release_and_retry_counts(tmp_path):
    q = Queue(tmp_path / "q.sqlite")
    q.enqueue(_rows(2))
    q.claim("w", 2, lease_s=60)
    q.release("w", ["k0"], "retry")  # counts as an attempt
    q.release("w", ["k1"], "released", count_attempt=False)  # deadline: does not
    back = {c.key: c.attempt for c in q.claim("w", 2, lease_s=60)}
    assert back == {"k0": 2, "k1": 1}


def test_ack_never_overwrites_a_finished_row(tmp_path):
    q = Queue(tmp_path / "q.sqlite")
    q.enqueue(_rows(1))
    q.claim("w", 1, lease_s=60)
    q.ack("w", [("k0", None)], "part-1")
    q.ack("w", [("k0", "internal_error")], "part-2")
    assert q.manifest()[0][2:4] == ("done", "part-1")
    q.requeue(["k0"], "lost_part")
    assert q.counts()["pending"] == 1 and q.manifest()[0][3] is None


def test_concurrent_claimers_never_share_a_row(tmp_path):
    path = tmp_path / "q.sqlite"
    Queue(path).enqueue(_rows(200))
    got: dict[str, list[str]] = {}

    def claimer(name):
        q = Queue(path)
        mine = got.setdefault(name, [])
        while batch := q.claim(name, 3, lease_s=60):
            mine.extend(c.key for c in batch)
        q.close()

    threads = [threading.Thread(target=claimer, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    keys = [k for v in got.values() for k in v]
    assert len(keys) == 200 and len(set(keys)) == 200


def test_dead_workers_on_this_host_lose_their_leases_at_once(tmp_path):
    q = Queue(tmp_path / "q.sqlite")
    q.enqueue(_rows(3))
    q.worker_started("dead", 111, "h1")
    q.worker_started("live", 222, "h1")
    q.worker_started("remote", 333, "h2")
    q.claim("dead", 1, lease_s=600)
    q.claim("live", 1, lease_s=600)
    q.claim("remote", 1, lease_s=600)
    assert q.expire_dead_workers("h1", lambda pid, started: pid == 222) == 1
    assert [c.key for c in q.claim("new", 5, lease_s=60)] == ["k0"]
