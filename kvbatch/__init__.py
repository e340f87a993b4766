"""kvbatch: config-driven batch generation for local LLMs on MLX.

The distribution installs this one import name. `kvbatch.engine` (everything that
touches MLX) and `kvbatch.pipeline` (the Hydra app, queue, worker and Parquet
results around it) live in the repository's top-level `engine/` and `pipeline/`
folders, mapped here by the build backend (pyproject.toml, `package-dir`).
"""
__version__ = "0.1.0"
