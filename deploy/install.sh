#!/usr/bin/env bash
# Installs what kubetune needs on a Kubernetes cluster, in order:
#   1. OpenEBS Local PV hostpath (StorageClass openebs-hostpath)          helm
#   2. MinIO, the artifact bucket and a bucket-scoped account              kustomize + a Job
#   3. Kubeflow Training Operator (PyTorchJob CRD), a pinned release       kubectl -k (remote)
#   +  only with --with trainer: Kubeflow Trainer v2 (TrainJob CRD) and    kubectl -k (remote)
#      the JobSet it ships, then its ClusterTrainingRuntimes
#   +  only with --with kserve: KServe (InferenceService CRD, controller,    kubectl (release URL)
#      the Hugging Face ClusterServingRuntime); needs cert-manager
#   +  only with --with katib: Katib (Experiment CRD, controller, its DB),    kubectl -k (remote)
#      then the kubetune namespace labelled for Katib's webhook
#   4. RBAC for notebooks, then JupyterHub                                 kustomize + helm
#   5. TensorBoard over the shared workspace claim                         kustomize
#   6. An MLflow tracking server (artifacts in the MinIO bucket)           kustomize
# Namespaces and Secrets (from deploy/.env, through deploy/secrets.sh) come first.
# Every step is idempotent (apply, helm upgrade --install): run it again after a change.
#
# Usage: deploy/install.sh [--overlay dev|nebius] [--context NAME] [--env-file FILE]
#                          [--with trainer|kserve|katib]... [--trainjob-status] [--skip STEP]... [--dry-run]
#   --overlay   deploy/overlays/NAME: storage classes and sizes (default: dev)
#   --with      trainer: also install Kubeflow Trainer v2 and JobSet, for kubetune's
#               --target trainjob (needs Kubernetes and kubectl >= 1.31);
#               kserve: also install KServe, for `kubetune render --serve` (needs cert-manager);
#               katib: also install Katib, for `kubetune submit --tune` (its DB needs a default
#               StorageClass: OpenEBS's, step 1)
#   --trainjob-status  with --with trainer: turn on the Trainer's TrainJobStatus feature gate
#               (alpha), so a TrainJob's rank 0 reports progress into status.trainerStatus
#   --skip      openebs | minio | training-operator | jupyterhub | tensorboard | mlflow
#   --dry-run   check the prerequisites, then print every change instead of making it
# Versions (environment): TRAINING_OPERATOR_REF (v1.8.1), TRAINER_REF (v2.3.0, which ships
#   JobSet v0.12.0), KSERVE_REF (v0.20.0), KATIB_REF (v0.19.0), OPENEBS_CHART_VERSION (4.1.1),
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
# Kubeflow Trainer v2 (--with trainer), upstream's kustomize install (kubeflow/trainer
# docs/operator-guides/installation.md): overlays/manager holds the CRDs, the controller, its
# webhooks and JobSet (third-party/jobset: v0.12.0 at v2.3.0), all in namespace kubeflow-system;
# overlays/runtimes the ClusterTrainingRuntimes (torch-distributed, ...), applied once the manager
# runs. kubetune's TrainJob target needs v2.3 or later (older ones drop fields it sends).
TRAINER_REF=${TRAINER_REF:-v2.3.0}
TRAINER_MANAGER_KUSTOMIZE="https://github.com/kubeflow/trainer.git/manifests/overlays/manager?ref=${TRAINER_REF}"
TRAINER_RUNTIMES_KUSTOMIZE="https://github.com/kubeflow/trainer.git/manifests/overlays/runtimes?ref=${TRAINER_REF}"
TRAINER_NAMESPACE=kubeflow-system
# Trainer's docs: Kubernetes >= 1.31 and kubectl >= 1.31.
TRAINER_MIN_MINOR=31
# KServe (--with kserve), upstream's release manifests (kserve/kserve, docs/install): kserve.yaml holds
# the CRDs, the controller and its webhooks in namespace kserve; kserve-cluster-resources.yaml the
# ClusterServingRuntimes (kserve-huggingfaceserver, which `kubetune render --serve` selects) and the
# storage initializer, applied once the controller runs. The webhook's certificates come from
# cert-manager, which must be installed first. kubetune's InferenceServices ask for Standard mode
# (a Deployment and a Service), so Knative is not needed.
KSERVE_REF=${KSERVE_REF:-v0.20.0}
KSERVE_MANIFESTS="https://github.com/kserve/kserve/releases/download/${KSERVE_REF}/kserve.yaml"
KSERVE_RESOURCES="https://github.com/kserve/kserve/releases/download/${KSERVE_REF}/kserve-cluster-resources.yaml"
KSERVE_NAMESPACE=kserve
# Katib (--with katib), upstream's standalone install (kubeflow/katib docs: installation): the
# Experiment, Suggestion and Trial CRDs, katib-controller (its webhook certificate it makes itself),
# katib-db-manager and katib-mysql (on a claim of the default StorageClass), katib-ui, in namespace
# kubeflow. Katib's webhook admits Experiments only in namespaces labelled for its metrics collector.
KATIB_REF=${KATIB_REF:-v0.19.0}
KATIB_KUSTOMIZE="github.com/kubeflow/katib.git/manifests/v1beta1/installs/katib-standalone?ref=${KATIB_REF}"
KATIB_NAMESPACE=kubeflow
KATIB_LABEL=katib.kubeflow.org/metrics-collector-injection=enabled
CERT_MANAGER_HINT="kubectl apply -f https://github.com/cert-manager/cert-manager/releases/download/v1.16.2/cert-manager.yaml"

