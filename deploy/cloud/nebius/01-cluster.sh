#!/usr/bin/env bash
# Creates, if they do not exist yet (re-running is safe):
#   the shared filesystem NB_FS_NAME, the managed Kubernetes cluster NB_CLUSTER_NAME (public
#   API endpoint), and the GPU node group NB_NODE_GROUP_NAME (NB_NODE_COUNT nodes of NB_PLATFORM /
#   NB_PRESET with NVIDIA drivers) with the filesystem attached and mounted on NB_MOUNT_POINT by
#   cloud-init; then writes the cluster's credentials into your kubeconfig.
# Usage: deploy/cloud/nebius/01-cluster.sh [--dry-run]
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

[[ ${1:-} != --dry-run ]] || DRY_RUN=1
[[ $# -eq 0 || ${1:-} == --dry-run ]] || die "unknown option '$1' — usage: 01-cluster.sh [--dry-run]"

nebius_preflight
need_name NB_CLUSTER_NAME
need_name NB_NODE_GROUP_NAME
need_name NB_FS_NAME
for n in NB_NODE_COUNT NB_GPUS_PER_NODE NB_BOOT_DISK_GIB NB_FS_SIZE_GIB; do need_int "$n"; done
[[ $NB_MOUNT_POINT == /* ]] || die "NB_MOUNT_POINT is '$NB_MOUNT_POINT', not an absolute path — e.g. /mnt/data"
[[ $NB_MOUNT_TAG =~ ^[a-z0-9-]+$ ]] || die "NB_MOUNT_TAG is '$NB_MOUNT_TAG' — use lowercase letters, digits and '-'"

# The node group runs as a service account (it pulls images, attaches disks).
sa_id=${NB_NODE_SA_ID:-}
if [[ -z $sa_id ]]; then
  need_var NB_NODE_SA_NAME "set NB_NODE_SA_ID, or NB_NODE_SA_NAME to an existing service account's name"
  sa_id=$(id_by_name iam service-account get-by-name --parent-id "$NB_PROJECT_ID" --name "$NB_NODE_SA_NAME")
  [[ -n $sa_id ]] || die "service account '$NB_NODE_SA_NAME' not found in project $NB_PROJECT_ID — create it (nebius iam service-account create --name $NB_NODE_SA_NAME) and add it to the project's editors group, or set NB_NODE_SA_ID"
fi

subnet_id=${NB_SUBNET_ID:-}
if [[ -z $subnet_id ]]; then
  subnet_id=$(nebius_field '{.items[0].metadata.id}' vpc subnet list --parent-id "$NB_PROJECT_ID")
  [[ -n $subnet_id ]] || die "project $NB_PROJECT_ID has no VPC subnet — create one in the console, or set NB_SUBNET_ID"
  info "subnet $subnet_id (the project's first; set NB_SUBNET_ID to choose)"
fi

# 1. Shared filesystem: network SSD, attached to every node (virtiofs).
fs_id=$(id_by_name compute filesystem get-by-name --parent-id "$NB_PROJECT_ID" --name "$NB_FS_NAME")
if [[ -n $fs_id ]]; then
  info "filesystem $NB_FS_NAME exists ($fs_id)"
else
  info "creating filesystem $NB_FS_NAME (${NB_FS_SIZE_GIB} GiB $NB_FS_TYPE)"
  run_quiet nebius compute filesystem create --parent-id "$NB_PROJECT_ID" --name "$NB_FS_NAME" \
    --size-gibibytes "$NB_FS_SIZE_GIB" --type "$NB_FS_TYPE" --block-size-bytes 4096 --format json
  fs_id=$(id_by_name compute filesystem get-by-name --parent-id "$NB_PROJECT_ID" --name "$NB_FS_NAME")
  [[ -n $fs_id || $DRY_RUN == 1 ]] || die "filesystem $NB_FS_NAME was not created — see the error above"
  fs_id=${fs_id:-"<new filesystem id>"}
fi

# 2. Control plane with a public endpoint (kubectl from your machine).
cluster_id=$(id_by_name mk8s cluster get-by-name --parent-id "$NB_PROJECT_ID" --name "$NB_CLUSTER_NAME")
if [[ -n $cluster_id ]]; then
  info "cluster $NB_CLUSTER_NAME exists ($cluster_id)"
else
  info "creating cluster $NB_CLUSTER_NAME (takes several minutes)"
  # Empty-array expansion below is written for bash 3.2 (macOS) under set -u.
  version_args=()
  [[ -z ${NB_K8S_VERSION:-} ]] || version_args=(--control-plane-version "$NB_K8S_VERSION")
  run_quiet nebius mk8s cluster create --parent-id "$NB_PROJECT_ID" --name "$NB_CLUSTER_NAME" \
    --control-plane-subnet-id "$subnet_id" --control-plane-endpoints-public-endpoint=true \
    ${version_args[@]+"${version_args[@]}"} --format json
  cluster_id=$(id_by_name mk8s cluster get-by-name --parent-id "$NB_PROJECT_ID" --name "$NB_CLUSTER_NAME")
  [[ -n $cluster_id || $DRY_RUN == 1 ]] || die "cluster $NB_CLUSTER_NAME was not created — see the error above"
  cluster_id=${cluster_id:-"<new cluster id>"}
fi

# 3. GPU node group. cloud-init mounts the filesystem by its tag on every node, now and after
#    reboots (fstab, nofail so a node still boots without it); the CSI driver (02-storage.sh)
#    then serves sub-directories of the mount as ReadWriteMany volumes.
cloud_init="runcmd:
  - mkdir -p $NB_MOUNT_POINT
  - mount -t virtiofs $NB_MOUNT_TAG $NB_MOUNT_POINT
  - grep -qs '^$NB_MOUNT_TAG ' /etc/fstab || echo '$NB_MOUNT_TAG $NB_MOUNT_POINT virtiofs defaults,nofail 0 2' >> /etc/fstab
"
# Plain printf is safe JSON here: the tag is checked above, and the ID by nebius_field (or the
# dry run's placeholder).
filesystems=$(printf '[{"attach_mode":"READ_WRITE","mount_tag":"%s","existing_filesystem":{"id":"%s"}}]' "$NB_MOUNT_TAG" "$fs_id")
group_id=$(id_by_name mk8s node-group get-by-name --parent-id "$cluster_id" --name "$NB_NODE_GROUP_NAME")
if [[ -n $group_id ]]; then
  info "node group $NB_NODE_GROUP_NAME exists ($group_id); change it in the console or delete it with 99-teardown.sh"
else
  info "creating node group $NB_NODE_GROUP_NAME: $NB_NODE_COUNT x $NB_PLATFORM/$NB_PRESET (takes several minutes)"
  run_quiet nebius mk8s node-group create --parent-id "$cluster_id" --name "$NB_NODE_GROUP_NAME" \
    --fixed-node-count "$NB_NODE_COUNT" \
    --template-resources-platform "$NB_PLATFORM" --template-resources-preset "$NB_PRESET" \
    --template-gpu-settings-drivers-preset "$NB_DRIVERS_PRESET" \
    --template-boot-disk-type network_ssd --template-boot-disk-size-gibibytes "$NB_BOOT_DISK_GIB" \
    --template-service-account-id "$sa_id" \
    --template-filesystems "$filesystems" \
    --template-cloud-init-user-data "$cloud_init" \
    --format json
fi

# 4. Credentials: a kubeconfig context for the public endpoint (--force replaces a stale one).
run nebius mk8s cluster get-credentials --id "$cluster_id" --external --force
if [[ $DRY_RUN != 1 ]]; then
  info "kubectl context: $(kubectl config current-context)"
  info "next: deploy/cloud/nebius/02-storage.sh"
fi
