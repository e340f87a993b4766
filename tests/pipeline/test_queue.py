"""The queue on both backends (the `queue_backend` fixture: SQLite and a real PostgreSQL server): idempotent
enqueue, leases (claim, renew, expiry), ack, release, the attempts record, crashes, dead workers."""
from __future__ import annotations

import threading

from kvbatch.pipeline.inputs import InputRow
from kvbatch.pipeline.queue import Queue
from tests.conftest import ManualClock


def _rows(n, start=0):
    return [InputRow(i, f"k{i}", {"prompt": f"p{i}"}) for i in range(start, start + n)]


def test_enqueue_is_idempotent_and_tracks_the_manifest(queue_backend):
    q = queue_backend()
    assert q.enqueue(_rows(3)) == 3
    assert q.enqueue(_rows(3)) == 0
    assert q.counts() == {"pending": 3, "leased": 0, "done": 0, "error": 0}
    assert q.enqueue(_rows(4)) == 1  # an appended row only
    assert [k for _, k, *_ in q.manifest()] == ["k0", "k1", "k2", "k3"]
    q.enqueue(_rows(2))  # the input shrank: the manifest follows it
    assert q.counts()["pending"] == 2


def test_claim_in_order_ack_and_record(queue_backend):
    q = queue_backend()
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


def test_expired_lease_returns_to_the_queue_as_a_crash_not_an_attempt(queue_backend):
    clock = ManualClock()
    q = queue_backend(clock=clock)
    q.enqueue(_rows(2))
    q.claim("dead", 2, lease_s=5)
    q.mark_running("dead", ["k0", "k1"], True)  # handed to its engine
    clock.advance(4.9)
    assert q.claim("alive", 5, lease_s=60) == []  # not yet
    clock.advance(0.2)
    again = q.claim("alive", 5, lease_s=60)
    assert [c.key for c in again] == ["k0", "k1"]
    assert all(c.attempt == 1 and c.crashes == 1 for c in again)  # the holder died: not the row's fault
    outcomes = [(k, a, w, o) for k, a, w, _, _, o, _, _ in q.attempts("k0")]
    assert outcomes == [("k0", 1, "dead", "expired"), ("k0", 1, "alive", None)]
    assert q.crash_counts() == {"rows": 2, "max": 1, "retried": 0}


def test_renew_keeps_the_lease(queue_backend):
    clock = ManualClock()
    q = queue_backend(clock=clock)
    q.enqueue(_rows(1))
    q.claim("w1", 1, lease_s=5)
    for _ in range(3):  # 12 s in all: past the first lease, held by renewing
        clock.advance(4)
        assert q.renew("w1", 5) == 1
    assert q.claim("w2", 1, lease_s=60) == []
    clock.advance(5.1)  # no renewal: the lease runs out
    assert [c.key for c in q.claim("w2", 1, lease_s=60)] == ["k0"]


def test_the_tokens_a_dead_holder_made_beyond_a_checkpoint_are_counted_once_by_the_next_claim(queue_backend):
    from kvbatch.engine.types import RowCheckpoint
    from kvbatch.pipeline import checkpoints

    clock = ManualClock()
    q = queue_backend(clock=clock)
    q.enqueue(_rows(4))
    q.claim("dead", 4, lease_s=5)
    checkpoints.save(q, "dead", [("k0", "fp", RowCheckpoint(list(range(32)))),
                                 ("k1", "fp", RowCheckpoint(list(range(64))))])
    # its lease heartbeat: k0 made 50 tokens (18 beyond its checkpoint), k1 64 (none), k2 40 (no checkpoint)
    assert q.renew("dead", 5, {"k0": 50, "k1": 64, "k2": 40, "k3": 7}) == 4
    q.release("dead", ["k3"], "deadline", count_attempt=False)  # handed back: the worker counted it itself
    clock.advance(5.1)  # the lease runs out: the next claim takes the rows over
    assert {c.key: c.lost_tokens for c in q.claim("next", 4, lease_s=60)} == {"k0": 18, "k1": 0, "k2": 40, "k3": 0}
    q.release("next", ["k0", "k1", "k2", "k3"], "deadline", count_attempt=False)
    assert {c.key: c.lost_tokens for c in q.claim("third", 4, lease_s=60)} == dict.fromkeys(["k0", "k1", "k2", "k3"], 0)


