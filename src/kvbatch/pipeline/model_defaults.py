"""`sampling.defaults`: where a job's sampling values come from when its config sets none.

`model` (the default), as vLLM does: the model's own generation_config.json (Qwen3 ships temperature
0.6, top_p 0.95, top_k 20), read for a local model from its folder or the local Hugging Face cache,
then kvbatch's default for what it does not set. `kvbatch`: kvbatch's defaults (temperature 0: greedy;
every other control off). A value the config sets (the command line, a job file, the API) and a row's
own value always win. The bundled SmolLM2 and the tiny model have no generation_config.json.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.params import PARAMS

CHOICES = ("model", "kvbatch")
# the generation_config.json keys vLLM applies, each the sampling key of the same name
KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FILE = "generation_config.json"


def _file(model: ModelConfig) -> Optional[Path]:
    if model.source != "local" or not model.path:
        return None
    path = Path(model.path).expanduser()
    if path.is_dir():
        return path / FILE
    try:  # a repo id: only what the local cache already holds (reading a config never downloads)
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model.path, FILE)
    except Exception:  # noqa: BLE001 - not a repo id the cache knows
        return None
    return Path(found) if isinstance(found, str) else None


def read(model: ModelConfig) -> dict[str, Any]:
    """The sampling values of the model's generation_config.json ({} when it has none)."""
    path = _file(model)
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path is not None and path.is_file() else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    out = {}
    for k in KEYS:
        v = data.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = int(v) if k == "top_k" else float(v)
    return out


def fill(sampling: Any, model: ModelConfig) -> None:
    """Set each of the job's sampling values that is unset (None): the model's (defaults=model), else
    kvbatch's."""
    own = read(model) if sampling.defaults == "model" else {}
    kvbatch = {p.name: p.default for p in PARAMS if p.name in KEYS}
    for k in KEYS:
        if getattr(sampling, k) is None:
            setattr(sampling, k, own.get(k, kvbatch[k]))


def describe(sampling: Any, model: ModelConfig) -> str:
    """Which defaults the job's sampling took, for the plan and the summary."""
    own = read(model) if sampling.defaults == "model" else {}
    if not own:
        why = "" if sampling.defaults == "kvbatch" else f" (the model has no {FILE})"
        return f"kvbatch's{why}"
    return f"the model's {FILE} ({', '.join(f'{k} {v:g}' for k, v in own.items())}) where the config sets none"
