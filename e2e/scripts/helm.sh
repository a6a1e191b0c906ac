#!/usr/bin/env bash
# Runs helm, built from the Go module pinned in e2e/tools/helm (no Debian package provides it),
# out of a cache keyed by the hash of that module's files (and this script): a warm cache execs at once, a change to
# go.mod/go.sum builds the new version. Usage: e2e/scripts/helm.sh <helm args>...
set -euo pipefail
mod=$(cd "$(dirname "$0")/../tools/helm" && pwd)

# The script is in the key too: a change of build flags must not reuse an old binary.
key=$(cat "$mod/go.mod" "$mod/go.sum" "$0" | sha256sum | cut -c1-16)
cache_root=${STOWAGE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/stowage}
out="$cache_root/helm/$key"

build() {
  # Progress goes to stderr so callers can parse helm's stdout (e.g. `helm template`).
  echo "helm: building $key into $out (a few minutes on a cold cache)" >&2
  tmp="$out.partial.$$"
  rm -rf "$tmp" && mkdir -p "$tmp"
  trap 'rm -rf "$tmp"' EXIT
  version=$(cd "$mod" && go list -m -f '{{.Version}}' helm.sh/helm/v3)
  # As helm's own Makefile does: its version, and the Kubernetes version that `helm template` and
  # `helm lint` assume (client-go v0.N → 1.N); without them it says v3.x-dev and Kubernetes 1.20.
  k8s_minor=$(cd "$mod" && go list -m -f '{{.Version}}' k8s.io/client-go | cut -d. -f2)
  ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$version -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    ldflags="$ldflags -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
  done
  (cd "$mod" && CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$tmp/helm" helm.sh/helm/v3/cmd/helm)
  rm -rf "$out" && mv "$tmp" "$out"
  trap - EXIT
}

if [ ! -x "$out/helm" ]; then
  mkdir -p "$cache_root/helm"
  # Parallel callers (tests) build once: the others wait on the lock and find the binary.
  exec 9>"$cache_root/helm/.lock"
  flock 9
  [ -x "$out/helm" ] || build
  exec 9>&-
fi
exec "$out/helm" "$@"
