"""Compile engine/kv/routes/cuda_kernels.py's kernels with nvcc, as MLX would wrap them, without a GPU.

Catches syntax errors and prints registers / spills / shared memory (-Xptxas -v) before
device time is spent. Needs nvcc on PATH; imports no MLX CUDA.

    python benchmarks/cuda_compile_check.py [--warps 4] [--unroll 1]

Kernel names: dense_/quant_<D>_<rep>_<dtype>[_split][_store][_q8|_q4|_k8v4]. Registers above 128 a
thread leave one 256-thread block per SM instead of two.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvbatch.engine.kv.routes import cuda_kernels as ca  # noqa: E402
from kvbatch.engine.kv.routes import cuda_source as cs  # noqa: E402

STUB = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cuda/std/limits>
namespace mlx::core::cu {
"""
TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half"}


def wrap(name: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]], consts: dict, body: str) -> str:
    params = [f"    const {t}* {n}" for n, t in inputs] + [f"    {t}* {n}" for n, t in outputs]
    lines = [f"__global__ void {name}(\n" + ",\n".join(params) + ") {"]
    for k, v in consts.items():
        lines.append(f"  using {k} = {v};" if isinstance(v, str) else f"  constexpr int {k} = {v};")
    return "\n".join(lines) + "\n" + body + "\n}\n"


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--warps", type=int, default=8, help="most warps per block (KVBATCH_CUDA_WARPS)")
    ap.add_argument("--unroll", type=int, default=ca.UNROLL["dense"])
    a = ap.parse_args()
    src = [STUB]
    for D, rep in ((64, 4), (128, 4), (64, 2), (96, 3)):
        for dt in ("bfloat16", "float32"):
            T = TYPES[dt]
            nw = ca.warps_for(D, rep, a.warps)
            base = dict(T=T, S=T, D=D, P=64, REP=rep, HKV=8, NW=nw, LPT=ca._lanes(D), NE=ca.NE, U=a.unroll)
            ints = [("table", "int32_t"), ("meta", "int32_t"), ("scale", "float")]
            for split, new_kv in ((False, False), (True, False), (False, True), (True, True)):
                i = f"{D}_{rep}_{dt}{'_split' if split else ''}{'_store' if new_kv else ''}"
                store = [("kn", T), ("vn", T)] if new_kv else []  # the kernel also stores the new token
                outs = [("pm", "float"), ("pl", "float"), ("pacc", "float")] if split else [("out", T)]
                dense_in = [("q", T), ("k", T), ("v", T), ("table", "int32_t"), ("lengths", "int32_t"),
                            ("meta", "int32_t"), ("scale", "float")]
                src.append(wrap(f"dense_{i}", dense_in + store, outs, base, cs.kernel_source(False, split, new_kv)))
                for kbits, vbits in ((8, 8), (4, 4), (8, 4)):
                    qin = [("q", T), ("kw", "uint32_t"), ("ks", T), ("kb", T), ("vw", "uint32_t"), ("vs", T),
                           ("vb", T), ("tk", T), ("tv", T), ("tails", "int32_t")] + ints[:1] + \
                          [("lens", "int32_t")] + ints[1:]
                    consts = dict(base, KBITS=kbits, VBITS=vbits, GS=32 if D % 64 else 64)
                    tag = f"q{kbits}" if kbits == vbits else f"k{kbits}v{vbits}"
                    src.append(wrap(f"quant_{i}_{tag}", qin + store, outs, consts,
                                    cs.kernel_source(True, split, new_kv)))
            for ql in (0, 1):
                src.append(wrap(f"reduce_{D}_{rep}_{dt}_{ql}", [("pm", "float"), ("pl", "float"), ("pacc", "float"),
                                                     ("meta", "int32_t"), ("lens", "int32_t")], [("out", T)],
                                dict(T=T, D=D, REP=rep, HKV=8, QL=ql), cs._REDUCE))
    src.append("}\n")
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "k.cu"
        f.write_text("\n".join(src))
        r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-c", "-Xptxas", "-v", "-o", str(Path(d) / "k.o"),
                            str(f)], capture_output=True, text=True)
    out = r.stdout + r.stderr
    name = ""
    for line in out.splitlines():
        if "error" in line or "warning" in line:
            print(line)
        elif "Compiling entry function" in line:
            m = re.search(r"cu\d+((?:dense|quant|reduce)_\w+?)E", line)
            name = m.group(1) if m else line
        elif "spill" in line and "0 bytes spill stores, 0 bytes spill loads" not in line:
            print(f"{name}: {line.strip()}")
        elif "Used" in line:
            print(f"{name}: {line.split('Used ')[1].split(',')[0]}")
    print("nvcc exit", r.returncode)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
