"""RoPE from a per-step table (engine/kv/routes/rope_cpu.py) against MLX's fast.rope, and in the engine."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import pytest

from kvbatch.engine.kv.routes import rope_cpu as rope
from tests.conftest import cpu_only


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims,head_dim", [(64, 64), (32, 64)])
def test_table_rope_is_bit_identical_to_mlx(traditional, dims, head_dim):
    inner = nn.RoPE(dims, traditional=traditional, base=500000.0)
    holder = nn.Module()
    holder.rope = inner
    assert rope.install(holder) == 1 and isinstance(holder.rope, rope.TableRoPE)
    assert rope.install(holder) == 1 and holder.rope.inner is inner  # idempotent
    x = mx.random.normal((5, 3, 1, head_dim))
    offsets = mx.array([0, 7, 300, 4095, 12])
    for offset in (offsets, 37, offsets + 1):  # per-row offsets; one int; the next step
        want = inner(x, offset=offset)
        got = holder.rope(x, offset=offset)
        assert mx.array_equal(got, want).item(), (offset, mx.abs(got - want).max().item())
    prefill = mx.random.normal((2, 3, 6, head_dim))  # several tokens: MLX's kernel
    assert mx.array_equal(holder.rope(prefill, offset=3), inner(prefill, offset=3)).item()
    rope.uninstall(holder)
    assert holder.rope is inner


def test_layers_share_one_table_per_step():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.rope = nn.RoPE(64, base=10000.0)

    model = nn.Module()
    model.layers = [Layer() for _ in range(3)]
    model.other = Layer()
    model.other.rope = nn.RoPE(64, base=99.0)  # another configuration: its own table
    assert rope.install(model) == 4
    tables = {id(m.rope._tables) for m in model.layers}
    assert len(tables) == 1 and id(model.other.rope._tables) not in tables


@cpu_only
def test_engine_installs_it_on_the_cpu(tiny_model):
    from kvbatch.engine.engine import Engine
    from kvbatch.engine.testing import engine_config

    model, tok, spec = tiny_model(family="llama", head_dim=64)
    Engine(model, tok, spec, engine_config(memory_budget=1 << 30))
    assert all(isinstance(layer.self_attn.rope, rope.TableRoPE) for layer in model.model.layers)
