# shellcheck shell=bash
# Helpers shared by deploy/install.sh and deploy/secrets.sh. Sourced, never executed.
# Bash 3.2 compatible (macOS): no associative arrays, no ${var,,}.

DRY_RUN=${DRY_RUN:-0}
KUBE_CONTEXT=${KUBE_CONTEXT:-}

# One line on stderr and exit 1: what is wrong, the value, and the fix.
die() {
  printf 'error: %s\n' "$*" >&2
  exit 1
}

warn() {
  printf 'warning: %s\n' "$*" >&2
}

info() {
  printf '==> %s\n' "$*"
}

# Words as a shell would need them typed: plain words as they are, anything else single-quoted.
quote() {
  local out="" arg
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then
      out+="$arg "
    else
      out+="'${arg//\'/\'\\\'\'}' "
    fi
  done
  printf '%s' "${out% }"
}

# Run a command that changes the cluster, or under --dry-run print it instead (kc and hc
# shown as the kubectl and helm commands they run).
run() {
  if [[ $DRY_RUN == 1 ]]; then
    printf '[dry-run] %s\n' "$(shown "$@")"
  else
    "$@"
  fi
}

# As run, with the command's own stdout discarded (the dry-run line still shows).
run_quiet() {
  if [[ $DRY_RUN == 1 ]]; then
    run "$@"
  else
    "$@" >/dev/null
  fi
}

# kc/hc as the command line a user would type.
shown() {
  local tool=$1
  shift
  case $tool in
    kc) if [[ -n $KUBE_CONTEXT ]]; then quote kubectl --context "$KUBE_CONTEXT" "$@"; else quote kubectl "$@"; fi ;;
    hc) if [[ -n $KUBE_CONTEXT ]]; then quote helm --kube-context "$KUBE_CONTEXT" "$@"; else quote helm "$@"; fi ;;
    *) quote "$tool" "$@" ;;
  esac
}

# kubectl / helm, pointed at --context when one was given. Read-only calls use these directly;
# changes go through run.
kc() {
  if [[ -n $KUBE_CONTEXT ]]; then
    kubectl --context "$KUBE_CONTEXT" "$@"
  else
    kubectl "$@"
  fi
}

hc() {
  if [[ -n $KUBE_CONTEXT ]]; then
    helm --kube-context "$KUBE_CONTEXT" "$@"
  else
    helm "$@"
  fi
}

need_cmd() {  # need_cmd NAME FIX
  command -v "$1" >/dev/null 2>&1 || die "$1 not found on PATH — $2"
}

# The context kubectl will use: --context, else the kubeconfig's current context.
current_context() {
  if [[ -n $KUBE_CONTEXT ]]; then
    kubectl config get-contexts -o name 2>/dev/null | grep -qxF -- "$KUBE_CONTEXT" \
      || die "kubectl context '$KUBE_CONTEXT' is not in the kubeconfig (${KUBECONFIG:-~/.kube/config}) — list them with: kubectl config get-contexts -o name"
    printf '%s' "$KUBE_CONTEXT"
    return
  fi
  local ctx
  ctx=$(kubectl config current-context 2>/dev/null) || ctx=""
  [[ -n $ctx ]] || die "kubectl has no current context (kubeconfig: ${KUBECONFIG:-~/.kube/config}) — run: kubectl config use-context NAME, or pass --context NAME"
  printf '%s' "$ctx"
}

# Fails with one line unless the API server of the chosen context answers.
check_reachable() {  # check_reachable CONTEXT
  local err
  if ! err=$(kc get --raw=/version --request-timeout=10s 2>&1 >/dev/null); then
    err=$(printf '%s\n' "$err" | grep -v '^[[:space:]]*$' | tail -n 1 | cut -c1-200) || err=""
    die "cannot reach the Kubernetes API server of context '$1' (${err:-no answer}) — check the cluster is running and 'kubectl cluster-info' works, or pick another with --context"
  fi
}

# Prints the value of KEY in an env file (KEY=VALUE lines, # comments, optional matching quotes,
# optional 'export '), or nothing. The file is parsed, never sourced: it cannot run code.
env_get() {  # env_get FILE KEY
  local line k v
  while IFS= read -r line || [[ -n $line ]]; do
    line=${line%$'\r'}
    [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
    line=${line#export }
    k=${line%%=*}
    [[ $k == "$2" ]] || continue
    v=${line#*=}
    if [[ ${#v} -ge 2 && ( $v == \"*\" || $v == \'*\' ) ]]; then
      v=${v:1:${#v}-2}
    fi
    printf '%s' "$v"
    return 0
  done <"$1"
  return 0
}

# Every non-comment line must be KEY=VALUE; names the line number, never its content (a secret).
env_check_syntax() {  # env_check_syntax FILE
  local line n=0
  while IFS= read -r line || [[ -n $line ]]; do
    n=$((n + 1))
    line=${line%$'\r'}
    [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
    line=${line#export }
    [[ $line =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] \
      || die "$1 line $n is not KEY=VALUE — fix or comment out that line (see deploy/.env.example)"
  done <"$1"
  return 0
}

# Credentials end up in a URL (MinIO's MC_HOST_*) and in YAML (the JupyterHub password), so
# only URL- and YAML-safe characters; the message gives the length, never the value.
check_secret_value() {  # check_secret_value FILE KEY VALUE MIN_LENGTH
  local file=$1 key=$2 value=$3 min=$4
  [[ -n $value ]] || die "$key is empty or missing in $file — set it (generate one with: openssl rand -hex 16)"
  [[ ${#value} -ge $min ]] \
    || die "$key in $file is ${#value} characters, fewer than $min — use a longer one (openssl rand -hex 16)"
  [[ $value =~ ^[A-Za-z0-9._~-]+$ ]] \
    || die "$key in $file (${#value} characters) holds characters other than letters, digits and . _ ~ - — use e.g. openssl rand -hex 16"
}
