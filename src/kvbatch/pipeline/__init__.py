"""kvbatch pipeline: everything around the engine (Hydra app, inputs, queue, worker, Parquet results)."""
