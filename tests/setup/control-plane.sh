#!/usr/bin/env bash
# Builds the pinned local control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, etcd, helm, kwok) from the Go module proxy into a cache
# outside the repository, keyed by version. Does nothing when the cache is complete.
#
# Prints the bin directory on stdout; progress goes to stderr.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.34.4}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.13}"
HELM_VERSION="${HELM_VERSION:-v3.22.0}"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"

CACHE_ROOT="${NPUFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npufleet}"
KEY="k8s-${K8S_VERSION}-etcd-${ETCD_VERSION}-helm-${HELM_VERSION}-kwok-${KWOK_VERSION}"
OUT="$CACHE_ROOT/$KEY"
BIN="$OUT/bin"
STAGES="$OUT/kwok-stages"

log() { echo "[control-plane] $*" >&2; }
# shellcheck source=lib/kubernetes.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/kubernetes.sh"

all_present() {
  for b in kube-apiserver kube-controller-manager kube-scheduler kubectl etcd helm kwok; do
    [ -x "$BIN/$b" ] || return 1
  done
  [ -f "$OUT/.complete" ]
}

if all_present; then
  echo "$BIN"
  exit 0
fi

command -v go >/dev/null || { log "go is required to build the control plane"; exit 1; }
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
mkdir -p "$BIN" "$STAGES"
WORK="$OUT/src"
mkdir -p "$WORK"
start=$(date +%s)

build_kubernetes() {
  build_kubernetes_commands "$K8S_VERSION" "$WORK/kubernetes" "$BIN" \
    kube-apiserver kube-controller-manager kube-scheduler kubectl
}

build_etcd() {
  [ -x "$BIN/etcd" ] && return 0
  local dir="$WORK/etcd"
  rm -rf "$dir" && mkdir -p "$dir" && cd "$dir"
  go mod init npufleet.local/etcd-build >/dev/null 2>&1
  go mod edit -require "go.etcd.io/etcd/server/v3@${ETCD_VERSION}"
  printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' >tools.go
  log "building etcd ${ETCD_VERSION}"
  go mod tidy >&2
  go build -trimpath -ldflags "-s -w" -o "$BIN/etcd.tmp" go.etcd.io/etcd/server/v3 >&2
  mv "$BIN/etcd.tmp" "$BIN/etcd"
}

build_helm() {
  [ -x "$BIN/helm" ] && return 0
  log "building helm ${HELM_VERSION}"
  GOBIN="$WORK/helm-bin" go install -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}" \
    "helm.sh/helm/v3/cmd/helm@${HELM_VERSION}" >&2
  mv "$WORK/helm-bin/helm" "$BIN/helm"
}

build_kwok() {
  [ -x "$BIN/kwok" ] && return 0
  log "building kwok ${KWOK_VERSION}"
  GOBIN="$WORK/kwok-bin" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@${KWOK_VERSION}" >&2
  mv "$WORK/kwok-bin/kwok" "$BIN/kwok"
  local moddir
  moddir=$(go mod download -json "sigs.k8s.io/kwok@${KWOK_VERSION}" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  cp -r "$moddir/kustomize/stage/." "$STAGES/"
  chmod -R u+w "$STAGES"
}

build_etcd
build_helm
build_kwok
build_kubernetes

touch "$OUT/.complete"
rm -rf "$WORK"
log "control plane ready in $(( $(date +%s) - start )) s: $BIN"
echo "$BIN"
