# Sourced by the set-up scripts that build commands of k8s.io/kubernetes from the Go module
# proxy (control-plane.sh, node.sh). The caller defines `log` and sets CGO_ENABLED/GOFLAGS.

# build_kubernetes_commands VERSION WORK_DIR BIN_DIR CMD...
# Builds each k8s.io/kubernetes/cmd/CMD missing from BIN_DIR, at VERSION, in a scratch module
# under WORK_DIR.
build_kubernetes_commands() {
  local version=$1 dir=$2 bin=$3
  shift 3
  local cmd missing=()
  for cmd in "$@"; do
    [ -x "$bin/$cmd" ] || missing+=("$cmd")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  local minor
  minor=$(echo "$version" | cut -d. -f2)
  rm -rf "$dir" && mkdir -p "$dir"
  (
    cd "$dir"
    go mod init npufleet.local/k8s-build >/dev/null 2>&1
    local gomod
    gomod=$(go mod download -json "k8s.io/kubernetes@${version}" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
    {
      echo "require k8s.io/kubernetes ${version}"
      # The kubernetes module replaces its staging modules with local paths; point each at
      # the published module of the same minor release instead.
      grep -E '^\s*k8s.io/[^ ]+ => \./staging/' "$gomod" | awk -v v="v0.${minor}.${version##*.}" '{print "replace " $1 " => " $1 " " v}'
      grep -E '^godebug' "$gomod" || true
    } >>go.mod
    {
      printf '//go:build tools\n\npackage tools\n\nimport (\n'
      for cmd in "${missing[@]}"; do
        printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$cmd"
      done
      printf ')\n'
    } >tools.go
    log "resolving k8s.io/kubernetes ${version}"
    go mod tidy >&2
    local ld="-s -w -X k8s.io/component-base/version.gitVersion=${version} -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${minor} -X k8s.io/client-go/pkg/version.gitVersion=${version} -X k8s.io/component-base/version.gitTreeState=clean"
    for cmd in "${missing[@]}"; do
      log "building $cmd"
      go build -trimpath -ldflags "$ld" -o "$bin/$cmd.tmp" "k8s.io/kubernetes/cmd/$cmd" >&2
      mv "$bin/$cmd.tmp" "$bin/$cmd"
    done
  )
}
