"""The base install (no extras) imports and runs a job; a feature whose extra is missing stops at once with
one line naming it. The extras' modules are made unimportable for a real `kvbatch` process by a meta-path
finder that refuses them, installed through a sitecustomize on PYTHONPATH."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

BLOCKER = '''
import sys

class _WithoutExtras:
    """Refuses the modules kvbatch's extras install, as an install without them would."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("matplotlib", "psycopg", "psycopg_binary"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _WithoutExtras())
'''


def test_base_install_runs_a_job_and_names_the_missing_extra(tmp_path, model_cache_dir):
    site = tmp_path / "without_extras"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    (tmp_path / "one.jsonl").write_text('{"id": "a", "prompt": "The cat"}\n')
    path = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}

    def kvbatch(*args):
        return subprocess.run([sys.executable, "-m", "kvbatch", "model=tiny", f"model.cache_dir={model_cache_dir}",
                               f"job.input={tmp_path / 'one.jsonl'}", f"output.root={tmp_path / 'out'}",
                               "job.max_tokens=2", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)

    check = subprocess.run([sys.executable, "-c", "import matplotlib"], env=env, capture_output=True, text=True)
    assert check.returncode != 0 and "No module named 'matplotlib'" in check.stderr  # the blocker is on
    run = kvbatch()
    assert run.returncode == 0, run.stderr
    results = Path(run.stdout.strip().splitlines()[-1])
    assert pq.read_table(results).column("error_code").to_pylist() == [None]
    for args, extra in ((["-m", "kv=none,q8"], "kvbatch[sweep]"),
                        (["queue.url=postgresql://me@localhost/jobs"], "kvbatch[postgres]")):
        p = kvbatch(*args)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and len(lines) == 1 and extra in lines[0], p.stderr


def test_the_command_imports_no_model_library_before_it_needs_one():
    """`kvbatch --help`, --version and a bad option answer without importing mlx-lm and transformers (seconds)."""
    code = "import sys, kvbatch.pipeline.cli; print(sorted(m for m in ('transformers', 'mlx_lm') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_the_extras_hold_the_optional_features_and_the_test_extra_pulls_them():
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"])
    assert not any(name in base for name in ("matplotlib", "psycopg", "submitit", "joblib", "ray"))
    extras = project["optional-dependencies"]
    assert any("matplotlib" in d for d in extras["sweep"]) and any("psycopg" in d for d in extras["postgres"])
    assert {"hydra-submitit-launcher", "hydra-joblib-launcher"} <= {d.split(">")[0] for d in extras["slurm"]}
    assert any(d.startswith("ray[data]") for d in extras["ray"])
    assert extras["all"] == ["kvbatch[sweep,postgres,slurm,ray]"] and "kvbatch[all]" in extras["test"]


RUN_CLI = """
import json, sys
from kvbatch.pipeline.cli import main
for args in json.loads(sys.argv[1]):
    sys.argv = ["kvbatch", *args]
    try:
        main()
    except SystemExit:
        pass
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "torch")
                        or m.startswith(("mlx_lm.models", "mlx_lm.utils", "mlx_lm.tokenizer_utils")))))
"""


def _imported(tmp_path, *runs) -> list[str]:
    """The model-library modules one `kvbatch` process imports running each of `runs` (argument lists)."""
    r = subprocess.run([sys.executable, "-c", RUN_CLI, json.dumps(runs)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_job_imports_neither_transformers_nor_torch_and_status_no_model_code(tmp_path, model_cache_dir):
    """A tiny job loads its model and tokenizer without transformers (nor torch, which transformers imports
    where it is installed); --help, --version and action=status import no mlx-lm model code either."""
    (tmp_path / "one.jsonl").write_text('{"id": "a", "prompt": "The cat"}\n')
    job = ["model=tiny", f"model.cache_dir={model_cache_dir}", "job.input=one.jsonl", "job.max_tokens=2"]
    ran = _imported(tmp_path, job)
    assert "mlx_lm.utils" in ran and not [m for m in ran if m.split(".")[0] in ("transformers", "torch")], ran
    assert (tmp_path / "outputs").is_dir()
    assert _imported(tmp_path, ["--help"], ["--version"], [*job, "action=status"]) == []
