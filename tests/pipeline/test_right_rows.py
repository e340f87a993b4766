"""Right rows or no rows: a reused folder, a clock jump, one odd row, and secrets in files (in process,
tiny model, injected clocks; the PostgreSQL tests use the session's real server).

Each test names the defect it pins (numbered as in the adversarial report it answers).
"""
from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import pytest

import kvbatch.pipeline.actions as actions
from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.config import ConfigError
from tests.pipeline.files import write_jsonl as _jsonl, error_codes as _codes


@pytest.fixture
def run_app(tmp_path, model_cache_dir, capsys):
    """run_app(*overrides) -> (results rows by key, captured stdout + stderr) of one in-process
    `kvbatch model=tiny ...`."""
    def run(*overrides):
        cfg = compose_config(["model=tiny", f"model.cache_dir={model_cache_dir}", f"output.root={tmp_path / 'out'}",
                              "output.progress=off", "job.max_tokens=2", "job.chat_template=false", *overrides])
        path = actions.execute(cfg)
        out = capsys.readouterr()
        return ({r["row_key"]: r for r in pq.read_table(path).to_pylist()} if path else {}), out.out + out.err
    return run




# ---- 1: a folder belongs to one job identity ---------------------------------------------------
@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_1_reused_output_dir_with_other_settings_is_refused(store, run_app, tmp_path, request):
    url = request.getfixturevalue("pg_url") if store == "postgresql" else ""
    src = _jsonl(tmp_path, [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(3)])
    folder = tmp_path / f"o-{store}"
    base = [f"job.input={src}", f"queue.url='{url}'", f"output.dir={folder}", f"job.name=reuse{store}"]
    rows, _ = run_app(*base)
    assert all(r["max_tokens"] == 2 for r in rows.values())
    for changed in (["job.max_tokens=3"], ["sampling.temperature=0.7"]):  # the variant: any shaping setting
        with pytest.raises(ConfigError, match="holds the rows of another config .job reuse"):
            run_app(*base, *changed)
    rows, out = run_app(*base)  # the same settings: the folder's own job, nothing adopted
    assert len(rows) == 3 and "adopted" not in out


def test_1_a_part_of_another_job_in_the_folder_is_never_taken(run_app, tmp_path):
    src = _jsonl(tmp_path, [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(3)])
    other = _jsonl(tmp_path, [{"id": f"r{i}", "prompt": f"other {i}"} for i in range(4)], "other.jsonl")
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    run_app(f"job.input={other}", f"output.dir={theirs}", "job.max_tokens=1")
    run_app(f"job.input={src}", f"output.dir={mine}", "action=enqueue")
    (mine / "parts").mkdir(exist_ok=True)
    for part in (theirs / "parts").glob("part-*.parquet"):  # copied in by hand (or a shared folder)
        shutil.copy(part, mine / "parts" / part.name)
    rows, out = run_app(f"job.input={src}", f"output.dir={mine}")
    assert "adopted" not in out and "belong to another job" in out
    assert sorted(rows) == ["r0", "r1", "r2"]
    assert all(r["prompt"].startswith("p") and r["max_tokens"] == 2 for r in rows.values())


# ---- 8: job.name is one safe path component -----------------------------------------------------
@pytest.mark.parametrize("name", ["..", ".", "a/b", ""])
def test_8_job_name_that_is_not_one_folder_name_is_refused(name):
    with pytest.raises(ConfigError, match="job.name"):
        compose_config(["model=tiny", f"job.name='{name}'"])


# ---- 6: rows never name files ---------------------------------------------------------------------
def test_6_a_rows_response_format_never_opens_a_path(run_app, tmp_path):
    import os

    secret = tmp_path / "secret.json"
    secret.write_text('{"const": "TOPSECRET-6"}')  # valid JSON schema: the old code copied it into the results
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # the old code waited on it forever
    src = _jsonl(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "s", "prompt": "y", "response_format": str(secret)},
                            {"id": "f", "prompt": "y", "response_format": str(fifo)},
                            {"id": "z", "prompt": "y", "response_format": "/dev/zero"},
                            {"id": "n", "prompt": "y", "response_format": str(tmp_path / "none.json")}])
    rows, _ = run_app(f"job.input={src}")
    assert _codes(rows) == {"a": None, "s": "invalid_input", "f": "invalid_input", "z": "invalid_input",
                            "n": "invalid_input"}
    # the same message whether the file exists or not: a row cannot probe the file system
    assert len({rows[k]["error_message"].split(", got")[0] for k in "sfzn"}) == 1
    assert all("TOPSECRET" not in json.dumps(r, default=str) for r in rows.values())


