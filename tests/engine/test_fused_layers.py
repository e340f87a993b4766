"""Llama layers in fewer kernels a pass (engine.options.fused_layers, engine/fused_layers.py).

On the CPU the fused forward composes its steps from MLX's ops (the option forced on): the rows get mlx-lm's
layers' tokens, the fused weights add no memory, a model it does not recognize or a layer whose weights were
replaced runs mlx-lm's forward. The CUDA kernels' own numbers (add + RMSNorm, RoPE with the heads' layout,
SwiGLU) are checked against MLX's ops on MLX CUDA; here their host side (RoPE's inverse frequencies) is checked
against mx.fast.rope, and their source compiles with nvcc.
"""
from __future__ import annotations

import shutil
from typing import Any
import subprocess

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kvbatch.engine import fused_layers
from kvbatch.engine.config import EngineOptions
from kvbatch.engine.engine import Engine
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.testing import engine_config
from kvbatch.engine.types import Request
from tests.conftest import ON_CUDA


def _requests(n: int = 10, max_tokens: int = 32) -> list[Request]:
    return [Request(f"r{i}", [(31 * i + 7 * j + 5) % 256 for j in range(3 + (11 * i) % 37)],
                    SamplingParams(max_tokens=max_tokens)) for i in range(n)]


def _tokens(m, fused: str, mode: str = "none", page: int = 16, **cfg) -> list[list[int]]:
    model, tok, spec = m
    eng = Engine(model, tok, spec, engine_config(kv_mode=mode, page_size=page, max_batch=8, memory_budget=2 << 30,
                                                options=EngineOptions(fused_layers=fused), **cfg))
    return [r.tokens for r in eng.generate(_requests())]


@pytest.fixture
def counted(monkeypatch):
    """How many fused add + RMSNorm calls ran (the fused forward makes two a layer)."""
    calls = [0]
    real = fused_layers._add_norm

    def add_norm(*a):
        calls[0] += 1
        return real(*a)

    monkeypatch.setattr(fused_layers, "_add_norm", add_norm)
    return calls


@pytest.mark.parametrize("mode,page", [("none", 16), ("q8", 16), ("none", 1)])
def test_fused_layers_give_the_tokens_of_mlx_lms_layers(tiny_model, counted, mode, page):
    m = tiny_model()
    plain = _tokens(m, "off", mode, page)
    assert counted[0] == 0 and not fused_layers.installed(m[0])
    fused = _tokens(m, "on", mode, page)
    assert fused_layers.installed(m[0]) and counted[0] > 0  # the fused forward ran
    assert fused == plain


def test_verification_windows_run_fused_with_the_same_tokens(tiny_model, counted):
    """Speculative passes (several tokens a row, each at its own position) through the fused forward."""
    m = tiny_model()
    spec = dict(method="ngram", num_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2, adaptive=False)
    plain = _tokens(m, "off", speculative=spec)
    fused = _tokens(m, "on", speculative=spec)
    assert counted[0] > 0 and fused == plain


def test_the_fused_weights_add_no_memory_and_keep_the_projections_values(tiny_model):
    model = tiny_model(num_layers=4)[0]
    fused_layers.uninstall(model)
    a = model.model.layers[1].self_attn
    before = np.array(a.k_proj.weight)
    mx.eval(model.parameters())
    mx.clear_cache()
    active = mx.get_active_memory()
    assert fused_layers.install(model)
    mx.clear_cache()
    layer_bytes = sum(v.nbytes for _, v in tree_flatten(model.model.layers[0].parameters()) if isinstance(v, mx.array))
    assert mx.get_active_memory() - active < layer_bytes  # at most a layer's while it is concatenated, none after
    assert np.array_equal(np.array(a.k_proj.weight), before)
    fused_layers.uninstall(model)
    assert not fused_layers.installed(model)


def test_models_and_layers_it_does_not_recognize_run_mlx_lms_forward(tiny_model, counted):
    qwen = tiny_model(family="qwen3")  # q/k norms: not a llama layer
    assert not fused_layers.install(qwen[0])
    assert _tokens(qwen, "on") == _tokens(qwen, "off") and counted[0] == 0
    m = tiny_model(num_layers=3)
    plain = _tokens(m, "off")
    model, tok, spec = m
    eng = Engine(model, tok, spec, engine_config(page_size=16, max_batch=8, memory_budget=2 << 30,
                                                options=EngineOptions(fused_layers="on")))
    assert fused_layers.installed(model)
    q = model.model.layers[2].self_attn.q_proj
    q.weight = mx.array(np.array(q.weight))  # reloaded weights: no longer the fused ones
    assert [r.tokens for r in eng.generate(_requests())] == plain and counted[0] == 0


def test_auto_fuses_on_mlx_cudas_own_route_only():
    assert fused_layers.wanted(EngineOptions()) == ON_CUDA
    assert not fused_layers.wanted(EngineOptions(route="portable"))
    assert fused_layers.wanted(EngineOptions(fused_layers="on")) and not fused_layers.wanted(
        EngineOptions(fused_layers="off"))


def _rope_by_kernel_math(x: np.ndarray, inv: np.ndarray, offsets: np.ndarray, traditional: bool) -> np.ndarray:
    """rope_split's arithmetic (float64 here): pairs rotated by (offset + position) * inverse frequency."""
    B, H, L, D = x.shape
    out = x.astype(np.float64).copy()
    half = D // 2
    i1 = np.arange(half) * 2 if traditional else np.arange(half)
    i2 = i1 + 1 if traditional else i1 + half
    for b in range(B):
        for pos in range(L):
            th = (offsets[b] + pos) * inv
            c, s = np.cos(th), np.sin(th)
            row = x[b, :, pos].astype(np.float64)  # (H, D)
            x1, x2 = row[:, i1], row[:, i2]
            out[b, :, pos][:, i1] = x1 * c - x2 * s  # basic indexing first: views of `out`
            out[b, :, pos][:, i2] = x1 * s + x2 * c
    return out