OVERLAY=dev
SKIP=" "
WITH=" "
TRAINJOB_STATUS=0
TRAINER_GATE_DIR=""

usage() {  # the header: every comment line from line 2 up to the shellcheck directive
  sed -n '2,/^# shellcheck/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
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
          openebs | minio | training-operator | jupyterhub | tensorboard | mlflow) SKIP+="$2 " ;;
          *) die "--skip '$2' is not a step — use openebs, minio, training-operator, jupyterhub or tensorboard" ;;
        esac
        shift 2
        ;;
      --with)
        [[ $# -ge 2 ]] || die "--with needs a COMPONENT (trainer, kserve or katib)"
        case $2 in
          trainer | kserve | katib) WITH+="$2 " ;;
          *) die "--with '$2' is not an optional component — use trainer, kserve or katib" ;;
        esac
        shift 2
        ;;
      --trainjob-status) TRAINJOB_STATUS=1; shift ;;
      --dry-run) DRY_RUN=1; shift ;;
      -h | --help) usage; exit 0 ;;
      *) die "unknown option '$1' — see deploy/install.sh --help" ;;
    esac
  done
  OVERLAY_DIR=$DEPLOY_DIR/overlays/$OVERLAY
  [[ -f $OVERLAY_DIR/kustomization.yaml ]] \
    || die "overlay '$OVERLAY' not found ($OVERLAY_DIR/kustomization.yaml) — use one of: $(cd "$DEPLOY_DIR/overlays" && echo */ | tr -d /)"
  [[ $TRAINJOB_STATUS == 0 ]] || wanted trainer \
    || die "--trainjob-status turns on a feature gate of the Kubeflow Trainer that --with trainer installs — add --with trainer, or enable the gate on your own Trainer (--feature-gates=TrainJobStatus=true on its controller)"
  PLAN="openebs minio training-operator"
  if wanted trainer; then
    PLAN+=" trainer"
  fi
  if wanted kserve; then
    PLAN+=" kserve"
  fi
  if wanted katib; then
    PLAN+=" katib"
  fi
  PLAN+=" jupyterhub tensorboard mlflow"
}

skipped() {
  [[ $SKIP == *" $1 "* ]]
}

wanted() {
  [[ $WITH == *" $1 "* ]]
}

