"""KV quantization quality (issues 5, 27): each KV mode against kv=none, teacher-forced first.

For varied chat prompts (36 by default), greedy, up to 256 new tokens:

1. kv=none generates (EOS ends a row, as in real use); its outputs are the reference text.
2. Teacher-forced (the primary measure): every mode of --modes scores none's outputs through its own
   cache with engine.scoring.compare (the code the sweep report's tf_* columns run): mean KL(none ||
   mode) over positions, the largest per-row mean KL, top-1 agreement of the two next-token
   distributions, and the perplexity of the text under the mode over its perplexity under none.
3. KV bytes per token of each mode from engine.memory's layout (all layers, K and V, scales and biases;
   full_precision_tokens adds a dense slot per row, not per token), and its ratio to q8's.
4. Free-running (secondary, --free-running): the mode generates the same way; token agreement with none
   over the first 256 positions (exact-match fraction and first divergence). One near-tie flip early in
   an answer makes the rest of it disagree, so this measures greedy chaos as much as the cache.
5. Calibration (issue 5; off unless asked): none again at another batch size (--floor-batch), and
   mlx-lm's own kv_bits=8/4 single-stream path (--mlx-lm-prompts).

--modes: comma-separated, each a named mode (none, q8, q4, k8v4, or k<K>v<V>) plus "+rot"
(kv.rotate_keys), "+fp<N>" (kv.full_precision_tokens=N) and "+g<N>" (kv.group_size=N instead of
--group-size), e.g. q8,q4,k8v4,q4+rot,k8v4+rot,q4+rot+fp64.
--model tiny128: a seeded random llama with head size 128 (random weights: a stress geometry for the
quantizers, not a quality claim). --base FILE: reuse none's outputs from an earlier --out of the same
model, prompts and settings (to split the modes over several calls).

    python -m benchmarks quality.kv_quality --modes q8,q4 --out /tmp/kv_quality.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

from benchmarks import harness as h
from kvbatch.engine.engine import Engine
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.memory import layout_for
from kvbatch.engine.scoring import ForcedRow, compare, summarize
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request

SMOKE = ["--model", "tiny", "--modes", "q8,q4+rot", "--new", "4", "--batch", "2", "--prompts", "2",
         "--floor-batch", "1", "--mlx-lm-prompts", "1"]

PROMPTS = [
    "What is the capital of France?",
    "Explain how photosynthesis works in simple terms.",
    "Write a short poem about the ocean at night.",
    "Give me three tips for learning a new programming language.",
    "What are the main causes of the French Revolution?",
    "Describe the water cycle step by step.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I make a cup of green tea?",
    "Explain what a black hole is to a ten-year-old.",
    "List five healthy breakfast ideas.",
    "Why is the sky blue?",
    "Write a short story about a robot who learns to paint.",
    "What are the benefits of regular exercise?",
    "How does a computer store numbers in binary?",
    "Translate 'Good morning, how are you?' into Spanish and French.",
    "Explain the rules of chess briefly.",
    "What should I pack for a weekend camping trip?",
    "Describe the life cycle of a butterfly.",
    "What is machine learning? Give an example.",
    "Write a polite email asking my manager for a day off.",
    "How do vaccines help the immune system?",
    "What are the planets of the solar system, in order?",
    "Give me a recipe for a simple tomato pasta sauce.",
    "Explain the difference between weather and climate.",
    "What is the Pythagorean theorem and how is it used?",
    "Write a haiku about autumn leaves.",
    "How can I improve my sleep?",
    "Explain supply and demand with an example.",
    "What happened during the Apollo 11 mission?",
    "Describe how a bill becomes a law in the United States.",
    "What are some ways to reduce plastic waste at home?",
    "Write a limerick about a cat who loves cheese.",
    "How does the internet work, at a high level?",
    "What is the meaning of the word 'serendipity'? Use it in a sentence.",
]


def chat_tokens(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   tokenize=True)


def mode_config(mode: str, args, **kw):
    return h.mode_config(mode, page_size=args.page_size, group_size=args.group_size, **kw)


def make_engine(model, tok, spec, mode: str, args) -> Engine:
    cfg = mode_config(mode, args, max_batch=args.batch, prefill_chunk=512, memory_budget=args.budget << 30)
    return Engine(model, tok, spec, cfg, EngineHooks())


def bytes_per_token(spec, mode: str, args) -> int:
    """KV bytes per token of this mode (engine.memory's layout of the engine's own config)."""
    return layout_for(spec, mode_config(mode, args).kv).bytes_per_token


def generate(model, tok, spec, mode, prompts, args):
    eng = make_engine(model, tok, spec, mode, args)
    reqs = [Request(f"p{i}", p, SamplingParams(max_tokens=args.new)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    res = eng.generate(reqs)
    for r in res:
        assert r.ok, (mode, r.key, r.error_code, r.error_message)
    return res, time.perf_counter() - t0, eng.summary()


def agreement(ref: list[int], got: list[int], n: int) -> tuple[int, int, int]:
    """(equal positions, compared positions, first divergence) over the first n positions.

    Past its end a row has no token: positions where only one row has a token are
    mismatches; positions where neither has one are not compared. First divergence is
    the first position where the two differ, n if they never do (both stopped together
    or both reached n).
    """
    a = ref[:n] + [None] * (n - len(ref[:n]))
    b = got[:n] + [None] * (n - len(got[:n]))
    compared = [(x, y) for x, y in zip(a, b) if x is not None or y is not None]
    equal = sum(x == y for x, y in compared)
    first = next((i for i in range(n) if a[i] != b[i]), n)
    return equal, len(compared), first


def agreement_summary(refs: list[list[int]], outs: list[list[int]], n: int) -> dict:
    eq = cmp = identical = 0
    firsts = []
    for ref, out in zip(refs, outs):
        e, c, f = agreement(ref, out, n)
        eq, cmp = eq + e, cmp + c
        firsts.append(f)
        identical += ref[:n] == out[:n]
    return {"exact_match_fraction": eq / cmp, "compared_positions": cmp,
            "mean_first_divergence": sum(firsts) / len(firsts), "min_first_divergence": min(firsts),
            "identical_rows": identical, "rows": len(refs)}


def fmt_agreement(m: dict) -> str:
    return (f"exact match {m['exact_match_fraction']:.4f} of {m['compared_positions']} positions; mean first "
            f"divergence {m['mean_first_divergence']:.1f} (min {m['min_first_divergence']}); identical rows "
            f"{m['identical_rows']}/{m['rows']}")


def mlx_lm_greedy(model, prompt: list[int], kv_bits, group: int, n: int, eos: set) -> list[int]:
    """mlx-lm's own single-stream greedy generation (kv_bits with quantized_kv_start=0)."""
    kw = {"kv_bits": kv_bits, "kv_group_size": group, "quantized_kv_start": 0} if kv_bits else {}
    out = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, **kw):
        t = int(t)
        if t in eos:
            break
        out.append(t)
    return out


