#!/usr/bin/env bash
# Fetch, on a machine with package-registry access, the wheels the GPU machine lacks (it has Python 3.12,
# torch, transformers 5.17, huggingface-hub, tokenizers, safetensors and more, and no registry). The pins
# live in slipstream/system/gpucheck/carry.py (STAGE1, STAGE2_RAY, STAGE2_NIXL); nothing else travels.
#
#   bash scripts/gpu_wheels.sh            # stage 1 -> .whl/ (about 20 MiB; must stay <= 60 MiB)
#   bash scripts/gpu_wheels.sh ray nixl   # stage 2 -> .whl_ray_1/ (48 MiB: Ray's first parts and the jsonschema
#                                         #    family), .whl_ray_2/ (31 MiB: the rest of Ray), .whl_nixl/ (57 MiB)
#
# Stage 1 travels in one call: carry .whl and run `bash scripts/gpu_check.sh`. A call carries at most 64 MiB
# with the 5 MiB working tree, so stage 2 takes three calls, each within the 30 s the machine stays warm:
#   1. carry .whl_ray_1        bash scripts/gpu_check.sh --install-only
#   2. carry .whl_ray_2 .whl   bash scripts/gpu_check.sh --stage2 --only one_gpu_train
#   3. carry .whl_nixl         bash scripts/gpu_check.sh --stage2 --only nixl_weightsync  (.whl still there)
# Whatever a machine has installed is kept for its later calls (gpu_check.sh stamps each wheel set).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
CARRY="$PY slipstream/system/gpucheck/carry.py"
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64"

fetch() {  # SET: every pinned wheel of SET into its folder, nothing else
  local which=$1 dest
  dest=$($CARRY folder "$which")
  rm -rf "$dest" && mkdir -p "$dest"
  # shellcheck disable=SC2086
  $CARRY specs "$which" | xargs "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $PLATFORMS -d "$dest" 2>&1 | grep -v "is ignored: it is neither" || true
}

sets=("$@")
[ ${#sets[@]} -eq 0 ] && sets=(stage1)
for which in "${sets[@]}"; do
  fetch "$which"
  if [ "$which" = ray ]; then  # Ray's wheel is larger than a call carries: parts of 24 MiB, with a manifest
    rm -rf .whl_ray_1 .whl_ray_2 && mkdir -p .whl_ray_1 .whl_ray_2
    (cd .whl_ray && wheel=$(ls ray-*.whl) && split -b 24m "$wheel" "$wheel.part." && rm "$wheel" &&
      ls "$wheel".part.* > PARTS)
    cp .whl_ray/PARTS .whl_ray_1/ && cp .whl_ray/PARTS .whl_ray_2/
    mv .whl_ray/*.whl .whl_ray_1/
    mapfile -t parts < .whl_ray/PARTS
    mv ".whl_ray/${parts[0]}" ".whl_ray/${parts[1]}" .whl_ray_1/ && mv .whl_ray/*.part.* .whl_ray_2/
    rm -rf .whl_ray
  fi
done
$CARRY check
du -sh .whl .whl_ray_1 .whl_ray_2 .whl_nixl 2>/dev/null || true
