#!/usr/bin/env bash
# Creates (or updates) the Secrets kubetune's cluster set-up needs, from deploy/.env:
#   minio/minio-root             MINIO_ROOT_USER, MINIO_ROOT_PASSWORD        (MinIO, setup Job)
#   minio/minio-credentials      AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY   (setup Job creates this account)
#   kubetune/minio-credentials   + AWS_ENDPOINT_URL   (jobs: kubernetes.secrets.s3: minio-credentials)
#   jupyterhub/minio-credentials + AWS_ENDPOINT_URL   (notebooks read outputs from s3://)
#   kubetune/hf-secrets          HF_TOKEN, when set   (jobs: kubernetes.secrets.hf_token)
#
# Values travel from the file to kubectl through a pipe (--from-env-file on a process
# substitution written by the printf builtin) and `kubectl apply -f -`: never as command-line
# arguments, which other users see in `ps`, and never printed. Idempotent (apply).
#
# Usage: deploy/secrets.sh [--env-file FILE] [--context NAME] [--dry-run]
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

DEPLOY_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib/common.sh
source "$DEPLOY_DIR/lib/common.sh"

SECRETS_ENV_FILE=${KUBETUNE_ENV_FILE:-$DEPLOY_DIR/.env}
DEFAULT_S3_ENDPOINT=http://minio.minio.svc.cluster.local:9000

# apply_secret NAMESPACE NAME KEY...: the values are the shell variables named KEY.
apply_secret() {
  local ns=$1 name=$2
  shift 2
  if [[ $DRY_RUN == 1 ]]; then
    printf '[dry-run] apply Secret %s/%s (keys: %s)\n' "$ns" "$name" "$*"
    return
  fi
  kc -n "$ns" create secret generic "$name" --dry-run=client -o yaml \
    --from-env-file=<(for key in "$@"; do printf '%s=%s\n' "$key" "${!key}"; done) \
    | kc apply -f - >/dev/null
  info "Secret $ns/$name applied (keys: $*)"
}

# Reads and checks deploy/.env, then applies the Secrets. Called by install.sh too.
create_secrets() {
  local file=$SECRETS_ENV_FILE ns
  [[ -f $file ]] || die "env file $file not found — copy deploy/.env.example to deploy/.env and fill it in (or pass --env-file FILE)"
  env_check_syntax "$file"

  MINIO_ROOT_USER=$(env_get "$file" MINIO_ROOT_USER)
  MINIO_ROOT_PASSWORD=$(env_get "$file" MINIO_ROOT_PASSWORD)
  AWS_ACCESS_KEY_ID=$(env_get "$file" AWS_ACCESS_KEY_ID)
  AWS_SECRET_ACCESS_KEY=$(env_get "$file" AWS_SECRET_ACCESS_KEY)
  AWS_ENDPOINT_URL=$(env_get "$file" AWS_ENDPOINT_URL)
  AWS_ENDPOINT_URL=${AWS_ENDPOINT_URL:-$DEFAULT_S3_ENDPOINT}
  HF_TOKEN=$(env_get "$file" HF_TOKEN)

  # MinIO refuses a root password under 8 characters and a user named like the root user.
  check_secret_value "$file" MINIO_ROOT_USER "$MINIO_ROOT_USER" 3
  check_secret_value "$file" MINIO_ROOT_PASSWORD "$MINIO_ROOT_PASSWORD" 8
  check_secret_value "$file" AWS_ACCESS_KEY_ID "$AWS_ACCESS_KEY_ID" 3
  check_secret_value "$file" AWS_SECRET_ACCESS_KEY "$AWS_SECRET_ACCESS_KEY" 8
  [[ $AWS_ACCESS_KEY_ID != "$MINIO_ROOT_USER" ]] \
    || die "AWS_ACCESS_KEY_ID in $file equals MINIO_ROOT_USER — the jobs' account must be a separate, bucket-scoped one; choose another name"
  [[ $AWS_ENDPOINT_URL =~ ^https?://[^[:space:]]+$ ]] \
    || die "AWS_ENDPOINT_URL in $file is '$AWS_ENDPOINT_URL', not an http(s):// URL — remove it to use $DEFAULT_S3_ENDPOINT"
  if [[ -n $HF_TOKEN && ! $HF_TOKEN =~ ^[A-Za-z0-9_-]+$ ]]; then
    die "HF_TOKEN in $file (${#HF_TOKEN} characters) is not a Hugging Face token (letters, digits, _ and -) — copy it again from https://huggingface.co/settings/tokens"
  fi

  for ns in minio kubetune jupyterhub; do
    [[ $DRY_RUN == 1 ]] || kc get namespace "$ns" >/dev/null 2>&1 \
      || die "namespace '$ns' does not exist — run deploy/install.sh (it creates the namespaces, then calls this script) or kubectl apply -k deploy/namespaces"
  done

  apply_secret minio minio-root MINIO_ROOT_USER MINIO_ROOT_PASSWORD
  apply_secret minio minio-credentials AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY
  apply_secret kubetune minio-credentials AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_ENDPOINT_URL
  apply_secret jupyterhub minio-credentials AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_ENDPOINT_URL
  if [[ -n $HF_TOKEN ]]; then
    apply_secret kubetune hf-secrets HF_TOKEN
  else
    info "HF_TOKEN not set in $file: no hf-secrets Secret (public models and datasets need none)"
  fi
}

main() {
  while [[ $# -gt 0 ]]; do
    case $1 in
      --env-file) [[ $# -ge 2 ]] || die "--env-file needs a FILE"; SECRETS_ENV_FILE=$2; shift 2 ;;
      --context) [[ $# -ge 2 ]] || die "--context needs a NAME"; KUBE_CONTEXT=$2; shift 2 ;;
      --dry-run) DRY_RUN=1; shift ;;
      -h | --help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
      *) die "unknown option '$1' — see deploy/secrets.sh --help" ;;
    esac
  done
  need_cmd kubectl "install kubectl: https://kubernetes.io/docs/tasks/tools/"
  local context
  context=$(current_context)
  check_reachable "$context"
  create_secrets
}

# Run main only when executed; install.sh sources this file for create_secrets.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  main "$@"
fi
