"""The fused kernels compiled once per machine, not once per process.

`mx.fast.cuda_kernel` compiles its source with NVRTC the first time a process launches it and keeps the binary in
memory only (MLX 0.32 writes its own kernels' binaries to its disk cache, not custom kernels'). A `kvbatch`
command is one process, so every run paid the compile at its first decode step: 3.6 s for kv none's kernels and
5.8 s for q8's on an H100 (docs/performance.md), a third of a 1B job. Here each kernel variant (its body, template
constants and argument types) is wrapped as MLX wraps it, compiled with the NVRTC library MLX itself loads, and
its binary kept under `kernel_cache_dir()` by a hash of everything that makes it; later processes load the binary
and launch it through `mx.fast.precompiled_cuda_kernel`.

Where NVRTC cannot be found or a compile fails, `KernelBuild.bind` falls back to `mx.fast.cuda_kernel` (the same
source, compiled per process), logging why once.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Optional, cast

import mlx.core as mx

logger = logging.getLogger(__name__)

# What MLX's custom kernels see besides their body (mlx/backend/cuda/custom_kernel.cpp wraps them in
# namespace mlx::core::cu with its device utilities): the half types, fixed-width integers and INFINITY.
HEADER = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/cstdint>
#include <cuda/std/limits>
using cuda::std::int32_t;
using cuda::std::int64_t;
using cuda::std::uint32_t;
using cuda::std::uint64_t;
using cuda::std::size_t;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
"""

_CUDA_TYPES = {mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint32: "uint32_t", mx.int32: "int32_t",
               mx.int64: "int64_t", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float"}


def cuda_type(dtype: mx.Dtype) -> str:
    """The CUDA type MLX gives an array of this dtype in a kernel's signature."""
    return _CUDA_TYPES[dtype]


def kernel_text(name: str, body: str, inputs: list[tuple[str, mx.Dtype]], outputs: list[tuple[str, mx.Dtype]],
                template: list[tuple[str, object]]) -> str:
    """The whole translation unit of one kernel variant: HEADER, then an `extern "C"` kernel (its name unmangled, as
    precompiled_cuda_kernel looks it up) with MLX's signature (const inputs, then outputs) and template constants."""
    params = [f"    const {cuda_type(d)}* {n}" for n, d in inputs] + [f"    {cuda_type(d)}* {n}" for n, d in outputs]
    consts = []
    for k, v in template:
        if isinstance(v, bool):
            consts.append(f"  constexpr bool {k} = {'true' if v else 'false'};")
        elif isinstance(v, int):
            consts.append(f"  constexpr int {k} = {v};")
        else:
            consts.append(f"  using {k} = {cuda_type(v)};")  # type: ignore[arg-type]  (a dtype)
    return (HEADER + f'extern "C" __global__ void {name}(\n' + ",\n".join(params) + ") {\n"
            + "\n".join(consts) + "\n" + body + "\n}\n")


def kernel_cache_dir() -> Path:
    """Where compiled kernels are kept: $XDG_CACHE_HOME/kvbatch/cuda-kernels (~/.cache by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvbatch" / "cuda-kernels"


def _site_dirs() -> list[Path]:
    return [Path(p) for p in sys.path if p and Path(p).is_dir()]


def _cuda_homes() -> list[str]:
    """The CUDA toolkit folders to look in, as MLX's JIT looks: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda."""
    return [h for h in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda") if h]


def _mlx_root() -> Optional[Path]:
    return Path(mx.__file__).resolve().parent.parent if getattr(mx, "__file__", None) else None


def nvrtc_library() -> Optional[str]:
    """The NVRTC library: the one this process has loaded (MLX's), else the nvidia-cuda-nvrtc package's, else the
    CUDA toolkit's; None where there is none."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libnvrtc.so" in line and "builtins" not in line:
                    return line.split()[-1]
    except OSError:
        pass
    found = [p for d in _site_dirs() for p in sorted(glob.glob(str(d / "nvidia" / "*" / "lib" / "libnvrtc.so*")))
             if "builtins" not in p]
    for home in _cuda_homes():
        found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    return found[0] if found else None


def include_dirs() -> list[str]:
    """Header folders for NVRTC, as MLX's JIT finds them: MLX's bundled headers and CCCL, the nvidia-cuda-runtime
    package's headers, else the CUDA toolkit's."""
    out: list[Path] = []
    root = _mlx_root()
    if root is not None:
        out += [root / "mlx" / "include", root / "mlx" / "include" / "cccl"]
    for d in _site_dirs():
        out += [Path(p) for p in sorted(glob.glob(str(d / "nvidia" / "cu*" / "include")))]
        out += [Path(p) for p in sorted(glob.glob(str(d / "nvidia" / "cu*" / "include" / "cccl")))]
    for home in _cuda_homes():
        out += [Path(home) / "include", Path(home) / "include" / "cccl"]
    seen: list[str] = []
    for p in out:
        if p.is_dir() and str(p) not in seen:
            seen.append(str(p))
    return seen


class Nvrtc:
    """NVRTC through ctypes: a translation unit to a cubin for one GPU architecture."""

    def __init__(self, library: str):
        self.lib = ctypes.CDLL(library)
        self.library = library
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = f"{major.value}.{minor.value}"

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(code).decode()}")

    def compile(self, source: str, name: str, arch: str, includes: list[str]) -> bytes:
        """The cubin of `source` for `arch` (e.g. sm_90a); raises RuntimeError with NVRTC's log on a failure."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0,
                                                None, None), "nvrtcCreateProgram")
        try:
            opts = [f"--gpu-architecture={arch}", "-std=c++17", *(f"--include-path={d}" for d in includes)]
            argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
            code = self.lib.nvrtcCompileProgram(prog, len(opts), argv)
            if code != 0:
                size = ctypes.c_size_t()
                self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                self.lib.nvrtcGetProgramLog(prog, log)
                raise RuntimeError(f"NVRTC could not compile {name}: {log.value.decode(errors='replace')[-2000:]}")
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            out = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetCUBIN(prog, out), "nvrtcGetCUBIN")
            return out.raw
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def device_arch() -> str:
    """The GPU's architecture as NVRTC names it, with the `a` features from sm_90 on (as MLX compiles its own)."""
    arch = str(mx.device_info().get("architecture", "sm_90"))
    return arch + "a" if int(arch.removeprefix("sm_")) >= 90 else arch


