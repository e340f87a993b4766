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


def _build(src: Path, out: Path, kind: str) -> tuple[Path, str]:
    """Build a wheel or an sdist with the PEP 517 hooks of the installed setuptools (no index is
    reached); the artifact and everything the build printed, warnings included."""
    code = (f"import warnings, setuptools.build_meta as b; warnings.simplefilter('always'); "
            f"print('ARTIFACT', b.build_{kind}({str(out)!r}))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # a pip install compiles
    r = subprocess.run([sys.executable, "-c", code], cwd=src, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    name = r.stdout.split("ARTIFACT")[-1].strip()
    return out / name, r.stdout + r.stderr


def test_wheel_and_sdist_hold_real_files_and_build_without_warnings(tmp_path):
    import tarfile
    import zipfile

    src, out, target = tmp_path / "src", tmp_path / "dist", tmp_path / "site"
    out.mkdir()
    subprocess.run(["git", "clone", "-q", str(ROOT), str(src)], check=True, timeout=120)
    # the working tree as it is now (a test runs before a commit too), links kept as links
    for rel in subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.split():
        s, d = ROOT / rel, src / rel
        if s.is_symlink() or not s.is_file():
            continue
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(s, d)
    for name in ("engine", "pipeline", "conf", "jobs"):  # the top-level names a reader looks for
        assert (src / name).is_symlink() and (src / name).resolve() == (src / "src" / "kvbatch" / name).resolve()

    wheel, log_w = _build(src, out, "wheel")
    sdist, log_s = _build(src, out, "sdist")
    for log in (log_w, log_s):
        assert "warning" not in log.lower(), log[-3000:]

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        infos = z.infolist()
    assert {"kvbatch/engine/engine.py", "kvbatch/engine/kv/cache.py", "kvbatch/pipeline/cli.py",
            "kvbatch/conf/config.yaml", "kvbatch/conf/model/tiny.yaml", "kvbatch/jobs/sample_prompts.jsonl"} <= names
    assert not any(n.split("/")[0] in ("engine", "pipeline", "conf", "jobs", "src", "tests") for n in names)
    assert not any((i.external_attr >> 28) == 0o12 for i in infos)  # no symlink entries
    with tarfile.open(sdist) as t:
        members = t.getmembers()
    assert not any(m.issym() or m.islnk() for m in members), [m.name for m in members if m.issym()]
    assert any(m.name.endswith("src/kvbatch/engine/engine.py") and m.isfile() for m in members)

    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    r = subprocess.run([sys.executable, "-m", "kvbatch", "--version"], cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("kvbatch 0.1.0"), r.stdout + r.stderr
    assert str(target) in subprocess.run(
        [sys.executable, "-c", "import kvbatch; print(kvbatch.__file__)"], cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True, text=True, timeout=60).stdout