def test_release_and_retry_counts(queue_backend):
    q = queue_backend()
    q.enqueue(_rows(2))
    q.claim("w", 2, lease_s=60)
    q.release("w", ["k0"], "retry")  # counts as an attempt
    q.release("w", ["k1"], "released", count_attempt=False)  # deadline: does not
    back = {c.key: c.attempt for c in q.claim("w", 2, lease_s=60)}
    assert back == {"k0": 2, "k1": 1}


def test_ack_never_overwrites_a_finished_row(queue_backend):
    q = queue_backend()
    q.enqueue(_rows(1))
    q.claim("w", 1, lease_s=60)
    q.ack("w", [("k0", None)], "part-1")
    q.ack("w", [("k0", "internal_error")], "part-2")
    assert q.manifest()[0][2:4] == ("done", "part-1")
    q.requeue([("k0", "part-2")], "lost_part")  # not the part that holds it: left alone
    assert q.manifest()[0][2:4] == ("done", "part-1")
    q.requeue([("k0", "part-1")], "lost_part")
    assert q.counts()["pending"] == 1 and q.manifest()[0][3] is None


def test_concurrent_claimers_never_share_a_row(queue_backend):
    queue_backend().enqueue(_rows(200))
    got: dict[str, list[str]] = {}

    def claimer(name):
        q = queue_backend()  # a connection of its own (PostgreSQL: claims with SKIP LOCKED)
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


def test_dead_workers_on_this_host_lose_their_leases_at_once(queue_backend):
    q = queue_backend()
    q.enqueue(_rows(3))
    q.worker_started("dead", 111, "h1")
    q.worker_started("live", 222, "h1")
    q.worker_started("remote", 333, "h2")
    q.claim("dead", 1, lease_s=600)
    q.mark_running("dead", ["k0"], True)
    q.claim("live", 1, lease_s=600)
    q.claim("remote", 1, lease_s=600)
    assert q.expire_dead_workers("h1", lambda pid, started: pid == 222) == 1
    assert q.counts()["pending"] == 1
    got = q.claim("new", 5, lease_s=60)
    assert [(c.key, c.attempt, c.crashes) for c in got] == [("k0", 1, 1)]
    assert [r[5] for r in q.attempts("k0")] == ["worker_died", None]
    stops = {s["worker"]: s["stop"] for s in q.sessions()}
    assert stops == {"dead": "died", "live": None, "remote": None}


def _crash(q, worker, keys_expected=None):
    """Claim as `worker` (a process that then dies), and have the next start notice it."""
    q.worker_started(worker, 1, "h")
    got = q.claim(worker, 10, lease_s=600, idle=True, isolate_after=2, max_crashes=4)
    q.mark_running(worker, [c.key for c in got], True)
    q.expire_dead_workers("h", lambda pid, started: False)
    return [c.key for c in got]


def test_crashes_do_not_use_up_attempts_and_suspects_run_alone(queue_backend):
    q = queue_backend()
    q.enqueue(_rows(4))
    assert _crash(q, "w1") == ["k0", "k1", "k2", "k3"]
    assert _crash(q, "w2") == ["k0", "k1", "k2", "k3"]  # every row now has 2 crashes: suspects
    # a worker with rows in flight gets no suspect; an idle one gets exactly one
    assert q.claim("w3", 10, lease_s=600, idle=False, isolate_after=2, max_crashes=4) == []
    one = q.claim("w3", 10, lease_s=600, idle=True, isolate_after=2, max_crashes=4)
    assert [(c.key, c.attempt, c.crashes) for c in one] == [("k0", 1, 2)]
    q.ack("w3", [("k0", None)], "part-x")
    # k1 kills its worker twice more while running alone: at max_crashes it is claimed
    # normally (the worker ends it without running it), next to the others
    for w in ("w4", "w5"):
        assert _crash(q, w) == ["k1"]
    got = q.claim("w6", 10, lease_s=600, idle=True, isolate_after=2, max_crashes=4)
    assert [(c.key, c.crashes, c.alone_crashes) for c in got] == [("k1", 4, 2)]  # 2 of them observed alone
    assert all(c.attempt == 1 for c in got)
    assert q.crash_counts() == {"rows": 4, "max": 4, "retried": 0}


