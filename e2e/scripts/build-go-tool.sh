#!/usr/bin/env bash
# Builds one Go tool from the module pinned in an e2e/ folder into a cache keyed by the hash of
# that module's files (and of this script), and links <folder>/bin to it. A warm cache makes this
# a no-op; a cold machine builds once.
#   build-go-tool.sh <folder under e2e/> <binary name> <package import path>
# GO_TOOL_LDFLAGS, if set, replaces the default -ldflags; GO_TOOL_TAGS are build tags (both are
# part of the key).
set -euo pipefail
dir=$1 name=$2 pkg=$3
self="$(cd "$(dirname "$0")" && pwd)/build-go-tool.sh"
here=$(cd "$(dirname "$0")/../$dir" && pwd)
cd "$here"

ldflags=${GO_TOOL_LDFLAGS:--s -w}
tags=${GO_TOOL_TAGS:-}
key=$( (cat go.mod go.sum "$self"; echo "$ldflags"; echo "$tags") | sha256sum | cut -c1-16)
cache_root=${STOWAGE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/stowage}
out="$cache_root/$name/$key"
if [ -x "$out/$name" ]; then
  echo "$name: cached build $key"
else
  echo "$name: building $key into $out"
  tmp="$out.partial.$$"
  rm -rf "$tmp" && mkdir -p "$tmp"
  CGO_ENABLED=0 go build -trimpath -tags "$tags" -ldflags "$ldflags" -o "$tmp/$name" "$pkg"
  rm -rf "$out" && mv "$tmp" "$out"
fi
ln -sfn "$out" "$here/bin"
