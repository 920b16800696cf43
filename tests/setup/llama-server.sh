#!/usr/bin/env bash
# Builds llama.cpp's own C++ `llama-server` (an OpenAI-compatible engine this project did not
# write) from the llama.cpp source carried by the llama-cpp-python source package the bench
# already pins, into the cache keyed by that version. Prints the path of the binary.
#
# The end-to-end tests run it as the `generic` runtime of an InferenceService: the router and
# the autoscaler read its `llamacpp:*` series the way they would any engine's.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VERSION=$(sed -n 's/^llama-cpp-python==//p' "$HERE/requirements-bench.txt")
CACHE_ROOT="${NPUFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npufleet}"
DIR="$CACHE_ROOT/llama-server-llama-cpp-python-$VERSION"
BIN="$DIR/bin/llama-server"
if [ ! -x "$BIN" ]; then
  for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "[llama-server] $tool is needed to build llama-server" >&2; exit 1; }
  done
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "[llama-server] building from llama-cpp-python==$VERSION's llama.cpp (a few minutes)" >&2
  python3 -m pip download --quiet --no-deps --no-binary :all: --dest "$tmp" \
    "llama-cpp-python==$VERSION" >&2
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  src="$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp"
  # No libcurl: models come from local files. Static ggml so the binary stands alone.
  cmake -S "$src" -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON >"$tmp/cmake.log" 2>&1 || { cat "$tmp/cmake.log" >&2; exit 1; }
  cmake --build "$tmp/build" --target llama-server -j "$(nproc)" >"$tmp/build.log" 2>&1 \
    || { tail -50 "$tmp/build.log" >&2; exit 1; }
  mkdir -p "$DIR/bin"
  cp "$tmp/build/bin/llama-server" "$BIN.part"
  mv "$BIN.part" "$BIN"
fi
echo "$BIN"
