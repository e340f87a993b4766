"""LoRA adapters (issue 45) on the tiny random llama: `model.adapter_path` gives mlx-lm's logits with that adapter
loaded; per-row adapters (`model.adapters`) decode two adapters and the base model in one batch as each runs
alone, each row's logits those of mlx-lm with its adapter; an unknown adapter is the row's invalid_input; the
prefix cache never hands one adapter's pages to another; the adapters' weights count in the model's bytes."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kvbatch.engine.engine import Engine
from kvbatch.engine.errors import INVALID_INPUT
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.load import load_model
from kvbatch.engine.models.sources import resolve_model_dir
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.testing import engine_config, write_random_adapter
from kvbatch.engine.types import Request
from tests.engine.kv_reference import teacher_forced_logits

PROMPT = [256, *b"Tell me a story about adapters"]  # 31 tokens: 3 full pages of 8 and a partial one
CONT = list(b" once upon a time")


@pytest.fixture(scope="module")
def setup(model_cache_dir, tmp_path_factory):
    """(tiny ModelConfig, adapter folders a and b, the tiny model's folder)."""
    cfg = ModelConfig(source="tiny", name="tiny", cache_dir=str(model_cache_dir))
    base = load_model(cfg)
    tmp = tmp_path_factory.mktemp("adapters")
    a = write_random_adapter(tmp / "a", base[0], seed=1)
    b = write_random_adapter(tmp / "b", base[0], seed=2, rank=8, scale=1.0, keys=("self_attn.k_proj", "mlp.up_proj"))
    return cfg, {"a": str(a), "b": str(b)}, resolve_model_dir(cfg), base


def _reference(model_dir, adapter, tokens=CONT) -> list[mx.array]:
    """mlx-lm's own single-stream logits with that adapter loaded (None: the base model)."""
    model, _ = mlx_lm.load(str(model_dir), adapter_path=adapter)
    return teacher_forced_logits(model, PROMPT, tokens, lambda: make_prompt_cache(model))


def _engine(m, hooks=None, max_batch=8):
    model, tok, spec = m
    return Engine(model, tok, spec, engine_config(memory_budget=1 << 30, page_size=8, max_batch=max_batch), hooks)


def _forced_logits(m, keys_adapters: dict[str, object]) -> dict[str, list[mx.array]]:
    hooks = EngineHooks()
    for key in keys_adapters:
        hooks.force(key, CONT)
    _engine(m, hooks).generate([Request(k, PROMPT, SamplingParams(max_tokens=64), adapter=a)  # type: ignore[arg-type]
                                for k, a in keys_adapters.items()])
    return hooks.logits


def _close(got: list[mx.array], want: list[mx.array]) -> float:
    assert len(got) == len(want)
    return max(float(mx.abs(g - w).max()) for g, w in zip(got, want))


def test_job_adapter_gives_mlx_lm_logits_with_it_loaded(setup):
    cfg, folders, model_dir, base = setup
    from dataclasses import replace

    m = load_model(replace(cfg, adapter_path=folders["a"]))
    got = _forced_logits(m, {"r": None})["r"]
    want = _reference(model_dir, folders["a"])
    assert _close(got, want) < 1e-4
    assert _close(got, _reference(model_dir, None)) > 1e-2  # the adapter changes the model
    assert m[2].weights_bytes > base[2].weights_bytes  # its weights are priced


def test_two_adapters_and_the_base_in_one_batch_equal_each_alone(setup):
    cfg, folders, model_dir, base = setup
    from dataclasses import replace

    m = load_model(replace(cfg, adapters=folders))
    from kvbatch.engine import lora

    found = lora.of(m[0])
    assert found is not None and m[2].weights_bytes == base[2].weights_bytes + found.nbytes
    logits = _forced_logits(m, {"ra": "a", "rb": "b", "base": None})
    for key, adapter in (("ra", folders["a"]), ("rb", folders["b"]), ("base", None)):
        assert _close(logits[key], _reference(model_dir, adapter)) < 1e-4, key
    # greedy and sampled (one seed: only the logits differ), the three in one batch with an unknown adapter
    # beside them give each one's tokens alone
    reqs = [Request(f"{t}{k}", PROMPT, SamplingParams(max_tokens=12, temperature=t, seed=3), adapter=k)
            for k in ("a", "b", None) for t in (0.0, 1.0)]
    mixed = {r.key: r for r in _engine(m).generate(reqs + [Request("bad", PROMPT, adapter="c")])}
    assert mixed["bad"].error_code == INVALID_INPUT and "'c' is not one of model.adapters (a, b)" in \
        str(mixed["bad"].error_message)
    alone = {r.key: _engine(m).generate([r])[0] for r in reqs}
    assert all(mixed[k].tokens == alone[k].tokens and mixed[k].ok for k in alone)
    # each adapter moves the logits (the tiny model's are near-uniform, so its tokens need not move)
    assert min(_close(logits["ra"], logits["base"]), _close(logits["rb"], logits["base"]),
               _close(logits["ra"], logits["rb"])) > 1e-2


def test_prefix_cache_keeps_each_adapters_pages_apart(setup):
    cfg, folders, _, _ = setup
    from dataclasses import replace

    m = load_model(replace(cfg, adapters=folders))
    rows = [Request(k, PROMPT, SamplingParams(max_tokens=4), adapter=a)
            for k, a in (("a1", "a"), ("b1", "b"), ("base", None), ("a2", "a"))]
    got = {r.key: r for r in _engine(m).generate(rows)}
    # a2 takes a1's full pages (or waits for them), b1 and base compute their own
    assert [got[k].stats.cached_tokens for k in ("a1", "b1", "base", "a2")] == [0, 0, 0, 24]
    assert got["a2"].tokens == got["a1"].tokens
