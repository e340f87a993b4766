"""Sweeps (`kvbatch -m kv=none,q8,q4 ...`): one job per override combination, then a report.

Each job runs in Hydra's job folder (`<hydra.sweep.dir>/<job num>/`): its queue,
parts, results.parquet and summary.json land there, next to `job_status.json`
(written when the job starts and again, in a `finally`, when it ends: completed,
failed with its reason, or interrupted). A job that fails (a KV mode the gate
refuses, a value the config checks refuse, an unexpected exception) fails alone:
the sweep goes on. With the basic launcher every job runs in this process: the
model is loaded once per distinct model config (pipeline/model_cache.py) and each
job's engines and KV pools are dropped and MLX's buffer cache cleared before the
next one. With `hydra/launcher=joblib` jobs run in worker processes; the status
files are how their outcome reaches the report.

`SweepCallback.on_multirun_end` (callback.py, registered in conf/config.yaml) reads
the job folders and writes sweep.parquet and report.md (report/) in the sweep folder.
If the multirun itself dies (a joblib worker killed), the CLI still builds the report
from whatever the job folders hold. The command exits 1 when a job did not complete,
0 when all did.

run.py: one job (the Hydra task) and the check before a sweep; status.py:
job_status.json; callback.py: the report at the end and the exit code.
"""
