#!/usr/bin/env bash
# Builds the container images from deploy/*.Dockerfile without a daemon or a registry: the
# operator, the router, the worker and the worker's `smollm2` target with the cached SmolLM2
# file baked in. buildah builds them on a runtime base assembled from Debian 12 packages with
# mmdebstrap (a stand-in for the distroless base the Dockerfiles name: glibc, libgcc, CA
# certificates, user nonroot 65532, no shell), from the binaries this workspace built
# ($NPUFLEET_BINARIES, else $CARGO_TARGET_DIR/debug; stripped of debug info) through the
# Dockerfiles' `prebuilt` stage.
#
# Each image is written as a docker-archive tarball (`ctr -n k8s.io images import FILE`,
# `docker load -i FILE`), cached under $NPUFLEET_CACHE/images and keyed by the content of its
# inputs (this script, its Dockerfile, the binary, the model, the base's packages); an image
# whose archive exists is not built again. Installs buildah, mmdebstrap and runc (buildah's
# runtime for RUN steps; the image tests run the images with it) with apt when they are
# missing (needs root).
#
# Prints one line per image on stdout: <repository> <tag> <archive path>; progress on stderr.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE_ROOT="${NPUFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npufleet}"
OUT="$CACHE_ROOT/images"
BINARIES="${NPUFLEET_BINARIES:-${CARGO_TARGET_DIR:-$CACHE_ROOT/cargo-target}/debug}"
REGISTRY=localhost/npufleet
VERSION=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$REPO/charts/npufleet/Chart.yaml")
MODEL_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
# The runtime base: the libraries the binaries link (see `ldd`), installed as packages, and
# the CA bundle's package, of which only the files are taken (it would pull in openssl and
# debconf).
BASE_SUITE=bookworm
BASE_PACKAGES=libc6,libgcc-s1
BASE_DATA_PACKAGES=ca-certificates

log() { echo "[images] $*" >&2; }
fail() { log "$*"; exit 1; }

[ -n "$VERSION" ] || fail "no appVersion in charts/npufleet/Chart.yaml"
# name, Dockerfile, binary, buildah target ("" for the default one), tag suffix
IMAGES=(
  "npufleet-operator operator.Dockerfile npufleet-operator - "
  "npufleet-router router.Dockerfile npufleet-router - "
  "npufleet-worker worker.Dockerfile npufleet-worker - "
  "npufleet-worker worker.Dockerfile npufleet-worker smollm2 -smollm2"
)
for binary in npufleet-operator npufleet-router npufleet-worker; do
  [ -x "$BINARIES/$binary" ] ||
    fail "$BINARIES/$binary is missing: build the workspace first (cargo build --workspace --bins)"
done
MODEL=$("$HERE/model.sh")

key() { sha256sum | cut -c1-12; }
# cksum (CRC-32, hardware-assisted) fingerprints the binaries and the model in milliseconds,
# so a run with nothing to do stays instant.
fingerprint() { cksum <"$1"; }

BASE_KEY=$(printf '%s\n' "$BASE_SUITE" "$BASE_PACKAGES" "$BASE_DATA_PACKAGES" |
  cat - "$0" | key)
BASE_TAR="$OUT/runtime-base-$BASE_KEY.tar"
BASE_IMAGE="$REGISTRY/runtime-base:$BASE_KEY"

# Fills the globals of one IMAGES entry: repository, tag, target, binary, dockerfile, archive.
describe() {
  local name suffix
  read -r name dockerfile binary target suffix <<<"$1"
  repository="$REGISTRY/$name"
  tag="$VERSION${suffix:-}"
  local model_key=""
  [ "$target" = - ] || model_key=$(fingerprint "$MODEL")
  archive="$OUT/$name-$tag-$({
    printf '%s\n' "$BASE_KEY" "$tag" "$target" "$model_key"
    fingerprint "$BINARIES/$binary"
    cat "$REPO/deploy/$dockerfile"
  } | key).tar"
}

all_present() {
  for entry in "${IMAGES[@]}"; do
    describe "$entry"
    [ -s "$archive" ] || return 1
  done
}

if ! all_present; then
  start=$(date +%s)
  mkdir -p "$OUT"
  # One build at a time (a run that waited finds what the other built); a run that died
  # leaves no lock behind, only a work directory the next run removes.
  exec 9>"$OUT/.lock"
  flock 9
