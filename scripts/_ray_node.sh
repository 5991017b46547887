#!/usr/bin/env bash
# Shared body of launch_{trainer,rollout}_cluster.sh: start a Ray head or worker whose GPUs count as the
# given pool resource. Usage: _ray_node.sh RESOURCE (--head | --address HOST:PORT) [--gpus N] [--port P]
#                             [--dashboard-host H] [--dashboard-port P] [--node-ip-address IP]
set -euo pipefail

resource="$1"; shift
mode=""; address=""; port=6379; dashboard_host="127.0.0.1"; dashboard_port=8265; gpus=""; node_ip=()
while [ $# -gt 0 ]; do
  case "$1" in
    --head) mode=head ;;
    --address) mode=worker; address="$2"; shift ;;
    --gpus) gpus="$2"; shift ;;
    --port) port="$2"; shift ;;
    --dashboard-host) dashboard_host="$2"; shift ;;
    --dashboard-port) dashboard_port="$2"; shift ;;
    --node-ip-address) node_ip=(--node-ip-address="$2"); shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$mode" ] || { echo "pass --head or --address HOST:PORT" >&2; exit 2; }
# shellcheck source=scripts/_ray_env.sh
. "$(dirname "$0")/_ray_env.sh"

if [ -z "$gpus" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi --list-gpus | wc -l)
  else
    gpus=0
  fi
fi
# Pool units count GPUs: only GPU parts (trainer ranks, inference servers) take whole units; CPU parts take a
# sliver or none (slipstream/pipeline/placement.py). A CPU-only node still joins its pool with one unit.
units=$(( gpus > 0 ? gpus : 1 ))
resources="{\"${resource}\": ${units}}"

if [ "$mode" = head ]; then
  exec ray start --head --port="$port" --num-gpus="$gpus" --resources="$resources" "${node_ip[@]}" \
    --dashboard-host="$dashboard_host" --dashboard-port="$dashboard_port" --block
else
  exec ray start --address="$address" --num-gpus="$gpus" --resources="$resources" "${node_ip[@]}" --block
fi