@pytest.mark.parametrize("traditional", [False, True])
def test_rope_inverse_frequencies_rotate_as_mlx_rope(traditional):
    from mlx_lm.models.rope_utils import Llama3RoPE

    x = np.random.default_rng(0).standard_normal((3, 2, 4, 64)).astype(np.float32)
    offsets = np.array([0, 7, 1000])
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    for rope in (nn.RoPE(64, traditional=traditional, base=100000.0, scale=0.5),
                 Llama3RoPE(64, traditional=traditional, base=500000.0, scaling_config=scaling)):
        inv = fused_layers._inverse_frequencies(rope, 64)
        assert inv is not None
        want = np.array(rope(mx.array(x), offset=mx.array(offsets)))  # pyright: ignore[reportArgumentType]
        got = _rope_by_kernel_math(x, inv.astype(np.float32).astype(np.float64), offsets, traditional)
        assert np.allclose(got, want, atol=2e-3), np.abs(got - want).max()
    assert fused_layers._inverse_frequencies(nn.RoPE(32), 64) is None  # a partial rotation is not fused


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit) to compile the kernels")
def test_the_fused_kernels_compile(tmp_path):
    from benchmarks.gpu.cuda_compile_check import STUB, TYPES, wrap

    src = [STUB]
    ins = {"add_norm": [("x", "T"), ("r", "T"), ("w", "T"), ("eps", "float")],
           "rope_split": [("qkv", "T"), ("offs", "int32_t"), ("inv", "float"), ("meta", "int32_t")],
           "swiglu": [("gu", "T"), ("meta", "int32_t")]}
    outs = {"add_norm": [("h", "T"), ("n", "T")], "rope_split": [("q", "T"), ("k", "T"), ("v", "T")],
            "swiglu": [("a", "T")]}
    consts = {"add_norm": dict(H=576), "rope_split": dict(HQ=9, HKV=3, D=64, L=1, TRAD=0), "swiglu": dict(I=1536)}
    for dt in ("bfloat16", "float32"):
        for name, (body, _, _) in fused_layers.KERNELS.items():
            T = TYPES[dt]
            params = [(n, T if t == "T" else t) for n, t in ins[name]]
            src.append(wrap(f"{name}_{dt}", params, [(n, T) for n, _ in outs[name]], dict(T=T, **consts[name]), body))
    path = tmp_path / "fused.cu"
    path.write_text("".join(src) + "}\n")
    r = subprocess.run(["nvcc", "-cuda", "-arch=sm_90", "-o", str(tmp_path / "fused.ii"), str(path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.skipif(not ON_CUDA, reason="the fused kernels run on MLX CUDA only")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_cuda_kernels_match_mlx_ops(dtype):
    rng = np.random.default_rng(1)
    tol = 2e-2 if dtype == mx.bfloat16 else 1e-4
    x, r = (mx.array(rng.standard_normal((5, 3, 576)).astype(np.float32)).astype(dtype) for _ in range(2))
    norm = nn.RMSNorm(576)
    norm.weight = mx.array(rng.standard_normal(576).astype(np.float32)).astype(dtype)
    h, n = fused_layers._add_norm(x, r, norm, True)
    assert mx.allclose(h, x + r, atol=tol).item()
    assert mx.allclose(n, mx.fast.rms_norm(x + r, norm.weight, norm.eps), atol=tol, rtol=tol).item()
    gu = mx.array(rng.standard_normal((4, 2, 2 * 96)).astype(np.float32)).astype(dtype)
    from mlx_lm.models.activations import swiglu

    p = fused_layers._Pass.of(4, 2, 0)
    assert mx.allclose(fused_layers._swiglu(gu, 96, p), swiglu(gu[..., :96], gu[..., 96:]), atol=tol).item()
    for traditional in (False, True):
        for L, offset in ((1, mx.array([0, 5, 300, 4095], dtype=mx.int32)), (3, mx.array([2, 9, 0, 70])), (2, 17)):
            B = 4
            rope: Any = nn.RoPE(64, traditional=traditional, base=100000.0)  # offsets: an int or one a row
            inv = fused_layers._inverse_frequencies(rope, 64)
            assert inv is not None
            f = fused_layers._Layer(mx.zeros((1, 1)), mx.zeros((1, 1)), 6, 2, 64, traditional,
                                    mx.array(inv.astype(np.float32)))
            qkv = mx.array(rng.standard_normal((B, L, 10 * 64)).astype(np.float32)).astype(dtype)
            q, k, v = fused_layers._rope_split(qkv, f, fused_layers._Pass.of(B, L, offset))
            heads = qkv.reshape(B, L, 10, 64).transpose(0, 2, 1, 3)
            assert mx.allclose(q, rope(heads[:, :6], offset=offset), atol=tol).item()
            assert mx.allclose(k, rope(heads[:, 6:8], offset=offset), atol=tol).item()
            assert mx.array_equal(v, heads[:, 8:]).item()


def test_the_option_is_checked():
    from kvbatch.engine.config import EngineConfig, EngineSettings
    from kvbatch.engine.errors import KvbatchConfigError

    bad = EngineConfig(engine=EngineSettings(options=EngineOptions(fused_layers="yes")))
    with pytest.raises(KvbatchConfigError, match="fused_layers"):
        bad.check()