fi
if ! all_present; then

  tools=(buildah mmdebstrap runc)
  for tool in "${tools[@]}"; do
    command -v "$tool" >/dev/null && continue
    [ "$(id -u)" = 0 ] || fail "$tool is missing: apt-get install ${tools[*]}"
    log "installing ${tools[*]}"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${tools[@]}" >&2
    break
  done

  WORK="$OUT/work"
  rm -rf "$WORK"
  mkdir -p "$WORK"
  # vfs keeps layers as plain directories: no mounts survive a crash, and it works where
  # overlayfs cannot be stacked (inside a container).
  buildah() {
    command buildah --root "$WORK/storage" --runroot "$WORK/run" --storage-driver vfs "$@"
  }

  if [ ! -s "$BASE_TAR" ]; then
    log "assembling the runtime base from Debian $BASE_SUITE ($BASE_PACKAGES, files of $BASE_DATA_PACKAGES)"
    rootfs="$WORK/rootfs"
    # The extract variant unpacks the packages without running their scripts (there is no
    # shell to run them); the hook adds the data packages without their dependencies.
    mmdebstrap --quiet --variant=extract --include="$BASE_PACKAGES" --skip=output/dev \
      --extract-hook='cd "$1/var/cache/apt/archives" &&
        APT_CONFIG="$MMDEBSTRAP_APT_CONFIG" apt-get download -qq '"${BASE_DATA_PACKAGES//,/ }"' &&
        for deb in ./*.deb; do dpkg-deb --extract "$deb" "$1"; done' \
      "$BASE_SUITE" "$rootfs" >&2
    (
      cd "$rootfs"
      # What only a package manager or a shell would use, and the device nodes of the chroot
      # (a runtime mounts its own /dev).
      rm -rf dev/* etc/apt etc/dpkg etc/fstab etc/hostname etc/resolv.conf etc/ca-certificates \
        usr/sbin/update-ca-certificates var/lib/apt var/lib/dpkg var/cache var/log \
        usr/share/doc usr/share/lintian usr/share/man
      # What the CA package's script would have written.
      mkdir -p etc/ssl/certs
      cat usr/share/ca-certificates/mozilla/*.crt >etc/ssl/certs/ca-certificates.crt
      # The accounts and name lookup order of the distroless base.
      printf '%s\n' 'root:x:0:0:root:/root:/sbin/nologin' \
        'nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin' \
        'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' >etc/passwd
      printf '%s\n' 'root:x:0:' 'nobody:x:65534:' 'nonroot:x:65532:' >etc/group
      printf '%s\n' 'passwd: files' 'group: files' 'hosts: files dns' >etc/nsswitch.conf
      mkdir -p root home/nonroot tmp proc sys
      chmod 0700 root home/nonroot
      chown 65532:65532 home/nonroot
      chmod 1777 tmp
    )
    tar --numeric-owner --sort=name -C "$rootfs" -cf "$BASE_TAR.part" .
    find "$OUT" -maxdepth 1 -name 'runtime-base-*.tar' -delete
    mv "$BASE_TAR.part" "$BASE_TAR"
  fi

  log "importing the runtime base"
  container=$(buildah from scratch)
  buildah add --quiet "$container" "$BASE_TAR" / >/dev/null
  buildah config --user 65532:65532 --workingdir /home/nonroot \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt "$container"
  buildah commit --quiet --rm "$container" "$BASE_IMAGE" >/dev/null

  # The build context holds only what the `prebuilt` and `model-context` stages copy. Debug
  # info is most of a debug binary's size and serves no one in an image.
  context="$WORK/context"
  mkdir -p "$context/bin" "$context/models"
  for binary in npufleet-operator npufleet-router npufleet-worker; do
    strip --strip-debug -o "$context/bin/$binary" "$BINARIES/$binary"
  done
  ln "$MODEL" "$context/models/$MODEL_NAME" 2>/dev/null || cp "$MODEL" "$context/models/$MODEL_NAME"

  for entry in "${IMAGES[@]}"; do
    describe "$entry"
    [ ! -s "$archive" ] || continue
    log "building $repository:$tag"
    target_args=()
    [ "$target" = - ] || target_args=(--target "$target")
    # Layers are cached within the run, so both worker images share the binary's layer.
    buildah build --quiet --pull=never --layers \
      --build-arg RUNTIME_IMAGE="$BASE_IMAGE" \
      --build-arg BINARIES=prebuilt --build-arg BINARIES_DIR=bin \
      --build-arg MODEL=context --build-arg MODEL_FILE="models/$MODEL_NAME" \
      "${target_args[@]}" -f "$REPO/deploy/$dockerfile" -t "$repository:$tag" "$context" >/dev/null
    buildah push --quiet "$repository:$tag" "docker-archive:$archive.part:$repository:$tag" >&2
    # Archives of earlier inputs go: only the newest one of each image is kept.
    find "$OUT" -maxdepth 1 -name "$(basename "$repository")-$tag-????????????.tar" ! -path "$archive" -delete
    mv "$archive.part" "$archive"
  done
  rm -rf "$WORK"
  log "images ready in $(($(date +%s) - start)) s"
fi

for entry in "${IMAGES[@]}"; do
  describe "$entry"
  echo "$repository $tag $archive"
done
