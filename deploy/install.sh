#!/usr/bin/env bash
# Installs what kubetune needs on a Kubernetes cluster, in order:
#   1. OpenEBS Local PV hostpath (StorageClass openebs-hostpath)          helm
#   2. MinIO, the artifact bucket and a bucket-scoped account              kustomize + a Job
#   3. Kubeflow Training Operator (PyTorchJob CRD), a pinned release       kubectl -k (remote)
#   4. RBAC for notebooks, then JupyterHub                                 kustomize + helm
#   5. TensorBoard over the shared workspace claim                         kustomize
# Namespaces and Secrets (from deploy/.env, through deploy/secrets.sh) come first.
# Every step is idempotent (apply, helm upgrade --install): run it again after a change.
#
# Usage: deploy/install.sh [--overlay dev|nebius] [--context NAME] [--env-file FILE]
#                          [--skip STEP]... [--dry-run]
#   --overlay   deploy/overlays/NAME: storage classes and sizes (default: dev)
#   --skip      openebs | minio | training-operator | jupyterhub | tensorboard
#   --dry-run   check the prerequisites, then print every change instead of making it
# Versions (environment): TRAINING_OPERATOR_REF (v1.8.1), OPENEBS_CHART_VERSION (4.1.1),
#   JUPYTERHUB_CHART_VERSION (4.2.0).
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

DEPLOY_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib/common.sh
source "$DEPLOY_DIR/lib/common.sh"
# shellcheck source=secrets.sh
source "$DEPLOY_DIR/secrets.sh"

# Pinned: a re-run installs the same thing. The standalone overlay is the Training Operator's
# documented install for v1.8.x; it creates namespace kubeflow.
TRAINING_OPERATOR_REF=${TRAINING_OPERATOR_REF:-v1.8.1}
TRAINING_OPERATOR_KUSTOMIZE="github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref=${TRAINING_OPERATOR_REF}"
OPENEBS_REPO=https://openebs.github.io/dynamic-localpv-provisioner
OPENEBS_CHART_VERSION=${OPENEBS_CHART_VERSION:-4.1.1}
JUPYTERHUB_REPO=https://hub.jupyter.org/helm-chart/
JUPYTERHUB_CHART_VERSION=${JUPYTERHUB_CHART_VERSION:-4.2.0}
# The Training Operator docs ask for kubectl >= 1.28 (server-side apply of its CRDs).
MIN_KUBECTL_MINOR=28

OVERLAY=dev
SKIP=" "

