#!/usr/bin/env bash
# Installs a cargo-installable tool into a cache outside the repository, keyed by crate and
# version, and prints the path of its binary. Does nothing when that version is installed.
#   tests/setup/cargo-tool.sh [--where] <crate> <version> [<binary, default the crate's name>]
# With --where it only prints where the binary is or would be.
set -euo pipefail
WHERE=false
if [ "${1:-}" = --where ]; then WHERE=true; shift; fi
CRATE="$1"
VERSION="$2"
BINARY="${3:-$CRATE}"
CACHE_ROOT="${NPUFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npufleet}"
ROOT="$CACHE_ROOT/tools/$CRATE-$VERSION"
BIN="$ROOT/bin/$BINARY"
if ! $WHERE && [ ! -x "$BIN" ]; then
  echo "[cargo-tool] installing $CRATE $VERSION into $ROOT" >&2
  # A private target directory: the install must not wait on, or hold, the workspace's lock,
  # nor leave its build in the workspace's cache.
  CARGO_TARGET_DIR="$ROOT.build" cargo install --quiet --locked --version "$VERSION" \
    --root "$ROOT" "$CRATE" >&2
  rm -rf "$ROOT.build"
fi
echo "$BIN"
