"""kvbatch's benchmarks, one package: `python -m benchmarks --list`, `python -m benchmarks NAME [--smoke]
[--out FILE] [options]` from the repository root (benchmarks/__main__.py; the harness: benchmarks/harness.py).

Subfolders by question: engine/ (the engine against mlx-lm, batch and admission limits, costs of its
features), cpu/ (MLX CPU kernels and BLAS), gpu/ (where a GPU step's time goes, kernel checks; the lent
GPU's stages in gpu/device_run.sh), quality/ (what KV quantization costs in quality and speed), job/ (the
whole `kvbatch` command: against mlx-lm, shared prompts, many workers, kill -9). Results: notebook/README.md and
results/ (history, as recorded).

`import kvbatch.engine` comes first: it loads OpenBLAS before anything imports mlx (loading it later has no
effect, see engine/blas.py), and every benchmark module imports mlx.
"""
import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)

# name -> what it answers (the module is benchmarks/<area>/<name>.py)
BENCHMARKS = {
    "engine.vs_mlx_lm": "kvbatch's Engine against mlx-lm's BatchGenerator: decode tok/s, memory, KV held, "
                        "modes and engine options A/B (mode@option=value), roofline, long context interleaved",
    "engine.batch_ceiling": "where more rows stop adding decode tok/s (engine.max_batch: auto)",
    "engine.admission": "admission under a memory budget: optimistic vs reserve, rows per KV mode, a long "
                        "run that grows the pool",
    "engine.fork_cost": "what a fork of n samples costs, at two pool sizes",
    "engine.mac_check": "one command for a Mac: the engine's tests on Metal, the portable route against mlx-lm "
                        "at 1k/8k/16k, a 30k-token answer, the max_batch ceiling (one JSON to paste into an issue)",
    "engine.portable_decode": "the portable route's decode step (Metal's): pages read in place vs gathered, ms "
                              "and workspace as a share of the KV",
    "engine.spec_cost": "a verification pass's cost against plain decode (draft model, acceptance forced to "
                        "0/50%/100%)",
    "engine.decoding_controls": "decode tok/s free, with logprobs, and held to a JSON schema",
    "engine.host_step": "the host's own work a decode step at large batches (scheduler, cache, route arrays, "
                         "output), without the device's; a commit side by side",
    "engine.ngram_cost": "the host time of one pass's n-gram proposals over hundreds of rows (a rewrite job's shape)",
    "engine.quant_prefill_plan": "the host time of a q8/q4 prefill pass's plan at mixed lengths (segments, slots, "
                                 "mask), with a fingerprint of the plan to compare two trees",
    "cpu.decode_attention": "one layer's CPU decode attention: dense routes (--kv none) and packed pages "
                            "gathered vs in place (--kv q8,q4)",
    "cpu.blas_matmul": "does loading OpenBLAS before mlx pay off on the Linux CPU",
    "gpu.spec_ops": "a verification pass's pieces (forward, MLP, lm_head, paged kernel) against a decode step's",
    "gpu.spec_profile": "where the rewrite job's engine time goes with and without n-gram speculation (cProfile)",
    "gpu.step_profile": "where a decode step's host time goes, next to mlx-lm's step",
    "gpu.prefill_shapes": "a mixed-length prefill's passes, cold, warm and on new shapes",
    "gpu.cold_shapes": "what a process pays the first time it meets a decode batch size, against the second "
                       "time (matmul alone, the model's forward, and batch sizes padded to a multiple)",
    "gpu.host_cost": "host costs of a CUDA decode step's pieces (mx.array, custom-kernel calls)",
    "gpu.cuda_compile_check": "compile the CUDA decode kernels with nvcc, registers and spills, no GPU",
    "gpu.backend_check": "correctness of the paged engine and the fused kernels on this MLX backend",
    "quality.kv_quality": "each KV mode against kv=none, teacher-forced (KL, top-1, perplexity)",
    "quality.kv_speed": "KV modes' speed and size at long context, against mlx-lm's kv_bits",
    "job.job_vs_mlx_lm": "the whole `kvbatch` command against mlx-lm's batch_generate",
    "job.shared_prompts": "a shared system prompt and n samples: prefix cache on/off against mlx-lm",
    "job.speculative": "speculative decoding (ngram) on a rewrite job: with and without it, and mlx-lm; the record "
                       "written as each side ends",
    "job.ngram_ceiling": "the most n-gram speculation can gain on a job already run: its greedy outputs replayed "
                         "through the proposer, plain steps against verification passes",
    "job.many_workers": "many workers on one PostgreSQL queue: rows/s, queue cost, claim latency",
    "job.commits": "the whole `kvbatch` command at two commits side by side: speed ratio and identical rows",
    "job.kill_soak": "many random kill -9 of real workers, then a final run: nothing lost or changed",
    "job.command_vs_engine": "the command's decode tok/s against its engine's alone, same rows and batch",
    "job.checkpoint_cost": "what checkpointing rows in flight costs a whole job: off, default, dense",
    "job.overnight": "a job stopped by its deadline half-way and run again, against one uninterrupted run",
    "job.score": "action=score (kvbatch.score) on DPO-shaped rows against mlx-lm's one forward per pair: "
                 "pairs/s, cached prompt pages, summed log-probabilities agree",
    "job.finalize_memory": "finalize of N one-token rows (synthetic parts): peak RSS and time, and a finished "
                           "job's rerun",
}
