"""The CPU SwiGLU (engine/kv/routes/swiglu_cpu.py) against mlx-lm's, and which MLPs it wraps."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

from kvbatch.engine.config import EngineOptions
from kvbatch.engine.mlx_lm_bridge import as_shipped, prepare_model
from kvbatch.engine.kv.routes import swiglu_cpu
from tests.conftest import cpu_only


@cpu_only
def test_swiglu_matches_mlx_lm_over_the_float32_range():
    """Within float32 rounding of mlx-lm's silu(gate) * up, from the gates where e^-x overflows
    (-100) or vanishes (+100) through zero, and on the shapes decode and prefill pass."""
    gate = mx.concatenate([mx.linspace(-100, 100, 20001), mx.array([0.0, -0.0, 1e-30, -88.5, 88.5])])
    up = mx.random.normal(gate.shape, key=mx.random.key(3))
    want, got = mlx_lm_swiglu(gate, up), swiglu_cpu.swiglu(gate, up)
    assert mx.isfinite(got).all().item()
    assert mx.allclose(got, want, rtol=2e-6, atol=1e-30).item(), mx.abs(got - want).max().item()
    for shape in [(64, 1, 1536), (3, 17, 40)]:
        g, u = mx.random.normal(shape, key=mx.random.key(1)) * 4, mx.random.normal(shape, key=mx.random.key(2))
        assert mx.allclose(swiglu_cpu.swiglu(g, u), mlx_lm_swiglu(g, u), rtol=2e-6, atol=1e-7).item()


@cpu_only
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_wraps_plain_swiglu_mlps_and_the_option_turns_it_off(tiny_model, family):
    model, _, _ = tiny_model(family=family, num_layers=2)
    x = mx.random.normal((2, 5, model.args.hidden_size), key=mx.random.key(0))
    as_shipped(model)
    mlps = [layer.mlp for layer in model.model.layers]
    want = [m(x) for m in mlps]
    prepare_model(model, EngineOptions(cpu_swiglu=True))
    wrapped = [layer.mlp for layer in model.model.layers]
    assert all(isinstance(w, swiglu_cpu.SwiGLUMLP) and w.inner is m for w, m in zip(wrapped, mlps))
    assert all(mx.allclose(w(x), y, rtol=1e-5, atol=1e-6).item() for w, y in zip(wrapped, want))
    prepare_model(model, EngineOptions(cpu_swiglu=False))
    assert [layer.mlp for layer in model.model.layers] == mlps
    prepare_model(model, EngineOptions())  # the engine's default, as other tests expect


def test_an_mlp_that_is_not_mlx_lms_plain_swiglu_is_left_alone():
    class GeluMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)

        def __call__(self, x):
            return self.down_proj(nn.gelu(self.gate_proj(x)) * self.up_proj(x))

    holder = nn.Module()
    holder.mlp = GeluMLP()
    assert swiglu_cpu.install(holder) == 0 and isinstance(holder.mlp, GeluMLP)
