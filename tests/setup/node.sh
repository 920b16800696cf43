#!/usr/bin/env bash
# Everything a real local Kubernetes node needs besides the control plane: kubelet and
# kube-proxy built from the Go module proxy (as control-plane.sh builds the control plane),
# CoreDNS with the plugins cluster DNS uses, the Debian packages of the container runtime and
# pod network (installed with apt when missing; needs root), and the images no registry can
# give here (the pod sandbox image and the tests' own image), as archives for
# `ctr images import`. Cached outside the repository, keyed by version; does nothing when
# complete.
#
#   node.sh          prints the bin directory (kubelet, kube-proxy, coredns)
#   node.sh images   prints one line per image: <name> <tag> <archive path>
#
# Progress goes to stderr.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.34.4}"
COREDNS_VERSION="${COREDNS_VERSION:-v1.15.0}"
# The sandbox image kubelet v1.34 and containerd are told to use.
PAUSE_IMAGE="registry.k8s.io/pause:3.10"
PACKAGES=(containerd runc containernetworking-plugins iptables conntrack)
CNI_PLUGINS=(bridge host-local loopback portmap)

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${NPUFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npufleet}"
OUT="$CACHE_ROOT/node-k8s-${K8S_VERSION}-coredns-${COREDNS_VERSION}"
BIN="$OUT/bin"
# Images are keyed by their sources, so that editing one rebuilds only the images.
SOURCES_HASH=$(cat "$HERE/node/pause.c" "$HERE/node/netcheck/"* "${BASH_SOURCE[0]}" | sha256sum | cut -c1-12)
IMAGES="$CACHE_ROOT/node-images-$SOURCES_HASH"

log() { echo "[node] $*" >&2; }
# shellcheck source=lib/kubernetes.sh
source "$HERE/lib/kubernetes.sh"

case "${1:-}" in
  "" | images) ;;
  *) log "unknown argument '$1'; usage: node.sh [images]"; exit 2 ;;
esac

packages_present() {
  local tool plugin
  for tool in containerd containerd-shim-runc-v2 ctr runc iptables conntrack; do
    command -v "$tool" >/dev/null || return 1
  done
  for plugin in "${CNI_PLUGINS[@]}"; do
    [ -x "/usr/lib/cni/$plugin" ] || return 1
  done
}

binaries_present() {
  local b
  for b in kubelet kube-proxy coredns; do
    [ -x "$BIN/$b" ] || return 1
  done
  [ -f "$OUT/.complete" ]
}

image_lines() {
  echo "pause $PAUSE_IMAGE $IMAGES/pause.tar"
  echo "netcheck localhost/npufleet/netcheck:$SOURCES_HASH $IMAGES/netcheck.tar"
}

print_result() {
  if [ "${1:-}" = images ]; then image_lines; else echo "$BIN"; fi
}

if packages_present && binaries_present && [ -f "$IMAGES/.complete" ]; then
  print_result "${1:-}"
  exit 0
fi

start=$(date +%s)

install_packages() {
  packages_present && return 0
  [ "$(id -u)" = 0 ] || { log "installing ${PACKAGES[*]} needs root"; exit 1; }
  log "installing ${PACKAGES[*]} with apt"
  export DEBIAN_FRONTEND=noninteractive
  # A bare machine has no package lists yet; a warm one installs without refreshing them.
  apt-get install -y --no-install-recommends "${PACKAGES[@]}" >&2 ||
    { apt-get update >&2 && apt-get install -y --no-install-recommends "${PACKAGES[@]}" >&2; }
  packages_present || { log "apt installed ${PACKAGES[*]} but a tool is still missing"; exit 1; }
}

build_coredns() {
  [ -x "$BIN/coredns" ] && return 0
  local dir="$OUT/src/coredns"
  rm -rf "$dir" && mkdir -p "$dir" && cd "$dir"
  cp "$HERE/node/coredns/main.go" .
  go mod init npufleet.local/coredns-build >/dev/null 2>&1
  go mod edit -require "github.com/coredns/coredns@${COREDNS_VERSION}"
  log "building coredns ${COREDNS_VERSION}"
  go mod tidy >&2
  go build -trimpath -ldflags "-s -w" -o "$BIN/coredns.tmp" . >&2
  mv "$BIN/coredns.tmp" "$BIN/coredns"
}

# oci_archive TAG ROOTFS_DIR ENTRYPOINT_JSON OUT_TAR: an OCI image archive of one
# uncompressed layer holding ROOTFS_DIR, named TAG for `ctr images import`.
oci_archive() {
  local tag=$1 rootfs=$2 entrypoint=$3 out=$4
  local dir
  dir=$(mktemp -d "$IMAGES/oci.XXXXXX")
  mkdir -p "$dir/blobs/sha256"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$rootfs" -cf "$dir/layer.tar" .
  local layer_digest layer_size config config_digest manifest manifest_digest
  layer_digest=$(sha256sum "$dir/layer.tar" | cut -d' ' -f1)
  layer_size=$(stat -c %s "$dir/layer.tar")
  mv "$dir/layer.tar" "$dir/blobs/sha256/$layer_digest"
  config="{\"architecture\":\"amd64\",\"os\":\"linux\",\"config\":{\"Entrypoint\":$entrypoint,\"User\":\"65532:65532\"},\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[\"sha256:$layer_digest\"]}}"
  config_digest=$(printf '%s' "$config" | sha256sum | cut -d' ' -f1)
  printf '%s' "$config" >"$dir/blobs/sha256/$config_digest"
  manifest="{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"config\":{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"sha256:$config_digest\",\"size\":${#config}},\"layers\":[{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar\",\"digest\":\"sha256:$layer_digest\",\"size\":$layer_size}]}"
  manifest_digest=$(printf '%s' "$manifest" | sha256sum | cut -d' ' -f1)
  printf '%s' "$manifest" >"$dir/blobs/sha256/$manifest_digest"
  printf '{"imageLayoutVersion":"1.0.0"}' >"$dir/oci-layout"
  printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%d,"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
    "$manifest_digest" "${#manifest}" "$tag" "${tag##*:}" >"$dir/index.json"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$dir" -cf "$out.tmp" oci-layout index.json blobs
  mv "$out.tmp" "$out"
  rm -rf "$dir"
}

build_images() {
  [ -f "$IMAGES/.complete" ] && return 0
  command -v gcc >/dev/null || { log "gcc is required to build the pause image"; exit 1; }
  mkdir -p "$IMAGES"
  local root="$IMAGES/rootfs"
  rm -rf "$root" && mkdir -p "$root/pause" "$root/netcheck"
  log "building the pause and netcheck images"
  gcc -static -Os -s -o "$root/pause/pause" "$HERE/node/pause.c"
  (cd "$HERE/node/netcheck" && go build -trimpath -ldflags "-s -w" -o "$root/netcheck/netcheck" .)
  local name tag archive
  while read -r name tag archive; do
    oci_archive "$tag" "$root/$name" "[\"/$name\"]" "$archive"
  done < <(image_lines)
  rm -rf "$root"
  touch "$IMAGES/.complete"
}

install_packages
if ! binaries_present; then
  command -v go >/dev/null || { log "go is required to build kubelet, kube-proxy and coredns"; exit 1; }
  export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
  mkdir -p "$BIN"
  build_kubernetes_commands "$K8S_VERSION" "$OUT/src/kubernetes" "$BIN" kubelet kube-proxy
  build_coredns
  touch "$OUT/.complete"
  rm -rf "$OUT/src"
fi
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
build_images
log "node ready in $(( $(date +%s) - start )) s: $BIN"
print_result "${1:-}"