class KernelCache:
    """Cubins on disk by a hash of what makes them (source, architecture, NVRTC's version)."""

    def __init__(self, folder: Path, nvrtc: Nvrtc, arch: str, includes: list[str]):
        self.folder, self.nvrtc, self.arch, self.includes = folder, nvrtc, arch, includes

    def cubin(self, name: str, source: str) -> bytes:
        """The variant's binary: read from disk, else compiled and written (atomically: processes compiling the
        same variant side by side each write a whole file). KernelBuild keeps it in memory for the process."""
        key = hashlib.sha256(f"{self.arch}\n{self.nvrtc.version}\n{source}".encode()).hexdigest()[:24]
        path = self.folder / f"{name}-{key}.cubin"
        try:
            data = path.read_bytes()
        except OSError:
            data = self.nvrtc.compile(source, name, self.arch, self.includes)
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(data)
                os.replace(tmp, path)
            except OSError as e:  # a read-only home: compiled per process, as MLX would
                logger.warning("cannot keep compiled kernel %s in %s: %s", name, self.folder, e)
        return data


@functools.cache
def kernel_cache() -> Optional[KernelCache]:
    """This process's KernelCache (None: no NVRTC here; the kernels then compile through mx.fast.cuda_kernel)."""
    lib = nvrtc_library()
    if lib is None:
        logger.info("no NVRTC library found: CUDA kernels compile in every process")
        return None
    try:
        return KernelCache(kernel_cache_dir(), Nvrtc(lib), device_arch(), include_dirs())
    except (OSError, RuntimeError, AttributeError) as e:
        logger.info("NVRTC at %s unusable (%s): CUDA kernels compile in every process", lib, e)
        return None


class KernelBuild:
    """One kernel (a body and its argument names) launched like mx.fast.cuda_kernel's object, from a cubin that the
    KernelCache keeps across processes."""

    def __init__(self, name: str, input_names: list[str], output_names: list[str], body: str):
        self.name, self.input_names, self.output_names, self.body = name, input_names, output_names, body
        self._binaries: dict[tuple, tuple[str, bytes]] = {}
        self._fallback: Optional[object] = None

    def _variant(self, template: list, inputs: list[mx.array], output_dtypes: list) -> Optional[tuple[str, bytes]]:
        key = (tuple(template), tuple(a.dtype for a in inputs), tuple(output_dtypes))
        got = self._binaries.get(key)
        if got is None:
            cache = kernel_cache()
            if cache is None:
                return None
            tag = hashlib.sha1(repr(key).encode()).hexdigest()[:10]
            name = f"{self.name}_{tag}"
            src = kernel_text(name, self.body, list(zip(self.input_names, (a.dtype for a in inputs))),
                              list(zip(self.output_names, output_dtypes)), template)
            try:
                got = (name, cache.cubin(name, src))
            except RuntimeError as e:
                logger.warning("%s: compiled in every process instead (%s)", self.name, e)
                return None
            self._binaries[key] = got
        return got

    def bind(self, inputs: list[mx.array], template: list, output_dtypes: list) -> Callable[..., list[mx.array]]:
        """The launcher of the variant these inputs' dtypes, `template` and `output_dtypes` make: called with
        inputs=, grid=, threadgroup=, output_shapes=, output_dtypes= (a decode step binds once per step shape and
        launches once per layer)."""
        built = self._variant(template, inputs, output_dtypes)
        if built is None:
            if self._fallback is None:
                self._fallback = mx.fast.cuda_kernel(name=self.name, input_names=self.input_names,
                                                     output_names=self.output_names, source=self.body)
            return functools.partial(cast(Callable[..., list[mx.array]], self._fallback), template=template)
        name, cubin = built
        return functools.partial(mx.fast.precompiled_cuda_kernel, name=name, compiled_source=cubin, scalars=[],
                       ensure_row_contiguous=True)