# "==> i/n TEXT": the step's place in this run's plan, which has one more step with --with
# trainer (a skipped step keeps its number).
step_title() {  # step_title STEP TEXT
  local step n=0 at=0
  for step in $PLAN; do
    n=$((n + 1))
    [[ $step != "$1" ]] || at=$n
  done
  info "$at/$n $2"
}

# kubetune's TrainJob target needs Trainer v2.3 or later: v2.0/v2.1 drop runtimePatches, v2.2
# drops terminationGracePeriodSeconds (the SIGTERM checkpoint).
check_trainer_ref() {
  if [[ $TRAINER_REF =~ ^v([0-9]+)\.([0-9]+)\.[0-9]+ ]]; then
    local major=${BASH_REMATCH[1]} minor=${BASH_REMATCH[2]}
    ((major > 2 || (major == 2 && minor >= 3))) \
      || die "TRAINER_REF=$TRAINER_REF is older than v2.3.0, the first Kubeflow Trainer kubetune's TrainJob target works with — unset TRAINER_REF (default v2.3.0) or set v2.3.0 or later"
  else
    warn "TRAINER_REF=$TRAINER_REF is not a release tag (vX.Y.Z): kubetune's TrainJob target needs Trainer v2.3 or later, which install.sh cannot check for this ref"
  fi
}

# Everything before the first change: tools, versions, a context, a reachable API server.
preflight() {
  need_cmd kubectl "install kubectl >= 1.$MIN_KUBECTL_MINOR: https://kubernetes.io/docs/tasks/tools/"
  need_cmd helm "install helm 3: https://helm.sh/docs/intro/install/"
  # kubectl fetches the Training Operator's and the Trainer's remote kustomizations with git.
  skipped training-operator || need_cmd git "install git (kubectl -k fetches the Training Operator manifests with it), or --skip training-operator"
  if wanted trainer; then
    need_cmd git "install git (kubectl -k fetches the Kubeflow Trainer manifests with it), or leave out --with trainer"
  fi
  if wanted katib; then
    need_cmd git "install git (kubectl -k fetches the Katib manifests with it), or leave out --with katib"
  fi

  local minor
  minor=$(kubectl version --client -o json 2>/dev/null | sed -n 's/.*"minor": *"\([0-9]*\).*/\1/p' | head -n 1) || minor=""
  [[ -n $minor ]] || die "cannot read kubectl's version (kubectl version --client -o json) — install kubectl >= 1.$MIN_KUBECTL_MINOR"
  ((minor >= MIN_KUBECTL_MINOR)) \
    || die "kubectl is 1.$minor, older than 1.$MIN_KUBECTL_MINOR — upgrade kubectl: https://kubernetes.io/docs/tasks/tools/"
  if wanted trainer; then
    ((minor >= TRAINER_MIN_MINOR)) \
      || die "kubectl is 1.$minor, older than the 1.$TRAINER_MIN_MINOR that Kubeflow Trainer $TRAINER_REF asks for — upgrade kubectl (https://kubernetes.io/docs/tasks/tools/), or leave out --with trainer"
  fi
  local helm_version
  helm_version=$(helm version --short 2>/dev/null | head -n 1) || helm_version=""
  [[ $helm_version =~ ^v([3-9])\. ]] \
    || die "helm reports version '${helm_version:-nothing}', not 3 or later — install helm 3: https://helm.sh/docs/intro/install/"

  CONTEXT=$(current_context)
  check_reachable "$CONTEXT"
  if wanted trainer; then
    preflight_trainer
  fi
  if wanted kserve; then
    # KServe's webhook server gets its certificate from a cert-manager Certificate.
    kc get crd certificates.cert-manager.io >/dev/null 2>&1 \
      || die "cert-manager is not installed on context '$CONTEXT' (no CRD certificates.cert-manager.io), and KServe's webhook needs it for its certificate — install it first ($CERT_MANAGER_HINT, then wait for its deployments), or leave out --with kserve"
  fi
  info "context $CONTEXT, overlay $OVERLAY$([[ $DRY_RUN == 1 ]] && printf ' (dry run: nothing is changed)')"
}