@pytest.mark.parametrize("kind", ["fifo", "dev", "big", "dir"])
def test_6_job_response_format_file_is_a_regular_file_of_bounded_size(kind, tmp_path):
    import os

    path = {"fifo": tmp_path / "f.json", "dev": "/dev/zero", "big": tmp_path / "big.json", "dir": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    if kind == "big":
        path.write_text('{"description": "' + "x" * (2 << 20) + '"}')
    why = "larger than" if kind == "big" else "not a regular file"
    with pytest.raises(ConfigError, match=why):
        compose_config(["model=tiny", f"job.response_format={path}"])


# ---- 3: a clock step never charges a row --------------------------------------------------------
class SteppingClock:
    """The real clock, stepped by `steps` ({call number: seconds}) as the queue reads it: a wall-clock
    jump mid-run (a Mac waking from sleep, an NTP step) at a place the test chooses, no sleeping."""

    def __init__(self, steps: dict[int, float]):
        import threading
        import time

        self.steps, self.calls, self.offset, self.lock, self.time = dict(steps), 0, 0.0, threading.Lock(), time.time

    def __call__(self) -> float:
        with self.lock:
            self.calls += 1
            self.offset += self.steps.pop(self.calls, 0.0)
            return self.time() + self.offset


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_3_clock_steps_forward_and_back_mid_run_charge_no_row(store, tmp_path, model_cache_dir, request):
    from kvbatch.pipeline.queue import Queue, open_store
    from kvbatch.pipeline.worker import Worker

    url = request.getfixturevalue("pg_url") if store == "postgresql" else ""
    src = _jsonl(tmp_path, [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(8)])
    cfg = compose_config(["model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={src}",
                          f"output.dir={tmp_path / store}", f"queue.url='{url}'", f"job.name=clock{store}",
                          "job.max_tokens=2", "job.chat_template=false", "output.progress=off",
                          "engine.max_batch=2", "worker.prefetch=0", "worker.flush_rows=1"])
    job = actions.job_for(cfg)
    actions.enqueue(job)[0].close()
    # +2 h after the first claims, then -5 h a little later: both while rows are leased and running
    clock = SteppingClock({6: 7200.0, 14: -18000.0})
    q = Queue(open_store(url, job.out_dir, job.queue_job), clock)
    stats = Worker(cfg, q, job.out_dir / "parts", actions.load_runtime(cfg)).run()
    assert not clock.steps and clock.calls > 14  # both steps happened mid-run
    assert stats.rows == 8 and stats.retried == 0 and stats.gave_up == 0
    assert q.counts()["done"] == 8 and q.crash_counts() == {"rows": 0, "max": 0, "retried": 0}
    assert {a[5] for a in q.attempts()} == {"done"} and len(q.attempts()) == 8  # one claim per row, none expired
    q.close()


@pytest.mark.parametrize("lease", ["0.3", "2.5"])
def test_3_a_lease_too_short_to_be_renewed_is_refused(lease):
    with pytest.raises(ConfigError, match=f"worker.lease_s={lease}: must be >= 3"):
        compose_config(["model=tiny", f"worker.lease_s={lease}"])


# ---- 7: never write a secret ----------------------------------------------------------------------
PASSWORD = "Pw/7@x:y%zz"  # a raw '/', '@' and ':' (the old redaction missed such passwords)


def _with_password(url: str) -> str:
    """The test server's URL (trust authentication: any password connects) with PASSWORD in it."""
    head, _, rest = url.partition("@")
    return f"{head}:{PASSWORD}@{rest}"


def _files_holding(folder, needle: str) -> list[str]:
    found = []
    for p in folder.rglob("*"):
        if p.is_file() and needle.encode() in p.read_bytes():
            found.append(str(p))
    return found


@pytest.mark.parametrize("url,password", [
    ("postgresql://u:Pw/7@x@host:5432/db", "Pw/7@x"), ("postgresql://u:a%40b@/db?host=/tmp/s", "a@b"),
    ("postgresql://u@h/db?host=/s&password=p@/q", "p@/q"), ("postgres://u@h/db?password=Q9z&sslmode=off", "Q9z")])
def test_7_redaction_finds_the_whole_password(url, password):
    from kvbatch.pipeline.redact import redact, redact_override, redact_text, split_password

    bare, found = split_password(url)
    assert found == password and password not in bare and split_password(bare)[1] is None
    for shown in (redact(url), redact_override(f"queue.url='{url}'"), redact_text(f"x: {url}\n")):
        assert "***" in shown and password not in shown and "@" in shown


def test_7_an_output_folder_holds_no_password(run_app, tmp_path, pg_url):
    src = _jsonl(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
    folder = tmp_path / "o"
    rows, out = run_app(f"job.input={src}", f"queue.url='{_with_password(pg_url)}'", f"output.dir={folder}",
                        "job.name=secret7")
    assert _codes(rows) == {"a": None, "b": None}
    run_app(f"job.input={src}", f"queue.url='{_with_password(pg_url)}'", f"output.dir={folder}",
            "job.name=secret7", "action=status")
    assert (folder / "config.yaml").exists() and (folder / "results.parquet").exists()
    for needle in (PASSWORD, "Pw/7"):
        assert _files_holding(folder, needle) == [] and needle not in out


def test_7_queue_url_from_a_file_or_the_environment_is_never_stored(run_app, tmp_path, pg_url, monkeypatch):
    src = _jsonl(tmp_path, [{"id": "a", "prompt": "x"}])
    url_file = tmp_path / "queue-url"
    url_file.write_text(_with_password(pg_url) + "\n")
    rows, out = run_app(f"job.input={src}", f"queue.url_file={url_file}", f"output.dir={tmp_path / 'f'}",
                        "job.name=secretfile")
    assert _codes(rows) == {"a": None} and _files_holding(tmp_path / "f", "Pw/7") == []
    monkeypatch.setenv("KVBATCH_TEST_QUEUE_URL", _with_password(pg_url))
    rows, out = run_app(f"job.input={src}", "queue.url=${oc.env:KVBATCH_TEST_QUEUE_URL}",
                        f"output.dir={tmp_path / 'e'}", "job.name=secretenv")
    assert _codes(rows) == {"a": None} and _files_holding(tmp_path / "e", "Pw/7") == [] and "Pw/7" not in out
    with pytest.raises(ConfigError, match="queue.url_file=.*not both"):
        compose_config(["model=tiny", f"queue.url_file={url_file}", f"queue.url='{pg_url}'"])
    with pytest.raises(ConfigError, match="not a regular file"):
        compose_config(["model=tiny", "queue.url_file=/dev/zero"])


def test_7_a_sweep_folder_and_a_failing_runs_stderr_hold_no_password(tmp_path, model_cache_dir, pg_url):
    """The kvbatch command as users run it: a sweep (one job fails) and a run that fails with a traceback."""
    import os
    import subprocess
    import sys

    src = _jsonl(tmp_path, [{"id": "a", "prompt": "x"}])
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("PGPASSWORD", None)
    common = ["model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={src}", "job.chat_template=false",
              "output.progress=off", f"queue.url='{_with_password(pg_url)}'", "job.name=secretsweep"]
    sweep = subprocess.run([sys.executable, "-m", "kvbatch", "-m", *common, "job.max_tokens=1,-1",
                            f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    assert (tmp_path / "sweep" / "multirun.yaml").exists() and (tmp_path / "sweep" / "sweep.parquet").exists()
    assert "failed" in sweep.stderr  # job 1 (max_tokens=-1) failed alone
    # an unexpected exception (here: a malformed testing variable) goes through Hydra's own report, which
    # prints the overrides ("Error executing job with overrides: [...]")
    crash = subprocess.run([sys.executable, "-m", "kvbatch", *common, "job.max_tokens=1", "job.name=secretcrash"],
                           cwd=tmp_path, env={**env, "KVBATCH_DEBUG_CRASH_AT": "bogus"}, capture_output=True,
                           text=True, timeout=300)
    assert crash.returncode != 0 and "queue.url" in crash.stderr
    assert "Error executing job with overrides" in crash.stderr
    for needle in (PASSWORD, "Pw/7"):
        assert _files_holding(tmp_path / "sweep", needle) == []
        for text in (sweep.stdout, sweep.stderr, crash.stdout, crash.stderr):
            assert needle not in text


def test_7_an_unreachable_queue_is_named_without_its_password(tmp_path, pg_url):
    from kvbatch.pipeline.queue import open_store
    from kvbatch.pipeline.queue_postgres import QueueUnreachable

    bad = _with_password(pg_url).replace("kvbatch_tests", "no_such_db")
    with pytest.raises(QueueUnreachable) as err:
        open_store(bad, tmp_path, "j")
    assert "no_such_db" in str(err.value) and "Pw/7" not in str(err.value)


# ---- 2: every float control stays where the sampler's arithmetic is finite ------------------------
@pytest.mark.parametrize("override,needle", [
    ("sampling.repetition_penalty=1e-300", "must be between 0.001 and 1000"),
    ("sampling.repetition_penalty=1e300", "must be between 0.001 and 1000"),
    ("sampling.top_p=1e-300", "must be in [1e-30, 1]"),
])
def test_2_float_controls_outside_the_finite_range_fail_at_once(override, needle):
    import re

    with pytest.raises(ConfigError, match=re.escape(needle)):
        compose_config(["model=tiny", override])


def test_2_float_controls_outside_the_finite_range_are_the_rows_invalid_input(run_app, tmp_path):
    src = _jsonl(tmp_path, ['{"id": "a", "prompt": "x"}', '{"id": "rp", "prompt": "x", "repetition_penalty": 1e-300}',
                            '{"id": "rp2", "prompt": "x", "repetition_penalty": 5000}',
                            '{"id": "tp", "prompt": "x", "top_p": 1e-40, "temperature": 0.7}',
                            '{"id": "ok", "prompt": "x", "repetition_penalty": 0.001, "top_p": 1e-30}'])
    rows, _ = run_app(f"job.input={src}")
    assert _codes(rows) == {"a": None, "rp": "invalid_input", "rp2": "invalid_input", "tp": "invalid_input",
                            "ok": None}
    assert "repetition_penalty must be between" in rows["rp"]["error_message"]


# ---- 5: whatever belongs to one row is that row's invalid_input, never the job's -----------------
def test_5_odd_rows_of_a_jsonl_input_end_alone(run_app, tmp_path):
    from kvbatch.pipeline.config import JobConfig
    from kvbatch.pipeline.inputs import read_rows

    plain = {"prompt": "no id here"}
    probe = _jsonl(tmp_path, [{"id": "a", "prompt": "x"}, plain], "probe.jsonl")
    hashed = read_rows(probe, "auto", JobConfig())[1].key  # the content-hash key of the row without an id
    lines = [
        '{"id": "a", "prompt": "x", "output": "o", "input_output": "io", "deep": ' + "[" * 60 + "1" + "]" * 60
        + ', "cat": "fine"}',
        plain,
        '{"id": "big", "prompt": "y", "n_digits": ' + "7" * 5000 + "}",  # more digits than Python converts
        '{"id": "sur", "prompt": "y", "cat": "bad \\udc00"}',  # a lone surrogate in a carried column
        {"id": hashed, "prompt": "an id equal to the other row's key"},
        '{"id": "b", "prompt": "z", "output": "o2", "input_output": "io2", "deep": [[1]], "cat": "also fine"}',
    ]
    src = _jsonl(tmp_path, lines)
    for _ in range(2):  # and the job's rerun reads its own files back
        rows, _ = run_app(f"job.input={src}")
        assert len(rows) == 6
        codes = {k: v for k, v in _codes(rows).items() if v}
        big = [k for k, r in rows.items() if "4300 digits" in (r["error_message"] or "")]  # unreadable: no id
        assert sorted(codes) == sorted(["sur", *big]) and len(big) == 1 and set(codes.values()) == {"invalid_input"}
    assert rows[hashed]["prompt"] == "an id equal to the other row's key"
    assert sum(1 for r in rows.values() if r["prompt"] == "no id here") == 1
    # both carried, neither lost; the deep one as JSON text; the surrogate spoils its own cell only
    assert (rows["a"]["input_input_output"], rows["a"]["input_output"]) == ("o", "io")  # input_output keeps its name
    assert json.loads(rows["a"]["deep"]) == json.loads("[" * 60 + "1" + "]" * 60)
    assert rows["a"]["cat"] == "fine" and rows["b"]["cat"] == "also fine" and rows["sur"]["cat"] == "bad \\udc00"
    assert "surrogate" in rows["sur"]["error_message"]


def test_5_invalid_utf8_in_a_parquet_string_column_and_a_damaged_passthrough(run_app, tmp_path):
    import pyarrow as pa

    table = pa.table({"id": ["a", "bad", "b"], "prompt": ["x", "y", "z"],
                      "note": pa.array([b"ok", b"\xff\xfe no", b"fine"], pa.binary())})
    table = table.set_column(2, "note", table.column("note").cast(pa.string(), safe=False))  # bytes as they are
    src = tmp_path / "in.parquet"
    pq.write_table(table, src)
    folder = tmp_path / "pq"
    rows, _ = run_app(f"job.input={src}", f"output.dir={folder}")
    assert _codes(rows) == {"a": None, "bad": "invalid_input", "b": None}
    assert rows["a"]["note"] == "ok" and rows["b"]["note"] == "fine"
    (folder / "passthrough.parquet").write_bytes(b"PAR1 not really")  # damaged by hand (or a full disk)
    again, out = run_app(f"job.input={src}", f"output.dir={folder}", "action=finalize")
    assert "rebuilt from the input" in out and again["a"]["note"] == "ok" and len(again) == 3


def test_5_an_id_holding_u0000_is_the_rows_invalid_input_on_postgresql(run_app, tmp_path, pg_url):
    src = _jsonl(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "n\u0000ul", "prompt": "y"}, {"id": "b", "prompt": "z"}])
    rows, _ = run_app(f"job.input={src}", f"queue.url='{pg_url}'", f"output.dir={tmp_path / 'o'}", "job.name=nul5")
    assert _codes(rows) == {"a": None, "n\\u0000ul": "invalid_input", "b": None}
    assert "U+0000" in rows["n\\u0000ul"]["error_message"]


# ---- the rule, as a property: each row ends once, with its outcome; the job never stops for a row ----
def _param_values():
    """Per-row values of every parameter (engine/params.py PARAMS): its type and range, edges and garbage.
    Counts that make work (max_tokens, min_tokens, n) are kept small where valid, so a run stays short."""
    from hypothesis import strategies as st

    from kvbatch.engine.params import PARAMS

    garbage = st.sampled_from(["x", "", [], {}, None, True, "NaN", "1e400", [1, "a"], {"a": [[[]]]}])
    huge = st.sampled_from([2**31, 2**63, 2**64, -1, -(2**40), 10**30, 1e12, 1e-300, 1e300, 5e-324])
    floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), huge,
                       st.sampled_from([0.0, 1e-3, 1e-30, 1e-31, 0.5, 1.0, 2.0, -2.0, 2.5, 1e3, 1001.0]))
    small = {"max_tokens": st.sampled_from([1, 2, 0, -3]), "min_tokens": st.sampled_from([0, 1, 2, 3]),
             "n": st.sampled_from([1, 2, 0, 4097])}
    kinds = {
        "int": st.one_of(st.integers(-5, 40), huge), "float": floats, "bool": st.one_of(st.booleans(), st.integers()),
        "ids": st.one_of(st.lists(st.one_of(st.integers(-2, 400), huge), max_size=3), st.integers(0, 300)),
        "strings": st.one_of(st.lists(st.text(max_size=3), max_size=3), st.text(max_size=3)),
        "name": st.one_of(st.text(max_size=4), st.sampled_from(["a", "../x", "a/b"])),  # an adapter, none known
        "format": st.sampled_from(["json_object", "regex:[ab]{1,2}", "text", '{"type": "foo"}', "/etc/hostname",
                                   {"type": "object"}, {"type": "json_schema", "json_schema": {"schema": {}}}, "x"]),
    }
    return {p.name: st.one_of(small.get(p.name, kinds[p.kind]), garbage) for p in PARAMS}


