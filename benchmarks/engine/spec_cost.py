"""What a verification pass costs against plain decode, with a draft model, at a forced acceptance (issue 41:
the overhead at acceptance 0 must be at most 10% of plain decode).

Random weights accept nothing on their own, so EngineHooks.force_acceptance makes each verification keep
the chosen share of every row's k proposed tokens (0, 50%, 100% by default) and rows propose k tokens every
step. Per batch size: plain decode (no speculation), then speculative.method=draft at each share, each on a
fresh engine warmed by a short run first; rows never stop early (no EOS: exactly --new tokens each).

- `verify_tok_s`: tokens over the verification passes' own time (the engine's decode_s: from a pass's
  dispatch to its tokens read; the draft's steps before it are not in it). At acceptance 0 a pass gives one
  token a row, as a decode step does, so `overhead` = plain decode tok/s / verify_tok_s - 1 is the
  verification pass's cost over a decode step's: the issue's figure.
- `decode_tok_s`: tokens over the whole decode phase (wall less prefill: draft steps, verification, host),
  what a user sees; against plain decode's as `speedup`.
- The speculating engines read each pass at once (`--spec-lookahead off`, the default here), so that decode_s
  is the passes' own time. With the lookahead a pass stays in flight until the next step has proposed and
  dispatched the next one (engine.py `_land_pass`), and decode_s then runs from landing to landing, the
  draft's steps included; `--spec-lookahead auto` measures what a GPU runs by default (plain decode always
  runs with the backend's default).

    python -m benchmarks engine.spec_cost --model random-1b --draft random-draft1b --batches 8,64 --prompt 512 --new 256
"""
from __future__ import annotations

import json
import time

from benchmarks import harness as h
from kvbatch.engine.config import EngineOptions
from kvbatch.engine.engine import Engine
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request

SMOKE = ["--model", "tiny", "--draft", "tiny", "--batches", "2", "--prompt", "16", "--new", "8", "--warm", "2"]


def add_args(ap) -> None:
    ap.add_argument("--model", default="random-1b", help=", ".join(h.MODEL_NAMES))
    ap.add_argument("--draft", default="",
                    help="the draft model (same vocabulary; default: the model drafts for itself)")
    ap.add_argument("--mode", default="none", help="KV mode (harness.parse_mode)")
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens a row")
    ap.add_argument("--new", type=int, default=256, help="new tokens a row")
    ap.add_argument("--num-tokens", type=int, default=4, help="speculative.num_tokens (k)")
    ap.add_argument("--accept", default="0,0.5,1", help="forced acceptance shares")
    ap.add_argument("--warm", type=int, default=8, help="new tokens of the untimed warm-up run on each engine")
    ap.add_argument("--budget-gb", type=float, default=0, help="memory budget (0: auto)")
    ap.add_argument("--spec-lookahead", default="off", choices=("off", "on", "auto"),
                    help="engine.options.lookahead of the speculating engines (off: each pass read at once, so "
                         "decode_s is the passes' own time; on: passes in flight, decode_s from landing to landing)")


def _requests(b: int, prompt: int, new: int, vocab: int, tag: str) -> list[Request]:
    return [Request(f"{tag}{i}", [(31 * i + 7 * j) % min(vocab, 5000) + 1 for j in range(prompt)],
                    SamplingParams(max_tokens=new, ignore_eos=True)) for i in range(b)]


def _timed(eng: Engine, a, b: int, vocab: int) -> dict:
    """A warm-up run, then the timed one: its tokens, wall, prefill and decode seconds (differences of stats())."""
    eng.generate(_requests(b, a.prompt, a.warm, vocab, "w"))
    s0, t0 = eng.stats(), time.perf_counter()
    res = eng.generate(_requests(b, a.prompt, a.new, vocab, "r"))
    wall, s1 = time.perf_counter() - t0, eng.stats()
    tokens = sum(len(r.tokens) for r in res)
    d = {k: (s1.get(k) or 0) - (s0.get(k) or 0) for k in ("prefill_s", "decode_s", "spec_proposed", "spec_accepted",
                                                          "spec_passes")}
    dec = wall - d["prefill_s"]
    return {"tokens": tokens, "wall_s": wall, **d, "decode_tok_s": tokens / dec if dec > 0 else None,
            "verify_tok_s": tokens / d["decode_s"] if d["decode_s"] else None,
            "errors": sum(not r.ok for r in res)}


def run(a) -> dict:
    model, tok, spec = h.load(a.model)
    draft = h.load(a.draft) if a.draft and a.draft != a.model else (model, tok, spec)
    if a.draft.startswith("random-") and a.model.startswith("random-"):
        draft = (draft[0], tok, draft[2])  # random geometries: token ids only (NoEos), one tokenizer for both
    budget = int(a.budget_gb * (1 << 30)) or None
    rows = []
    for b in map(int, a.batches.split(",")):
        kw = dict(page_size=16, max_batch=b, memory_budget=budget, prefix_cache=False)
        plain = _timed(Engine(model, tok, spec, h.mode_config(a.mode, **kw)), a, b, spec.vocab_size)
        row = {"batch": b, "plain": plain}
        print(json.dumps({"batch": b, "side": "plain", **plain}), flush=True)
        for share in map(float, a.accept.split(",")):
            # adaptive off: the payoff would keep most steps plain where verifying does not pay (at acceptance
            # 0, always), and the passes measured would be a handful
            cfg = h.mode_config(a.mode, **kw, speculative={"method": "draft", "num_tokens": a.num_tokens,
                                                          "adaptive": False},
                                options=EngineOptions(lookahead=a.spec_lookahead))
            eng = Engine(model, tok, spec, cfg, hooks=EngineHooks(force_acceptance=share), draft=draft)
            got = _timed(eng, a, b, spec.vocab_size)
            base = plain["verify_tok_s"]  # plain decode: tokens over its decode steps' own time
            got["overhead"] = base / got["verify_tok_s"] - 1 if base and got["verify_tok_s"] else None
            got["speedup"] = got["decode_tok_s"] / plain["decode_tok_s"] \
                if got["decode_tok_s"] and plain["decode_tok_s"] else None
            row[f"accept_{share:g}"] = got
            print(json.dumps({"batch": b, "side": f"accept {share:g}", **got}), flush=True)
            h.checkpoint({"rows": [*rows, row]})
        rows.append(row)
    return {"rows": rows, "model": a.model, "draft": a.draft or a.model, "num_tokens": a.num_tokens}
