#!/usr/bin/env bash
# Rust bindings to CANN's ACL runtime, ACL BLAS and HCCL, generated with bindgen from the public
# C headers that the PyPI wheel torch-npu ships. See README.md beside this script.
#
#   bindings.sh setup        fetch the wheel's headers and install bindgen into the cache
#   bindings.sh generate [F] write the bindings to F (default: worker/src/ascend/bindings.rs)
#   bindings.sh check        regenerate into a temporary file and compare with the checked-in one;
#                            exits 77 (skipped) when `setup` has not run
set -euo pipefail

TORCH_NPU_VERSION="2.14.0"
BINDGEN_VERSION="0.73.2"
WHEEL_PLATFORM="manylinux_2_28_x86_64"
WHEEL_PYTHON="3.11"

HERE="$(cd "$(dirname "$0")" && pwd)"
CHECKED_IN="$HERE/../src/ascend/bindings.rs"
CACHE_ROOT="${NPUFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npufleet}"
HEADERS_DIR="$CACHE_ROOT/torch-npu-$TORCH_NPU_VERSION"
INCLUDE_DIR="$HEADERS_DIR/torch_npu/include"
BINDGEN=$("$HERE/../../tests/setup/cargo-tool.sh" --where bindgen-cli "$BINDGEN_VERSION" bindgen)

SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT

log() { echo "[ascend-bindings] $*" >&2; }

have_libclang() {
  [ -n "${LIBCLANG_PATH:-}" ] && return 0
  ldconfig -p 2>/dev/null | grep -q 'libclang[-.0-9]*\.so' && return 0
  compgen -G '/usr/lib/llvm-*/lib/libclang.so*' >/dev/null
}

fetch_headers() {
  [ -f "$HEADERS_DIR/.complete" ] && return 0
  local tmp="$SCRATCH/wheel"
  log "downloading torch-npu==$TORCH_NPU_VERSION ($WHEEL_PLATFORM) for its CANN headers"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform "$WHEEL_PLATFORM" --python-version "$WHEEL_PYTHON" \
    --dest "$tmp" "torch-npu==$TORCH_NPU_VERSION" >&2
  rm -rf "$HEADERS_DIR"
  mkdir -p "$HEADERS_DIR"
  python3 - "$tmp" "$HEADERS_DIR" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
wanted = ("torch_npu/include/acl/", "torch_npu/include/third_party/hccl/inc/")
with zipfile.ZipFile(wheel) as z:
    members = [n for n in z.namelist() if n.startswith(wanted) and not n.endswith("/")]
    if not members:
        sys.exit(f"{wheel.name} holds no ACL/HCCL headers")
    z.extractall(sys.argv[2], members)
PY
  touch "$HEADERS_DIR/.complete"
}

install_bindgen() {
  "$HERE/../../tests/setup/cargo-tool.sh" bindgen-cli "$BINDGEN_VERSION" bindgen >/dev/null
}

ensure_libclang() {
  have_libclang && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing libclang-dev (bindgen parses the headers with libclang)"
    apt-get install -y -qq libclang-dev >&2 || { apt-get update -qq >&2 && apt-get install -y -qq libclang-dev >&2; }
  else
    log "libclang is missing: install it (Debian/Ubuntu: apt-get install libclang-dev) or set LIBCLANG_PATH"
    exit 1
  fi
}

setup() {
  ensure_libclang
  fetch_headers
  install_bindgen
}

# A (code, name) table of the constants in types.rs whose names match $2, so that a failed call's
# return code can be reported by name.
name_table() {
  local table="$1" pattern="$2" what="$3"
  echo "/// Names of $what."
  echo "pub const $table: &[(i64, &str)] = &["
  sed -nE "s/^pub const ($pattern): [A-Za-z0-9_:]+ = -?[0-9]+;$/(\1 as i64, \"\1\"),/p" "$work/types.rs"
  echo "];"
}

