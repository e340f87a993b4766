"""Compile engine/kv/routes/cuda_kernels.py's kernels with nvcc, as MLX would wrap them, without a GPU.

Catches syntax errors and prints registers / spills / shared memory (-Xptxas -v) before
device time is spent. Needs nvcc on PATH; imports no MLX CUDA.

    python -m benchmarks gpu.cuda_compile_check [--warps 4] [--unroll 1]

Kernel names: dense_/quant_<D>_<rep>_<dtype>[_split][_store][_q8|_q4|_k8v4]; the tensor-core kernels
mmaw_ (a window of --window tokens), mmad_ (decode), mmads_ (decode storing its token), mmaq_ / mmaqs_
(q8 decode, storing its token), bf16/fp16,
<D>_<rep>_<dtype>[_split], and their merges reducew<tag>_; seal_<D>_<rep>_<dtype>_<bits> (q8/q4 tails into the
pool). Registers above 128 a thread leave one
256-thread block per SM instead of two.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from kvbatch.engine.kv.routes import cuda_kernels as ca
from kvbatch.engine.kv.routes import cuda_source as cs

NEEDS = "nvcc"
SMOKE = ["--geometries", "64x4", "--dtypes", "float32", "--variants", "plain", "--bits", "8x8", "--frontend-only"]

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


def add_args(ap) -> None:
    ap.add_argument("--warps", type=int, default=8, help="most warps per block (engine.options.cuda.warps)")
    ap.add_argument("--unroll", type=int, default=ca.UNROLL["dense"])
    ap.add_argument("--geometries", default="64x4,128x4,64x2,96x3", help="head size x query heads per KV head")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--variants", default="plain,split,store,split_store")
    ap.add_argument("--bits", default="8x8,4x4,8x4", help="quantized kernels: key x value bits")
    ap.add_argument("--window", type=int, default=5, help="verification window tokens (k + 1)")
    ap.add_argument("--frontend-only", action="store_true",
                    help="nvcc -cuda: parse and type-check only (no ptxas: no registers, spills)")


def sources(a) -> list[str]:
    src = [STUB]
    ints = [("table", "int32_t"), ("meta", "int32_t"), ("scale", "float")]
    variants = {"plain": (False, False), "split": (True, False), "store": (False, True), "split_store": (True, True)}
    for D, rep in (tuple(map(int, g.split("x"))) for g in a.geometries.split(",")):
        for dt in a.dtypes.split(","):
            T = TYPES[dt]
            nw = ca.warps_for(D, rep, a.warps)
            base = dict(T=T, S=T, D=D, P=64, REP=rep, HKV=8, NW=nw, LPT=ca._lanes(D), NE=ca.NE, U=a.unroll)
            for split, new_kv in (variants[v] for v in a.variants.split(",")):
                i = f"{D}_{rep}_{dt}{'_split' if split else ''}{'_store' if new_kv else ''}"
                store = [("kn", T), ("vn", T)] if new_kv else []  # the kernel also stores the new token
                outs = [("pm", "float"), ("pl", "float"), ("pacc", "float")] if split else [("out", T)]
                dense_in = [("q", T), ("k", T), ("v", T), ("table", "int32_t"), ("lengths", "int32_t"),
                            ("meta", "int32_t"), ("scale", "float")]
                src.append(wrap(f"dense_{i}", dense_in + store, outs, base, cs.kernel_source(False, split, new_kv)))
                for kbits, vbits in (tuple(map(int, b.split("x"))) for b in a.bits.split(",")):
                    qin = [("q", T), ("kw", "uint32_t"), ("ks", T), ("kb", T), ("vw", "uint32_t"), ("vs", T),
                           ("vb", T), ("tk", T), ("tv", T), ("tails", "int32_t")] + ints[:1] + \
                          [("pos", "int32_t")] + ints[1:]
                    consts = dict(base, KBITS=kbits, VBITS=vbits, GS=32 if D % 64 else 64)
                    tag = f"q{kbits}" if kbits == vbits else f"k{kbits}v{vbits}"
                    src.append(wrap(f"quant_{i}_{tag}", qin + store, outs, consts,
                                    cs.kernel_source(True, split, new_kv)))
                    if not split and not new_kv:  # the seal of filled tails after a q8/q4 decode step
                        seal_in = [("a", T), *qin[1:9], ("tails", "int32_t"), ("table", "int32_t"),
                                   ("pos", "int32_t"), ("meta", "int32_t")]
                        src.append(wrap(f"seal_{i}_{tag}", seal_in, [("o", T)],
                                        dict(T=T, HKV=8, P=64, D=D, GS=consts["GS"], KBITS=kbits, VBITS=vbits),
                                        cs.SEAL))
            merge_in = [("pm", "float"), ("pl", "float"), ("pacc", "float"), ("meta", "int32_t"), ("lens", "int32_t")]
            for ql in (0, 1):
                src.append(wrap(f"reduce_{D}_{rep}_{dt}_{ql}", merge_in, [("out", T)],
                                dict(T=T, D=D, REP=rep, HKV=8, QL=ql), cs.reduce_source()))
            if dt != "float32":  # the tensor-core kernels (bf16 / fp16 pages): a window, decode (storing or not)
                for L, store in ((a.window, False), (1, False), (1, True)):
                    qc = min(L, ca.MMA_ROWS // rep)
                    window = dict(NL=L, QC=qc, NQC=-(-L // qc))
                    consts = dict(T=T, S=T, D=D, P=64, REP=rep * qc, HKV=8, NW=ca.mma_warps(D), **window)
                    ins = [("q", T), ("k", T), ("v", T), ("table", "int32_t")] + \
                        ([("firsts", "int32_t")] if L > 1 else []) + \
                        [("lengths", "int32_t"), ("meta", "int32_t"), ("scale", "float")] + \
                        ([("kn", T), ("vn", T)] if store else [])
                    tag = "w" if L > 1 else "d" + ("s" if store else "")
                    for split in (False, True):
                        outs = [("pm", "float"), ("pl", "float"), ("pacc", "float")] if split else [("out", T)]
                        src.append(wrap(f"mma{tag}_{D}_{rep}_{dt}{'_split' if split else ''}", ins, outs, consts,
                                        cs.mma_source(split, dt == "float16", L > 1, store)))
                    src.append(wrap(f"reducew{tag}_{D}_{rep}_{dt}", merge_in, [("out", T)],
                                    dict(T=T, D=D, REP=rep * qc, HKV=8, QL=0, **window), cs.reduce_source(True)))
                if "8x8" in a.bits.split(","):  # q8 decode on the tensor cores (storing its token or not)
                    gs = 32 if D % 64 else 64
                    consts = dict(T=T, S=T, D=D, P=64, REP=rep, HKV=8, NW=ca.mma_warps(D), NL=1, QC=1, NQC=1,
                                  KBITS=8, VBITS=8, GS=gs)
                    qin = [("q", T), ("kw", "uint32_t"), ("ks", T), ("kb", T), ("vw", "uint32_t"), ("vs", T),
                           ("vb", T), ("tk", T), ("tv", T), ("tails", "int32_t"), ("table", "int32_t"),
                           ("pos", "int32_t"), ("meta", "int32_t"), ("scale", "float")]
                    for split in (False, True):
                        for store in (False, True):
                            outs = [("pm", "float"), ("pl", "float"), ("pacc", "float")] if split else [("out", T)]
                            src.append(wrap(f"mmaq{'s' if store else ''}_{D}_{rep}_{dt}{'_split' if split else ''}",
                                            qin + ([("kn", T), ("vn", T)] if store else []), outs, consts,
                                            cs.mma_quant_source(split, dt == "float16", store)))
    return src + ["}\n"]


def run(a) -> dict:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "k.cu"
        f.write_text("\n".join(sources(a)))
        what = ["-cuda", "-o", str(Path(d) / "k.ii")] if a.frontend_only else \
            ["-c", "-Xptxas", "-v", "-o", str(Path(d) / "k.o")]
        r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", *what, str(f)], capture_output=True, text=True)
    out = r.stdout + r.stderr
    name, kernels, problems = "", {}, []
    for line in out.splitlines():
        if "error" in line or "warning" in line:
            print(line)
            problems.append(line)
        elif "Compiling entry function" in line:
            m = re.search(r"cu\d+((?:dense|quant|seal|reduce|reducew\w*|mma\w*)_\w+?)E", line)
            name = m.group(1) if m else line
        elif "spill" in line and "0 bytes spill stores, 0 bytes spill loads" not in line:
            print(f"{name}: {line.strip()}")
            kernels.setdefault(name, {})["spills"] = line.strip()
        elif "Used" in line:
            print(f"{name}: {line.split('Used ')[1].split(',')[0]}")
            kernels.setdefault(name, {})["registers"] = line.split("Used ")[1].split(",")[0]
    print("nvcc exit", r.returncode)
    return {"nvcc_exit": r.returncode, "failed": r.returncode != 0, "problems": problems, "kernels": kernels}
