#!/usr/bin/env bash
# Runs helm, built from the Go module pinned in e2e/tools/helm (no Debian package provides it),
# out of a cache keyed by the hash of that module's files: a warm cache execs at once, a change to
# go.mod/go.sum builds the new version. Usage: e2e/scripts/helm.sh <helm args>...
set -euo pipefail
mod=$(cd "$(dirname "$0")/../tools/helm" && pwd)

key=$(cat "$mod/go.mod" "$mod/go.sum" | sha256sum | cut -c1-16)
cache_root=${STOWAGE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/stowage}
out="$cache_root/helm/$key"

if [ ! -x "$out/helm" ]; then
  # Progress goes to stderr so callers can parse helm's stdout (e.g. `helm template`).
  echo "helm: building $key into $out (a few minutes on a cold cache)" >&2
  tmp="$out.partial.$$"
  rm -rf "$tmp" && mkdir -p "$tmp"
  trap 'rm -rf "$tmp"' EXIT
  version=$(cd "$mod" && go list -m -f '{{.Version}}' helm.sh/helm/v3)
  # helm reports its version from these; without them `helm version` says v3.x-dev.
  ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$version"
  (cd "$mod" && CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$tmp/helm" helm.sh/helm/v3/cmd/helm)
  # Concurrent builders (parallel tests) race here; the rename is atomic, the loser's copy is dropped.
  mkdir -p "$(dirname "$out")"
  mv -T "$tmp" "$out" 2>/dev/null || true
  trap - EXIT
  rm -rf "$tmp"
fi
exec "$out/helm" "$@"
