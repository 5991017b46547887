#!/usr/bin/env bash
# What only a GPU can prove, in one short call (python -m slipstream.system.gpucheck; its docstring lists the checks).
#
#   bash scripts/gpu_check.sh                   # stage 1 on the GPU machine: carry .whl (scripts/gpu_wheels.sh)
#   bash scripts/gpu_check.sh --stage2          # stage 2 (Ray, NIXL): carry .whl_ray parts / .whl_nixl
#   bash scripts/gpu_check.sh --rehearse DIR    # on a CPU: the stage-1 checks at small shapes in a venv with the
#                                               # GPU image's versions plus exactly the carried wheels
#   ... --only CHECK,CHECK                      # some checks
#
# On the GPU machine results go to $OUT/results.json (what comes back), rewritten after every check, with the
# GPU tests' junit beside it (OUT/gpu_tests.xml). Stage 1 needs no Ray and no NIXL and fits one call of <= 420 s
# (send .whl/ with the checkout). docs/gpu/README.md has the calls of both stages.
# Wheels are installed once per machine into $SLIPSTREAM_GPU_SITE (default /tmp/site): a later call on the same
# warm machine skips what is there. Ray's wheel is larger than one call carries: its parts (.whl_ray_*/*.part.*,
# listed in PARTS) come over two calls (scripts/gpu_wheels.sh gives the three stage-2 calls); they are kept in
# /tmp/slipstream-ray until all are there, then Ray is installed with the jsonschema family it needs.
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=${SLIPSTREAM_GPU_SITE:-/tmp/site}
PARTS=/tmp/slipstream-ray
PY=${PY:-python3}

if [ "${1:-}" = "--rehearse" ]; then
  [ -n "${2:-}" ] || { echo "usage: $0 --rehearse DIR [--reuse-venv] [--only ...]" >&2; exit 2; }
  dir=$2; shift 2
  exec "${REHEARSE_PY:-python3}" -m slipstream.system.gpucheck.rehearse --dir "$dir" "$@"
fi

install_once() {  # WHEEL...: into $SITE, once per machine for this exact set (a stamp named by its hash)
  local stamp
  stamp="$SITE/.carried-$(for w in "$@"; do basename "$w"; done | sort | sha1sum | cut -c1-12)"
  [ -f "$stamp" ] && return 0
  mkdir -p "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@" &&
    touch "$stamp"
}

stage=1
if [ "${1:-}" = "--stage2" ]; then stage=2; shift; fi
if compgen -G ".whl/*.whl" >/dev/null; then install_once .whl/*.whl || exit 1; fi
if compgen -G ".whl_nixl/*.whl" >/dev/null; then install_once .whl_nixl/*.whl || exit 1; fi
for dir in .whl_ray*; do
  [ -f "$dir/PARTS" ] || continue
  mkdir -p "$PARTS" && cp "$dir"/PARTS "$PARTS"/
  compgen -G "$dir/*.part.*" >/dev/null && cp "$dir"/*.part.* "$PARTS"/
  compgen -G "$dir/*.whl" >/dev/null && cp "$dir"/*.whl "$PARTS"/
done
if [ -f "$PARTS/PARTS" ]; then
  missing=$(cd "$PARTS" && while read -r p; do [ -f "$p" ] || echo "$p"; done < PARTS)
  if [ -z "$missing" ]; then
    wheel=$(head -1 "$PARTS/PARTS"); wheel=${wheel%.part.*}
    (cd "$PARTS" && cat $(cat PARTS) > "/tmp/$wheel") &&
      install_once "/tmp/$wheel" "$PARTS"/*.whl && rm -f "/tmp/$wheel"
  else
    echo "Ray: parts still to come: $missing" >&2
  fi
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
[ "${1:-}" = "--install-only" ] && exit 0
exec "$PY" -m slipstream.system.gpucheck --device cuda --stage "$stage" "$@"
