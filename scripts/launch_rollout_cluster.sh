#!/usr/bin/env bash
# Start the rollout pool of a Slipstream Ray cluster on this node (inference servers + the rollouter).
# See scripts/launch_trainer_cluster.sh for the whole procedure.
#
#   On every rollout node: scripts/launch_rollout_cluster.sh --address HEAD_IP:6379 [--gpus N]
#   (or --head, when the rollout pool hosts the head)
set -euo pipefail

role_resource="${SLIPSTREAM_ROLLOUT_RESOURCE:-rollout_pool}"
exec "$(dirname "$0")/_ray_node.sh" "$role_resource" "$@"