# --with trainer, before any change: the cluster's Kubernetes version, and no Trainer or JobSet
# installed some other way (a second controller would reconcile the same TrainJobs or JobSets,
# and the apply would re-point the existing webhook configurations at ours).
preflight_trainer() {
  local minor
  minor=$(kc get --raw=/version --request-timeout=10s 2>/dev/null | sed -n 's/.*"minor": *"\([0-9]*\).*/\1/p' | head -n 1) || minor=""
  [[ -n $minor ]] || die "cannot read the Kubernetes version of context '$CONTEXT' (kubectl get --raw=/version) — check that 'kubectl version' works, or leave out --with trainer"
  ((minor >= TRAINER_MIN_MINOR)) \
    || die "context '$CONTEXT' runs Kubernetes 1.$minor, older than the 1.$TRAINER_MIN_MINOR that Kubeflow Trainer $TRAINER_REF needs — upgrade the cluster, or leave out --with trainer (and submit with --target pytorchjob)"

  local configs name managed namespaces groups ns
  # One line per ValidatingWebhookConfiguration: name|managed-by label|service namespaces|API groups
  # ('|', not a tab: read would merge the empty fields between IFS whitespace).
  configs=$(kc get validatingwebhookconfigurations -o jsonpath='{range .items[*]}{.metadata.name}{"|"}{.metadata.labels.app\.kubernetes\.io/managed-by}{"|"}{.webhooks[*].clientConfig.service.namespace}{"|"}{.webhooks[*].rules[*].apiGroups[*]}{"\n"}{end}' 2>/dev/null) \
    || die "cannot list the ValidatingWebhookConfigurations of context '$CONTEXT' — --with trainer installs CRDs and webhooks: run it with cluster-admin rights"
  while IFS='|' read -r name managed namespaces groups; do
    [[ -n $name ]] || continue
    ns=${namespaces%% *}
    if [[ " $groups " == *" trainer.kubeflow.org "* ]]; then
      [[ $ns == "$TRAINER_NAMESPACE" ]] \
        || die "Kubeflow Trainer is already installed, served from namespace '$ns' (ValidatingWebhookConfiguration $name) — leave out --with trainer and use it if it is v2.3 or later (a second Trainer would fight it over the same TrainJobs), or remove it first"
      [[ $managed != Helm ]] \
        || die "Kubeflow Trainer is installed by Helm in namespace '$ns' (ValidatingWebhookConfiguration $name) — upgrade that release (chart kubeflow-trainer 2.3.0 or later) and leave out --with trainer; install.sh's kustomize manifests would conflict with it"
    elif [[ " $groups " == *" jobset.x-k8s.io "* ]]; then
      [[ $ns == "$TRAINER_NAMESPACE" && $managed != Helm ]] \
        || die "JobSet is already installed, served from namespace '$ns' (ValidatingWebhookConfiguration $name), and Kubeflow Trainer's manifests bring their own into $TRAINER_NAMESPACE (two JobSet controllers would fight) — remove that JobSet first, or install Trainer without JobSet (Helm chart kubeflow-trainer, --set jobset.install=false) and leave out --with trainer"
    fi
  done <<<"$configs"
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
  step_title openebs "OpenEBS Local PV hostpath (chart localpv-provisioner $OPENEBS_CHART_VERSION)"
  run hc repo add openebs-localpv "$OPENEBS_REPO" --force-update
  run hc upgrade --install openebs-localpv openebs-localpv/localpv-provisioner \
    --version "$OPENEBS_CHART_VERSION" --namespace openebs --create-namespace \
    --values "$DEPLOY_DIR/helm/openebs-values.yaml" --wait --timeout 5m
}

step_minio() {
  step_title minio "MinIO and the artifact bucket"
  # A Job's pod template cannot change in place, and a finished Job does not run again:
  # replace it so every run re-checks the bucket and the account (it waits for MinIO itself).
  run kc -n minio delete job minio-setup --ignore-not-found
  apply_component minio
  run kc -n minio rollout status deployment/minio --timeout=5m
  run kc -n minio wait --for=condition=complete job/minio-setup --timeout=5m
}

