"""`kvbatch.generate`: the command's run (enqueue, work, finalize) from Python, on rows in memory or a file.

The options are the config's keys, so a notebook and a job file say the same thing: a key by its own
name where only one section has it (`max_tokens=64`, `system_prompt=...`), a section as a mapping
(`sampling={"seed": 3}`), or a dotted name (`**{"engine.max_batch": 8}`). In-memory rows are written to
the output folder as the job's input file (JSONL for a list, Parquet for a DataFrame or Table, so
column types carry through). With `output_dir` the run is the command's: durable parts, resume where
it stopped, nothing generated twice; without it everything lives in a temporary folder, removed on return.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import tempfile
import typing
import warnings
from os import PathLike
from pathlib import Path
from typing import Any, Optional, Union

import kvbatch.engine  # noqa: F401  (loads OpenBLAS before anything imports mlx)
import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.params import PARAMS
from kvbatch.pipeline.compose import CONF_DIR, compose_nodes, describe, node_to_config
from kvbatch.pipeline.config import Config, ConfigError
from kvbatch.pipeline.finalize import RESULTS

# keys two sections share, taken as the one a generation call means (a per-row parameter's section,
# job.name; model.seed, model.name: dotted)
PREFERRED = {**{p.name: p.section for p in PARAMS}, "name": "job"}
Rows = Union[str, PathLike, list, pa.Table, Any]  # Any: a pandas DataFrame (pandas is not required)


def _sections() -> dict[str, set[str]]:
    hints = typing.get_type_hints(Config)
    return {f.name: {g.name for g in dataclasses.fields(hints[f.name])}
            for f in dataclasses.fields(Config) if dataclasses.is_dataclass(hints[f.name])}


def _key(name: str) -> str:
    """An option's dotted config key: itself when dotted or a section, else the one section that has it."""
    sections = _sections()
    if "." in name or name in sections or name == "action":
        return name
    owners = [s for s, names in sections.items() if name in names]
    if name in PREFERRED:
        return f"{PREFERRED[name]}.{name}"
    if len(owners) == 1:
        return f"{owners[0]}.{name}"
    if owners:
        raise ConfigError(f"{name}: several sections have this key ({', '.join(f'{s}.{name}' for s in owners)}); "
                          f"pass the one you mean as **{{'{owners[0]}.{name}': ...}} or {owners[0]}={{...}}")
    raise ConfigError(f"{name}: unknown option (use a config key: max_tokens, system_prompt, sampling={{...}}, "
                      f"'engine.max_batch', ...; docs/jobs.md, \"Job files\")")


def _model_option(model: str) -> list[str]:
    """A model group option (smollm2, tiny, local), else an mlx-lm folder or Hugging Face repo id."""
    if (CONF_DIR / "model" / f"{model}.yaml").exists():
        return [f"model={model}"]
    return ["model=local"]


def _write_input(rows: Rows, folder: Path) -> Path:
    """The rows as the job's input file in `folder` (a path is used where it is)."""
    if isinstance(rows, (str, PathLike)):
        return Path(rows)
    if type(rows).__module__.split(".")[0] == "pandas":
        rows = pa.Table.from_pandas(rows, preserve_index=False)  # NaN (pandas' missing value) becomes null
    if isinstance(rows, pa.Table):
        path = folder / "input.parquet"
        pq.write_table(rows, path)
        return path
    if isinstance(rows, (list, tuple)):
        path = folder / "input.jsonl"
        with open(path, "w", encoding="utf-8") as fh:
            for r in rows:
                if not isinstance(r, (str, dict)):
                    raise ConfigError(f"rows: each row must be a prompt string or a dict of columns, "
                                      f"got {type(r).__name__}")
                fh.write(json.dumps({"prompt": r} if isinstance(r, str) else r, ensure_ascii=False,
                                    default=str) + "\n")
        return path
    raise ConfigError(f"rows: a list of strings or dicts, a pandas DataFrame, a pyarrow Table or a path; "
                      f"got {type(rows).__name__}")