def test_property_each_row_ends_once_with_its_outcome_and_the_job_never_stops(tmp_path_factory, model_cache_dir):
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    from kvbatch.engine.errors import ERROR_CODES
    from kvbatch.pipeline.config import JobConfig
    from kvbatch.pipeline.inputs import read_rows
    from kvbatch.pipeline.queue import Queue

    leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=4),
                     st.sampled_from(["\udc00", "\x00"]))
    nested = st.recursive(leaf, lambda c: st.one_of(st.lists(c, max_size=2), st.dictionaries(st.text(max_size=3), c,
                                                                                            max_size=2)), max_leaves=5)
    deep = st.integers(1, 70).map(lambda d: json.loads("[" * d + "1" + "]" * d))
    row = st.fixed_dictionaries({"prompt": st.sampled_from(["hi", "a b", "x"])},
                                optional={**_param_values(), "id": st.one_of(st.text(max_size=4), st.integers(0, 3)),
                                          "extra": nested, "deep": deep, "output": leaf, "input_output": leaf,
                                          "response": nested})

    @settings(max_examples=4, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(rows=st.lists(row, min_size=1, max_size=5))
    @example(rows=[{"prompt": "hi", "output": 1, "input_output": "2", "deep": json.loads("[" * 60 + "]" * 60)},
                   {"prompt": "x", "id": 7, "repetition_penalty": 1e-300, "extra": {"a": "\udc00"}},
                   {"prompt": "y", "response_format": "/etc/hostname", "top_p": 1e-300}])
    def check(rows):
        d = tmp_path_factory.mktemp("rule")
        src = d / "in.jsonl"
        src.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in rows + [{"prompt": "good"}]))
        cfg = compose_config(["model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={src}",
                              f"output.dir={d / 'out'}", "output.progress=off", "job.max_tokens=2",
                              "job.chat_template=false", "output.max_error_fraction=1", "model.context_length=64"])
        path = actions.execute(cfg)  # the job never stops for a row
        got = pq.read_table(path).to_pylist()
        inputs = read_rows(src, "auto", JobConfig())
        queued = len({r.key for r in inputs}) + sum(max(int(r.payload.get("n", 1)) - 1, 0) for r in inputs
                                                     if "error" not in r.payload)
        assert len(got) == queued and len({(r["row_key"], r["sample_index"]) for r in got}) == len(got)
        assert sorted({r["row_key"] for r in got}) == sorted(r.key for r in inputs)
        for r in got:  # its own outcome, once: ok, or a documented code with a message
            assert r["error_code"] is None or (r["error_code"] in ERROR_CODES and r["error_message"]), r
            assert r["attempt"] == 1
        q = Queue(d / "out" / "queue.sqlite")
        assert q.counts()["pending"] == q.counts()["leased"] == 0 and q.crash_counts()["rows"] == 0
        q.close()

    check()


