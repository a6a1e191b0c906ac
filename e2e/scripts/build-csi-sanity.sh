#!/usr/bin/env bash
# Builds csi-sanity from the csi-test module pinned in e2e/csi/go.mod into a cache keyed by the
# hash of the module files, and links e2e/csi/bin to it. A warm cache makes this a no-op.
set -euo pipefail
here=$(cd "$(dirname "$0")/../csi" && pwd)
cd "$here"

key=$(cat go.mod go.sum ../scripts/build-csi-sanity.sh | sha256sum | cut -c1-16)
cache_root=${STOWAGE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/stowage}
out="$cache_root/csi-sanity/$key"
if [ -x "$out/csi-sanity" ]; then
  echo "csi-sanity: cached build $key"
else
  echo "csi-sanity: building $key into $out"
  tmp="$out.partial.$$"
  rm -rf "$tmp" && mkdir -p "$tmp"
  CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$tmp/csi-sanity" github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity
  rm -rf "$out" && mv "$tmp" "$out"
fi
ln -sfn "$out" "$here/bin"
