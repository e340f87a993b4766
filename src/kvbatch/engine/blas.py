"""Load a fast BLAS for MLX's CPU backend on Linux, before `mlx.core` is imported.

The `mlx-cpu` wheel bundles netlib's reference BLAS (~4-8 GFLOP/s for a float32
512x576x1536 matmul). Loading OpenBLAS globally (RTLD_GLOBAL) *before* MLX is
first imported makes MLX's matmuls bind to it instead (~150-240 GFLOP/s,
docs/performance.md). Loading it after `import mlx.core` has no effect, so `kvbatch.engine`
calls `ensure_blas()` first thing.

Env: KVBATCH_BLAS=/path/to/libblas.so picks the library; KVBATCH_BLAS=none
turns the step off (used by the benchmark's "without" run).
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
import sys
import warnings
from typing import Optional

INSTALL_HINT = "apt-get install libopenblas0-pthread"
_OFF = {"none", "off", "0", "false", "reference"}
_in_use: Optional[str] = None
_warned = False


def _cuda_installed() -> bool:
    """Cheap check, without importing mlx: is an MLX CUDA wheel installed?"""
    for dist in ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda"):
        try:
            importlib.metadata.version(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


def _candidates() -> list[str]:
    arch = platform.machine()
    return [
        f"/usr/lib/{arch}-linux-gnu/openblas-pthread/libblas.so.3",
        f"/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    ]


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def ensure_blas() -> str:
    """On Linux, load OpenBLAS globally before mlx is imported; return what is in use.

    Loaded even when a CUDA wheel is present (harmless; covers CPU-device runs).
    Idempotent. Never raises: without OpenBLAS MLX still runs, only slower.
    """
    global _in_use
    if _in_use is not None:
        return _in_use
    if sys.platform == "darwin":
        _in_use = "accelerate"
        return _in_use
    if not sys.platform.startswith("linux"):
        _in_use = "unknown"
        return _in_use
    preload = os.environ.get("LD_PRELOAD", "")
    if "blas" in preload:
        _in_use = f"openblas:{preload} (LD_PRELOAD)"
        return _in_use
    requested = os.environ.get("KVBATCH_BLAS", "").strip()
    if requested.lower() in _OFF:
        _in_use = "reference (bundled)"
        return _in_use
    if "mlx.core" in sys.modules:
        _in_use = "reference (bundled)"
        _warn_once(
            "kvbatch: mlx was imported before OpenBLAS could be loaded, so MLX uses its slow "
            "reference BLAS; import kvbatch.engine (or kvbatch.engine.blas.ensure_blas()) before mlx."
        )
        return _in_use
    for path in [requested] if requested else _candidates():
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            _in_use = f"openblas:{path}"
            return _in_use
    if _cuda_installed():  # MLX will run on the GPU: no BLAS needed, no warning
        _in_use = "n/a (gpu)"
        return _in_use
    _in_use = "reference (bundled)"
    what = f"KVBATCH_BLAS={requested} could not be loaded" if requested else "no OpenBLAS found"
    _warn_once(
        f"kvbatch: {what}, MLX's CPU matmuls will be ~30x slower; "
        f"install it with `{INSTALL_HINT}` (or set KVBATCH_BLAS to a libblas.so)."
    )
    return _in_use


def blas_in_use() -> str:
    """Short description of the BLAS MLX uses, for run summaries.

    e.g. "openblas:/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "reference (bundled)", "accelerate", "n/a (gpu)".
    """
    state = _in_use if _in_use is not None else ensure_blas()
    mx = sys.modules.get("mlx.core")
    if mx is not None and state != "accelerate":
        try:
            if mx.default_device().type == mx.gpu:
                return "n/a (gpu)"
        except Exception:  # pragma: no cover - defensive: never fail a summary
            pass
    return state
