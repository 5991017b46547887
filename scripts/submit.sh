#!/usr/bin/env bash
# Submit a training run to a running Slipstream Ray cluster (see launch_trainer_cluster.sh).
#
#   scripts/submit.sh CONFIG [key=value ...]
#
# RAY_ADDRESS (default http://127.0.0.1:8265, the head's job server) selects the cluster. The config is
# validated locally first, so a bad key fails here, before anything is submitted.
set -euo pipefail

[ $# -ge 1 ] || { sed -n '2,8p' "$0"; exit 2; }
config="$1"; shift
slipstream config show "$config" cluster.ray_address=auto "$@" >/dev/null
exec ray job submit --address "${RAY_ADDRESS:-http://127.0.0.1:8265}" --working-dir . -- \
  slipstream train "$config" cluster.ray_address=auto "$@"
