"""The installed distribution claims one import name, `kvbatch`.

The project is installed plainly (not editable) into a scratch folder, with the test
environment's own dependencies, and imported from a folder outside the repository: the
generic names `engine` and `pipeline` must not be importable, `kvbatch.engine` and the
`kvbatch` command's module must be, and the Hydra config and sample job ship as package data.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_installed_distribution_has_one_import_name(tmp_path):
    target, elsewhere, src = tmp_path / "site", tmp_path / "elsewhere", tmp_path / "src"
    elsewhere.mkdir()
    # from a copy of the sources: setuptools' build/ in the checkout may hold files the source no longer has
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "outputs", ".gpu", "*.egg-info",
                                                             "__pycache__", "results"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(src)],
                   check=True, capture_output=True, timeout=300)
    packages = sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin")
    assert packages == ["kvbatch"]  # bin/: the console script
    env = {**os.environ, "PYTHONPATH": str(target)}

    def py(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=120)

    for name in ("engine", "pipeline"):
        r = py(f"import {name}")
        assert r.returncode != 0 and "No module named" in r.stderr, (name, r.stderr)
    r = py("import kvbatch.engine, kvbatch.pipeline.cli, kvbatch.pipeline.compose as c; "
           "print(kvbatch.engine.__file__); print(c.CONF_DIR)")
    assert r.returncode == 0, r.stderr
    engine_file, conf_dir = r.stdout.split()
    assert Path(engine_file).is_relative_to(target) and Path(conf_dir).is_relative_to(target)
    assert (Path(conf_dir) / "config.yaml").is_file() and (Path(conf_dir) / "job" / "sample.yaml").is_file()
    assert (target / "kvbatch" / "jobs" / "sample_prompts.jsonl").is_file()
