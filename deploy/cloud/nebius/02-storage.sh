#!/usr/bin/env bash
# Installs Nebius' csi-mounted-fs-path driver, which serves directories of the shared filesystem
# (mounted on every node at NB_MOUNT_POINT by 01-cluster.sh) as ReadWriteMany volumes through the
# StorageClass csi-mounted-fs-path-sc, and proves it: a claim written on one node is read on the others.
# Usage: deploy/cloud/nebius/02-storage.sh [--dry-run]
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

[[ ${1:-} != --dry-run ]] || DRY_RUN=1
[[ $# -eq 0 || ${1:-} == --dry-run ]] || die "unknown option '$1' — usage: 02-storage.sh [--dry-run]"
need_cmd kubectl "install kubectl: https://kubernetes.io/docs/tasks/tools/"
need_cmd helm "install helm 3 (>= 3.8 for OCI charts): https://helm.sh/docs/intro/install/"
[[ $NB_MOUNT_POINT == /* ]] || die "NB_MOUNT_POINT is '$NB_MOUNT_POINT', not an absolute path — e.g. /mnt/data"
context=$(current_context)
check_reachable "$context"

info "csi-mounted-fs-path $NB_CSI_CHART_VERSION, data under $NB_MOUNT_POINT/csi-mounted-fs-path-data/"
run hc upgrade --install csi-mounted-fs-path "$NB_CSI_CHART" --version "$NB_CSI_CHART_VERSION" \
  --namespace kube-system --set "dataDir=$NB_MOUNT_POINT/csi-mounted-fs-path-data/" --wait --timeout 5m
if [[ $DRY_RUN == 1 ]]; then
  exit 0
fi
kc get storageclass csi-mounted-fs-path-sc >/dev/null 2>&1 \
  || die "StorageClass csi-mounted-fs-path-sc did not appear after installing the chart — check: kubectl -n kube-system get pods | grep csi"

# One claim, one pod per node: each writes its node name, the last lists what all wrote.
ns=$NB_CHECK_NAMESPACE
kc -n "$ns" apply -f - <<YAML >/dev/null
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: kubetune-fs-check}
spec:
  accessModes: [ReadWriteMany]
  storageClassName: csi-mounted-fs-path-sc
  resources: {requests: {storage: 1Gi}}
YAML
nodes=$(kc get nodes -o jsonpath='{.items[*].metadata.name}')
last=""
for node in $nodes; do
  pod=fs-check-${node:0:40}
  pod=${pod%-}
  kc -n "$ns" delete pod "$pod" --ignore-not-found >/dev/null
  kc -n "$ns" apply -f - <<YAML >/dev/null
apiVersion: v1
kind: Pod
metadata: {name: $pod}
spec:
  nodeName: $node
  restartPolicy: Never
  tolerations: [{operator: Exists}]
  containers:
    - name: check
      image: busybox:1.36
      command: [sh, -c, 'echo ok > /shared/$node && ls /shared']
      volumeMounts: [{name: shared, mountPath: /shared}]
  volumes: [{name: shared, persistentVolumeClaim: {claimName: kubetune-fs-check}}]
YAML
  kc -n "$ns" wait --for=jsonpath='{.status.phase}'=Succeeded "pod/$pod" --timeout=5m >/dev/null \
    || die "pod $pod on node $node did not finish writing to the shared claim — see: kubectl -n $ns describe pod $pod"
  last=$pod
done
seen=$(kc -n "$ns" logs "$last")
for node in $nodes; do
  grep -qxF "$node" <<<"$seen" || die "the shared claim does not show node $node's file on the last node — the filesystem is not shared; check the mount on $node ($NB_MOUNT_POINT)"
done
info "shared filesystem OK: every node wrote to one ReadWriteMany claim ($(wc -w <<<"$nodes" | tr -d ' ') nodes)"
for node in $nodes; do
  pod=fs-check-${node:0:40}
  kc -n "$ns" delete pod "${pod%-}" --ignore-not-found >/dev/null
done
kc -n "$ns" delete pvc kubetune-fs-check --ignore-not-found >/dev/null
info "next: deploy/cloud/nebius/03-gpu-check.sh, then deploy/install.sh --overlay nebius"
