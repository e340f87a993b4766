"""What `action=score` costs against mlx-lm (issue 45): DPO-shaped rows (a shared system prompt, a question of
their own, a chosen and a rejected answer) scored by `kvbatch.score` (the whole job in process: queue, parts,
results.parquet; the completions of one prompt share its cached pages) and by mlx-lm the way one scores with it
today: one forward of the model over prompt + completion per pair, log-softmax, the completion's tokens summed.

Both sides hold the model before they are timed (kvbatch through the pipeline's model cache, warmed by one
call). Reported per round and as medians: pairs/s of each and kvbatch's ratio, the prompt tokens kvbatch took
from cached pages, and the largest difference of a pair's summed log-probability between the two sides (the
same model and tokens; MLX's CPU logsumexp, which the mlx-lm side uses, is itself ~2e-4 off per token over a
49k vocabulary, so the sums drift apart by ~1e-2 over long answers), and after the rounds the same difference
against a float64 log-softmax of mlx-lm's logits (the first 8 pairs, untimed: it must stay near float
rounding).

    python -m benchmarks job.score --model smollm2 --rows 64 --rounds 2
"""
from __future__ import annotations

import random
import statistics
import time

import mlx.core as mx

from benchmarks import harness as h
from benchmarks.job.job_vs_mlx_lm import WORDS

SMOKE = ["--model", "tiny", "--rows", "2", "--system-words", "4", "--words", "3", "--rounds", "1"]
COLUMNS = ["chosen", "rejected"]


def add_args(ap) -> None:
    ap.add_argument("--model", default="smollm2", help=", ".join(h.MODEL_NAMES))
    ap.add_argument("--kv", default="none")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--system-words", type=int, default=60, help="the system prompt every row shares")
    ap.add_argument("--words", type=int, default=40, help="words of each answer (chosen, rejected)")
    ap.add_argument("--rounds", type=int, default=2)


def _rows(a) -> list[dict]:
    rnd = random.Random(45)
    say = lambda n: " ".join(rnd.choice(WORDS) for _ in range(n))  # noqa: E731
    system = say(a.system_words)
    return [{"id": f"r{i}", "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": f"Question {i}: {say(8)}?"}],
             "chosen": " " + say(a.words), "rejected": " " + say(a.words)} for i in range(a.rows)]


def _mlx_lm(model, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """Each pair's summed log-probability of its completion: one forward over prompt + completion."""
    out = []
    for prompt, text in pairs:
        logits = model(mx.array([prompt + text]))[0, len(prompt) - 1:-1].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out.append(mx.take_along_axis(lp, mx.array(text)[:, None], axis=-1).sum())
        mx.eval(out[-1])
    return [float(x.item()) for x in out]


def _exact(model, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """The same sums with the log-softmax in float64 (numpy): the agreement check, not timed."""
    import numpy as np

    out = []
    for prompt, text in pairs:
        lg = np.asarray(model(mx.array([prompt + text]))[0, len(prompt) - 1:-1].astype(mx.float32), dtype=np.float64)
        top = lg.max(axis=-1, keepdims=True)
        lp = lg - top - np.log(np.exp(lg - top).sum(axis=-1, keepdims=True))
        out.append(float(lp[np.arange(len(text)), text].sum()))
    return out


def run(a) -> dict:
    import kvbatch
    from kvbatch.pipeline import model_cache

    cfg = h.model_config(a.model)
    opts = {"model.cache_dir": cfg.cache_dir} if cfg.cache_dir else {}
    rows = _rows(a)
    model_cache.enable(True)

    def score(which: list[dict]):
        return kvbatch.score(which, model=a.model, kv=a.kv, columns=COLUMNS, **opts).to_pylist()

    score(rows[:1])  # the model loads (and stays in the pipeline's cache)
    model, tok, _ = h.load(a.model)
    pairs = []
    for r in rows:
        prompt = tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
        ids = tok.encode(prompt, add_special_tokens=False)
        for c in COLUMNS:
            pairs.append((ids, tok.encode(prompt + r[c], add_special_tokens=False)[len(ids):]))
    _mlx_lm(model, pairs[:1])  # warm
    rounds = []
    for k in range(a.rounds):
        sides = {}
        for name in (("kvbatch", "mlx_lm") if k % 2 == 0 else ("mlx_lm", "kvbatch")):
            t0 = time.perf_counter()
            got = score(rows) if name == "kvbatch" else _mlx_lm(model, pairs)
            sides[name] = (time.perf_counter() - t0, got)
        kv_wall, res = sides["kvbatch"]
        ml_wall, ref = sides["mlx_lm"]
        assert all(r["error_code"] is None for r in res), [r["error_message"] for r in res if r["error_code"]]
        assert [r["output_token_ids"] for r in res] == [t for _, t in pairs], "the two sides scored other tokens"
        rounds.append({"kvbatch_s": kv_wall, "mlx_lm_s": ml_wall, "kvbatch_pairs_s": len(pairs) / kv_wall,
                       "mlx_lm_pairs_s": len(pairs) / ml_wall, "ratio": ml_wall / kv_wall,
                       "cached_prompt_tokens": sum(r["cached_tokens"] or 0 for r in res),
                       "prompt_tokens": sum(r["prompt_tokens"] for r in res),
                       "completion_tokens": sum(r["output_tokens"] for r in res),
                       "max_abs_diff_sum": max(abs(r["cumulative_logprob"] - x) for r, x in zip(res, ref))})
        print(f"round {k}: kvbatch {len(pairs) / kv_wall:.1f} pairs/s, mlx-lm {len(pairs) / ml_wall:.1f} pairs/s "
              f"({ml_wall / kv_wall:.2f}x); cached prompt tokens {rounds[-1]['cached_prompt_tokens']} of "
              f"{rounds[-1]['prompt_tokens']}; max |sum difference| {rounds[-1]['max_abs_diff_sum']:.2e}")
    med = statistics.median(r["ratio"] for r in rounds)
    n = min(len(pairs), 8)
    exact = max(abs(r["cumulative_logprob"] - x) for r, x in zip(res[:n], _exact(model, pairs[:n])))
    print(f"kvbatch.score against mlx-lm one forward per pair: median {med:.2f}x over {a.rounds} rounds "
          f"({len(pairs)} pairs, kv={a.kv}); max |sum difference| against a float64 log-softmax of mlx-lm's "
          f"logits (first {n} pairs): {exact:.2e}")
    return {"pairs": len(pairs), "rounds": rounds, "median_ratio": med, "max_abs_diff_sum_float64": exact}
