#!/usr/bin/env bash
# Fetch, on a machine with package-registry access, the wheels scripts/gpu_check.sh needs on a GPU machine
# that has Python 3.12, torch and transformers but no registry (its image lacks our other dependencies).
# The versions are this checkout's virtualenv's, so the GPU run uses what the test suite used.
#
#   bash scripts/gpu_wheels.sh     # -> .whl/ (small wheels, 26 MB), .whl_nixl/ (57 MB), and Ray's wheel cut
#                                  #    in parts: .whl_ray_1/ (34 MB), .whl_ray_2/ (the rest)
# A call to the GPU machine carries at most 64 MiB, so they travel in three calls sent back to back (the
# machine keeps /tmp between calls while it is held):
#   1. carry .whl .whl_ray_1   bash scripts/gpu_check.sh --stage
#   2. carry .whl_ray_2        bash scripts/gpu_check.sh --stage
#   3. carry .whl_nixl         bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SMALL="msgspec pyzmq tensordict pyvers fastapi starlette pydantic pydantic-core annotated-types
  typing-inspection opentelemetry-api uvicorn transformers huggingface-hub tokenizers
  safetensors megatron-core math-verify latex2sympy2_extended antlr4-python3-runtime gguf"
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64"

pinned() {  # NAME==VERSION as installed here (a NAME==VERSION given stays as it is)
  case $1 in *==*) echo "$1" ;; *)
    "$PY" -c "import importlib.metadata as m, sys; print(f'{sys.argv[1]}=={m.version(sys.argv[1])}')" "$1" ;;
  esac
}

fetch() {  # DEST NAME...
  local dest=$1; shift
  mkdir -p "$dest"
  for name in "$@"; do
    spec=$(pinned "$name")
    # shellcheck disable=SC2086
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      $PLATFORMS -d "$dest" "$spec" 2>&1 | grep -v "is ignored: it is neither" || true
    ls "$dest" | grep -qi "^${spec%%==*}" || ls "$dest" | grep -qi "^$(echo "${spec%%==*}" | tr - _)" ||
      { echo "could not fetch $spec" >&2; exit 1; }
  done
}

rm -rf .whl .whl_nixl .whl_ray .whl_ray_1 .whl_ray_2
# shellcheck disable=SC2086
fetch .whl $SMALL
NIXL=$("$PY" -c "import importlib.metadata as m; print(m.version('nixl'))")
fetch .whl_nixl "nixl==$NIXL" "nixl-cu13==$NIXL"
fetch .whl_ray ray
(cd .whl_ray && wheel=$(ls ray-*.whl) && split -b 34m "$wheel" ray.part. && rm "$wheel" &&
  echo "$wheel $(ls ray.part.* | wc -l)" > WHEEL)
mkdir -p .whl_ray_1 .whl_ray_2
cp .whl_ray/WHEEL .whl_ray_1/ && cp .whl_ray/WHEEL .whl_ray_2/
mv .whl_ray/ray.part.aa .whl_ray_1/ && mv .whl_ray/ray.part.* .whl_ray_2/ && rm -rf .whl_ray
du -sh .whl .whl_nixl .whl_ray_1 .whl_ray_2