# Runs bindgen once per shared library: the types once, then one function table per library,
# each loaded at run time through libloading (every symbol must resolve, or loading fails).
generate() {
  local out work="$SCRATCH/generate"
  out=$(realpath -m "$1")
  mkdir -p "$work"
  # rustfmt (run by bindgen and below) comes from the toolchain the repository pins.
  cd "$HERE"
  cat >"$work/wrapper.h" <<'H'
#include "acl/acl.h"
#include "acl/ops/acl_cblas.h"
#include "hccl/hccl.h"
H
  local clang_args=(-- -x c++ -std=c++17 -I"$INCLUDE_DIR" -I"$INCLUDE_DIR/third_party/hccl/inc")
  local common=(--rust-target 1.85 --rust-edition 2024 --no-doc-comments --no-layout-tests
    --no-prepend-enum-name --wrap-unsafe-ops)

  "$BINDGEN" "$work/wrapper.h" "${common[@]}" \
    --allowlist-type 'aclError|aclrtStream|aclDataType|aclrtMemcpyKind|aclrtMemMallocPolicy' \
    --allowlist-type 'aclTransType|aclComputeType|HcclResult|HcclComm|HcclDataType|HcclReduceOp' \
    --allowlist-var 'ACL_SUCCESS|ACL_ERROR_.*' \
    "${clang_args[@]}" >"$work/types.rs"

  local lib name functions
  for lib in \
    "AclRuntime:aclInit|aclFinalize|aclrtSetDevice|aclrtResetDevice|aclrtGetDeviceCount|aclrtMalloc|aclrtFree|aclrtMemcpy|aclrtCreateStream|aclrtDestroyStream|aclrtSynchronizeStream" \
    "AclOp:aclopSetModelDir" \
    "AclBlas:aclblasGemmEx" \
    "Hccl:HcclCommInitClusterInfo|HcclAllReduce|HcclAllGather|HcclBroadcast|HcclCommDestroy|HcclGetErrorString"; do
    name="${lib%%:*}"
    functions="${lib#*:}"
    "$BINDGEN" "$work/wrapper.h" "${common[@]}" \
      --allowlist-function "$functions" --blocklist-type '.*' \
      --dynamic-loading "$name" --dynamic-link-require-all \
      "${clang_args[@]}" >"$work/$name.rs"
  done

  {
    echo "// Generated by worker/ascend/bindings.sh from the CANN headers in torch-npu $TORCH_NPU_VERSION"
    echo "// with bindgen $BINDGEN_VERSION. Do not edit: regenerate with \`worker/ascend/bindings.sh generate\`."
    echo
    echo "pub mod types {"
    grep -v '^/\* automatically generated' "$work/types.rs"
    name_table ACL_ERROR_NAMES 'ACL_ERROR_[A-Z0-9_]+' "every ACL error code the headers define"
    name_table HCCL_RESULT_NAMES 'HCCL_(SUCCESS|E_[A-Z0-9_]+)' "every HcclResult the headers define"
    echo "}"
    for name in AclRuntime AclOp AclBlas Hccl; do
      echo
      echo "pub mod $(echo "$name" | sed -E 's/([a-z])([A-Z])/\1_\2/g' | tr 'A-Z' 'a-z') {"
      echo "use super::types::*;"
      grep -v '^/\* automatically generated' "$work/$name.rs"
      echo "}"
    done
  } >"$work/bindings.rs"
  rustfmt --edition 2024 "$work/bindings.rs"
  mv "$work/bindings.rs" "$out"
}

check() {
  local missing=()
  [ -f "$HEADERS_DIR/.complete" ] || missing+=("the torch-npu $TORCH_NPU_VERSION headers ($HEADERS_DIR)")
  [ -x "$BINDGEN" ] || missing+=("bindgen $BINDGEN_VERSION ($BINDGEN)")
  have_libclang || missing+=("libclang")
  if [ ${#missing[@]} -gt 0 ]; then
    local joined
    joined=$(printf '%s; ' "${missing[@]}")
    echo "skipped: missing ${joined%; } (run worker/ascend/bindings.sh setup)"
    exit 77
  fi
  local fresh="$SCRATCH/bindings.rs"
  generate "$fresh"
  if ! diff -u "$CHECKED_IN" "$fresh"; then
    echo "worker/src/ascend/bindings.rs has drifted from the headers: run worker/ascend/bindings.sh generate"
    exit 1
  fi
  echo "bindings match torch-npu $TORCH_NPU_VERSION's headers"
}

case "${1:-}" in
  setup) setup ;;
  generate) setup; generate "${2:-$CHECKED_IN}"; log "wrote $(realpath -m "${2:-$CHECKED_IN}")" ;;
  check) check ;;
  *) echo "usage: $0 setup | generate [OUT] | check" >&2; exit 2 ;;
esac
