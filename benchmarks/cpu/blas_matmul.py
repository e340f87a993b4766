"""BLAS microbenchmark for issue 2: does loading OpenBLAS before mlx pay off on the Linux CPU?

Measures float32 512x576x1536 matmul GFLOP/s with and without the OpenBLAS
step (each in its own subprocess: the step only works before mlx is first
imported), and SmolLM2-135M-Instruct decode tokens/s at batch 1 and 8 with
mlx-lm (float32 weights, greedy). Prints the "## Models / BLAS (issue 2)" section
of the notebook (benchmarks/notebook/README.md) as it was written (the record has it under `section`).

    python -m benchmarks cpu.blas_matmul [--max-tokens 64]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks import harness as h

SMOKE = ["--model", "tiny", "--max-tokens", "4", "--seconds", "0.05", "--decode", ":2"]
HEADING = "## Models / BLAS (issue 2)"
M, K, N = 512, 576, 1536
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List ten ideas for a weekend trip and say why each is fun.",
    "Describe the water cycle step by step.",
    "Write a poem about autumn leaves and the first frost.",
    "What are the pros and cons of working from home?",
    "Explain the difference between a virus and a bacterium.",
    "Give me a recipe for a simple vegetable soup with all the steps.",
]


def add_args(ap) -> None:
    ap.add_argument("--model", default="smollm2", help=", ".join(h.MODEL_NAMES))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=2.0, help="matmul: timed for about this long")
    ap.add_argument("--decode", default=":1,:8,none:1", help="decode runs, KVBATCH_BLAS:batch,...")


def worker_matmul(seconds: float) -> dict:
    import kvbatch.engine as engine
    import mlx.core as mx

    a, b = mx.random.normal((M, K)), mx.random.normal((K, N))
    mx.eval(a, b)
    for _ in range(3):
        mx.eval(a @ b)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < seconds and len(times) < 200):
        t = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - t)
    return {"blas": engine.blas_in_use(), "gflops": 2 * M * K * N / statistics.median(times) / 1e9,
            "runs": len(times)}


def worker_decode(model_name: str, batch: int, max_tokens: int) -> dict:
    import kvbatch.engine as engine
    import mlx.core as mx
    from mlx_lm import batch_generate, stream_generate

    model, tok, spec = h.load(model_name)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in PROMPTS[:batch]]
    for _ in stream_generate(model, tok, prompts[0], max_tokens=4):  # warm-up
        pass
    if batch == 1:
        *_, last = stream_generate(model, tok, prompts[0], max_tokens=max_tokens)
        stats = {"prompt_tokens": last.prompt_tokens, "prompt_tps": last.prompt_tps,
                 "generation_tokens": last.generation_tokens, "generation_tps": last.generation_tps}
    else:
        s = batch_generate(model, tok, prompts, max_tokens=max_tokens).stats
        stats = {"prompt_tokens": s.prompt_tokens, "prompt_tps": s.prompt_tps,
                 "generation_tokens": s.generation_tokens, "generation_tps": s.generation_tps}
    return {"blas": engine.blas_in_use(), "batch": batch, "dtype": spec.dtype,
            "peak_gb": mx.get_peak_memory() / 1e9, **stats}


def run_worker(args: list[str], blas: str) -> dict:
    """A worker in its own process (the OpenBLAS step only works before mlx is first imported)."""
    env = {**os.environ, "KVBATCH_BLAS": blas}
    out = subprocess.run([sys.executable, "-m", "benchmarks.cpu.blas_matmul", *args], capture_output=True,
                         text=True, env=env, cwd=h.ROOT)
    if out.returncode:
        raise SystemExit(f"worker {args} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def render(info: dict, mm: dict, decode: list[dict], max_tokens: int) -> str:
    ref, ob = mm["reference"], mm["openblas"]
    lines = [
        HEADING, "",
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB RAM "
        f"(shared; 1-min load average {info['loadavg']:.1f} at start). "
        f"mlx {info['mlx']}, mlx-lm {info['mlx_lm']}, Python {info['python']}. "
        f"{info['date']}, commit {info['commit']}. Command: `python -m benchmarks cpu.blas_matmul`.",
        "",
        f"float32 {M}x{K}x{N} matmul (median of repeated runs, one subprocess per setting):", "",
        "| BLAS | GFLOP/s |", "|---|---|",
        f"| {ref['blas']} (KVBATCH_BLAS=none) | {ref['gflops']:.1f} |",
        f"| {ob['blas']} | {ob['gflops']:.1f} ({ob['gflops'] / ref['gflops']:.0f}x) |",
        "",
        f"SmolLM2-135M-Instruct (GGUF Q4_1 converted to float32), greedy, chat prompts, up to "
        f"{max_tokens} new tokens, mlx-lm `stream_generate` (batch 1) / `batch_generate` (batch 8):", "",
        "| BLAS | batch | prompt tokens | prefill tok/s | generated tokens | decode tok/s | peak GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in decode:
        lines.append(f"| {d['blas'].split(':')[0]} | {d['batch']} | {d['prompt_tokens']} | {d['prompt_tps']:.1f} "
                     f"| {d['generation_tokens']} | {d['generation_tps']:.1f} | {d['peak_gb']:.2f} |")
    return "\n".join(lines) + "\n"


def run(a) -> dict:
    mm = {"reference": run_worker(["matmul", str(a.seconds)], "none"),
          "openblas": run_worker(["matmul", str(a.seconds)], "")}
    print(json.dumps(mm))
    decode = []
    for item in filter(None, a.decode.split(",")):
        blas, _, batch = item.partition(":")
        decode.append(run_worker(["decode", a.model, batch, str(a.max_tokens)], blas))
        print(json.dumps(decode[-1]))
    rec = h.record("cpu.blas_matmul", [], {}, None)
    info = {**rec["machine"], **rec["versions"], "ram_gib": rec["machine"]["memory_gib"], "date": rec["date"][:10],
            "commit": rec["commit"]}
    section = render(info, mm, decode, a.max_tokens)
    print(section)
    return {"matmul": mm, "decode": decode, "section": section}


if __name__ == "__main__":  # a worker: python -m benchmarks.cpu.blas_matmul matmul SECONDS | decode MODEL BATCH N
    kind, *rest = sys.argv[1:]
    result = worker_matmul(float(rest[0])) if kind == "matmul" else worker_decode(rest[0], int(rest[1]), int(rest[2]))
    print(json.dumps(result))
