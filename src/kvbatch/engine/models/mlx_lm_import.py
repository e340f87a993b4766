"""Import mlx-lm's model code and weight loader without its tokenizer stack.

`import mlx_lm.<anything>` runs `mlx_lm/__init__.py`, which imports mlx-lm's generate and convert
modules, and `mlx_lm.utils` imports `mlx_lm.tokenizer_utils`: both import transformers (and
transformers imports torch where it is installed), seconds before the first row for code that
only needs a model class, `load_model` or a sampling helper. kvbatch loads tokenizers itself
(models/fast_tokenizer.py), so `defer()` makes those two modules load on first use instead:

- the `mlx_lm` package imports without running its `__init__`; the first attribute that only
  `__init__` defines (`mlx_lm.load`, `mlx_lm.batch_generate`, `mlx_lm.__version__`) runs it;
- while `mlx_lm.utils` is first imported, `mlx_lm.tokenizer_utils` is a stand-in whose `load`
  and `TokenizerWrapper` import the real module when called; the stand-in is gone right after,
  so any later `import mlx_lm.tokenizer_utils` gets mlx-lm's own.

Both go through a finder on `sys.meta_path` until their first import. Code that imports mlx-lm
before kvbatch.engine gets mlx-lm's usual import; nothing changes for it.
"""
from __future__ import annotations

import importlib
import sys
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any, Optional

_PACKAGE = "mlx_lm"
_TOKENIZER_UTILS = "mlx_lm.tokenizer_utils"
_UTILS = "mlx_lm.utils"


class _DeferredPackage(ModuleType):
    """The mlx_lm package before its `__init__` ran: submodules import as usual; a name only
    `__init__` defines runs it first."""

    def __getattr__(self, name: str) -> Any:
        init = self.__dict__.pop("_kvbatch_init", None)
        if init is None or name.startswith("__") and name != "__version__":
            raise AttributeError(f"module {_PACKAGE!r} has no attribute {name!r}")
        init.exec_module(self)
        return getattr(self, name)


class _PackageLoader(Loader):
    """Creates the mlx_lm package without running its `__init__` (kept for `_DeferredPackage`)."""

    def __init__(self, loader: Loader):
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__class__ = _DeferredPackage
        module.__dict__["_kvbatch_init"] = self._loader


def _real_tokenizer_utils() -> ModuleType:
    return importlib.import_module(_TOKENIZER_UTILS)


class _TokenizerWrapperStandIn:
    """What `mlx_lm.utils` names as `TokenizerWrapper` (its annotations) until the real one is imported."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return _real_tokenizer_utils().TokenizerWrapper(*args, **kwargs)


def _load_tokenizer(*args: Any, **kwargs: Any) -> Any:
    return _real_tokenizer_utils().load(*args, **kwargs)


class _UtilsLoader(Loader):
    """mlx_lm.utils' own loader, run with the stand-in `mlx_lm.tokenizer_utils` in place."""

    def __init__(self, loader: Loader):
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        stand_in = ModuleType(_TOKENIZER_UTILS)
        stand_in.__dict__.update(TokenizerWrapper=_TokenizerWrapperStandIn, load=_load_tokenizer)
        sys.modules[_TOKENIZER_UTILS] = stand_in
        try:
            self._loader.exec_module(module)
        finally:
            if sys.modules.get(_TOKENIZER_UTILS) is stand_in:
                del sys.modules[_TOKENIZER_UTILS]
            package = sys.modules.get(_PACKAGE)
            if package is not None and package.__dict__.get("tokenizer_utils") is stand_in:
                del package.__dict__["tokenizer_utils"]


class _Finder(MetaPathFinder):
    """Finds mlx_lm and mlx_lm.utils on their first import, with the loaders above around theirs;
    leaves `sys.meta_path` once both are found."""

    def __init__(self) -> None:
        self._pending = {_PACKAGE: _PackageLoader, _UTILS: _UtilsLoader}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Optional[ModuleSpec]:
        wrap = self._pending.pop(name, None)
        if wrap is None:
            return None
        if not self._pending:
            sys.meta_path.remove(self)
        spec = PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = wrap(spec.loader)
        return spec


def defer() -> None:
    """Put the finder for mlx_lm and mlx_lm.utils first on `sys.meta_path` (nothing is imported now;
    a no-op where mlx_lm is imported already)."""
    if _PACKAGE not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
