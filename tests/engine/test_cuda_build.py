"""The fused CUDA kernels compiled by NVRTC as the engine compiles them (routes/cuda_build.py), without a GPU.

NVRTC and the CUDA headers come from the nvidia-cuda-nvrtc / -runtime / -cccl wheels of the test extra: every kernel
kind the engine launches compiles to a cubin for an H100/H200 (sm_90a), and the disk cache gives a later process
the same binary without compiling again. The launches themselves run on MLX CUDA only
(tests/engine/test_cuda_kernel_write.py and the q8/q4 tests there).
"""
from __future__ import annotations

import mlx.core as mx
import pytest

from kvbatch.engine.kv.routes import cuda_build as cb
from kvbatch.engine.kv.routes import cuda_kernels as ca

LIB = cb.nvrtc_library()
needs_nvrtc = pytest.mark.skipif(LIB is None, reason="needs NVRTC (the nvidia-cuda-nvrtc wheel of the test extra)")

T = mx.bfloat16
_TYPES = {"q": T, "k": T, "v": T, "kn": T, "vn": T, "tk": T, "tv": T, "ks": T, "kb": T, "vs": T, "vb": T, "a": T,
          "kw": mx.uint32, "vw": mx.uint32, "scale": mx.float32, "pm": mx.float32, "pl": mx.float32,
          "pacc": mx.float32}
# Llama-1B's decode (64-element heads, 4 query heads a KV head, 64-token pages), q8 in groups of 64
_TEMPLATE = [("T", T), ("S", T), ("D", 64), ("P", 64), ("REP", 4), ("HKV", 8), ("NW", 4), ("LPT", 8), ("NE", 8),
             ("U", 4), ("KBITS", 8), ("VBITS", 8), ("GS", 64), ("QL", 1)]
_KINDS = [("dense", True), ("quant", True), ("mma_decode_bf16", True), ("mma_quant_bf16", True), ("reduce", False),
          ("seal", False), ("mma_window_bf16", False)]


def _text(kind: str, split: bool, new_kv: bool) -> tuple[str, str]:
    kb = ca._kernel(kind, split, new_kv)
    window = [("NL", 1), ("QC", 1), ("NQC", 1)] if kind.startswith(("mma", "reduce")) else []
    if kind.startswith("mma_window"):
        window = [("NL", 4), ("QC", 4), ("NQC", 1)]
    name = f"{kb.name}_t"
    ins = [(n, _TYPES.get(n, mx.int32)) for n in kb.input_names]
    outs = [(n, T if n in ("out", "o") else mx.float32) for n in kb.output_names]
    return name, cb.kernel_text(name, kb.body, ins, outs, _TEMPLATE + window)


def test_kernel_text_is_mlx_s_signature_unmangled():
    """A variant's text: the header, an extern "C" kernel (precompiled_cuda_kernel finds it by its plain name) taking
    the inputs as const pointers of their dtypes' CUDA types, then the outputs, then the template constants."""
    text = cb.kernel_text("k1", "out[0] = q[0];", [("q", mx.bfloat16), ("lens", mx.int32)], [("out", mx.float32)],
                          [("T", mx.float16), ("D", 64), ("ON", True)])
    assert text.startswith(cb.HEADER)
    assert ('extern "C" __global__ void k1(\n    const __nv_bfloat16* q,\n    const int32_t* lens,\n    float* out) {\n'
            in text)
    assert "  using T = __half;\n  constexpr int D = 64;\n  constexpr bool ON = true;\nout[0] = q[0];\n}\n" in text


@needs_nvrtc
@pytest.mark.parametrize("kind,new_kv,split", [(k, n, s) for k, n in _KINDS for s in (False, True)
                                               if not (k == "seal" and s)])  # (the seal has no split variant)
def test_every_kernel_kind_compiles_with_nvrtc(kind, new_kv, split, tmp_path):
    assert LIB is not None
    cache = cb.KernelCache(tmp_path, cb.Nvrtc(LIB), "sm_90a", cb.include_dirs())
    name, text = _text(kind, split, new_kv)
    cubin = cache.cubin(name, text)
    assert cubin[:4] == b"\x7fELF"  # a device binary, not PTX text
    (path,) = tmp_path.iterdir()  # kept for later processes
    assert path.name.startswith(f"{name}-") and path.suffix == ".cubin" and path.read_bytes() == cubin


@needs_nvrtc
def test_a_later_process_reads_the_binary_instead_of_compiling(tmp_path):
    """The cache's second life (a new KernelCache on the same folder: a later process) returns the written binary;
    another source or architecture gets its own file."""
    assert LIB is not None
    nv = cb.Nvrtc(LIB)
    name, text = _text("mma_decode_bf16", False, True)
    first = cb.KernelCache(tmp_path, nv, "sm_90a", cb.include_dirs()).cubin(name, text)
    (path,) = tmp_path.iterdir()
    stamp = path.stat().st_mtime_ns

    class NoCompile(cb.Nvrtc):
        def compile(self, *a, **kw):  # a later process must not compile what the folder holds
            raise AssertionError("compiled again")

    later = cb.KernelCache(tmp_path, NoCompile(LIB), "sm_90a", cb.include_dirs())
    assert later.cubin(name, text) == first and path.stat().st_mtime_ns == stamp
    cb.KernelCache(tmp_path, nv, "sm_80", cb.include_dirs()).cubin(name, text)
    cb.KernelCache(tmp_path, nv, "sm_90a", cb.include_dirs()).cubin(name, text.replace("NE = 8", "NE = 8 "))
    assert len(list(tmp_path.iterdir())) == 3


@needs_nvrtc
def test_a_compile_error_names_the_kernel_and_nvrtc_s_message(tmp_path):
    assert LIB is not None
    cache = cb.KernelCache(tmp_path, cb.Nvrtc(LIB), "sm_90a", cb.include_dirs())
    with pytest.raises(RuntimeError, match=r"broken_k.*undefined"):
        cache.cubin("broken_k", cb.kernel_text("broken_k", "nope[0] = 1;", [], [("out", mx.float32)], []))
    assert not list(tmp_path.iterdir())
