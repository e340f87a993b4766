"""KV quantization quality on SmolLM2-135M-Instruct (issue 5): q8 / q4 against kv=none.

For >= 32 varied chat prompts, greedy, up to 256 new tokens:

1. kv=none generates (EOS ends a row, as in real use) and keeps every step's logits.
2. kv=q8 and kv=q4 generate the same way. Token agreement with none over the first
   256 positions, two ways:
   - exact-match fraction: positions i < 256 where both outputs have a token and the
     tokens are equal, over the positions where either output has one (a row that
     stops early or runs on counts as mismatches for the missing tokens);
   - first divergence: the first position where the outputs differ (a row that has
     stopped differs from one that goes on), 256 if they never do; mean over prompts,
     and how many prompts are identical throughout.
3. kv=q8 and kv=q4 teacher-forced on none's output (EngineHooks.force:
   teacher forcing and logit capture): mean KL(p_none || p_mode) of the next-token distributions over all
   positions (and the max over rows of the per-row mean), plus the top-1 agreement of
   the two distributions at every position.
4. Calibration: the same agreement for kv=none run again at another batch size (same
   math, other float rounding: the floor that greedy divergence alone produces), and
   for mlx-lm's own single-stream kv_bits=8/4 path (quantized_kv_start=0) against its
   own unquantized run, on the first --mlx-lm-prompts prompts.

    flock /tmp/kvbatch-bench.lock .venv/bin/python benchmarks/kv_quality.py --out /tmp/kv_quality.json
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvbatch.engine  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from kvbatch.engine.engine import Engine  # noqa: E402
from kvbatch.engine.hooks import EngineHooks  # noqa: E402
from tests.configs import engine_config  # noqa: E402
from kvbatch.engine.models.config import ModelConfig  # noqa: E402
from kvbatch.engine.models.load import load_model  # noqa: E402
from kvbatch.engine.types import Request, SamplingParams  # noqa: E402

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


def make_engine(model, tok, spec, mode: str, args) -> Engine:
    cfg = engine_config(kv_mode=mode, page_size=args.page_size, group_size=args.group_size,
                        max_batch=args.batch, prefill_chunk=512, memory_budget=args.budget << 30)
    return Engine(model, tok, spec, cfg, EngineHooks())


def generate(model, tok, spec, mode, prompts, args, capture=False):
    eng = make_engine(model, tok, spec, mode, args)
    reqs = [Request(f"p{i}", p, SamplingParams(max_tokens=args.new)) for i, p in enumerate(prompts)]
    if capture:
        eng.hooks.capture_logits.update(r.key for r in reqs)
    t0 = time.perf_counter()
    res = eng.generate(reqs)
    for r in res:
        assert r.ok, (mode, r.key, r.error_code, r.error_message)
    return res, eng.hooks.logits, time.perf_counter() - t0, eng.summary()


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


def log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--budget", type=int, default=8, help="GiB")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--floor-batch", type=int, default=5, help="batch of the second none run (noise floor)")
    ap.add_argument("--mlx-lm-prompts", type=int, default=12, help="prompts for mlx-lm's own kv_bits path")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    model, tok, spec = load_model(ModelConfig(source="smollm2"))
    prompts = [chat_tokens(tok, p) for p in PROMPTS[: args.prompts]]
    report = {"model": spec.name, "dtype": spec.dtype, "prompts": len(prompts), "new_tokens": args.new,
              "batch": args.batch, "page_size": args.page_size, "group_size": args.group_size,
              "prompt_tokens": [len(p) for p in prompts], "modes": {}}

    base, base_logits, t_base, _ = generate(model, tok, spec, "none", prompts, args, capture=True)
    base_tokens = [r.tokens for r in base]
    # log p_none at each position of the none output, float32, one (positions, vocab) array per row
    base_logp = []
    for r in base:
        lp = log_softmax(mx.stack(base_logits[r.key][: len(r.tokens)])) if r.tokens else None
        if lp is not None:
            mx.eval(lp)
        base_logp.append(lp)
    del base, base_logits
    report["none"] = {"seconds": t_base, "output_tokens": [len(t) for t in base_tokens],
                      "stopped_early": sum(len(t) < args.new for t in base_tokens)}
    print(f"none: {sum(map(len, base_tokens))} tokens in {t_base:.1f}s; "
          f"{report['none']['stopped_early']} rows stopped before {args.new}", flush=True)

    # float-noise floor: none again at another batch size (other BLAS blockings, same math)
    floor_args = argparse.Namespace(**{**vars(args), "batch": args.floor_batch})
    res, _, t_floor, _ = generate(model, tok, spec, "none", prompts, floor_args)
    report["none_floor"] = {**agreement_summary(base_tokens, [r.tokens for r in res], args.new),
                            "batch": args.floor_batch, "seconds": t_floor}
    print(f"none at batch {args.floor_batch} vs none at batch {args.batch} (float-noise floor): "
          f"{fmt_agreement(report['none_floor'])}; {t_floor:.0f}s", flush=True)

    mode_tokens = {}
    for mode in ("q8", "q4"):
        res, _, t_gen, summ = generate(model, tok, spec, mode, prompts, args)
        mode_tokens[mode] = [r.tokens for r in res]
        # teacher-forced on none's output
        eng = make_engine(model, tok, spec, mode, args)
        reqs = [Request(f"p{i}", p, SamplingParams(max_tokens=len(t)))
                for i, (p, t) in enumerate(zip(prompts, base_tokens)) if t]
        for req in reqs:
            eng.hooks.force(req.key, base_tokens[int(req.key[1:])])
            eng.add(req)
        t0 = time.perf_counter()
        kl_sum = n_pos = top1 = 0
        row_means = []
        for r in eng.run():
            i = int(r.key[1:])
            logits = eng.hooks.logits.pop(r.key)
            assert r.ok and len(logits) == len(base_tokens[i]), (r.key, r.error_code)
            lp = base_logp[i]
            lq = log_softmax(mx.stack(logits))
            kl = (mx.exp(lp) * (lp - lq)).sum(axis=-1)  # (positions,)
            same = (mx.argmax(lp, axis=-1) == mx.argmax(lq, axis=-1)).sum()
            mx.eval(kl, same)
            kl_sum += kl.sum().item()
            n_pos += kl.size
            top1 += same.item()
            row_means.append(kl.mean().item())
        t_tf = time.perf_counter() - t0
        m = {**agreement_summary(base_tokens, [r.tokens for r in res], args.new),
             "mean_kl_teacher_forced": kl_sum / n_pos, "max_row_mean_kl": max(row_means),
             "teacher_forced_top1_agreement": top1 / n_pos, "teacher_forced_positions": n_pos,
             "generate_seconds": t_gen, "teacher_forced_seconds": t_tf,
             "kv_bytes_per_token": summ["kv_bytes_per_token"], "route": summ["route"]}
        report["modes"][mode] = m
        print(f"{mode}: {fmt_agreement(m)}; mean KL {m['mean_kl_teacher_forced']:.2e} nats "
              f"(worst row {m['max_row_mean_kl']:.2e}); teacher-forced top-1 agreement "
              f"{m['teacher_forced_top1_agreement']:.4f}; {t_gen:.0f}s + {t_tf:.0f}s", flush=True)

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
            report["mlx_lm"][f"kvbatch_{mode}_same_prompts"] = agreement_summary(
                base_tokens[: len(sub)], mode_tokens[mode][: len(sub)], args.new)
            print(f"mlx-lm kv_bits={bits} vs mlx-lm none (first {len(sub)} prompts): "
                  f"{fmt_agreement(report['mlx_lm'][mode])}  | kvbatch {mode} on the same prompts: "
                  f"{fmt_agreement(report['mlx_lm'][f'kvbatch_{mode}_same_prompts'])}", flush=True)
        report["mlx_lm"]["seconds"] = time.perf_counter() - t0

    report["env"] = {"python": platform.python_version(), "mlx": mx.__version__,
                     "mlx_lm": __import__("mlx_lm").__version__, "machine": platform.machine(),
                     "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                              text=True).stdout.strip()}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
