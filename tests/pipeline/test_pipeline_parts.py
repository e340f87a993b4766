"""Parquet parts (atomic, verified) and finalize (input order, exactly once, adopt, re-queue lost rows)."""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from kvbatch.pipeline.finalize import finalize
from kvbatch.pipeline.inputs import InputRow
from kvbatch.pipeline.parts import PartError, read_part, write_part
from kvbatch.pipeline.queue import Queue
from kvbatch.pipeline.results import SCHEMA, ResultRecord


def _rec(key, pos, text="out", code=None):
    return ResultRecord(row_key=key, row_index=pos, prompt=f"p{pos}", output=text,
                        output_token_ids=[1, 2, 3], output_tokens=3, finish_reason="error" if code else "stop",
                        error_code=code, model="m", kv_mode="none")


def _queue(tmp_path, n):
    q = Queue(tmp_path / "queue.sqlite")
    q.enqueue([InputRow(i, f"k{i}", {"prompt": f"p{i}"}) for i in range(n)])
    return q


def _shared(queue_backend, tmp_path, n):
    """(queue, output folder) on the test's backend: SQLite in the folder, or a PostgreSQL job."""
    q = queue_backend("o")
    (tmp_path / "o").mkdir(exist_ok=True)
    q.enqueue([InputRow(i, f"k{i}", {"prompt": f"p{i}"}) for i in range(n)])
    return q, tmp_path / "o"


def test_part_roundtrip_and_no_temp_left(tmp_path):
    path = write_part(tmp_path, "part-w-00000.parquet", [_rec("a", 0), _rec("b", 1)])
    t = read_part(path)
    assert t.num_rows == 2 and t.schema.remove_metadata() == SCHEMA
    assert t.column("output_token_ids").to_pylist() == [[1, 2, 3], [1, 2, 3]]
    assert [p.name for p in tmp_path.iterdir()] == ["part-w-00000.parquet"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_damaged_parts_are_detected(tmp_path, damage):
    path = write_part(tmp_path, "part-w-00000.parquet", [_rec(f"k{i}", i, "x" * 500) for i in range(20)])
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        mid = len(data) // 3
        path.write_bytes(data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:])
    else:
        path.write_bytes(b"")
    with pytest.raises(PartError):
        read_part(path)


def test_finalize_orders_dedupes_adopts_and_requeues(queue_backend, tmp_path):
    q, out = _shared(queue_backend, tmp_path, 5)
    parts = out / "parts"
    q.claim("w", 5, lease_s=60)
    write_part(parts, "part-w-00000.parquet", [_rec("k3", 3), _rec("k1", 1, code="invalid_input")])
    q.ack("w", [("k3", None), ("k1", "invalid_input")], "part-w-00000.parquet")
    # k3 generated twice (a second worker re-ran it): the acknowledged part wins
    write_part(parts, "part-a-00000.parquet", [_rec("k3", 3, "dup")])
    # k0 durable but never acknowledged (worker died between rename and ack): adopted
    write_part(parts, "part-w-00001.parquet", [_rec("k0", 0)])
    # k2 acknowledged, but its part got corrupted: re-queued, not dropped
    bad = write_part(parts, "part-w-00002.parquet", [_rec("k2", 2)])
    q.ack("w", [("k2", None)], "part-w-00002.parquet")
    bad.write_bytes(bad.read_bytes()[:40])
    fin = finalize(out, q, {"kvbatch.config": "{}"})
    t = pq.read_table(fin.path)
    assert t.column("row_key").to_pylist() == ["k0", "k1", "k3"]
    assert t.column("row_index").to_pylist() == [0, 1, 3]
    assert t.column("output").to_pylist()[2] == "out"
    assert fin.adopted == 1 and fin.requeued == ["k2"] and fin.remaining == 1  # k4 still leased
    assert list(fin.bad_parts) == ["part-w-00002.parquet"] and (parts / "corrupt" / "part-w-00002.parquet").exists()
    assert q.counts() == {"pending": 1, "leased": 1, "done": 2, "error": 1}
    assert t.schema.metadata[b"kvbatch.config"] == b"{}"


