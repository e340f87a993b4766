"""`kvbatch.ray`: kvbatch as a stage of a Ray Data pipeline.

    import ray
    from kvbatch.ray import Generate

    ds = ray.data.read_parquet("prompts/")
    ds = ds.map_batches(Generate, fn_constructor_kwargs={"model": "smollm2", "max_tokens": 256},
                        batch_size=64, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=1))
    ds.write_parquet("results/")

Each actor loads the model once and runs every batch it is given through kvbatch's engine: the rows
of a batch are the input rows of a job (a prompt or messages column, an id column, per-row parameters,
any other column carried through), the batch that comes back holds results.parquet's columns for them
(output, token ids, error_code, error_message, ...), one row per input row (per sample with n > 1). The
options are the command's config keys, as `kvbatch.generate` takes them (pipeline/api.py). A bad row
comes back with its error code like any other row; a batch that cannot run at all (a missing prompt
column) comes back with every row carrying the error, so the dataset never fails for its rows. Which
rows ran is Ray's to track: a batch whose actor died is run again by Ray as a whole.

Nothing heavy is imported until an actor is built, so importing this module is cheap (and Ray itself
is needed only to run the pipeline: `pip install 'kvbatch[ray]'`).
"""
from __future__ import annotations

import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

__all__ = ["Generate"]

log = logging.getLogger("kvbatch")


class Generate:
    """A callable class for `Dataset.map_batches`: one loaded model per actor, rows in, result columns out.

    model: smollm2 | tiny, or an mlx-lm folder / Hugging Face repo id; kv: none | q8 | q4; options: the
    command's config keys (`max_tokens=64`, `sampling={"seed": 1}`, `**{"engine.max_batch": 8}`). A bad
    option raises ConfigError here, when the actor starts (one line), never per batch."""

    def __init__(self, model: str = "smollm2", kv: str = "none", **options: Any):
        from kvbatch.pipeline import model_cache
        from kvbatch.pipeline.api import config_for

        model_cache.enable(True)  # every batch of this actor reuses the model loaded here
        with tempfile.TemporaryDirectory(prefix="kvbatch-ray-") as tmp:
            # composed once (a bad option fails the actor at once); each batch gets its own input and folder
            self.cfg = config_for(Path(tmp) / "input.jsonl", model, kv, Path(tmp),
                                  {"output": {"progress": "off"}, **options})
        model_cache.load_model(self.cfg.model)

    def __call__(self, batch: Any) -> Any:
        """The batch's results (a pyarrow Table): the rows of a dict of columns, a pandas DataFrame or a
        pyarrow Table, generated as one job."""
        import pyarrow as pa

        from kvbatch.engine.errors import INTERNAL_ERROR, INVALID_INPUT, KvbatchConfigError
        from kvbatch.pipeline.api import generate_with

        table = _table(batch, pa)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "no row succeeded" is in every row's error_code
                return generate_with(table, self.cfg)
        except KvbatchConfigError as exc:  # the batch's columns cannot make a job (no prompt column)
            return _failed(table, INVALID_INPUT, str(exc))
        except Exception as exc:  # noqa: BLE001 - a batch that fails as a whole: its rows say why
            log.exception("kvbatch: a batch failed")
            return _failed(table, INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")


def _table(batch: Any, pa) -> Any:
    """A batch as a pyarrow Table (Ray's numpy batches are dicts of arrays; pandas batches DataFrames)."""
    if isinstance(batch, pa.Table):
        return batch
    if type(batch).__module__.split(".")[0] == "pandas":
        return pa.Table.from_pandas(batch, preserve_index=False)
    return pa.table({name: pa.array([_plain(v) for v in values]) for name, values in dict(batch).items()})


def _plain(value: Any) -> Any:
    """A numpy scalar or array from a numpy batch as the Python value it holds."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _failed(table: Any, code: str, message: str, id_column: Optional[str] = "id") -> Any:
    """Every row of a batch that could not run, in the results schema, with `code` and `message`."""
    from kvbatch.pipeline.results import ResultRecord, to_table

    n = table.num_rows
    ids = table.column(id_column).to_pylist() if id_column in table.column_names else [None] * n
    prompts = table.column("prompt").to_pylist() if "prompt" in table.column_names else [None] * n
    out = to_table([ResultRecord(row_key=str(k) if k is not None else f"row-{i}", row_index=i,
                                 prompt=p if isinstance(p, str) else None, error_code=code, error_message=message)
                    for i, (k, p) in enumerate(zip(ids, prompts))])
    for name in table.column_names:
        if name not in out.column_names and name != id_column:
            out = out.append_column(table.schema.field(name), table.column(name))
    return out
