"""Unknown config keys, at any depth: found against the schema's dataclasses, named with a suggestion.

Hydra refuses a misspelt key that is set (`job.max_tokenz=5`), but `+key=value` adds keys that the
schema does not have (`+sampling.typical_p=0.9`, `+job.n=4`) and OmegaConf then drops them without a
word. Every composed node is therefore walked against the schema before it is used; this module
also words Hydra's own unknown-key error, so both read the same.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Optional, cast

from omegaconf import DictConfig, OmegaConf

IGNORED_TOP = ("hydra",)  # Hydra's own section: Hydra checks it


def _nested(cls: type) -> dict[str, Optional[type]]:
    """Field name -> its dataclass type (None for a leaf)."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name] if dataclasses.is_dataclass(hints.get(f.name)) else None)
            for f in dataclasses.fields(cls)}


def _section(root: type, path: list[str]) -> Optional[type]:
    cls: Optional[type] = root
    for part in path:
        if cls is None:
            return None
        cls = _nested(cls).get(part)
    return cls


def message(root: type, full_key: str) -> str:
    """'job.max_tokenz' -> 'job.max_tokenz: unknown key (did you mean job.max_tokens?)'."""
    *parent, name = full_key.split(".")
    cls = _section(root, parent)
    names = list(_nested(cls)) if cls is not None else []
    prefix = ".".join(parent) + "." if parent else ""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean {prefix}{close[0]}?"
    elif names:
        where = f"{'.'.join(parent)} has" if parent else "the top-level keys are"
        hint = f"kvbatch has no such setting; {where}: {', '.join(n for n in names if n not in IGNORED_TOP)}"
    else:
        hint = "kvbatch has no such setting"
    return f"{full_key}: unknown key ({hint})"


def unknown(root: type, node: Any, prefix: str = "") -> Optional[str]:
    """The first key of `node` (a composed DictConfig or a plain dict) the schema `root` lacks, as a
    dotted path; None when every key is known."""
    data = cast(dict, OmegaConf.to_container(node, resolve=False)) if isinstance(node, DictConfig) else node
    fields = _nested(root)
    for key, value in data.items():
        if not prefix and key in IGNORED_TOP:
            continue
        if key not in fields:
            return f"{prefix}{key}"
        sub = fields[key]
        if sub is not None and isinstance(value, dict):
            found = unknown(sub, value, f"{prefix}{key}.")
            if found:
                return found
    return None