# ---- 9: a finished job's rerun reads no part ------------------------------------------------------
def test_9_a_finished_jobs_rerun_reads_no_part_and_a_change_is_seen(run_app, tmp_path, monkeypatch):
    import kvbatch.pipeline.finalize as fz

    src = _jsonl(tmp_path, [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(4)])
    folder = tmp_path / "o"
    rows, _ = run_app(f"job.input={src}", f"output.dir={folder}", "worker.flush_rows=1")
    real_scan = fz.scan
    monkeypatch.setattr(fz, "scan", lambda d: pytest.fail("a finished job's rerun scanned its parts"))
    again, _ = run_app(f"job.input={src}", f"output.dir={folder}", "worker.flush_rows=1")
    assert again == rows
    monkeypatch.setattr(fz, "scan", real_scan)
    parts = sorted((folder / "parts").glob("part-*.parquet"))
    parts[0].unlink()  # a change on disk: reconciled again, the lost row generated again
    again, out = run_app(f"job.input={src}", f"output.dir={folder}", "worker.flush_rows=1")
    assert sorted(again) == sorted(rows) and "4 rows (4 ok)" in out
    assert len(list((folder / "parts").glob("part-*.parquet"))) == len(parts)  # the lost row's new part


# ---- 4: a PostgreSQL restart ends no worker and charges no row -----------------------------------
def test_4_a_postgresql_restart_is_reconnected_and_charges_no_row(pg_server, pg_url):
    import uuid

    from kvbatch.pipeline.inputs import InputRow
    from kvbatch.pipeline.queue import Queue, open_store
    from kvbatch.pipeline.queue_postgres import QueueUnreachable

    q = Queue(open_store(pg_url, pg_server.root, f"restart-{uuid.uuid4().hex[:8]}"))
    q.enqueue([InputRow(i, f"k{i}", {"prompt": "p"}) for i in range(3)])
    got = q.claim("w", 2, lease_s=600)
    r = pg_server._cmd("pg_ctl", "-D", str(pg_server.data), "-l", str(pg_server.root / "log"), "-m", "fast", "-w",
                       "restart")  # every connection dropped; the same options (postmaster.opts)
    assert r.returncode == 0, r.stderr
    q.ack("w", [(c.key, None) for c in got], "part-w-00000.parquet")  # on a new connection
    q.worker_progress("w", 2, 4)
    assert q.counts() == {"pending": 1, "leased": 0, "done": 2, "error": 0}
    assert q.crash_counts() == {"rows": 0, "max": 0, "retried": 0} and [c.attempt for c in got] == [1, 1]
    # a server that does not come back: one line after the bounded wait
    q.s.reconnect_s = 0.2
    q.s.url = q.s.url.replace("kvbatch_tests", "no_such_database")
    q.s.db.close()
    with pytest.raises(QueueUnreachable, match="did not come back within 0.2 s"):
        q.renew("w", 600)
