#!/usr/bin/env bash
# Builds promtool from the Prometheus module pinned in e2e/promtool/go.mod into a cache keyed by
# the hash of the module files, and links e2e/promtool/bin to it. A warm cache makes this a no-op.
set -euo pipefail
here=$(cd "$(dirname "$0")/../promtool" && pwd)
cd "$here"

key=$(cat go.mod go.sum ../scripts/build-promtool.sh | sha256sum | cut -c1-16)
cache_root=${STOWAGE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/stowage}
out="$cache_root/promtool/$key"
if [ -x "$out/promtool" ]; then
  echo "promtool: cached build $key"
else
  echo "promtool: building $key into $out"
  tmp="$out.partial.$$"
  rm -rf "$tmp" && mkdir -p "$tmp"
  CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$tmp/promtool" github.com/prometheus/prometheus/cmd/promtool
  rm -rf "$out" && mv "$tmp" "$out"
fi
ln -sfn "$out" "$here/bin"
