#!/usr/bin/env bash
# Fetches the Gateway API Inference Extension's InferencePool CRD
# (inference.networking.k8s.io/v1) from its Go module into the cache, keyed by version.
# Prints the path of the CRD file.
set -euo pipefail
VERSION="${INFERENCE_EXTENSION_VERSION:-v1.1.0}"
CACHE_ROOT="${NPUFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npufleet}"
DIR="$CACHE_ROOT/gateway-api-inference-extension-$VERSION"
FILE="$DIR/inference.networking.k8s.io_inferencepools.yaml"
if [ ! -s "$FILE" ]; then
  command -v go >/dev/null || { echo "[inference-extension] go is required" >&2; exit 1; }
  echo "[inference-extension] downloading sigs.k8s.io/gateway-api-inference-extension@$VERSION" >&2
  moddir=$(go mod download -json "sigs.k8s.io/gateway-api-inference-extension@$VERSION" |
    sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  mkdir -p "$DIR"
  cp "$moddir/config/crd/bases/$(basename "$FILE")" "$FILE.part"
  chmod u+w "$FILE.part"
  mv "$FILE.part" "$FILE"
fi
echo "$FILE"
