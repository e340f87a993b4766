"""The CPU decode attention's masked softmax (polynomial 2^x, compiled kernels) against MLX's precise softmax."""
import mlx.core as mx
import pytest

from kvbatch.engine import backend
from kvbatch.engine.kv.routes import softmax_cpu as softmax


def _reference(scores: mx.array, mask: mx.array) -> mx.array:
    s = mx.where(mask, scores.astype(mx.float32), mx.array(-mx.inf, mx.float32))
    return mx.softmax(s, axis=-1, precise=True)


@pytest.mark.parametrize("shape", [(1, 3, 3, 2112), (8, 2, 2, 37), (4, 1, 5, 1)])
def test_masked_softmax_matches_precise_softmax(shape):
    mx.random.seed(3)
    scores = mx.random.normal(shape) * 30  # large spreads: exp underflows for most keys
    mask = mx.random.uniform(shape=(shape[0], 1, 1, shape[-1])) < 0.7
    mask[..., 0] = True  # every row has a key (decode always attends to its own token)
    got, want = softmax.masked_softmax(scores, mask), _reference(scores, mask)
    assert got.dtype == mx.float32 and got.shape == shape
    assert mx.abs(got - want).max().item() < 1e-6
    assert mx.allclose(got.sum(-1), mx.ones(shape[:-1]), atol=1e-5).item()
    assert (mx.where(mask, 0.0, got) == 0).all().item()  # masked keys get exactly 0


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_masked_softmax_keeps_half_dtypes_and_computes_in_float32(dtype):
    scores = (mx.random.normal((2, 2, 3, 50)) * 20).astype(dtype)
    mask = mx.ones((2, 1, 1, 50), dtype=mx.bool_)
    got = softmax.masked_softmax(scores, mask)
    assert got.dtype == dtype
    assert mx.abs(got.astype(mx.float32) - _reference(scores, mask)).max().item() < 4e-3  # output rounding


def test_fused_kernel_is_the_one_used_on_the_cpu():
    """MLX builds the compiled kernel with the machine's C++ compiler; where that works (CI has one),
    decode must use it, not the slower eager fallback."""
    if not backend.on_cpu():
        pytest.skip("the fused softmax is the CPU route only")
    softmax.masked_softmax(mx.zeros((1, 1, 1, 4)), mx.ones((1, 1, 1, 4), dtype=mx.bool_))
    assert softmax._impl is softmax.softmax_fused


def test_masked_softmax_scale_and_keys_axis():
    """In-place decode scales inside the kernel and runs the softmax down a key-major axis."""
    mx.random.seed(5)
    scores = mx.random.normal((3, 2, 70, 4)) * 40  # (B, Hkv, T, G): keys on axis -2
    mask = (mx.arange(70)[None] < mx.array([70, 41, 5])[:, None]).reshape(3, 1, 70, 1)
    got = softmax.masked_softmax(scores, mask, axis=-2, scale=0.125)
    want = _reference(scores.swapaxes(-1, -2) * 0.125, mask.swapaxes(-1, -2)).swapaxes(-1, -2)
    assert mx.abs(got - want).max().item() < 1e-6
    assert (mx.where(mask, 0.0, got) == 0).all().item()
