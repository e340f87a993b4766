"""Correctness of the paged engine on whatever MLX backend runs here (CPU, CUDA, Metal).

Teacher-forced logits of a batch through kvbatch vs mlx-lm single-stream references
(KVCache for kv=none, tests/kv_reference.QuantRefCache for q8/q4), for float32,
bfloat16 and float16 random llama/qwen3 models. Prints one line per case and exits
non-zero on a mismatch. Used on the lent GPU, where the pytest suite's fixtures
(SmolLM2 wheel, Hydra) are not installed.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402,F401
import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama, qwen3  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from engine.engine import Engine, EngineConfig  # noqa: E402
from engine.models.spec import model_spec  # noqa: E402
from engine.types import Request, SamplingParams  # noqa: E402
from tests.kv_reference import StoredPagesRefCache, record_page_tables, teacher_forced_logits  # noqa: E402


class _Tok:
    eos_token_ids: list[int] = []

    def decode(self, t):
        return ""


def build(family: str, head_dim: int, dtype):
    cfg = dict(model_type=family, hidden_size=256, num_hidden_layers=2, intermediate_size=512,
               num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, vocab_size=512,
               rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=10000.0)
    mod = llama if family == "llama" else qwen3
    mx.random.seed(0)
    m = mod.Model(mod.ModelArgs(**cfg))
    m.set_dtype(dtype)
    mx.eval(m.parameters())
    return m, model_spec(f"{family}-{head_dim}", m, cfg)


def check(family, head_dim, dtype, mode, page, tol) -> bool:
    m, spec = build(family, head_dim, dtype)
    bits = {"q8": 8, "q4": 4}.get(mode)
    chunk = 24
    eng = Engine(m, _Tok(), spec, EngineConfig(kv_mode=mode, page_size=page, max_batch=8, prefill_chunk=chunk,
                                               memory_budget=2 << 30, allow_unvalidated=True))
    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(8)]
    cont = [[(3 * i + 5 * j) % 500 + 1 for j in range(40)] for i in range(8)]
    tables = record_page_tables(eng.cache)
    res = eng.generate([Request(str(i), p, SamplingParams(max_tokens=40), forced_tokens=c, capture_logits=True)
                        for i, (p, c) in enumerate(zip(prompts, cont))])
    worst = 0.0
    for p, c, r in zip(prompts, cont, res):
        if r.error_code:
            print(f"FAIL {family} hd={head_dim} {dtype} {mode} page={page}: {r.error_code} {r.error_message}")
            return False
        mk = (lambda: [KVCache() for _ in m.layers]) if not bits else \
            (lambda: [StoredPagesRefCache(eng.cache.store, i, tables[r.key]) for i in range(len(m.layers))])
        ref = teacher_forced_logits(m, p, c, mk, chunk)
        worst = max(worst, max(float(mx.abs(a - b).max()) for a, b in zip(r.logits, ref)))
    ok = worst <= tol
    print(f"{'ok  ' if ok else 'FAIL'} {family} hd={head_dim} {str(dtype):14s} kv={mode:4s} page={page:3d} "
          f"max|dlogit|={worst:.2e} route={eng.summary()['route']} growths={len(eng.summary()['growth_events'])}",
          flush=True)
    return ok


def main() -> int:
    print("device:", mx.default_device(), "mlx", mx.__version__, flush=True)
    ok = True
    for family, hd in (("llama", 64), ("llama", 128), ("qwen3", 128)):
        for mode in ("none", "q8", "q4"):
            for page in (16, 64):
                ok &= check(family, hd, mx.float32, mode, page, 1e-4 if mx.default_device() == mx.cpu else 1e-2)
    for dtype in (mx.bfloat16, mx.float16):
        for mode in ("none", "q8", "q4"):
            ok &= check("llama", 64, dtype, mode, 16, 0.15)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
