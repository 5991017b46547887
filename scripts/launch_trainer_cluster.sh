#!/usr/bin/env bash
# Start the trainer pool of a Slipstream Ray cluster on this node.
#
# One Ray cluster spans both pools; custom resources mark which nodes belong to which pool, and the
# pipeline places trainer ranks on `trainer_pool` and inference servers + the rollouter on `rollout_pool`
# (names from cluster.trainer_resource / cluster.rollout_resource).
#
#   On the first trainer node:   scripts/launch_trainer_cluster.sh --head
#   On every other trainer node: scripts/launch_trainer_cluster.sh --address HEAD_IP:6379
#   Then on every rollout node:  scripts/launch_rollout_cluster.sh --address HEAD_IP:6379
#   And submit:                  scripts/submit.sh configs/recipes/qwen2.5-7b-dapo-math-64x64.yaml
#
# Options: --gpus N (default: all visible GPUs), --port P (head only, default 6379),
#          --dashboard-host H (head only, default 127.0.0.1: the dashboard stays on loopback unless asked).
set -euo pipefail

role_resource="${SLIPSTREAM_TRAINER_RESOURCE:-trainer_pool}"
exec "$(dirname "$0")/_ray_node.sh" "$role_resource" "$@"
