"""What `engine.options.dispatch_layers` buys a pass the host waits for: decode wall of verification passes
(n-gram, fixed) or step-by-step decode steps with the pass handed to the device every N layers, against the
whole pass at its end.

A pass's time is the host building its graph, then the device running it, when nothing else overlaps them.
The host-bound regime is where a GPU runs a small model at a large batch (SmolLM2 at 1,024 rows on the H200).
This CPU stand-in is a random model of many thin layers at a large batch: the host's graph building is a
fair share of a pass, and MLX's CPU stream runs the layers handed over on a thread of its own, while the
host builds the next ones. Each setting is an engine of its own in this process, rounds alternate, every
row's tokens are compared.

    python -m benchmarks dispatch --rows 1024 --layers 30 --width 64 --settings 0,4 --rounds 2
"""
from __future__ import annotations

import hashlib
import json
import random
import time

SMOKE = ["--rows", "8", "--layers", "2", "--new", "4", "--rounds", "1"]


def add_args(ap) -> None:
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--width", type=int, default=64, help="hidden size (heads of 64)")
    ap.add_argument("--new", type=int, default=48, help="tokens each row generates")
    ap.add_argument("--prompt-tokens", default="20-60", help="each row's prompt length, drawn from MIN-MAX")
    ap.add_argument("--settings", default="0,4", help="dispatch_layers values compared")
    ap.add_argument("--spec", default="ngram", help="speculative.method (fixed), or none: step-by-step decode")
    ap.add_argument("--rounds", type=int, default=2)


def _model(layers: int, width: int):
    import mlx.core as mx
    from mlx_lm.models import llama

    from kvbatch.engine.models.spec import model_spec

    args = dict(hidden_size=width, num_hidden_layers=layers, intermediate_size=2 * width,
                num_attention_heads=max(1, width // 64), num_key_value_heads=1, head_dim=64, vocab_size=512,
                rope_theta=10000.0, tie_word_embeddings=True)
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, max_position_embeddings=131072,
                                        **args))
    mx.eval(model.parameters())
    return model, model_spec("thin-random", model, dict(args, model_type="llama", max_position_embeddings=131072))


def _side(model, spec, a, n: int) -> dict:
    from benchmarks import harness as h

    rng = random.Random(0)
    lo, hi = (int(x) for x in a.prompt_tokens.split("-"))
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(a.rows)]
    _, opts = h.parse_mode(f"none@dispatch_layers={n}")
    speculative = {"method": a.spec, "adaptive": False} if a.spec != "none" else None
    eng = h.engine(model, h.NoEos(), spec, "none", options=opts, page_size=16, max_batch=a.rows,
                   prefill_chunk=1 << 16, memory_budget=int(8e9), allow_unvalidated=True, speculative=speculative)
    for r in h.requests(prompts, a.new):
        eng.add(r)
    results, wall, steps = [], 0.0, 0
    while eng.has_unfinished():
        decoding = not any(row.prefilling for row in eng.scheduler.running) and not eng.scheduler.waiting
        t = time.perf_counter()
        results += eng.step()
        if decoding:
            wall += time.perf_counter() - t
            steps += 1
    tokens = [r.tokens for r in sorted(results, key=lambda r: int(r.key))]
    return {"dispatch_layers": n, "decode_s": wall, "steps": steps, "ms_per_step": wall / max(steps, 1) * 1e3,
            "tokens_sha": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]}


def run(a) -> dict:
    from benchmarks import harness as h

    model, spec = _model(a.layers, a.width)
    settings = [int(x) for x in a.settings.split(",")]
    runs = h.alternate({f"dispatch_{n}": (lambda n=n: _side(model, spec, a, n)) for n in settings}, a.rounds)
    out: dict = {"rows": a.rows, "layers": a.layers, "width": a.width, "new": a.new, "spec": a.spec,
                 "prompt_tokens": a.prompt_tokens}
    for name, rs in runs.items():
        out[name] = h.median_run(rs, "ms_per_step")
    base = f"dispatch_{settings[0]}"
    for name, rs in runs.items():
        if name != base:
            out[f"{base}_over_{name}"] = [b["ms_per_step"] / x["ms_per_step"] for b, x in zip(runs[base], rs)]
    out["same_tokens"] = len({r["tokens_sha"] for rs in runs.values() for r in rs}) == 1
    return out
