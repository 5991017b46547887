#!/usr/bin/env bash
# What only a GPU can prove, in one command (<= 25 minutes on one H100): runs `python -m slipstream.gpucheck`
# (see its docstring for the checks) and writes docs/gpu/results.json.
#
# On a GPU machine with Python, torch and transformers but no package registry, bring the rest as wheels
# fetched beforehand with scripts/gpu_wheels.sh (into .whl/, .whl_nixl/, .whl_ray_1/, .whl_ray_2/; how they
# travel is in its header); every folder found here is installed into $SLIPSTREAM_GPU_SITE (default
# /tmp/site) before the checks run. Ray's wheel travels in parts over several calls on the same machine:
# parts found in .whl_ray*/ are kept in /tmp/slipstream-ray and Ray is installed once all have arrived.
# `--stage` installs what it was given and keeps the parts, then stops.
#
#   bash scripts/gpu_check.sh                      # every check
#   bash scripts/gpu_check.sh --only env,gpu_tests # some
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=${SLIPSTREAM_GPU_SITE:-/tmp/site}
PARTS=/tmp/slipstream-ray
PY=${PY:-python3}

install() {  # DIR|FILE...: wheels into $SITE, no index, no dependencies (every one is brought along)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"
}

for dir in .whl .whl_nixl; do
  if compgen -G "$dir/*.whl" >/dev/null; then install "$dir"/*.whl || exit 1; fi
done
for dir in .whl_ray*; do
  if [ -f "$dir/WHEEL" ]; then mkdir -p "$PARTS" && cp "$dir"/WHEEL "$dir"/ray.part.* "$PARTS"/; fi
done
if [ -f "$PARTS/WHEEL" ]; then
  read -r wheel count < "$PARTS/WHEEL"
  if [ "$(ls "$PARTS"/ray.part.* 2>/dev/null | wc -l)" -eq "$count" ]; then
    cat "$PARTS"/ray.part.* > "/tmp/$wheel" && install "/tmp/$wheel" && rm -rf "$PARTS" "/tmp/$wheel"
  else
    echo "Ray: $(ls "$PARTS"/ray.part.* | wc -l) of $count parts here; send the rest" >&2
  fi
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
[ "${1:-}" = "--stage" ] && exit 0
exec timeout 1500 "$PY" -m slipstream.gpucheck --device cuda "$@"
