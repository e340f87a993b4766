"""Which MLX backend this process runs on: detected once, asked everywhere else."""
from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    """The MLX backend in use (cpu, cuda or metal), which picks the attention routes and kernels."""

    name: str  # "cpu" | "cuda" | "metal"
    cuda_kernels: bool  # MLX CUDA with custom kernels (mx.fast.cuda_kernel)

    @property
    def on_cpu(self) -> bool:
        """Whether MLX runs on the CPU backend (the CPU routes' work-arounds apply)."""
        return self.name == "cpu"


@functools.cache
def backend() -> Backend:
    """The backend of MLX's default device. On the CPU backend MLX's SDPA is a composed fallback
    and quantized matmuls run one thread per stream, which is what the CPU routes work around."""
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.cpu:
        name = "cpu"
    else:
        name = "metal" if mx.metal.is_available() else "cuda" if mx.cuda.is_available() else "cpu"
    return Backend(name, name == "cuda" and hasattr(mx.fast, "cuda_kernel"))


def on_cpu() -> bool:
    """Whether this process's MLX backend is the CPU."""
    return backend().on_cpu


def device_works() -> bool:
    """Whether the device still evaluates anything. After some faults (CUDA's "illegal memory access") every
    later evaluation in the process fails, so a step that failed then is the device's fault, not its rows'."""
    import mlx.core as mx

    try:
        mx.eval(mx.array([1]) + 1)
    except Exception:  # noqa: BLE001 - any failure of a one-element add says the device is gone
        return False
    return True
