#!/usr/bin/env bash
# Re-quantises the SmolLM2 GGUF (tests/setup/model.sh) into the k-quant file types with
# llama.cpp's quantiser (llama-cpp-python in the bench environment), cached under a key of
# both versions. With a type argument (Q4_K_M, Q5_K_M or Q6_K) prints that file's path;
# without one makes all three and prints their directory.
#
# SmolLM2's 576-wide rows are not a multiple of the 256-value super-block, so llama.cpp
# stores those matrices in its fallback types (Q5_0 for Q4_K_M, Q5_1 for Q5_K_M, Q8_0 for
# Q6_K); only the 1536-wide ffn_down matrices are k-quants.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
LLAMA_CPP_PYTHON=$(sed -n 's/^llama-cpp-python==//p' "$HERE/requirements-bench.txt")
SOURCE=$("$HERE/model.sh")
CACHE_ROOT="${NPUFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npufleet}"
DIR="$CACHE_ROOT/models/smollm2-kquant-$(basename "$(dirname "$SOURCE")")-llama-cpp-python-$LLAMA_CPP_PYTHON"
TYPES=(Q4_K_M Q5_K_M Q6_K)
missing=()
for t in "${TYPES[@]}"; do
  [ -s "$DIR/SmolLM2-135M-Instruct.$t.gguf" ] || missing+=("$t")
done
if [ ${#missing[@]} -gt 0 ]; then
  PYTHON=$("$HERE/python-env.sh" "$HERE/requirements-bench.txt")
  mkdir -p "$DIR"
  echo "[model] quantising SmolLM2 to ${missing[*]}" >&2
  # llama.cpp logs every tensor; the log is kept and shown only when quantising fails.
  if ! "$PYTHON" - "$SOURCE" "$DIR" "${missing[@]}" >"$DIR/quantise.log" 2>&1 <<'PY'; then
import ctypes, pathlib, sys
import llama_cpp

FTYPES = {
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q5_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
}
source, out_dir = sys.argv[1], pathlib.Path(sys.argv[2])
for name in sys.argv[3:]:
    out = out_dir / f"SmolLM2-135M-Instruct.{name}.gguf"
    part = out.with_suffix(".part")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[name]
    # The source is already Q4_1: llama.cpp refuses to re-quantise unless told.
    params.allow_requantize = True
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(source.encode(), str(part).encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"quantising to {name} failed ({rc})")
    part.rename(out)
PY
    cat "$DIR/quantise.log" >&2
    exit 1
  fi
fi
if [ $# -gt 0 ]; then
  echo "$DIR/SmolLM2-135M-Instruct.$1.gguf"
else
  echo "$DIR"
fi
