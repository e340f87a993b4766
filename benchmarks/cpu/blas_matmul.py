"""BLAS microbenchmark for issue 2: does loading OpenBLAS before mlx pay off on the Linux CPU?

Measures float32 512x576x1536 matmul GFLOP/s with and without the OpenBLAS
step (each in its own subprocess: the step only works before mlx is first
imported), and SmolLM2-135M-Instruct decode tokens/s at batch 1 and 8 with
mlx-lm (float32 weights, greedy). Writes the "## Models / BLAS (issue 2)"
section of benchmarks/RESULTS.md, leaving the other sections alone.

    .venv/bin/python benchmarks/blas_matmul.py [--max-tokens 64] [--no-write]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
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


def worker_matmul() -> dict:
    import kvbatch.engine as engine
    import mlx.core as mx

    a, b = mx.random.normal((M, K)), mx.random.normal((K, N))
    mx.eval(a, b)
    for _ in range(3):
        mx.eval(a @ b)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < 2.0 and len(times) < 200):
        t = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - t)
    return {"blas": engine.blas_in_use(), "gflops": 2 * M * K * N / statistics.median(times) / 1e9,
            "runs": len(times)}


def worker_decode(batch: int, max_tokens: int) -> dict:
    import kvbatch.engine as engine
    import mlx.core as mx
    from mlx_lm import batch_generate, stream_generate

    model, tok, spec = engine.load_model(engine.ModelConfig())
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
    env = {**os.environ, "KVBATCH_BLAS": blas}
    out = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True, text=True,
                         env=env, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"worker {args} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        return ""


def machine() -> dict:
    cpu = re.search(r"Model name:\s*(.+)", _sh(["lscpu"]))
    meminfo = Path("/proc/meminfo")
    mem = re.search(r"MemTotal:\s*(\d+) kB", meminfo.read_text()) if meminfo.exists() else None
    import mlx.core as mx
    import mlx_lm

    return {
        "cpu": cpu.group(1).strip() if cpu else platform.processor(),
        "cores": os.cpu_count(),
        "ram_gib": round(int(mem.group(1)) / 2**20, 1) if mem else None,
        "loadavg": os.getloadavg()[0],
        "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"), "commit": _sh(["git", "rev-parse", "--short", "HEAD"]),
    }


def render(info: dict, mm: dict, decode: list[dict], max_tokens: int) -> str:
    ref, ob = mm["reference"], mm["openblas"]
    lines = [
        HEADING, "",
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB RAM "
        f"(shared; 1-min load average {info['loadavg']:.1f} at start). "
        f"mlx {info['mlx']}, mlx-lm {info['mlx_lm']}, Python {info['python']}. "
        f"{info['date']}, commit {info['commit']}. Command: `.venv/bin/python benchmarks/blas_matmul.py`.",
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


def write_section(section: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(HEADING)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-write", action="store_true", help="print the section, do not edit RESULTS.md")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.worker:
        kind, *rest = args.worker
        result = worker_matmul() if kind == "matmul" else worker_decode(int(rest[0]), int(rest[1]))
        print(json.dumps(result))
        return
    info = machine()
    mm = {"reference": run_worker(["matmul"], "none"), "openblas": run_worker(["matmul"], "")}
    print(json.dumps(mm))
    decode = []
    for blas, batch in (("", 1), ("", 8), ("none", 1)):
        decode.append(run_worker(["decode", str(batch), str(args.max_tokens)], blas))
        print(json.dumps(decode[-1]))
    section = render(info, mm, decode, args.max_tokens)
    print(section)
    if not args.no_write:
        write_section(section)


if __name__ == "__main__":
    main()
