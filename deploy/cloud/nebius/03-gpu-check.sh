#!/usr/bin/env bash
# Checks the GPU nodes before any training: NB_NODE_COUNT nodes Ready, NB_GPUS_PER_NODE
# allocatable nvidia.com/gpu on each, and nvidia-smi inside a pod on every node (driver, CUDA,
# device plugin, scheduling all work).
# Usage: deploy/cloud/nebius/03-gpu-check.sh
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

[[ $# -eq 0 ]] || die "unknown option '$1' — usage: 03-gpu-check.sh"
need_cmd kubectl "install kubectl: https://kubernetes.io/docs/tasks/tools/"
need_int NB_NODE_COUNT
need_int NB_GPUS_PER_NODE
context=$(current_context)
check_reachable "$context"

# Nodes: Ready ones with GPUs allocatable (the driver preset installs the device plugin).
deadline=$((SECONDS + 1200))
while :; do
  gpu_nodes=$(kc get nodes -o jsonpath='{range .items[*]}{.metadata.name}{" "}{.status.allocatable.nvidia\.com/gpu}{" "}{range .status.conditions[?(@.type=="Ready")]}{.status}{end}{"\n"}{end}' \
    | awk -v want="$NB_GPUS_PER_NODE" '$2 >= want && $3 == "True" {print $1}')
  count=$(wc -w <<<"$gpu_nodes" | tr -d ' ')
  [[ $count -lt $NB_NODE_COUNT ]] || break
  ((SECONDS < deadline)) \
    || die "only $count of $NB_NODE_COUNT nodes are Ready with $NB_GPUS_PER_NODE allocatable nvidia.com/gpu after 20 min — see: kubectl describe nodes | grep -A5 Allocatable"
  info "waiting for GPU nodes: $count of $NB_NODE_COUNT ready"
  sleep 30
done
info "$count GPU nodes Ready: $(tr '\n' ' ' <<<"$gpu_nodes")"

ns=$NB_CHECK_NAMESPACE
for node in $gpu_nodes; do
  pod=gpu-check-${node:0:40}
  pod=${pod%-}
  kc -n "$ns" delete pod "$pod" --ignore-not-found >/dev/null
  kc -n "$ns" apply -f - <<YAML >/dev/null
apiVersion: v1
kind: Pod
metadata: {name: $pod}
spec:
  nodeName: $node
  restartPolicy: Never
  tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
  containers:
    - name: nvidia-smi
      image: $NB_CUDA_IMAGE
      command: [nvidia-smi, --query-gpu=name,memory.total,driver_version, --format=csv]
      resources: {limits: {nvidia.com/gpu: "$NB_GPUS_PER_NODE"}}
YAML
  kc -n "$ns" wait --for=jsonpath='{.status.phase}'=Succeeded "pod/$pod" --timeout=10m >/dev/null \
    || die "nvidia-smi did not succeed on node $node — see: kubectl -n $ns describe pod $pod; kubectl -n $ns logs $pod"
  info "$node:"
  kc -n "$ns" logs "$pod" | sed 's/^/    /'
  kc -n "$ns" delete pod "$pod" --ignore-not-found >/dev/null
done
info "GPUs OK on $count nodes"
