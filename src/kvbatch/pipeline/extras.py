"""The features an install extra provides, and the one line that says which extra is missing.

`pip install kvbatch` holds what one machine's job needs. `kvbatch[sweep]`: matplotlib, for the
sweep report's plots (`kvbatch -m ...`, action=report). `kvbatch[postgres]`: psycopg, for a shared
PostgreSQL queue (queue.url). `kvbatch[slurm]`: Hydra's submitit and joblib launchers
(hydra/launcher=submitit_slurm | submitit_local | joblib). `kvbatch[ray]`: Ray Data, for kvbatch.ray's
stage (Dataset.map_batches). `kvbatch[all]`: every one.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

# extra -> (the module it installs, what needs it)
EXTRAS = {"sweep": ("matplotlib", "a sweep's report plots (kvbatch -m ..., action=report)"),
          "postgres": ("psycopg", "a PostgreSQL queue (queue.url)"),
          "ray": ("ray", "kvbatch.ray's Ray Data stage")}
# Hydra launcher option -> its plugin package (kvbatch[slurm] installs them)
LAUNCHERS = {"joblib": "hydra_plugins.hydra_joblib_launcher",
             "submitit_slurm": "hydra_plugins.hydra_submitit_launcher",
             "submitit_local": "hydra_plugins.hydra_submitit_launcher"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or blocked
        return False


def missing(extra: str) -> Optional[str]:
    """The one line saying kvbatch[extra] is needed and not installed, or None when it is."""
    module, what = EXTRAS[extra]
    if _installed(module):
        return None
    return f"{what} needs {module}: pip install 'kvbatch[{extra}]'"


def missing_launcher(option: str) -> Optional[str]:
    """The same for hydra/launcher=OPTION (None: installed, or not a launcher kvbatch[slurm] provides)."""
    plugin = LAUNCHERS.get(option)
    if plugin is None or _installed(plugin):
        return None
    return f"hydra/launcher={option} needs Hydra's launcher plugin: pip install 'kvbatch[slurm]'"