def add_args(ap) -> None:
    ap.add_argument("--model", default="smollm2", help=", ".join(h.MODEL_NAMES))
    ap.add_argument("--modes", default="q8,q4,k8v4,q4+rot,k8v4+rot")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--budget", type=int, default=8, help="GiB")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--free-running", action=argparse.BooleanOptionalAction, default=True,
                    help="also generate with each mode and compare outputs (secondary)")
    ap.add_argument("--base", default=None, help="reuse none's outputs from this earlier --out JSON")
    ap.add_argument("--floor-batch", type=int, default=0, help="batch of a second none run (noise floor); 0: skip")
    ap.add_argument("--mlx-lm-prompts", type=int, default=0, help="prompts for mlx-lm's own kv_bits path; 0: skip")


def run(args) -> dict:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        h.parse_kv(m)

    model, tok, spec = h.load(args.model)
    prompts = [chat_tokens(tok, p) for p in PROMPTS[: args.prompts]]
    settings = {"model": spec.name, "dtype": spec.dtype, "head_dim": spec.head_dim, "prompts": len(prompts),
                "new_tokens": args.new, "batch": args.batch, "page_size": args.page_size,
                "group_size": args.group_size}
    report = {**settings, "prompt_tokens": [len(p) for p in prompts], "modes": {}}

    if args.base:
        old = json.loads(Path(args.base).read_text())
        old = old.get("result", old)  # a harness record, or an older bare report
        if any(old.get(k) != v for k, v in settings.items()) or old["prompt_tokens"] != report["prompt_tokens"]:
            raise SystemExit(f"--base {args.base}: another model, prompts or settings")
        base_tokens, report["none"] = old["none_tokens"], {**old["none"], "from": args.base}
    else:
        base, t_base, _ = generate(model, tok, spec, "none", prompts, args)
        base_tokens = [r.tokens for r in base]
        report["none"] = {"seconds": t_base, "output_tokens": [len(t) for t in base_tokens],
                          "stopped_early": sum(len(t) < args.new for t in base_tokens)}
    report["none_tokens"] = base_tokens
    print(f"{spec.name} none: {sum(map(len, base_tokens))} tokens; {report['none']['stopped_early']} rows "
          f"stopped before {args.new}", flush=True)

    if args.floor_batch:  # float-noise floor: none again at another batch size (other BLAS blockings, same math)
        floor_args = argparse.Namespace(**{**vars(args), "batch": args.floor_batch})
        res, t_floor, _ = generate(model, tok, spec, "none", prompts, floor_args)
        report["none_floor"] = {**agreement_summary(base_tokens, [r.tokens for r in res], args.new),
                                "batch": args.floor_batch, "seconds": t_floor}
        print(f"none at batch {args.floor_batch} vs none at batch {args.batch} (float-noise floor): "
              f"{fmt_agreement(report['none_floor'])}; {t_floor:.0f}s", flush=True)

    # teacher-forced: none's outputs under every mode's cache (engine.scoring.compare, as the sweep report)
    rows = [ForcedRow(f"p{i}", p, t) for i, (p, t) in enumerate(zip(prompts, base_tokens))]
    t0 = time.perf_counter()
    engines = {m: make_engine(model, tok, spec, m, args) for m in modes}
    scored = compare(make_engine(model, tok, spec, "none", args), engines, rows)
    t_tf = time.perf_counter() - t0
    q8_bpt = bytes_per_token(spec, "q8", args)
    mode_tokens = {}
    for m in modes:
        tf = summarize(list(scored[m].values()))
        bpt = bytes_per_token(spec, m, args)
        summ = engines[m].summary()
        entry = {"kv_label": summ["kv_label"], "route": summ["route"], "kv_k_axis": summ["kv_k_axis"],
                 "kv_bytes_per_token": bpt, "bytes_vs_q8": bpt / q8_bpt,
                 "full_precision_slot_bytes": layout_for(spec, mode_config(m, args).kv).slot_bytes, **tf,
                 "tf_ppl_ratio": tf["tf_ppl"] / tf["tf_ppl_baseline"],
                 "tf_rows_detail": {k: vars(v) for k, v in scored[m].items()}}
        if args.free_running:
            res, t_gen, _ = generate(model, tok, spec, m, prompts, args)
            mode_tokens[m] = [r.tokens for r in res]
            entry["free_running"] = {**agreement_summary(base_tokens, mode_tokens[m], args.new),
                                     "seconds": t_gen}
        report["modes"][m] = entry
        fr = f"; free-running {fmt_agreement(entry['free_running'])}" if args.free_running else ""
        print(f"{m}: {bpt} B/token ({entry['bytes_vs_q8']:.3f}x q8); teacher-forced mean KL {tf['tf_kl_mean']:.2e} "
              f"(worst row {tf['tf_kl_row_max']:.2e}), top-1 {tf['tf_top1_agreement']:.4f}, ppl ratio "
              f"{entry['tf_ppl_ratio']:.4f} over {tf['tf_positions']} positions{fr}", flush=True)
    report["teacher_forced_seconds"] = t_tf

    # mlx-lm's own kv_bits path, single stream, on the first prompts: its agreement with itself
    if args.mlx_lm_prompts:
        eos = set(tok.eos_token_ids)
        sub = prompts[: args.mlx_lm_prompts]
        t0 = time.perf_counter()
        ref = [mlx_lm_greedy(model, p, None, args.group_size, args.new, eos) for p in sub]
        report["mlx_lm"] = {"prompts": len(sub),
                            "none_vs_kvbatch_none": agreement_summary(base_tokens[: len(sub)], ref, args.new)}
        print(f"mlx-lm none vs kvbatch none (first {len(sub)} prompts): "
              f"{fmt_agreement(report['mlx_lm']['none_vs_kvbatch_none'])}", flush=True)
        for mode, bits in (("q8", 8), ("q4", 4)):
            out = [mlx_lm_greedy(model, p, bits, args.group_size, args.new, eos) for p in sub]
            report["mlx_lm"][mode] = agreement_summary(ref, out, args.new)
            if mode in mode_tokens:
                report["mlx_lm"][f"kvbatch_{mode}_same_prompts"] = agreement_summary(
                    base_tokens[: len(sub)], mode_tokens[mode][: len(sub)], args.new)
            print(f"mlx-lm kv_bits={bits} vs mlx-lm none (first {len(sub)} prompts): "
                  f"{fmt_agreement(report['mlx_lm'][mode])}", flush=True)
        report["mlx_lm"]["seconds"] = time.perf_counter() - t0

    return report
