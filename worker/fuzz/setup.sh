#!/usr/bin/env bash
# Installs cargo-fuzz into the cache, keyed by version, and prints the path of its binary.
# Does nothing when that version is already installed.
set -euo pipefail
VERSION="${CARGO_FUZZ_VERSION:-0.13.2}"
CACHE_ROOT="${NPUFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npufleet}"
ROOT="$CACHE_ROOT/cargo-fuzz-$VERSION"
BIN="$ROOT/bin/cargo-fuzz"
if [ ! -x "$BIN" ]; then
  echo "[fuzz] installing cargo-fuzz $VERSION" >&2
  # A private target directory: the install must not wait on, or hold, the workspace's lock.
  CARGO_TARGET_DIR="$ROOT/build" cargo install --quiet --locked --version "$VERSION" \
    --root "$ROOT" cargo-fuzz >&2
  rm -rf "$ROOT/build"
fi
echo "$BIN"