def test_plain_rows_pass_suspects_and_lost_parts_do_not_count(queue_backend):
    q = queue_backend()
    q.enqueue(_rows(3))
    q.worker_started("w1", 1, "h")
    q.claim("w1", 1, lease_s=600)  # k0 only
    q.mark_running("w1", ["k0"], True)
    q.expire_dead_workers("h", lambda pid, started: False)
    got = q.claim("w2", 10, lease_s=600, idle=True, isolate_after=1, max_crashes=3)
    assert [c.key for c in got] == ["k0"]  # idle: the suspect first, alone
    q.release("w2", ["k0"], "deadline", count_attempt=False)
    got = q.claim("w2", 10, lease_s=600, idle=False, isolate_after=1, max_crashes=3)
    assert [c.key for c in got] == ["k1", "k2"]  # busy: plain rows go past the suspect
    q.ack("w2", [("k1", None)], "p1")
    q.requeue([("k1", "p1")], "lost_part")
    again = {c.key: c.attempt for c in q.claim("w3", 10, lease_s=600)}
    assert again == {"k0": 1, "k1": 1}  # handed back / part lost: neither counts as an attempt


def test_a_crash_is_charged_only_to_rows_running_in_the_engine(queue_backend):
    """Rows only claimed (prefetched) or finished and not yet written were not running when the
    worker died: they come back uncharged (issue 23, defect 4)."""
    q = queue_backend()
    q.enqueue(_rows(4))
    q.worker_started("w1", 1, "h")
    q.claim("w1", 4, lease_s=600)
    q.mark_running("w1", ["k0", "k1", "k2"], True)
    q.mark_running("w1", ["k2"], False)  # finished, still in the worker's buffer
    q.expire_dead_workers("h", lambda pid, started: False)
    assert {c.key: c.crashes for c in q.claim("w2", 10, lease_s=600)} == {"k0": 1, "k1": 1, "k2": 0, "k3": 0}


def test_rows_of_an_ended_worker_come_back_at_once_uncharged(queue_backend):
    """A worker that ended (an exception, disk full) and still holds leases: freed by the next
    start on any host, no attempt and no crash counted (issue 23, defect 3)."""
    q = queue_backend()
    q.enqueue(_rows(2))
    q.worker_started("gone", 1, "other-host")
    q.claim("gone", 2, lease_s=600)
    q.mark_running("gone", ["k0"], True)
    q.worker_ended("gone", 0, 0, 1.0, {}, "failed")
    assert q.claim("w2", 10, lease_s=600) == []  # leased until lease_s ...
    assert q.expire_dead_workers("h", lambda pid, started: True) == 2  # ... unless its worker ended
    assert [(c.key, c.attempt, c.crashes) for c in q.claim("w2", 10, lease_s=600)] == [("k0", 1, 0), ("k1", 1, 0)]


