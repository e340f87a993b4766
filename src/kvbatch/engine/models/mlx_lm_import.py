"""Import mlx-lm's model code and weight loader without its tokenizer stack.

`import mlx_lm.<anything>` runs `mlx_lm/__init__.py`, which imports mlx-lm's generate and convert
modules, and `mlx_lm.utils` imports `mlx_lm.tokenizer_utils`: both import transformers (and
transformers imports torch where it is installed), seconds before the first row for code that
only needs a model class, `load_model` or a sampling helper. kvbatch loads tokenizers itself
(models/fast_tokenizer.py), so `defer()` makes those two modules load on first use instead:

- the `mlx_lm` package is registered without running its `__init__`; the first attribute that
  only `__init__` defines (`mlx_lm.load`, `mlx_lm.batch_generate`, `mlx_lm.__version__`) runs it;
- while `mlx_lm.utils` is imported, `mlx_lm.tokenizer_utils` is a stand-in whose `load` and
  `TokenizerWrapper` import the real module when called; the real module replaces it at once
  after, so any later `import mlx_lm.tokenizer_utils` gets mlx-lm's own.

Code that imports mlx-lm before kvbatch.engine gets mlx-lm's usual import; nothing changes for it.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

_PACKAGE = "mlx_lm"
_TOKENIZER_UTILS = "mlx_lm.tokenizer_utils"


class _DeferredPackage(ModuleType):
    """The mlx_lm package before its `__init__` ran: submodules import as usual; a name only
    `__init__` defines runs it first."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name != "__version__" or self.__dict__.get("_kvbatch_ran"):
            raise AttributeError(f"module {_PACKAGE!r} has no attribute {name!r}")
        self.__dict__["_kvbatch_ran"] = True
        spec = self.__spec__
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(self)
        return getattr(self, name)


def _real_tokenizer_utils() -> ModuleType:
    return importlib.import_module(_TOKENIZER_UTILS)


class _TokenizerWrapperStandIn:
    """What `mlx_lm.utils` names as `TokenizerWrapper` (its annotations) until the real one is imported."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return _real_tokenizer_utils().TokenizerWrapper(*args, **kwargs)


def _load_tokenizer(*args: Any, **kwargs: Any) -> Any:
    return _real_tokenizer_utils().load(*args, **kwargs)


def _import_utils() -> None:
    stand_in = ModuleType(_TOKENIZER_UTILS)
    stand_in.__dict__.update(TokenizerWrapper=_TokenizerWrapperStandIn, load=_load_tokenizer)
    sys.modules[_TOKENIZER_UTILS] = stand_in
    try:
        importlib.import_module("mlx_lm.utils")
    finally:
        if sys.modules.get(_TOKENIZER_UTILS) is stand_in:
            del sys.modules[_TOKENIZER_UTILS]
        package = sys.modules.get(_PACKAGE)
        if package is not None and package.__dict__.get("tokenizer_utils") is stand_in:
            del package.__dict__["tokenizer_utils"]


def defer() -> None:
    """Register mlx_lm and mlx_lm.utils so that importing them imports no transformers (a no-op
    where mlx_lm is imported already or is not installed)."""
    if _PACKAGE in sys.modules:
        return
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.loader is None:
        return
    package = importlib.util.module_from_spec(spec)
    package.__class__ = _DeferredPackage
    sys.modules[_PACKAGE] = package
    _import_utils()
