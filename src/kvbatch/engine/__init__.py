"""kvbatch engine: everything that touches MLX.

`ensure_blas()` runs first, before anything imports mlx: on Linux CPU it loads
OpenBLAS globally so MLX's matmuls use it (31x the bundled reference BLAS, docs/performance.md).
Then mlx-lm is registered so that its model code imports without transformers.
"""
from typing import TYPE_CHECKING

from kvbatch.engine.blas import blas_in_use, ensure_blas

ensure_blas()

from kvbatch.engine.models.mlx_lm_import import defer  # noqa: E402

defer()  # mlx-lm's model code without transformers (models/mlx_lm_import.py)

from kvbatch.engine.errors import KvbatchConfigError  # noqa: E402
from kvbatch.engine.models.config import ModelConfig  # noqa: E402
from kvbatch.engine.params import SamplingParams  # noqa: E402
from kvbatch.engine.types import ModelSpec, Request, Result, RowStats  # noqa: E402

# load_model too: it imports mlx-lm and transformers (seconds), which `kvbatch --help` never needs
_LAZY = {"Engine": "kvbatch.engine.engine", "EngineHooks": "kvbatch.engine.hooks",
         "load_model": "kvbatch.engine.models.load",
         "samples": "kvbatch.engine.samples", "derive_seed": "kvbatch.engine.samples",
         **{name: "kvbatch.engine.config" for name in ("EngineConfig", "EngineOptions", "EngineSettings", "KVConfig",
                                                       "MemoryConfig", "CudaLaunch")}}

if TYPE_CHECKING:  # the names _LAZY imports on first use, typed for type checkers and editors (re-exported)
    from kvbatch.engine.config import CudaLaunch as CudaLaunch, EngineConfig as EngineConfig
    from kvbatch.engine.config import EngineOptions as EngineOptions, EngineSettings as EngineSettings
    from kvbatch.engine.config import KVConfig as KVConfig, MemoryConfig as MemoryConfig
    from kvbatch.engine.engine import Engine as Engine
    from kvbatch.engine.hooks import EngineHooks as EngineHooks
    from kvbatch.engine.models.load import load_model as load_model
    from kvbatch.engine.samples import derive_seed as derive_seed, samples as samples


def __getattr__(name: str):
    """Import the heavier engine pieces on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvbatch.engine' has no attribute {name!r}")


__all__ = [
    "blas_in_use", "ensure_blas", "load_model", "KvbatchConfigError", "ModelConfig", "ModelSpec",
    "Request", "Result", "RowStats", "SamplingParams",
]