usage() {
  sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

parse_args() {
  while [[ $# -gt 0 ]]; do
    case $1 in
      --overlay) [[ $# -ge 2 ]] || die "--overlay needs a NAME (dev or nebius)"; OVERLAY=$2; shift 2 ;;
      --context) [[ $# -ge 2 ]] || die "--context needs a NAME"; KUBE_CONTEXT=$2; shift 2 ;;
      --env-file) [[ $# -ge 2 ]] || die "--env-file needs a FILE"; SECRETS_ENV_FILE=$2; shift 2 ;;
      --skip)
        [[ $# -ge 2 ]] || die "--skip needs a STEP"
        case $2 in
          openebs | minio | training-operator | jupyterhub | tensorboard) SKIP+="$2 " ;;
          *) die "--skip '$2' is not a step — use openebs, minio, training-operator, jupyterhub or tensorboard" ;;
        esac
        shift 2
        ;;
      --dry-run) DRY_RUN=1; shift ;;
      -h | --help) usage; exit 0 ;;
      *) die "unknown option '$1' — see deploy/install.sh --help" ;;
    esac
  done
  OVERLAY_DIR=$DEPLOY_DIR/overlays/$OVERLAY
  [[ -f $OVERLAY_DIR/kustomization.yaml ]] \
    || die "overlay '$OVERLAY' not found ($OVERLAY_DIR/kustomization.yaml) — use one of: $(cd "$DEPLOY_DIR/overlays" && echo */ | tr -d /)"
}

skipped() {
  [[ $SKIP == *" $1 "* ]]
}

# Everything before the first change: tools, versions, a context, a reachable API server.
preflight() {
  need_cmd kubectl "install kubectl >= 1.$MIN_KUBECTL_MINOR: https://kubernetes.io/docs/tasks/tools/"
  need_cmd helm "install helm 3: https://helm.sh/docs/intro/install/"
  # kubectl fetches the Training Operator's remote kustomization with git.
  skipped training-operator || need_cmd git "install git (kubectl -k fetches the Training Operator manifests with it), or --skip training-operator"

  local minor
  minor=$(kubectl version --client -o json 2>/dev/null | sed -n 's/.*"minor": *"\([0-9]*\).*/\1/p' | head -n 1) || minor=""
  [[ -n $minor ]] || die "cannot read kubectl's version (kubectl version --client -o json) — install kubectl >= 1.$MIN_KUBECTL_MINOR"
  ((minor >= MIN_KUBECTL_MINOR)) \
    || die "kubectl is 1.$minor, older than 1.$MIN_KUBECTL_MINOR — upgrade kubectl: https://kubernetes.io/docs/tasks/tools/"
  local helm_version
  helm_version=$(helm version --short 2>/dev/null | head -n 1) || helm_version=""
  [[ $helm_version =~ ^v([3-9])\. ]] \
    || die "helm reports version '${helm_version:-nothing}', not 3 or later — install helm 3: https://helm.sh/docs/intro/install/"

  CONTEXT=$(current_context)
  check_reachable "$CONTEXT"
  info "context $CONTEXT, overlay $OVERLAY$([[ $DRY_RUN == 1 ]] && printf ' (dry run: nothing is changed)')"
}

# Applies the overlay's objects of one component (label kubetune.io/component).
apply_component() {  # apply_component COMPONENT
  run kc apply -k "$OVERLAY_DIR" -l "kubetune.io/component=$1"
}

step_namespaces() {
  info "namespaces"
  apply_component namespaces
}

step_secrets() {
  info "secrets"
  if [[ -f $SECRETS_ENV_FILE ]]; then
    create_secrets
    return
  fi
  # No .env: a re-run on a set-up cluster keeps the Secrets it has.
  local missing="" pair
  for pair in minio/minio-root minio/minio-credentials kubetune/minio-credentials jupyterhub/minio-credentials; do
    kc -n "${pair%%/*}" get secret "${pair#*/}" >/dev/null 2>&1 || missing+="${missing:+, }$pair"
  done
  [[ -z $missing ]] \
    || die "env file $SECRETS_ENV_FILE not found and Secrets $missing do not exist — copy deploy/.env.example to deploy/.env, fill it in, and run again"
  info "no $SECRETS_ENV_FILE: keeping the Secrets already in the cluster"
}

step_openebs() {
  info "1/5 OpenEBS Local PV hostpath (chart localpv-provisioner $OPENEBS_CHART_VERSION)"
  run hc repo add openebs-localpv "$OPENEBS_REPO" --force-update
  run hc upgrade --install openebs-localpv openebs-localpv/localpv-provisioner \
    --version "$OPENEBS_CHART_VERSION" --namespace openebs --create-namespace \
    --values "$DEPLOY_DIR/helm/openebs-values.yaml" --wait --timeout 5m
}

step_minio() {
  info "2/5 MinIO and the artifact bucket"
  # A Job's pod template cannot change in place, and a finished Job does not run again:
  # replace it so every run re-checks the bucket and the account (it waits for MinIO itself).
  run kc -n minio delete job minio-setup --ignore-not-found
  apply_component minio
  run kc -n minio rollout status deployment/minio --timeout=5m
  run kc -n minio wait --for=condition=complete job/minio-setup --timeout=5m
}

step_training_operator() {
  info "3/5 Kubeflow Training Operator $TRAINING_OPERATOR_REF"
  # Server-side apply: the CRDs are too large for the last-applied annotation of client-side apply.
  run kc apply --server-side -k "$TRAINING_OPERATOR_KUSTOMIZE"
  run kc -n kubeflow rollout status deployment/training-operator --timeout=5m
  run kc wait --for=condition=established crd/pytorchjobs.kubeflow.org --timeout=2m
}

step_jupyterhub() {
  info "4/5 RBAC for notebooks, then JupyterHub (chart jupyterhub $JUPYTERHUB_CHART_VERSION)"
  apply_component rbac
  run hc repo add jupyterhub "$JUPYTERHUB_REPO" --force-update
  local args=(upgrade --install jupyterhub jupyterhub/jupyterhub --version "$JUPYTERHUB_CHART_VERSION"
    --namespace jupyterhub --values "$DEPLOY_DIR/helm/jupyterhub-values.yaml")
  [[ ! -f $OVERLAY_DIR/jupyterhub-values.yaml ]] || args+=(--values "$OVERLAY_DIR/jupyterhub-values.yaml")
  # First start pulls the hub and proxy images.
  args+=(--wait --timeout 15m)
  local password=""
  [[ ! -f $SECRETS_ENV_FILE ]] || password=$(env_get "$SECRETS_ENV_FILE" JUPYTERHUB_PASSWORD)
  if [[ -z $password ]]; then
    warn "no JUPYTERHUB_PASSWORD in $SECRETS_ENV_FILE: JupyterHub accepts any password — keep it behind port-forward"
    run hc "${args[@]}"
  elif [[ $DRY_RUN == 1 ]]; then
    printf '[dry-run] %s --values <(JUPYTERHUB_PASSWORD from %s)\n' "$(shown hc "${args[@]}")" "$SECRETS_ENV_FILE"
  else
    check_secret_value "$SECRETS_ENV_FILE" JUPYTERHUB_PASSWORD "$password" 8
    # The password reaches helm as a values file on a pipe, not as a --set argument.
    hc "${args[@]}" --values <(printf 'hub:\n  config:\n    DummyAuthenticator:\n      password: "%s"\n' "$password")
  fi
}

step_tensorboard() {
  info "5/5 TensorBoard"
  apply_component tensorboard
  run kc -n kubetune rollout status deployment/tensorboard --timeout=5m
}

print_access() {
  local ctx=""
  [[ -z $KUBE_CONTEXT ]] || ctx=" --context $KUBE_CONTEXT"
  cat <<EOF

Reach the services from this machine (each command keeps running; one terminal each):
  MinIO S3 API      kubectl$ctx -n minio port-forward svc/minio 9000:9000        -> http://localhost:9000
  MinIO console     kubectl$ctx -n minio port-forward svc/minio 9001:9001        -> http://localhost:9001
  JupyterHub        kubectl$ctx -n jupyterhub port-forward svc/proxy-public 8080:80 -> http://localhost:8080
  TensorBoard       kubectl$ctx -n kubetune port-forward svc/tensorboard 6006:6006 -> http://localhost:6006
Credentials stay in the cluster; read one when you need it, e.g.:
  kubectl$ctx -n minio get secret minio-root -o jsonpath='{.data.MINIO_ROOT_USER}' | base64 -d
Jobs: kubetune submit job.yaml --namespace kubetune (set kubernetes.secrets.s3: minio-credentials,
  kubernetes.service_account: kubetune-runner); in JupyterHub open examples/notebooks/finetune.ipynb.
EOF
}

main() {
  parse_args "$@"
  preflight
  step_namespaces
  step_secrets
  skipped openebs || step_openebs
  skipped minio || step_minio
  skipped training-operator || step_training_operator
  skipped jupyterhub || step_jupyterhub
  skipped tensorboard || step_tensorboard
  print_access
}

main "$@"
