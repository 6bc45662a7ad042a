#!/usr/bin/env bash
# Deletes what 01-cluster.sh created, in reverse order: the node group (the GPUs bill while it
# exists), the cluster, and with --delete-filesystem the shared filesystem and all data on it.
# Prints what it would delete and stops unless --yes is given. Missing resources are skipped.
# Usage: deploy/cloud/nebius/99-teardown.sh [--yes] [--delete-filesystem]
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

yes=0
delete_fs=0
for arg in "$@"; do
  case $arg in
    --yes) yes=1 ;;
    --delete-filesystem) delete_fs=1 ;;
    *) die "unknown option '$arg' — usage: 99-teardown.sh [--yes] [--delete-filesystem]" ;;
  esac
done
# Without --yes nothing changes: every delete below is printed instead.
[[ $yes == 1 ]] || DRY_RUN=1

nebius_preflight
need_name NB_CLUSTER_NAME
need_name NB_NODE_GROUP_NAME
[[ $delete_fs == 0 ]] || need_name NB_FS_NAME

cluster_id=$(id_by_name mk8s cluster get-by-name --parent-id "$NB_PROJECT_ID" --name "$NB_CLUSTER_NAME")
if [[ -z $cluster_id ]]; then
  info "cluster $NB_CLUSTER_NAME not found: nothing to delete there"
else
  group_id=$(id_by_name mk8s node-group get-by-name --parent-id "$cluster_id" --name "$NB_NODE_GROUP_NAME")
  if [[ -n $group_id ]]; then
    info "node group $NB_NODE_GROUP_NAME ($group_id)"
    run nebius mk8s node-group delete --id "$group_id"
  else
    info "node group $NB_NODE_GROUP_NAME not found"
  fi
  info "cluster $NB_CLUSTER_NAME ($cluster_id)"
  run nebius mk8s cluster delete --id "$cluster_id"
fi

if [[ $delete_fs == 1 ]]; then
  fs_id=$(id_by_name compute filesystem get-by-name --parent-id "$NB_PROJECT_ID" --name "$NB_FS_NAME")
  if [[ -n $fs_id ]]; then
    info "filesystem $NB_FS_NAME ($fs_id) and ALL data on it"
    run nebius compute filesystem delete --id "$fs_id"
  else
    info "filesystem $NB_FS_NAME not found"
  fi
else
  info "keeping filesystem ${NB_FS_NAME:-(NB_FS_NAME)} and its data (--delete-filesystem deletes it)"
fi
[[ $yes == 1 ]] || info "nothing deleted: run again with --yes to delete the above"
