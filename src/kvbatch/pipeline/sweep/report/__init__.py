"""The sweep report: sweep.parquet (one row per job) and report.md with PNG plots.

Built at the end of a multirun (sweep/callback.py) and again on demand from one or more
sweep folders (`kvbatch action=report report.sweep_dirs=[DIR,...]`). Everything comes
from the job folders: job_status.json (how the job ended, its overrides and resolved
config), summary.json (rows, speed, memory, KV bytes) and results.parquet (tokens, for
agreement against the kv=none job with the same model, prompts and sampling).

collect.py reads the folders into one record per job; compare.py adds agreement;
plots.py and markdown.py draw and write; write.py puts it together (and action=report).
"""
