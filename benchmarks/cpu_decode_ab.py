"""kvbatch's CPU decode with an engine option off and on, against mlx-lm, alternated in one process.

The machine is shared and noisy: separate processes minutes apart differ by ±10%. Here
mlx-lm, kvbatch with the boolean engine option off and on (EngineOptions) run in turn, `--rounds` times, on the
same prompts; medians and the ratios of medians are reported, and every run's tokens
must match mlx-lm's (greedy).

    flock /tmp/kvbatch-bench.lock .venv/bin/python benchmarks/cpu_decode_ab.py --option in_place \\
        --models tiny --batches 8,32 --page-sizes 16,64
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvbatch.engine  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
from kvbatch.engine.config import EngineOptions  # noqa: E402
from kvbatch.engine.models.config import ModelConfig  # noqa: E402
from kvbatch.engine.models.load import load_model  # noqa: E402
from engine_vs_mlx_lm import TINY, prompts_for, run_kvbatch, run_mlx_lm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--option", required=True, help="a boolean EngineOptions field: runs with it off and on")
    ap.add_argument("--models", default="tiny")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--page-sizes", default="16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    mx.set_cache_limit(2 << 30)  # as engine_vs_mlx_lm.py runs both sides
    rows = []
    for name in a.models.split(","):
        cfg = ModelConfig(**TINY, cache_dir=tempfile.mkdtemp()) if name == "tiny" else ModelConfig(source=name)
        model, tok, spec = load_model(cfg)
        for batch in map(int, a.batches.split(",")):
            ps = prompts_for(batch, a.prompt, spec.vocab_size)
            for page in map(int, a.page_sizes.split(",")):
                run_mlx_lm(model, ps[:2], 8)  # warm-up
                rates: dict[str, list[float]] = {"mlx_lm": [], "0": [], "1": []}
                same = True
                for _ in range(a.rounds):
                    ref = run_mlx_lm(model, ps, a.new)
                    rates["mlx_lm"].append(ref["decode_tps"])
                    for v in ("0", "1"):
                        r = run_kvbatch(model, tok, spec, ps, a.new, page, EngineOptions(**{a.option: v == "1"}))
                        rates[v].append(r["decode_tps"])
                        same = same and r["outputs"] == ref["outputs"]
                med = {k: statistics.median(v) for k, v in rates.items()}
                row = {"model": name, "batch": batch, "page_size": page, "option": a.option, "rounds": a.rounds,
                       "tok_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
                       "ratio_off": med["0"] / med["mlx_lm"], "ratio_on": med["1"] / med["mlx_lm"],
                       "on_over_off": med["1"] / med["0"], "same_tokens": same}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
