#!/usr/bin/env bash
# Builds the pinned monitoring stack that CCE's Cloud Native Cluster Monitoring add-on runs
# (Prometheus and prometheus-adapter) from the Go module proxy into a cache outside the
# repository, keyed by version. Does nothing when the cache is complete.
#
# Prints the bin directory on stdout; progress goes to stderr.
set -euo pipefail

# Prometheus publishes its Go module as v0.3XX.Y for release v3.XX.Y.
PROMETHEUS_VERSION="${PROMETHEUS_VERSION:-v0.316.0}"
ADAPTER_VERSION="${ADAPTER_VERSION:-v0.12.0}"

CACHE_ROOT="${NPUFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npufleet}"
OUT="$CACHE_ROOT/monitoring-prometheus-${PROMETHEUS_VERSION}-adapter-${ADAPTER_VERSION}"
BIN="$OUT/bin"

log() { echo "[monitoring] $*" >&2; }

if [ -x "$BIN/prometheus" ] && [ -x "$BIN/prometheus-adapter" ] && [ -f "$OUT/.complete" ]; then
  echo "$BIN"
  exit 0
fi

command -v go >/dev/null || { log "go is required to build Prometheus and prometheus-adapter"; exit 1; }
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
mkdir -p "$BIN"
WORK="$OUT/src"
start=$(date +%s)

if [ ! -x "$BIN/prometheus" ]; then
  log "building prometheus ${PROMETHEUS_VERSION}"
  # Only Kubernetes service discovery is used (as on CCE); the other discoverers' cloud SDKs
  # would double the build.
  GOBIN="$WORK/prometheus-bin" go install -trimpath -tags remove_all_sd,enable_kubernetes_sd \
    -ldflags "-s -w -X github.com/prometheus/common/version.Version=${PROMETHEUS_VERSION}" \
    "github.com/prometheus/prometheus/cmd/prometheus@${PROMETHEUS_VERSION}" >&2
  mv "$WORK/prometheus-bin/prometheus" "$BIN/prometheus"
fi

if [ ! -x "$BIN/prometheus-adapter" ]; then
  log "building prometheus-adapter ${ADAPTER_VERSION}"
  # The proxy serves the module's versions but not its version list, which `go install
  # pkg@version` reads; a wrapper module that requires the exact version needs no list.
  dir="$WORK/adapter"
  rm -rf "$dir" && mkdir -p "$dir" && cd "$dir"
  go mod init npufleet.local/adapter-build >/dev/null 2>&1
  go mod edit -require "sigs.k8s.io/prometheus-adapter@${ADAPTER_VERSION}"
  printf '//go:build tools\n\npackage tools\n\nimport _ "sigs.k8s.io/prometheus-adapter/cmd/adapter"\n' >tools.go
  go mod tidy >&2
  go build -trimpath -ldflags "-s -w" -o "$BIN/prometheus-adapter.tmp" sigs.k8s.io/prometheus-adapter/cmd/adapter >&2
  mv "$BIN/prometheus-adapter.tmp" "$BIN/prometheus-adapter"
fi

touch "$OUT/.complete"
rm -rf "$WORK"
log "monitoring stack ready in $(( $(date +%s) - start )) s: $BIN"
echo "$BIN"