step_training_operator() {
  step_title training-operator "Kubeflow Training Operator $TRAINING_OPERATOR_REF"
  # Server-side apply: the CRDs are too large for the last-applied annotation of client-side apply.
  run kc apply --server-side -k "$TRAINING_OPERATOR_KUSTOMIZE"
  run kc -n kubeflow rollout status deployment/training-operator --timeout=5m
  run kc wait --for=condition=established crd/pytorchjobs.kubeflow.org --timeout=2m
}

# --trainjob-status: upstream's manager overlay with the TrainJobStatus gate on the controller's
# command line (which overrides its config file). A kustomization around the remote one, in the same
# single server-side apply: a later `kubectl patch` of the args would conflict with the next run's
# apply. A run without the flag applies the plain overlay, which turns the gate off again.
trainer_gate_kustomization() {
  TRAINER_GATE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kubetune-trainer.XXXXXX") \
    || die "cannot make a temporary directory for the Trainer's kustomization — check TMPDIR"
  trap 'rm -rf "$TRAINER_GATE_DIR"' EXIT
  cat >"$TRAINER_GATE_DIR/kustomization.yaml" <<EOF
# made by deploy/install.sh --trainjob-status: Kubeflow Trainer with the TrainJobStatus feature gate on
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $TRAINER_MANAGER_KUSTOMIZE
patches:
  - target:
      kind: Deployment
      name: kubeflow-trainer-controller-manager
    patch: |-
      - op: add
        path: /spec/template/spec/containers/0/args/-
        value: --feature-gates=TrainJobStatus=true
EOF
  if [[ $DRY_RUN == 1 ]]; then
    sed 's/^/[dry-run]   /' "$TRAINER_GATE_DIR/kustomization.yaml"
  fi
}

step_trainer() {
  step_title trainer "Kubeflow Trainer $TRAINER_REF with the JobSet it ships, then its ClusterTrainingRuntimes"
  # One server-side apply (the CRDs are too large for client-side apply): the Trainer's CRDs,
  # controller and webhooks, and JobSet's, in namespace kubeflow-system.
  if [[ $TRAINJOB_STATUS == 1 ]]; then
    trainer_gate_kustomization
    run kc apply --server-side -k "$TRAINER_GATE_DIR"
  else
    run kc apply --server-side -k "$TRAINER_MANAGER_KUSTOMIZE"
  fi
  run kc wait --for=condition=established crd/jobsets.jobset.x-k8s.io crd/trainjobs.trainer.kubeflow.org \
    crd/trainingruntimes.trainer.kubeflow.org crd/clustertrainingruntimes.trainer.kubeflow.org --timeout=2m
  # Both controllers report ready only once their webhook certificates exist and the webhook
  # server listens. JobSet first: every TrainJob becomes a JobSet, admitted by JobSet's webhook.
  run kc -n "$TRAINER_NAMESPACE" rollout status deployment/jobset-controller-manager --timeout=5m
  run kc -n "$TRAINER_NAMESPACE" rollout status deployment/kubeflow-trainer-controller-manager --timeout=5m
  # The runtimes are objects of the CRDs above; upstream applies them once the manager runs.
  run kc apply --server-side -k "$TRAINER_RUNTIMES_KUSTOMIZE"
}

step_kserve() {
  step_title kserve "KServe $KSERVE_REF and its ClusterServingRuntimes (Hugging Face runtime)"
  # Server-side apply: the InferenceService CRD is too large for client-side apply's annotation.
  run kc apply --server-side -f "$KSERVE_MANIFESTS"
  run kc wait --for=condition=established crd/inferenceservices.serving.kserve.io \
    crd/clusterservingruntimes.serving.kserve.io --timeout=2m
  # Ready only once cert-manager has issued the webhook certificate and the webhook listens.
  run kc -n "$KSERVE_NAMESPACE" rollout status deployment/kserve-controller-manager --timeout=5m
  run kc apply --server-side -f "$KSERVE_RESOURCES"
}

