#!/usr/bin/env bash
# Submit a training run to a running Slipstream Ray cluster (see launch_trainer_cluster.sh).
#
#   scripts/submit.sh CONFIG [key=value ...]
#
# RAY_ADDRESS (default http://127.0.0.1:8265, the head's job server) selects the cluster. The config is
# resolved and validated here (a bad key fails before anything is submitted) and travels with the job, so
# it need not exist on the cluster. By default the project's source is uploaded too, so the nodes need only
# the dependencies; with SLIPSTREAM_UPLOAD=0 the nodes run their installed slipstream. Paths inside the
# config (model, data, run.output_dir) are read on the nodes: use storage every node sees.
set -euo pipefail

[ $# -ge 1 ] || { sed -n '2,10p' "$0"; exit 2; }
config="$1"; shift
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/_ray_env.sh
. "$here/_ray_env.sh"
resolved="$(slipstream config show "$config" cluster.ray_address=auto "$@")"
runtime_env="$(printf '%s' "$resolved" | python3 -c \
  'import json, sys; print(json.dumps({"env_vars": {"SLIPSTREAM_JOB_CONFIG": sys.stdin.read()}}))')"
address="${RAY_ADDRESS:-http://127.0.0.1:8265}"
if [ "${SLIPSTREAM_UPLOAD:-1}" = 0 ]; then
  exec ray job submit --address "$address" --runtime-env-json "$runtime_env" -- \
    bash -c 'f="$(mktemp --suffix=.yaml)"; printf "%s" "$SLIPSTREAM_JOB_CONFIG" >"$f"; exec slipstream train "$f"'
fi
exec ray job submit --address "$address" --working-dir "$(dirname "$here")" --runtime-env-json "$runtime_env" \
  -- bash scripts/_job_entry.sh
