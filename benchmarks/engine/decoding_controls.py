"""What constrained decoding and logprobs cost (issue 24): decode tokens/s of the same rows free, with
logprobs on, and held to a JSON schema, alternated in one process.

Every row runs exactly --new tokens in every variant, so the batch stays --batch rows for the whole
decode and the rates compare like with like: free rows and logprobs rows with ignore_eos, constrained
rows with a schema they cannot finish in --new tokens (an array of at least 100 person objects: keys,
enums, integers, short strings, nested arrays; the grammar's mask changes every token). Greedy.
Rounds alternate the order (free, logprobs, json, then reversed); medians and the ratios of medians
are reported, with the host's mask time per step (llguidance, all constrained rows in one call).

    python -m benchmarks engine.decoding_controls --batch 32 --new 64
"""
from __future__ import annotations

import json
import statistics
import sys

from benchmarks import harness as h
from kvbatch.engine.grammar import grammar_from_format
from kvbatch.engine.params import SamplingParams

SMOKE = ["--model", "tiny", "--batch", "2", "--new", "4", "--logprobs", "2", "--rounds", "2"]

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "country", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "country": {"enum": ["France", "Spain", "Italy"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}}}
SCHEMA = {"type": "array", "items": PERSON, "minItems": 100}
TOPICS = ["friends", "colleagues", "football players", "painters", "cooks", "teachers", "pilots", "doctors"]


def add_args(ap) -> None:
    ap.add_argument("--model", default="smollm2", help=", ".join(h.MODEL_NAMES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)


def one(model, tok, spec, prompts, params: SamplingParams, batch: int) -> dict:
    eng = h.engine(model, tok, spec, max_batch=batch, memory_budget=6 << 30)
    masks = h.time_grammar_masks(eng)
    res = eng.generate(h.requests(prompts, params.max_tokens, "r", **{k: v for k, v in vars(params).items()
                                                                       if k != "max_tokens"}))
    s = eng.summary()
    assert all(r.ok and len(r.tokens) == params.max_tokens for r in res), [r.finish_reason for r in res]
    return {"decode_tps": s["decode_tokens_per_s"], "tokens": s["generated_tokens"],
            "mask_ms_per_step": 1000 * masks["s"] / masks["calls"] if masks["calls"] else 0.0,
            "texts": [r.text for r in res]}


def run(a) -> dict:
    model, tok, spec = h.load(a.model)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"List {TOPICS[i % len(TOPICS)]} of "
                                         f"mine as JSON objects with name, age, country and tags ({i})."}],
                                       add_generation_prompt=True) for i in range(a.batch)]
    grammar = grammar_from_format(SCHEMA)
    variants = {"free": SamplingParams(max_tokens=a.new, ignore_eos=True),
                "logprobs": SamplingParams(max_tokens=a.new, ignore_eos=True, logprobs=a.logprobs),
                "json": SamplingParams(max_tokens=a.new, grammar=grammar)}
    one(model, tok, spec, prompts[:4], SamplingParams(max_tokens=8, grammar=grammar), 4)  # warm-up (and llguidance)
    runs = h.alternate({k: (lambda p=p: one(model, tok, spec, prompts, p, a.batch)) for k, p in variants.items()},
                       a.rounds, log=False)
    for name, rs in runs.items():
        for r in rs:
            print(f"{name}: {r.get('decode_tps', 0):.1f} decode tok/s {r.get('error', '')}", file=sys.stderr)
    last = runs["json"][-1]
    assert all(t.replace(" ", "").replace("\n", "").startswith("[{") for t in last["texts"]), last["texts"][:2]
    rates = {k: [r["decode_tps"] for r in rs] for k, rs in runs.items()}
    med = {k: statistics.median(v) for k, v in rates.items()}
    summary = {"batch": a.batch, "new_tokens": a.new, "logprobs": a.logprobs, "rounds": a.rounds,
               "decode_tps": rates, "median": med,
               "logprobs_cost": 1 - med["logprobs"] / med["free"], "json_cost": 1 - med["json"] / med["free"],
               "mask_ms_per_step": [r["mask_ms_per_step"] for r in runs["json"]],
               "sample_json_output": last["texts"][0][:300]}
    print(json.dumps(summary, indent=1))
    return summary
