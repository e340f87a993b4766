"""The repository's own text holds (issue 22.10): files it names exist, README's KV-memory ratios are the
engine's memory model, the command's --help and --version work, no private mlx-lm imports."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from kvbatch.engine.memory import kv_layout
from kvbatch.engine.types import ModelSpec
from tests.e2e.test_pipeline_cli import kvbatch

ROOT = Path(__file__).resolve().parents[2]
TRACKED = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
SOURCES = [p for p in TRACKED if p.endswith((".py", ".yaml", ".md", ".sh", ".toml")) or p == "Makefile"]
PATH = re.compile(r"\b((?:engine|pipeline|benchmarks|tests|conf|jobs)/[A-Za-z0-9_./-]*"
                  r"\.(?:py|md|yaml|jsonl?|sh|txt))\b")


def test_every_repository_path_named_in_the_text_exists():
    missing = []
    for name in SOURCES:
        for lineno, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            for path in PATH.findall(line):
                if "NAME" in path or path.startswith("benchmarks/results/") and "_{" in line:
                    continue  # a placeholder, not a file
                if re.search(r"(--out[ =]|> ?)" + re.escape(path), line):
                    continue  # a file the command on this line writes
                if "deleted" in line:
                    continue  # history: a script that was removed, said so where it is named
                if name == "benchmarks/RESULTS.md" and path.startswith("benchmarks/"):
                    continue  # history: commands as they were run (the note at its top maps old script names)
                if not (ROOT / path).exists():
                    missing.append(f"{name}:{lineno}: {path}")
    assert not missing, "\n".join(missing)


def test_no_private_mlx_lm_names_are_imported():
    """A private mlx-lm function can change or vanish in any release."""
    found = []
    for name in TRACKED:
        if not name.endswith(".py") or not name.startswith(("engine/", "pipeline/", "kvbatch/")):
            continue
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm"):
                found += [f"{name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not found, found


def test_readme_kv_memory_ratios_are_the_memory_model():
    """README's table of KV bytes per token against kv=none, for float32 and half models."""
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| (float32|float16 / bfloat16)[^|]*\| 1 \| ([\d.]+× \| [\d.]+×) \|$", readme, re.M))
    assert set(rows) == {"float32", "float16 / bfloat16"}, rows
    for label, dtype in (("float32", "float32"), ("float16 / bfloat16", "float16")):
        spec = ModelSpec("smollm2-like", "llama", 30, 9, 3, 64, dtype, 8192, 49152, tuple(range(30)))
        none = kv_layout(spec, "none", 64, 64).bytes_per_token
        want = " | ".join(f"{kv_layout(spec, m, 64, 64).bytes_per_token / none:.2f}×" for m in ("q8", "q4"))
        assert rows[label] == want, (label, rows[label], want)


def test_version_and_help(tmp_path):
    v = kvbatch("--version", cwd=tmp_path)
    assert v.returncode == 0 and re.fullmatch(r"kvbatch \S+ \(mlx \S+, mlx-lm \S+, Python \S+\)\n", v.stdout), v
    h = kvbatch("--help", cwd=tmp_path)
    assert h.returncode == 0, h.stderr
    for needle in ("== Actions (action=...) ==", "status", "retry", "== Inputs ==", "== Outputs ==",
                   "== Examples ==", "kv: k8v4, none, q4, q8", "max_error_fraction"):
        assert needle in h.stdout, needle
    assert "Powered by Hydra" not in h.stdout


@pytest.mark.skipif(__import__("kvbatch.engine.backend", fromlist=["x"]).backend().name != "cpu",
                    reason="the warning is about MLX's CPU backend")
def test_half_precision_on_the_cpu_warns(tmp_path, model_cache_dir):
    args = ("model=tiny", f"model.cache_dir={model_cache_dir}", f"output.root={tmp_path / 'out'}", "job.max_tokens=2")
    half = kvbatch(*args, "model.dtype=float16", cwd=tmp_path)
    assert half.returncode == 0 and "kvbatch: warning: the model's weights are float16 on the CPU backend" \
        in half.stderr and "set model.dtype=float32" in half.stderr, half.stderr
    plain = kvbatch(*args, cwd=tmp_path)
    assert plain.returncode == 0 and "warning" not in plain.stderr, plain.stderr