step_katib() {
  step_title katib "Katib $KATIB_REF, then namespace kubetune labelled for its webhook"
  run kc apply -k "$KATIB_KUSTOMIZE"
  run kc wait --for=condition=established crd/experiments.kubeflow.org crd/suggestions.kubeflow.org \
    crd/trials.kubeflow.org --timeout=2m
  # The DB first (the db-manager waits for it), then the controller, whose webhook admits Experiments.
  run kc -n "$KATIB_NAMESPACE" rollout status deployment/katib-mysql --timeout=5m
  run kc -n "$KATIB_NAMESPACE" rollout status deployment/katib-db-manager --timeout=5m
  run kc -n "$KATIB_NAMESPACE" rollout status deployment/katib-controller --timeout=5m
  run kc label namespace kubetune "$KATIB_LABEL" --overwrite
}

step_jupyterhub() {
  step_title jupyterhub "RBAC for notebooks, then JupyterHub (chart jupyterhub $JUPYTERHUB_CHART_VERSION)"
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
  step_title tensorboard "TensorBoard"
  apply_component tensorboard
  run kc -n kubetune rollout status deployment/tensorboard --timeout=5m
}

step_mlflow() {
  step_title mlflow "MLflow tracking server"
  apply_component mlflow
  run kc -n kubetune rollout status deployment/mlflow --timeout=5m
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
  MLflow            kubectl$ctx -n kubetune port-forward svc/mlflow 5000:5000        -> http://localhost:5000
Credentials stay in the cluster; read one when you need it, e.g.:
  kubectl$ctx -n minio get secret minio-root -o jsonpath='{.data.MINIO_ROOT_USER}' | base64 -d
Jobs: kubetune submit job.yaml --namespace kubetune (set kubernetes.secrets.s3: minio-credentials,
  kubernetes.service_account: kubetune-runner); in JupyterHub open examples/notebooks/finetune.ipynb.
EOF
  if wanted trainer; then
    cat <<EOF
TrainJobs (Kubeflow Trainer $TRAINER_REF): the same with --target trainjob; kubetune runtimes lists
  the ClusterTrainingRuntimes kubernetes.runtime can name (default torch-distributed).
EOF
    if [[ $TRAINJOB_STATUS == 1 ]]; then
      cat <<EOF
  TrainJobStatus is on: kubetune status reads a TrainJob's progress from status.trainerStatus
  (kubectl$ctx get trainjob NAME -o jsonpath='{.status.trainerStatus}').
EOF
    fi
  fi
  if wanted katib; then
    cat <<EOF
Hyperparameter search (Katib $KATIB_REF): kubetune submit --tune job.yaml --namespace kubetune (the spec's
  tune section as an Experiment); kubetune status --tune NAME; Katib's UI:
  kubectl$ctx -n $KATIB_NAMESPACE port-forward svc/katib-ui 8081:80 -> http://localhost:8081/katib/
EOF
  fi
  if wanted kserve; then
    cat <<EOF
Serving (KServe $KSERVE_REF): once a job has finished, kubetune render --serve job.yaml | kubectl$ctx apply -f -
  (an InferenceService on the Hugging Face runtime); kubectl$ctx -n kubetune get inferenceservices.
EOF
  fi
}

main() {
  parse_args "$@"
  if wanted trainer; then
    check_trainer_ref
  fi
  preflight
  step_namespaces
  step_secrets
  skipped openebs || step_openebs
  skipped minio || step_minio
  skipped training-operator || step_training_operator
  if wanted trainer; then
    step_trainer
  fi
  if wanted kserve; then
    step_kserve
  fi
  if wanted katib; then
    step_katib
  fi
  skipped jupyterhub || step_jupyterhub
  skipped tensorboard || step_tensorboard
  skipped mlflow || step_mlflow
  print_access
}

main "$@"
