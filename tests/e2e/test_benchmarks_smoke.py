"""Every benchmark runs: `python -m benchmarks NAME --smoke` (the tiny random model, a couple of steps) exits 0 and
writes its JSON record, so a stale option or a renamed engine internal fails here, not in a GPU session.
Benchmarks that need MLX's CUDA backend are refused on other machines, with one line."""
from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from benchmarks import BENCHMARKS
from kvbatch.engine import blas_in_use

ROOT = Path(__file__).resolve().parents[2]
RECORD = {"benchmark", "command", "date", "commit", "versions", "machine", "args", "result", "smoke"}


@pytest.fixture(scope="module")
def bench_cache(tmp_path_factory) -> Path:
    """One model cache for every smoke run (the tiny models are built once)."""
    return tmp_path_factory.mktemp("bench-models")


def _bench(name: str, tmp: Path, cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVBATCH_BENCH_CACHE": str(cache), "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "benchmarks", name, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _skip_reason(name: str, needs: str) -> str | None:
    if needs == "nvcc" and shutil.which("nvcc") is None:
        return "needs nvcc (the CUDA toolkit) to compile the kernels"
    if name == "job.many_workers":
        from tests.pg_server import find_bindir

        if find_bindir() is None:
            return "needs PostgreSQL's server binaries (make system-deps installs them)"
    return None


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_smoke_run(name, tmp_path, bench_cache):
    mod = importlib.import_module(f"benchmarks.{name}")
    needs = getattr(mod, "NEEDS", "")
    out = tmp_path / "record.json"
    if needs == "cuda" and not mx.cuda.is_available():
        r = _bench(name, tmp_path, bench_cache, "--smoke", "--out", str(out))
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "refused" in lines[0] and "CUDA" in lines[0], r.stderr
        assert not out.exists()
        return
    reason = _skip_reason(name, needs)
    if reason:
        pytest.skip(reason)
    r = _bench(name, tmp_path, bench_cache, "--smoke", "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert RECORD <= set(rec), sorted(rec)
    assert rec["benchmark"] == name and rec["smoke"] is True and rec["result"] is not None
    assert rec["command"].startswith(f"python -m benchmarks {name} --smoke")
    assert {"kvbatch", "mlx", "mlx_lm", "python"} <= set(rec["versions"])
    assert {"cpu", "cores", "memory_gib", "platform"} <= set(rec["machine"])
    assert rec["machine"]["blas"] == blas_in_use()  # OpenBLAS loaded before mlx, as in this process
    assert f"record: {out}" in r.stdout


def test_every_benchmark_is_listed_and_has_the_harness_surface():
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    files = {f"{p.parent.name}.{p.stem}" for p in (ROOT / "benchmarks").glob("*/*.py") if p.stem != "__init__"}
    assert files == set(BENCHMARKS), files ^ set(BENCHMARKS)
    for name in BENCHMARKS:
        assert name in r.stdout
        mod = importlib.import_module(f"benchmarks.{name}")
        assert callable(mod.add_args) and callable(mod.run) and isinstance(mod.SMOKE, list), name


def test_benchmarks_edit_no_sys_path_and_import_no_test_configs():
    for p in (ROOT / "benchmarks").rglob("*.py"):
        text = p.read_text()
        assert "sys.path.insert" not in text and "sys.path.append" not in text, p
        assert "tests.configs" not in text, p


def test_gpu_stages_name_registered_benchmarks_and_no_removed_variables():
    """benchmarks/gpu/device_run.sh runs on the lent GPU: what it names must exist here first."""
    import re

    text = (ROOT / "benchmarks" / "gpu" / "device_run.sh").read_text()
    named = set(re.findall(r"-m benchmarks ([a-z_]+\.[a-z_]+)", text))
    assert named and named <= set(BENCHMARKS), named - set(BENCHMARKS)
    assert "KVBATCH_CUDA_" not in text  # engine settings are modes (KV@cuda.key=value), not environment variables
    assert not re.search(r"python3? benchmarks/\w+\.py", text)  # scripts run as python -m benchmarks NAME
