#!/usr/bin/env bash
# Creates the virtual environment with the real third-party clients and references the
# tests use (tritonclient, openai, gguf + numpy, pytest), keyed by the requirements file's
# hash. Prints the environment's python.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REQ="${1:-$HERE/requirements-test.txt}"
CACHE_ROOT="${NPUFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npufleet}"
KEY=$(sha256sum "$REQ" | cut -c1-12)
VENV="$CACHE_ROOT/venv-$(basename "$REQ" .txt)-$KEY"
if [ ! -f "$VENV/.complete" ]; then
  echo "[python] creating $VENV" >&2
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$REQ" >&2
  touch "$VENV/.complete"
fi
echo "$VENV/bin/python"
