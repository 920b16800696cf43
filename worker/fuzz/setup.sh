#!/usr/bin/env bash
# Installs cargo-fuzz into the cache, keyed by version, and prints the path of its binary.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
exec "$HERE/../../tests/setup/cargo-tool.sh" cargo-fuzz "${CARGO_FUZZ_VERSION:-0.13.2}"
