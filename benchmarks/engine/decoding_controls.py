"""What constrained decoding and logprobs cost (issue 24): decode tokens/s of the same rows free, with
logprobs on, and held to a JSON schema, alternated in one process.

Every row runs exactly --new tokens in every variant, so the batch stays --batch rows for the whole
decode and the rates compare like with like: free rows and logprobs rows with ignore_eos, constrained
rows with a schema they cannot finish in --new tokens (an array of at least 100 person objects: keys,
enums, integers, short strings, nested arrays; the grammar's mask changes every token). Greedy.
Rounds alternate the order (free, logprobs, json, then reversed); medians and the ratios of medians
are reported, with the host's mask time per step (llguidance, all constrained rows in one call).

    flock /tmp/kvbatch-bench.lock .venv/bin/python benchmarks/decoding_controls.py --batch 32 --new 64
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvbatch.engine  # noqa: E402,F401  (OpenBLAS before mlx)
from kvbatch.engine.engine import Engine  # noqa: E402
from kvbatch.engine.grammar import Grammars, grammar_from_format  # noqa: E402
from kvbatch.engine.models.config import ModelConfig  # noqa: E402
from kvbatch.engine.models.load import load_model  # noqa: E402
from kvbatch.engine.types import Request, SamplingParams  # noqa: E402
from tests.configs import engine_config  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "country", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "country": {"enum": ["France", "Spain", "Italy"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}}}
SCHEMA = {"type": "array", "items": PERSON, "minItems": 100}
TOPICS = ["friends", "colleagues", "football players", "painters", "cooks", "teachers", "pilots", "doctors"]


class TimedGrammars(Grammars):
    """Grammars that add up the host's mask time (the benchmark's only instrument)."""

    fill_s = 0.0
    fills = 0

    def fill(self, bitmask, rows):
        t0 = time.perf_counter()
        super().fill(bitmask, rows)
        TimedGrammars.fill_s += time.perf_counter() - t0
        TimedGrammars.fills += 1


def run(model, tok, spec, prompts, params: SamplingParams, batch: int) -> dict:
    eng = Engine(model, tok, spec, engine_config(max_batch=batch, memory_budget=6 << 30))
    eng.grammars = eng.runner.grammars = TimedGrammars(tok, spec.vocab_size, eng.output.eos_ids)
    TimedGrammars.fill_s, TimedGrammars.fills = 0.0, 0
    res = eng.generate([Request(f"r{i}", p, params) for i, p in enumerate(prompts)])
    s = eng.summary()
    assert all(r.ok and len(r.tokens) == params.max_tokens for r in res), [r.finish_reason for r in res]
    return {"decode_tps": s["decode_tokens_per_s"], "tokens": s["generated_tokens"],
            "mask_ms_per_step": 1000 * TimedGrammars.fill_s / TimedGrammars.fills if TimedGrammars.fills else 0.0,
            "texts": [r.text for r in res]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    model, tok, spec = load_model(ModelConfig(source="smollm2"))
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"List {TOPICS[i % len(TOPICS)]} of "
                                         f"mine as JSON objects with name, age, country and tags ({i})."}],
                                       add_generation_prompt=True) for i in range(a.batch)]
    grammar = grammar_from_format(SCHEMA)
    variants = {"free": SamplingParams(max_tokens=a.new, ignore_eos=True),
                "logprobs": SamplingParams(max_tokens=a.new, ignore_eos=True, logprobs=a.logprobs),
                "json": SamplingParams(max_tokens=a.new, grammar=grammar)}
    run(model, tok, spec, prompts[:4], SamplingParams(max_tokens=8, grammar=grammar), 4)  # warm-up (and llguidance)
    rates: dict[str, list[float]] = {k: [] for k in variants}
    masks: list[float] = []
    last: dict = {}
    for r in range(a.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            out = run(model, tok, spec, prompts, variants[name], a.batch)
            rates[name].append(out["decode_tps"])
            if name == "json":
                masks.append(out["mask_ms_per_step"])
            last[name] = out
            print(f"round {r} {name}: {out['decode_tps']:.1f} decode tok/s", file=sys.stderr, flush=True)
    assert all(t.replace(" ", "").replace("\n", "").startswith("[{") for t in last["json"]["texts"])
    med = {k: statistics.median(v) for k, v in rates.items()}
    summary = {"batch": a.batch, "new_tokens": a.new, "logprobs": a.logprobs, "rounds": a.rounds,
               "decode_tps": rates, "median": med,
               "logprobs_cost": 1 - med["logprobs"] / med["free"], "json_cost": 1 - med["json"] / med["free"],
               "mask_ms_per_step": masks, "sample_json_output": last["json"]["texts"][0][:300]}
    text = json.dumps(summary, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
