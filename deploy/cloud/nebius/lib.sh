# shellcheck shell=bash
# Shared by the deploy/cloud/nebius scripts (sourced). Every name and ID comes from the
# environment (see nebius.env.example); nothing here is specific to one account.

# shellcheck source-path=SCRIPTDIR
NEBIUS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../../lib/common.sh
source "$NEBIUS_DIR/../../lib/common.sh"

# Defaults reproduce the target of the seed set-up: 2 nodes x 1 H100, shared filesystem on
# /mnt/data. Each can be overridden from the environment.
: "${NB_NODE_COUNT:=2}"
: "${NB_PLATFORM:=gpu-h100-sxm}"
: "${NB_PRESET:=1gpu-16vcpu-200gb}"
: "${NB_GPUS_PER_NODE:=1}"
: "${NB_DRIVERS_PRESET:=cuda12}"
: "${NB_BOOT_DISK_GIB:=1000}"
: "${NB_FS_SIZE_GIB:=2000}"
: "${NB_FS_TYPE:=network_ssd}"
: "${NB_MOUNT_POINT:=/mnt/data}"
: "${NB_MOUNT_TAG:=csi-storage}"
: "${NB_CSI_CHART_VERSION:=0.1.3}"
: "${NB_CSI_CHART:=oci://cr.eu-north1.nebius.cloud/mk8s/helm/csi-mounted-fs-path}"
: "${NB_CUDA_IMAGE:=nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04}"
: "${NB_CHECK_NAMESPACE:=default}"
export NB_NODE_COUNT NB_PLATFORM NB_PRESET NB_GPUS_PER_NODE NB_DRIVERS_PRESET NB_BOOT_DISK_GIB \
  NB_FS_SIZE_GIB NB_FS_TYPE NB_MOUNT_POINT NB_MOUNT_TAG NB_CSI_CHART_VERSION NB_CSI_CHART \
  NB_CUDA_IMAGE NB_CHECK_NAMESPACE

need_var() {  # need_var NAME HINT
  [[ -n ${!1:-} ]] || die "$1 is not set — $2 (see deploy/cloud/nebius/nebius.env.example)"
}

# Resource names become Nebius names and Kubernetes labels: keep them DNS-label shaped.
need_name() {  # need_name NAME
  need_var "$1" "export $1=a-name-of-your-choice"
  [[ ${!1} =~ ^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$ ]] \
    || die "$1 is '${!1}', not a lowercase DNS label (letters, digits, '-') — choose another name"
}

need_int() {  # need_int NAME
  [[ ${!1} =~ ^[1-9][0-9]*$ ]] || die "$1 is '${!1}', not a positive integer — set a number"
}

nebius_preflight() {
  need_cmd nebius "install the Nebius CLI (curl -sSL https://storage.eu-north1.nebius.cloud/cli/install.sh | bash), then: nebius profile create"
  need_var NB_PROJECT_ID "export NB_PROJECT_ID=<your project ID, Project settings in the Nebius console>"
  nebius iam whoami --format json >/dev/null 2>&1 \
    || die "the Nebius CLI is not signed in (nebius iam whoami failed) — run: nebius profile create"
}

# The CLI's own jsonpath output picks one field, so reading it needs no jq (one tool fewer).
# nebius_field JSONPATH <nebius words...>: the field, or nothing when the call fails (not found).
nebius_field() {
  local path=$1 out
  shift
  out=$(nebius "$@" --format "jsonpath=$path" 2>/dev/null) || return 0
  out=${out//[[:space:]]/}
  # An ID goes into a JSON argument and into messages: refuse anything not shaped like one.
  [[ -z $out || $out =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] \
    || die "nebius $* returned '${out:0:80}' for $path, not a resource ID — check the CLI version (nebius version) and the name"
  printf '%s' "$out"
}

# The ID of a named resource, or nothing. Read-only: runs under --dry-run too.
id_by_name() {  # id_by_name <nebius words...> (e.g. mk8s cluster get-by-name --parent-id X --name Y)
  nebius_field '{.metadata.id}' "$@"
}