def config_for(rows_path: Path, model: str, kv: str, output_dir: Path, options: dict[str, Any]) -> Config:
    """The validated Config of one call: the command's defaults, the model and KV options, then `options`."""
    node = compose_nodes([[*_model_option(model), f"kv={kv}"]])[0]
    # quiet unless asked: no progress display (output={"progress": "on"} shows it)
    settings: dict[str, Any] = {"output.dir": str(output_dir), "job.input": str(rows_path), "output.progress": "off"}
    if not (CONF_DIR / "model" / f"{model}.yaml").exists():
        settings["model.path"] = model
    settings.update({_key(k): v for k, v in options.items()})
    try:
        for key, value in settings.items():
            OmegaConf.update(node, key, value, merge=True)
        return node_to_config(node)
    except (KvbatchConfigError, OmegaConfBaseException) as exc:
        raise ConfigError(describe(exc)) from None


def generate(rows: Rows, model: str = "smollm2", kv: str = "none", max_tokens: Optional[int] = None,
             output_dir: Optional[Union[str, PathLike]] = None, **options: Any) -> pa.Table:
    """Generate every row; a pyarrow Table with results.parquet's schema (one row per input row, in order).

    rows: prompt strings, dicts of columns (prompt or messages, id, per-row parameters, anything else
    carried through), a pandas DataFrame, a pyarrow Table, or a path to a JSONL/CSV/Parquet file.
    model: smollm2 | tiny, or an mlx-lm folder / Hugging Face repo id (run as model=local with that model.path).
    kv: none | q8 | q4. output_dir: where the queue, parts and results live (run again to resume);
    None: a temporary folder, removed on return. options: config keys (`max_tokens=64`,
    `system_prompt="..."`, `sampling={"seed": 1}`, `**{"engine.max_batch": 8}`).
    A bad option or input raises ConfigError (one line); a run where no row succeeded warns
    (raises RowsFailed when `output={"max_error_fraction": ...}` is set, as the command exits 1).
    Nothing is written to stdout; the plan and notes go to the `kvbatch` logger (logging.basicConfig
    (level=logging.INFO) shows them), the summary line and results path to `kvbatch.out`.
    """
    if max_tokens is not None:
        options = {"max_tokens": max_tokens, **options}
    return _run_rows(rows, model, kv, output_dir, options)


def score(rows: Rows, model: str = "smollm2", kv: str = "none", columns: Optional[list[str]] = None,
          tokens: bool = False, output_dir: Optional[Union[str, PathLike]] = None, **options: Any) -> pa.Table:
    """action=score: the log-probability of each row's given completion(s) after its prompt (docs/score.md);
    a pyarrow Table with results.parquet's schema, one row per (input row, column scored), in order.

    rows: as generate's, each with a prompt (or messages) and the columns to score. columns: those
    columns (job.score_columns; default ["completion"]), e.g. ["chosen", "rejected"]. tokens: also each
    completion token's log-probability (job.score_tokens, in output_logprobs). The other arguments are
    generate's.
    """
    if columns is not None:
        options = {"job.score_columns": list(columns), **options}
    return _run_rows(rows, model, kv, output_dir, {"action": "score", "job.score_tokens": tokens, **options})


def _run_rows(rows: Rows, model: str, kv: str, output_dir: Optional[Union[str, PathLike]],
              options: dict[str, Any]) -> pa.Table:
    """One run of the command's action (run or score) on these rows; results.parquet as a Table."""
    with tempfile.TemporaryDirectory(prefix="kvbatch-") as tmp:
        folder = Path(output_dir) if output_dir is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        return _run(config_for(_write_input(rows, folder).resolve(), model, kv, folder, options), folder)


def generate_with(rows: Rows, cfg: Config) -> pa.Table:
    """generate() with a Config composed once (config_for) for many calls (kvbatch.ray's batches): `rows` run
    as its job's input in a temporary folder, removed on return."""
    with tempfile.TemporaryDirectory(prefix="kvbatch-") as tmp:
        folder = Path(tmp)
        cfg = copy.deepcopy(cfg)
        cfg.job.input, cfg.output.dir = str(_write_input(rows, folder).resolve()), str(folder)
        return _run(cfg, folder)


def _run(cfg: Config, folder: Path) -> pa.Table:
    """The command's run of `cfg` (its results in `folder`), as a table."""
    from kvbatch.pipeline import actions

    try:
        path = actions.run(actions.job_for(cfg))
    except actions.RowsFailed as exc:
        if cfg.output.max_error_fraction is not None:
            raise
        warnings.warn(f"kvbatch: {exc}", stacklevel=3)
        path = folder.resolve() / RESULTS
    return pq.read_table(path)
