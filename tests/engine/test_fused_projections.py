"""Fused q/k/v and gate/up projections (engine/models/fused_projections.py): the separate matmuls' numbers (to
float rounding: a BLAS may pick another kernel for the wider matrix), the same parameters, the same tokens
through the engine, and which groups are left apart."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from kvbatch.engine import Engine
from kvbatch.engine.config import EngineOptions
from kvbatch.engine.lora import RowLoRALinear, Selection
from kvbatch.engine.mlx_lm_bridge import as_shipped, prepare_model
from kvbatch.engine.models import fused_projections as fp
from kvbatch.engine.testing import engine_config
from kvbatch.engine.types import Request, SamplingParams
from tests.conftest import cpu_only


def _params(model) -> dict:
    return dict(tree_flatten(model.parameters()))


def _bytes(model) -> int:
    return sum(v.nbytes for v in _params(model).values())


@cpu_only
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_model_gives_the_separate_matmuls_bits_and_undoes(tiny_model, family, dtype):
    model, _, _ = tiny_model(family=family, num_layers=2, dtype=dtype)
    as_shipped(model)
    x = mx.array([[5, 7, 9, 11, 200], [1, 2, 3, 4, 5]])
    want, names, size = model(x), sorted(_params(model)), _bytes(model)
    assert fp.install(model) == 4 and fp.install(model) == 4  # q/k/v and gate/up of 2 layers, once
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, fp.Part) and isinstance(attn.fused_qkv, fp.FusedGroup)
    assert not any(n.endswith(("q_proj.weight", "up_proj.weight")) for n in _params(model))
    assert _bytes(model) == size  # the group's arrays replace the projections', counted once
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    assert mx.allclose(model(x), want, **tol).item()
    fp.uninstall(model)
    assert sorted(_params(model)) == names and mx.array_equal(model(x), want).item()
    prepare_model(model, EngineOptions())  # the engine's default, as other tests expect: apart on the CPU
    assert isinstance(attn.q_proj, nn.Linear)


@cpu_only
def test_a_part_called_alone_or_twice_or_on_another_input_computes_its_own(tiny_model):
    model, _, _ = tiny_model(family="llama", num_layers=2)
    as_shipped(model)
    attn = model.model.layers[1].self_attn
    sep = [attn.q_proj, attn.k_proj, attn.v_proj]
    a = mx.random.normal((2, 3, model.args.hidden_size), key=mx.random.key(0))
    b = mx.random.normal((2, 3, model.args.hidden_size), key=mx.random.key(1))
    want = {(i, n): m(x) for i, m in enumerate(sep) for n, x in (("a", a), ("b", b))}
    fp.install(model)
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    calls = [(1, "a"), (1, "a"), (0, "b"), (2, "a"), (1, "b"), (0, "a"), (2, "b"), (2, "b")]
    for i, n in calls:
        assert mx.allclose(parts[i](a if n == "a" else b), want[(i, n)], rtol=1e-5, atol=1e-6).item(), (i, n)
    prepare_model(model, EngineOptions())


def test_only_groups_of_one_plain_kind_are_fused():
    holder = nn.Module()
    holder.q_proj, holder.k_proj, holder.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4, bias=False)
    holder.gate_proj, holder.up_proj = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False)
    assert fp.install(holder) == 1  # q/k/v differ in bias: left apart; gate/up fused
    assert isinstance(holder.q_proj, nn.Linear) and isinstance(holder.gate_proj, fp.Part)
    quant = nn.Module()
    quant.gate_proj, quant.up_proj = nn.Linear(64, 32, bias=False), nn.Linear(64, 32, bias=False)
    nn.quantize(quant, group_size=32, bits=4)
    x = mx.random.normal((3, 64), key=mx.random.key(2))
    want = (quant.gate_proj(x), quant.up_proj(x))
    assert fp.install(quant) == 1 and isinstance(quant.fused_gate_up.layer, nn.QuantizedLinear)
    got = (quant.gate_proj(x), quant.up_proj(x))
    assert all(mx.allclose(g, w, rtol=1e-5, atol=1e-6).item() for g, w in zip(got, want))
    lora = nn.Module()
    lora.gate_proj = RowLoRALinear(nn.Linear(8, 16, bias=False), mx.zeros((2, 8, 2)), mx.zeros((2, 2, 16)),
                                   mx.ones((2,)), Selection())
    lora.up_proj = nn.Linear(8, 16, bias=False)
    assert fp.install(lora) == 0 and not isinstance(lora.up_proj, fp.Part)  # an adapter's projection stays its own


def _tokens(model, tok, spec, fuse: bool, kv_mode: str) -> list[list[int]]:
    eng = Engine(model, tok, spec, engine_config(kv_mode, page_size=16, max_batch=4, allow_unvalidated=True,
                                                 options=EngineOptions(fuse_projections="on" if fuse else "off")))
    prompts = [list(range(10, 10 + n)) for n in (5, 23, 40, 9)]
    reqs = [Request(str(i), p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    return [r.tokens for r in sorted(eng.generate(reqs), key=lambda r: int(r.key))]


@cpu_only
@pytest.mark.parametrize("kv_mode", ["none", "q8"])
def test_engine_tokens_are_the_same_with_and_without_fusion(tiny_model, kv_mode):
    """Greedy tokens of a random model are the same (its margins are far wider than a matmul's rounding); the
    CPU's default leaves the projections apart, the option fuses them."""
    model, tok, spec = tiny_model(family="qwen3", num_layers=2)
    off = _tokens(model, tok, spec, False, kv_mode)
    assert not isinstance(model.model.layers[0].self_attn.q_proj, fp.Part)
    on = _tokens(model, tok, spec, True, kv_mode)
    assert isinstance(model.model.layers[0].self_attn.q_proj, fp.Part)
    assert on == off and all(len(t) == 24 for t in on)
