#!/usr/bin/env bash
# Stages of one GPU session on the lent H200 (no network there), run from the repo root:
#   bash benchmarks/gpu_device_run.sh STAGE[:SECONDS] ...
# Installs MLX CUDA from the wheels that shared/tools/mlx-cuda-stage.sh staged (call 1 copies
# .gpu/a to $HOME/kvbatch-stage; this script joins it with .gpu/b) once per machine. Each
# stage writes its log (and JSON) under $OUT and is cut at SECONDS (default 300).
#   kernels  kernel checks (float64 reference) and the one-layer 8k bench of the launch settings
#            (VARIANTS below); writes $HOME/kvbatch-best.env with the fastest checked one
#   pytest   the engine's correctness tests on MLX CUDA
#   gpu8b / gpu1b  benchmarks/gpu.py, 2 order-alternating rounds (8B with 5 modes took ~120 s a
#            case in the fifth session: give it 600 s for b1-b64, or fewer modes)
#   long8b   8k context only (batch 1 and 8), 4 rounds, none/q8/q4 and the old kernel: the q8/q4-vs-none
#            target of issue 9, with rounds enough to see past the machine's noise
# Later stages source $HOME/kvbatch-best.env, so they run the settings that the bench picked.
set -uo pipefail
S=$HOME/kvbatch-stage SITE=$HOME/kvbatch-site OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ ! -d "$SITE/mlx" ]; then
  cat "$S"/mlxcuda.part.aa .gpu/b/mlxcuda.part.ab > "$S"/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$S"/*.whl || exit 1
fi
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
git log -1 --format='commit %h %s' 2>/dev/null; git status --short 2>/dev/null | head -20
# the checks of one variant take ~2.5 min (60 cases, most of it compiling): check the default only
CHECKS="default:"
# not yet measured: 4 warps x unroll 4 (the best q8 kernel at 256-token splits) with 1024-token splits, and 2048
VARIANTS="default:;old:KVBATCH_CUDA_RAW=0,KVBATCH_CUDA_CHUNK=256:1024;c256:KVBATCH_CUDA_CHUNK=256:1024;w4u4:KVBATCH_CUDA_WARPS=4,KVBATCH_CUDA_UNROLL=4;c2048:KVBATCH_CUDA_CHUNK=2048:1024"
TESTS="tests/test_cuda_kernel_write.py tests/test_engine_paged.py tests/test_kv_quant.py tests/test_nonfinite.py tests/test_memory.py tests/test_lookahead.py"
for arg in "$@"; do
  stage=${arg%%:*} secs=${arg#*:}; [ "$secs" = "$arg" ] && secs=300
  [ -f "$HOME/kvbatch-best.env" ] && source "$HOME/kvbatch-best.env" && cp "$HOME/kvbatch-best.env" "$OUT/best.env"
  echo "== stage $stage (${secs}s) $(date -u +%T) $(env | grep ^KVBATCH_ | tr '\n' ' ')"
  case $stage in
    kernels) timeout "$secs" python3 benchmarks/backend_check.py --parts kernels,bench --kernel-dtypes bfloat16,float32 \
               --kernel-chunks default,48 --check-variants "$CHECKS" --variants "$VARIANTS" \
               --pick-out "$HOME/kvbatch-best.env" 2>&1 | tee "$OUT/kernels.txt" | grep -v "^ok  kernel" ;;
    pytest) timeout "$secs" python3 -m pytest -q -p no:cacheprovider -rs --durations=8 $TESTS 2>&1 | tee "$OUT/pytest.txt" ;;
    gpu8b|gpu1b) g=${stage#gpu}; timeout "$secs" python3 benchmarks/gpu.py --geometry "$g" --repeats 2 \
               --modes none,q8,q4,none@old,q8@old --out "$OUT/gpu_$g.json" 2>&1 | tee "$OUT/gpu_$g.txt" | cut -c1-400 ;;
    long8b) timeout "$secs" python3 benchmarks/gpu.py --geometry 8b --batches '' --repeats 4 \
               --modes none,q8,q4,none@old,q8@old --out "$OUT/gpu_8b_long.json" 2>&1 | tee "$OUT/gpu_8b_long.txt" | cut -c1-400 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "== done $(date -u +%T)"