def test_old_queue_files_gain_the_new_columns(tmp_path):
    import sqlite3

    path = tmp_path / "q.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""CREATE TABLE rows(key TEXT PRIMARY KEY, pos INTEGER NOT NULL, payload TEXT NOT NULL,
      state TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0, worker TEXT, lease_until REAL,
      part TEXT, error_code TEXT, updated_at REAL NOT NULL);
      CREATE TABLE workers(id TEXT PRIMARY KEY, pid INTEGER, host TEXT, started_at REAL, heartbeat_at REAL,
      ended_at REAL, rows INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0, wall_s REAL, summary TEXT);""")
    db.close()
    q = Queue(path)
    q.enqueue(_rows(1))
    assert q.claim("w", 1, lease_s=60)[0].crashes == 0
    q.worker_started("w", 1, "h")
    q.worker_ended("w", 1, 5, 1.0, {}, "deadline")
    assert q.sessions()[0]["stop"] == "deadline"


def test_jobs_sharing_a_database_never_see_each_other(queue_backend):
    a, b = queue_backend("a"), queue_backend("b")
    a.enqueue(_rows(3))
    b.enqueue(_rows(2))
    a.set_meta("config_hash", "A")
    assert b.get_meta("config_hash") is None and b.counts()["pending"] == 2
    assert [c.key for c in b.claim("w", 10, lease_s=60)] == ["k0", "k1"]
    assert a.counts() == {"pending": 3, "leased": 0, "done": 0, "error": 0}
    b.worker_started("w", 1, "h")
    assert a.sessions() == [] and a.expire_dead_workers("h", lambda pid, started: False) == 0
    assert b.expire_dead_workers("h", lambda pid, started: False) == 2


def test_a_worker_on_another_host_is_judged_by_its_lease(queue_backend):
    """A PID means nothing on another host: its rows wait for their lease (leased_elsewhere says until
    when), then any claimer takes them as a crash; the same host's dead worker is freed at once."""
    clock = ManualClock()
    q = queue_backend(clock=clock)
    q.enqueue(_rows(2))
    q.worker_started("far", 1, "h2")
    q.claim("far", 1, lease_s=5)
    q.mark_running("far", ["k0"], True)
    clock.advance(1)
    assert q.expire_dead_workers("h1", lambda pid, started: False) == 0  # not this host's to judge
    until = q.leased_elsewhere("h1")
    assert until is not None and abs(until - q.now() - 4) < 1e-6 and q.leased_elsewhere("h2") is None
    assert [c.key for c in q.claim("near", 5, lease_s=60)] == ["k1"]
    clock.advance(until - q.now() - 0.01)
    assert q.claim("near", 5, lease_s=60) == []  # its lease not run out yet
    clock.advance(0.02)
    assert [(c.key, c.crashes) for c in q.claim("near", 5, lease_s=60)] == [("k0", 1)]
    assert q.leased_elsewhere("h1") is None


def test_the_schema_is_versioned(queue_backend):
    from kvbatch.pipeline import queue_sqlite

    q = queue_backend()
    if queue_backend.kind == "sqlite":
        assert q.s.version() == queue_sqlite.VERSION
    else:
        from kvbatch.pipeline import queue_postgres

        assert q.s.version() == queue_postgres.VERSION
        assert q.reopen().s.version() == queue_postgres.VERSION  # opening again migrates nothing twice


def test_a_bad_or_unreachable_queue_url_is_one_line_naming_it(tmp_path, model_cache_dir):
    import pytest

    from kvbatch.engine.errors import KvbatchConfigError
    from kvbatch.pipeline import actions
    from kvbatch.pipeline.compose import compose_config
    from kvbatch.pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=r"queue.url='mysql://u:\*\*\*@h/db': use postgresql://"):
        compose_config(["model=tiny", "queue.url='mysql://u:secret@h/db'"])
    nowhere = tmp_path / "nosock"
    nowhere.mkdir()
    cfg = compose_config(["model=tiny", f"model.cache_dir={model_cache_dir}", f"output.root={tmp_path / 'o'}",
                          "action=enqueue", f"queue.url='postgresql://u:secret@/db?host={nowhere}'"])
    with pytest.raises(KvbatchConfigError, match="cannot connect") as err:
        actions.execute(cfg)
    assert "secret" not in str(err.value) and len(str(err.value).splitlines()) == 1
