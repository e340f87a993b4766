"""kvbatch: config-driven batch generation for local LLMs on MLX.

The distribution installs this one import name: `kvbatch.engine` (everything that touches
MLX) and `kvbatch.pipeline` (the Hydra app, queue, worker and Parquet results around it), with
the Hydra configs in `kvbatch/conf` and the sample job in `kvbatch/jobs`. The code lives in
`src/kvbatch/`; the repository's top-level `engine/`, `pipeline/`, `conf/` and `jobs/` are links
to those folders.

`kvbatch.generate(rows, model=..., kv=..., max_tokens=..., **options)` is the command from Python
(pipeline/api.py), `kvbatch.score(rows, columns=[...], ...)` its action=score; they are imported on first
use, so `import kvbatch` stays cheap.
"""
__version__ = "0.1.0"
__all__ = ["generate", "score", "__version__"]

TYPE_CHECKING = False  # typing's constant, without importing typing (type checkers take it as True)
if TYPE_CHECKING:
    from kvbatch.pipeline.api import generate, score


def __getattr__(name: str):  # PEP 562
    if name in ("generate", "score"):
        from kvbatch.pipeline import api

        return getattr(api, name)
    raise AttributeError(f"module 'kvbatch' has no attribute {name!r}")