def test_finalize_empty(tmp_path):
    q = _queue(tmp_path, 0)
    fin = finalize(tmp_path, q, {})
    t = pq.read_table(fin.path)
    assert t.num_rows == 0 and t.schema.remove_metadata() == SCHEMA


def test_reconcile_while_another_worker_acknowledges(queue_backend, tmp_path, monkeypatch):
    """A worker that reconciles while another one writes and acknowledges a part must not take
    that row for lost: the queue is read before the parts, so a row it sees finished has a part
    already on disk (a worker renames its part, then acknowledges)."""
    import kvbatch.pipeline.finalize as fz

    q, out = _shared(queue_backend, tmp_path, 2)
    other = queue_backend("o")  # worker b's own connection
    parts = out / "parts"
    q.claim("b", 2, lease_s=60)
    real_scan = fz.scan

    def scan_then_other_worker_acks(folder, *pattern):
        seen = real_scan(folder, *pattern)
        # worker b, between this scan and the rest of the reconcile: rename, then ack
        write_part(parts, "part-b-00000.parquet", [_rec("k0", 0)])
        other.ack("b", [("k0", None)], "part-b-00000.parquet")
        return seen

    monkeypatch.setattr(fz, "scan", scan_then_other_worker_acks)
    rec = fz.reconcile(out, q)
    assert rec.requeued == [] and rec.adopted == 0
    assert q.counts() == {"pending": 0, "leased": 1, "done": 1, "error": 0}
    assert [r[5] for r in q.attempts("k0")] == ["done"]
    monkeypatch.setattr(fz, "scan", real_scan)
    fin = finalize(out, q, {})
    assert fin.requeued == [] and pq.read_table(fin.path).column("row_key").to_pylist() == ["k0"]


def test_a_row_acknowledged_while_finalize_writes_is_in_the_next_results(queue_backend, tmp_path, monkeypatch):
    """Workers acknowledge rows without finalize's lock. A row acknowledged after finalize read the
    queue is not in the file it writes; the file's stamp must not say it is, or the next finalize (the
    acknowledging worker's own, at its end) takes the file as up to date and the row never appears."""
    import kvbatch.pipeline.finalize as fz

    q, out = _shared(queue_backend, tmp_path, 2)
    other = queue_backend("o")  # worker b's own connection
    parts = out / "parts"
    q.claim("a", 1, lease_s=60)
    write_part(parts, "part-a-00000.parquet", [_rec("k0", 0)])
    q.ack("a", [("k0", None)], "part-a-00000.parquet")
    other.claim("b", 1, lease_s=60)
    real_reconcile = fz._reconcile

    def reconcile_then_other_worker_acks(folder, queue, *pattern):
        done = real_reconcile(folder, queue, *pattern)
        # worker b, after worker a's finalize read the queue and before it stamps its file: rename, then ack
        write_part(parts, "part-b-00000.parquet", [_rec("k1", 1)])
        other.ack("b", [("k1", None)], "part-b-00000.parquet")
        return done

    monkeypatch.setattr(fz, "_reconcile", reconcile_then_other_worker_acks)
    first = finalize(out, q, {})
    assert pq.read_table(first.path).column("row_key").to_pylist() == ["k0"]
    monkeypatch.setattr(fz, "_reconcile", real_reconcile)
    last = finalize(out, other, {})  # worker b's, at its end
    assert not last.unchanged and pq.read_table(last.path).column("row_key").to_pylist() == ["k0", "k1"]


def test_reconcile_and_finalize_take_one_lock_across_connections(queue_backend):
    """The queue's lock (SQLite: the folder's lock file; PostgreSQL: an advisory lock, which holds
    across hosts): a second holder waits until the first lets go."""
    import threading
    import time

    a, b = queue_backend("o"), queue_backend("o")
    got, trying = [], threading.Event()

    def second():
        trying.set()
        with b.exclusive():
            got.append(time.monotonic())

    with a.exclusive():
        t = threading.Thread(target=second)
        t.start()
        assert trying.wait(timeout=60)
        time.sleep(0.3)  # time for a broken lock to let it in (a slow machine can only hide a bug, not fail)
        assert got == []  # still waiting
        released = time.monotonic()
    t.join(timeout=60)
    assert got and got[0] >= released
