#!/usr/bin/env bash
# The base image for building the trainer image where Docker Hub cannot be reached (`make image-test`):
# a Debian bookworm minbase made with debootstrap from the Debian mirror, holding what the
# Dockerfile's production base (python:3.11-slim-bookworm) gives it: Python 3.11 with pip, CA
# certificates and tini. Debian's python refuses system-wide pip installs (PEP 668), so a venv at
# /opt/venv comes first on PATH. Imported into the engine as BASE_TAG; kept while it exists.
#
#   ENGINE=podman docker/base/make-base.sh [BASE_TAG]
set -euo pipefail

TAG=${1:-localhost/kubetune-base:bookworm}
ENGINE=${ENGINE:-podman}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if "$ENGINE" image exists "$TAG" 2>/dev/null; then
  echo "base image $TAG: already made"
  exit 0
fi
command -v debootstrap > /dev/null || { echo "error: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 2; }

root=$(mktemp -d /var/tmp/kubetune-base.XXXXXX)
trap 'rm -rf "$root" "$root.log"' EXIT
start=$(date +%s)
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates,tini \
  bookworm "$root" "$MIRROR" > "$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"
chroot "$root" python3 -m venv /opt/venv
# what an image does not need: package lists and caches, documentation
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/*
tar -C "$root" --numeric-owner -c . | "$ENGINE" import \
  --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV VIRTUAL_ENV=/opt/venv' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  - "$TAG" > /dev/null
echo "base image $TAG: made in $(( $(date +%s) - start )) s, $("$ENGINE" image inspect "$TAG" --format '{{.Size}}' | awk '{printf "%.0f MB", $1/1e6}')"
