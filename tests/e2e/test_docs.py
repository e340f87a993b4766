"""The repository's own text holds: files it names exist, every config key of the Hydra schema is in the manual
(docs/) and every key the manual or README names exists, the manual's KV-memory ratios are the engine's memory
model, the README stays a one-minute read that links into the manual, the manual builds with
`mkdocs build --strict`, the command's --help and --version work, no private mlx-lm imports."""
from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvbatch.engine.memory import kv_layout
from kvbatch.engine.types import ModelSpec
from kvbatch.pipeline.config import Config
from tests.e2e.test_pipeline_cli import kvbatch

ROOT = Path(__file__).resolve().parents[2]
TRACKED = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
SOURCES = [p for p in TRACKED if p.endswith((".py", ".yaml", ".md", ".sh", ".toml")) or p == "Makefile"]
PATH = re.compile(r"\b((?:engine|pipeline|benchmarks|tests|conf|jobs|docs)/[A-Za-z0-9_./-]*"
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
                if name == "benchmarks/notebook/README.md" and path.startswith("benchmarks/"):
                    continue  # history: commands as they were run (the note at its top maps old script names)
                if not (ROOT / path).exists():
                    missing.append(f"{name}:{lineno}: {path}")
    assert not missing, "\n".join(missing)


def test_no_private_mlx_lm_names_are_imported():
    """A private mlx-lm function can change or vanish in any release."""
    found = []
    for name in TRACKED:
        if not name.endswith(".py") or not name.startswith(("src/kvbatch/", "engine/", "pipeline/", "kvbatch/")):
            continue
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm"):
                found += [f"{name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not found, found


def test_manual_kv_memory_ratios_are_the_memory_model():
    """The manual's table of KV bytes per token against kv=none (docs/kv-modes.md), for float32 and half models."""
    page = (ROOT / "docs" / "kv-modes.md").read_text()
    rows = dict(re.findall(r"^\| (float32|float16 / bfloat16)[^|]*\| 1 \| ([\d.]+× \| [\d.]+×) \|$", page, re.M))
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


# ---- The manual (docs/, mkdocs.yml) and the README that points into it ----

DOCS = ROOT / "docs"
SECTIONS = tuple(f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(getattr(Config(), f.name)))
# Names in the text that look like keys and are not: files, and the unknown keys the manual shows being refused.
NOT_KEYS = {"sampling.typical_p", "job.max_tokenz"}
FILE_SUFFIXES = {"md", "py", "sqlite", "yaml", "parquet", "json", "jsonl", "txt", "png", "log", "lock", "gguf"}


def schema_keys(obj=None, prefix: str = "") -> tuple[set[str], set[str]]:
    """(leaf keys, section keys) of the Hydra schema, dotted: `engine.options.route`, `engine.options.cuda`."""
    obj = Config() if obj is None else obj
    leaves: set[str] = set()
    sections: set[str] = set()
    for f in dataclasses.fields(obj):
        key, value = prefix + f.name, getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            sections.add(key)
            sub_leaves, sub_sections = schema_keys(value, key + ".")
            leaves |= sub_leaves
            sections |= sub_sections
        else:
            leaves.add(key)
    return leaves, sections


def manual_text() -> str:
    return "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))


def test_every_config_key_is_in_the_manual():
    """Every key of the structured config (pipeline/config.py with engine/config.py's dataclasses, walked
    recursively) is named in the manual, dotted as it is typed: `engine.options.route`, `kv.group_size`."""
    leaves, _ = schema_keys()
    assert len(leaves) > 90, sorted(leaves)  # the walk reached the nested sections
    text = manual_text()
    missing = sorted(k for k in leaves
                     if not re.search(r"(?<![\w.])" + re.escape(k) + (r"=" if "." not in k else r"(?![\w])"), text))
    assert not missing, "config keys the manual (docs/*.md) does not name:\n" + "\n".join(missing)


def test_every_config_key_named_in_the_text_exists():
    """A key the manual or README names (`job.max_tokens=64`, `engine.options.cuda.chunk`) is in the schema."""
    leaves, sections = schema_keys()
    key = re.compile(r"(?<![\w./-])((?:" + "|".join(SECTIONS) + r")(?:\.[a-z_][a-z0-9_]*)+)")
    unknown = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for name in key.findall(line):
                if name in NOT_KEYS or name.rsplit(".", 1)[1] in FILE_SUFFIXES:
                    continue
                if name not in leaves and name not in sections:
                    unknown.append(f"{path.relative_to(ROOT)}:{lineno}: {name}")
    assert not unknown, "\n".join(unknown)


def readme_links() -> list[str]:
    return re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", (ROOT / "README.md").read_text())


def test_readme_is_a_one_minute_read_that_points_into_the_manual():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, len(readme.splitlines())
    # the two commands, exactly: .ci/run calls `make test`
    assert re.search(r"^make run\b", readme, re.M) and re.search(r"^make test\b", readme, re.M)
    links = readme_links()
    broken = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not broken, broken
    # each one link away: own prompts, JSON output, resume, many machines, the speed against mlx-lm
    for page, about in (("docs/jobs.md", "own prompts"), ("docs/decoding.md", "JSON output"),
                        ("docs/queue.md", "resume"), ("docs/many-machines.md", "many machines"),
                        ("docs/performance.md", "mlx-lm")):
        rows = [line for line in readme.splitlines() if f"]({page}" in line and about in line]
        assert rows, f"README: no line names {about!r} with a link to {page}"
    # every page of the manual is reachable from README in one step
    pages = {p.relative_to(ROOT).as_posix() for p in DOCS.glob("*.md")} - {"docs/index.md"}
    assert pages <= set(links), sorted(pages - set(links))


def test_performance_page_is_the_one_current_place():
    page = (DOCS / "performance.md").read_text()
    assert len(page.splitlines()) <= 250, len(page.splitlines())
    assert "benchmarks/notebook/README.md" in page
    # every figure is traceable: each section names a command and a source (a raw file or the notebook)
    for section in re.split(r"^### ", page, flags=re.M)[1:]:
        title = section.splitlines()[0]
        assert "python -m benchmarks" in section or "device_run.sh" in section, f"performance.md, {title}: no command"
        assert "benchmarks/results/" in section or "notebook" in section, f"performance.md, {title}: no source"
    assert not (ROOT / "benchmarks" / "RESULTS.md").exists(), "the notebook lives in benchmarks/notebook/"


def test_the_manual_builds_strict(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, a page missing from the nav or a docstring that
    mkdocstrings cannot render fails CI (the docs extra: pip install -e '.[docs]')."""
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, env={**__import__("os").environ,
                                                                     "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("Engine") > 5  # the reference rendered
