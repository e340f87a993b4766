"""Sweeps (issue 8): `kvbatch -m ...` with the basic and joblib launchers, job failures recorded,
sweep.parquet + report.md with PNG plots, and action=report over one or several sweep folders.

The sweeps run as the user runs them (subprocesses), on the tiny model, 3 short prompts each.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from kvbatch.pipeline.sweep.report.compare import compare
from kvbatch.pipeline.sweep.report.plots import CODE_COLORS, KV_COLORS, PLOTS

PROMPTS = [{"id": "a", "prompt": "The cat sat on"}, {"id": "b", "prompt": "Once upon a time"},
           {"id": "c", "prompt": "1, 2, 3,"}, {"id": "empty", "prompt": ""}]  # the last: invalid_input


def kvbatch(*args, cwd, popen=False):
    cmd = [sys.executable, "-m", "kvbatch", *args]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if popen:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def base_args(root: Path, model_cache_dir: Path, sweep: str) -> list[str]:
    src = root / "prompts.jsonl"
    if not src.exists():
        src.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return ["-m", "model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={src}", "job.max_tokens=12",
            "job.chat_template=false", "output.progress=off", f"hydra.sweep.dir={root / sweep}"]


def jobs(sweep_dir: Path) -> list[dict]:
    return pq.read_table(sweep_dir / "sweep.parquet").to_pylist()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("sweeps")


@pytest.fixture(scope="module")
def basic_sweep(root, model_cache_dir):
    p = kvbatch(*base_args(root, model_cache_dir, "basic"), "kv=none,q8,q4", cwd=root)
    return root / "basic", p


@pytest.fixture(scope="module")
def sealed_sweep(root, model_cache_dir):
    # pages of 16 tokens: every row seals a page, so q8/q4 read something quantized
    p = kvbatch(*base_args(root, model_cache_dir, "sealed"), "kv=none,q8,q4", "kv.page_size=16", cwd=root)
    assert p.returncode == 0, p.stderr[-2000:]
    return root / "sealed"


@pytest.fixture(scope="module")
def refused_sweep(root, model_cache_dir):
    # head size 32 is not validated for q8 (engine/gate.py); group size 32 so the gate's reason is that.
    p = kvbatch(*base_args(root, model_cache_dir, "refused"), "model.head_dim=64,32", "kv=none,q8",
                "kv.group_size=32", cwd=root)
    return root / "refused", p


def _png_ok(path: Path, must_have: tuple[str, ...] = ()) -> None:
    img = Image.open(path)
    img.load()
    assert img.format == "PNG" and img.width > 100 and img.height > 100
    px = np.asarray(img.convert("RGB")).reshape(-1, 3)
    assert px.std() > 0 and len(np.unique(px, axis=0)) > 1, f"{path.name} is blank"
    for hex_color in must_have:  # a bar of this colour was drawn
        rgb = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(px.astype(int) - rgb).sum(axis=1) <= 3).sum() > 50, f"{path.name}: no {hex_color} bar"


def test_basic_launcher_three_jobs_one_process_one_model_load(basic_sweep):
    sweep, p = basic_sweep
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == str(sweep / "sweep.parquet")
    assert "sweep of 3 jobs: 3 completed" in p.stdout
    rows = jobs(sweep)
    assert [r["kv_mode"] for r in rows] == ["none", "q8", "q4"] and [r["job_num"] for r in rows] == [0, 1, 2]
    dirs = [Path(r["job_dir"]) for r in rows]
    assert len(set(dirs)) == 3 and all(d.parent == sweep for d in dirs)
    for r, d in zip(rows, dirs):
        assert r["status"] == "completed" and r["failure_reason"] is None
        assert (r["rows"], r["rows_ok"], r["rows_invalid_input"], r["rows_insufficient_memory"]) == (4, 3, 1, 0)
        assert f"kv={r['kv_mode']}" in r["overrides"] and r["label"] == f"#{r['job_num']} kv={r['kv_mode']}"
        results = pq.read_table(d / "results.parquet")
        assert results.column("kv_mode").to_pylist() == [r["kv_mode"]] * 4
        summary = json.loads((d / "summary.json").read_text())
        assert r["decode_tokens_per_s"] == summary["engine"]["decode_tokens_per_s"] > 0
        assert r["peak_memory_bytes"] == summary["peak_memory_bytes"] > 0
        assert r["kv_bytes_per_token"] == summary["engine"]["kv_bytes_per_token"]
        assert r["output_tokens"] == sum(results.column("output_tokens").to_pylist()) > 0
    kvb = [r["kv_bytes_per_token"] for r in rows]
    assert kvb[0] > kvb[1] > kvb[2] > 0
    # One process ran every job; the model loaded for the first job only.
    assert len({r["pid"] for r in rows}) == 1 and [r["model_loads"] for r in rows] == [1, 0, 0]
    # Each job's engines and KV pages are gone once it ends: MLX holds the cached model's weights only.
    st = [json.loads((d / "job_status.json").read_text()) for d in dirs]
    after = [x["mlx_active_bytes_after_release"] for x in st]
    assert after[0] > 0 and after == [after[0]] * 3 and st[1]["mlx_active_bytes_at_start"] == after[0]


def test_agreement_against_kv_none(basic_sweep):
    sweep, _ = basic_sweep
    rows = jobs(sweep)
    none = rows[0]
    assert none["token_agreement"] is None and none["baseline_job_dir"] is None
    base = {r["row_key"]: r["output_token_ids"] for r in
            pq.read_table(Path(none["job_dir"]) / "results.parquet").to_pylist() if r["error_code"] is None}
    for r in rows[1:]:
        assert r["baseline_job_dir"] == none["job_dir"] and r["rows_compared"] == 3
        other = {x["row_key"]: x["output_token_ids"] for x in
                 pq.read_table(Path(r["job_dir"]) / "results.parquet").to_pylist() if x["error_code"] is None}
        assert sorted(other) == sorted(base) == ["a", "b", "c"]
        matched = sum(sum(x == y for x, y in zip(base[k], other[k])) for k in base)
        total = sum(max(len(base[k]), len(other[k])) for k in base)
        assert r["token_agreement"] == pytest.approx(matched / total)
        assert r["rows_identical"] == sum(base[k] == other[k] for k in base)
        if r["rows_identical"] < 3:
            assert 0 <= r["first_divergence_min"] <= r["first_divergence_median"] <= 12


def test_teacher_forced_quality_against_kv_none(sealed_sweep):
    """Issue 27: each quantized job scored on kv=none's outputs under its own cache: per row in the job's
    teacher_forced.parquet, per job in sweep.parquet; q4 loses more than q8."""
    sweep = sealed_sweep
    by = {r["kv_mode"]: r for r in jobs(sweep)}
    assert [by[m]["kv_label"] for m in ("none", "q8", "q4")] == ["none", "q8", "q4"]
    assert by["none"]["tf_top1_agreement"] is None
    assert not (Path(by["none"]["job_dir"]) / "teacher_forced.parquet").exists()
    base = {r["row_key"]: r["output_token_ids"] for r in
            pq.read_table(Path(by["none"]["job_dir"]) / "results.parquet").to_pylist() if r["error_code"] is None}
    for m in ("q8", "q4"):
        r = by[m]
        rows = pq.read_table(Path(r["job_dir"]) / "teacher_forced.parquet").to_pylist()
        assert {x["row_key"]: x["positions"] for x in rows} == {k: len(v) for k, v in base.items()}
        assert all(x["error_code"] is None and 0 <= x["kl_mean"] <= x["kl_max"] for x in rows)
        n = sum(len(v) for v in base.values())
        assert r["tf_rows"] == 3 and r["tf_positions"] == n and r["tf_error"] is None
        assert r["tf_kl_mean"] == pytest.approx(sum(x["kl_mean"] * x["positions"] for x in rows) / n)
        assert r["tf_kl_max"] == max(x["kl_max"] for x in rows) and r["tf_kl_row_max"] <= r["tf_kl_max"]
        assert 0.5 <= r["tf_top1_agreement"] <= 1 and r["tf_kl_mean"] < 0.05
        assert r["tf_ppl"] == pytest.approx(np.exp(sum(x["nll"] * x["positions"] for x in rows) / n))
    assert by["q8"]["tf_ppl_baseline"] == by["q4"]["tf_ppl_baseline"] > 1  # the same kv=none text and scores
    assert by["q4"]["tf_kl_mean"] > by["q8"]["tf_kl_mean"] > 0
    assert "top-1 vs kv=none (teacher-forced)" in (sweep / "report.md").read_text()


def test_report_md_and_plots(basic_sweep):
    sweep, _ = basic_sweep
    md = (sweep / "report.md").read_text()
    for name, title in PLOTS.values():
        assert f"![{title}]({name})" in md
    assert "| `#1 kv=q8` | completed | tiny | q8 | 3 / 4 | invalid_input 1 |" in md
    _png_ok(sweep / PLOTS["decode"][0], must_have=(KV_COLORS["none"], KV_COLORS["q8"], KV_COLORS["q4"]))
    _png_ok(sweep / PLOTS["kv_memory"][0], must_have=(KV_COLORS["none"], KV_COLORS["q8"], KV_COLORS["q4"]))
    _png_ok(sweep / PLOTS["quality"][0], must_have=(KV_COLORS["none"], KV_COLORS["q8"], KV_COLORS["q4"]))


def test_report_shows_the_kv_cache_itself(basic_sweep):
    """Issue 22.9: the peak-memory plot showed q8/q4 above none on a small model (weights dominate). The
    report now carries the KV cache's own peak bytes and the tokens the budget holds per mode, and the
    agreement axis is zoomed to the data."""
    from kvbatch.pipeline.sweep.report.kv_plots import agreement_limits

    sweep, _ = basic_sweep
    by = {r["kv_mode"]: r for r in jobs(sweep)}
    assert by["none"]["kv_peak_bytes"] > by["q8"]["kv_peak_bytes"] > by["q4"]["kv_peak_bytes"] > 0
    assert 0 < by["none"]["kv_tokens_fit"] < by["q8"]["kv_tokens_fit"] < by["q4"]["kv_tokens_fit"]
    for r in by.values():
        assert r["kv_tokens_fit"] == r["kv_budget_bytes"] // r["kv_bytes_per_token"]
    lo, hi = agreement_limits([0.93, 0.97])
    assert 0.9 < lo < 0.93 and 1.0 < hi < 1.02
    _png_ok(sweep / PLOTS["agreement"][0], must_have=(KV_COLORS["q8"], KV_COLORS["q4"]))
    _png_ok(sweep / PLOTS["errors"][0], must_have=(CODE_COLORS["ok"], CODE_COLORS["invalid_input"]))


def test_refused_mode_fails_alone_and_is_recorded(refused_sweep):
    sweep, p = refused_sweep
    assert p.returncode == 1, p.stderr  # a job did not complete: the sweep says so
    rows = jobs(sweep)
    assert [(r["job_num"], r["status"]) for r in rows] == [(0, "completed"), (1, "completed"),
                                                           (2, "completed"), (3, "failed")]
    bad = rows[3]
    assert "kv=q8 is not validated for llama with head size 32" in bad["failure_reason"]
    assert bad["error_type"] == "KvbatchConfigError" and bad["rows"] is None
    assert json.loads((Path(bad["job_dir"]) / "job_status.json").read_text())["status"] == "failed"
    assert "sweep job #3" in p.stderr and "failed: kv=q8 is not validated" in p.stderr
    for r in rows[:3]:
        assert r["rows_ok"] == 3 and (Path(r["job_dir"]) / "results.parquet").exists()
    # Two distinct models, each loaded once; q8 (head 64) compares with kv=none of head 64, not of head 32.
    assert [r["model_loads"] for r in rows] == [1, 0, 1, 0]
    assert rows[1]["baseline_job_dir"] == rows[0]["job_dir"] and rows[1]["token_agreement"] is not None
    md = (sweep / "report.md").read_text()
    assert "## Jobs that did not complete" in md and "head size 32" in md
    _png_ok(sweep / PLOTS["errors"][0])


def test_bad_value_fails_alone_unknown_option_stops_the_sweep_first(root, model_cache_dir):
    p = kvbatch(*base_args(root, model_cache_dir, "badvalue"), "job.max_tokens=4,-1", cwd=root)
    assert p.returncode == 1
    rows = jobs(root / "badvalue")
    assert [r["status"] for r in rows] == ["completed", "failed"]
    assert rows[0]["rows_ok"] == 3 and rows[1]["failure_reason"] == "job.max_tokens=-1: must be >= 1"
    # An option that does not exist: one line, before any job (no sweep folder at all).
    p = kvbatch(*base_args(root, model_cache_dir, "unknown"), "kv=none,q3", cwd=root)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and lines == ["kvbatch: error: kv=q3: no such option (choose one of: k8v4, none, q4, q8)"]
    assert not (root / "unknown").exists()


def test_joblib_launcher(root, model_cache_dir):
    proc = kvbatch(*base_args(root, model_cache_dir, "joblib"), "kv=none,q8,q4", "hydra/launcher=joblib",
                   "hydra.launcher.n_jobs=2", cwd=root, popen=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    sweep = root / "joblib"
    assert out.strip().splitlines()[-1] == str(sweep / "sweep.parquet")
    rows = jobs(sweep)
    assert [(r["kv_mode"], r["status"], r["rows_ok"]) for r in rows] == [
        ("none", "completed", 3), ("q8", "completed", 3), ("q4", "completed", 3)]
    assert all(r["pid"] != proc.pid for r in rows)  # jobs ran in joblib's worker processes
    status = json.loads((Path(rows[0]["job_dir"]) / "job_status.json").read_text())
    assert "JoblibLauncher" in status["launcher"]
    assert all(r["token_agreement"] is not None for r in rows[1:])
    for name, _ in PLOTS.values():
        _png_ok(sweep / name)


def test_action_report_rebuilds_from_one_and_several_sweeps(root, basic_sweep, refused_sweep, model_cache_dir):
    basic, _ = basic_sweep
    refused, _ = refused_sweep
    out = root / "combined"
    p = kvbatch("action=report", f"report.sweep_dirs=[{basic},{refused}]", f"report.out={out}", cwd=root)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == str(out / "sweep.parquet")
    rows = jobs(out)
    assert len(rows) == 7 and [r["label"].split()[0] for r in rows][:4] == ["basic/#0", "basic/#1", "basic/#2",
                                                                            "refused/#0"]
    assert sum(r["status"] == "failed" for r in rows) == 1
    assert (out / "report.md").exists() and all((out / name).exists() for name, _ in PLOTS.values())

    # One folder, in process: the same rows as the sweep's own report (timings and all).
    from kvbatch.pipeline.compose import compose_config
    from kvbatch.pipeline.sweep.report.write import report_action

    again = root / "again"
    report_action(compose_config(["action=report", f"report.sweep_dirs=[{basic}]", f"report.out={again}"]))
    cols = ["job_num", "status", "kv_mode", "rows_ok", "decode_tokens_per_s", "peak_memory_bytes",
            "token_agreement", "first_divergence_min", "tf_kl_mean", "tf_top1_agreement"]
    assert pq.read_table(again / "sweep.parquet", columns=cols).to_pylist() == \
        pq.read_table(basic / "sweep.parquet", columns=cols).to_pylist()

    p = kvbatch("action=report", f"report.sweep_dirs=[{basic},{refused}]", cwd=root)
    assert p.returncode == 2 and "report.out" in p.stderr


def test_compare_definitions():
    base = {"a": [1, 2, 3, 4], "b": [5, 6, 7], "c": [1, 1], "err": [9]}
    other = {"a": [1, 2, 3, 4], "b": [5, 0, 7, 8], "c": [1]}
    r = compare(base, other)
    assert r["rows_compared"] == 3 and r["rows_identical"] == 1
    assert r["token_agreement"] == pytest.approx((4 + 2 + 1) / (4 + 4 + 2))
    assert r["first_divergence_min"] == 1 and r["first_divergence_median"] == 1.0  # b at 1, c at 1 (prefix)


def test_model_cache_loads_once_per_model_config(model_cache_dir):
    from kvbatch.engine.models.config import ModelConfig
    from kvbatch.pipeline import model_cache

    model_cache.enable(True)
    try:
        n0 = model_cache.loads
        a = ModelConfig(source="tiny", name="tiny", cache_dir=str(model_cache_dir))
        first = model_cache.load_model(a)
        assert model_cache.load_model(ModelConfig(**{**a.__dict__})) is first
        other = model_cache.load_model(ModelConfig(**{**a.__dict__, "head_dim": 32}))
        assert other is not first and model_cache.loads - n0 == 2
        model_cache.enable(True, max_bytes=1)  # room for one model only: the older ones are dropped
        model_cache.load_model(ModelConfig(**{**a.__dict__, "head_dim": 128}))
        assert len(model_cache.cached_keys()) == 1 and model_cache.loads - n0 == 3
    finally:
        model_cache.enable(False)
    assert model_cache.cached_keys() == []


def test_glob_and_range_sweeps(root, model_cache_dir):
    """Hydra's sweep syntaxes beyond a,b,c: glob(...) over a config group's options (it used to fail with
    "ConfigLoader is not set" before any job ran) and range(...)."""
    args = [a if not a.startswith("job.max_tokens") else "job.max_tokens=range(3,5)"
            for a in base_args(root, model_cache_dir, "glob")]
    p = kvbatch(*args, "kv=glob(q*)", cwd=root)
    assert p.returncode == 0, p.stderr[-2000:]
    swept = ("kv=", "job.max_tokens=")
    got = sorted((j["kv_mode"], j["status"], tuple(sorted(o for o in j["overrides"] if o.startswith(swept))))
                 for j in jobs(root / "glob"))
    assert got == [(kv, "completed", (f"job.max_tokens={n}", f"kv={kv}")) for kv in ("q4", "q8") for n in (3, 4)], got
