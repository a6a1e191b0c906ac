#!/usr/bin/env bash
# Builds Kubernetes' storage e2e suite (e2e.test, from e2e/storage/suite), the ginkgo CLI that runs
# it, agnhost (the test image's binary) from the modules pinned in e2e/storage/go.mod, and the CSI
# mock tests' stand-ins for images no served module builds (e2e/storage/cmd: hostpathplugin,
# csi-node-driver-registrar; docs/csi.md), into a cache keyed by the hash of the module files, the
# suite's and stand-ins' source and this script; links
# e2e/storage/bin to it. A warm cache makes this a no-op; a cold one shares the Go build cache with
# the control-plane build (same module versions), so most packages are compiled once.
set -euo pipefail
here=$(cd "$(dirname "$0")/../storage" && pwd)
cd "$here"

key=$(cat go.mod go.sum suite/*.go cmd/*/*.go internal/*/*.go ../scripts/build-storage-e2e.sh ../scripts/k8s-ldflags.sh | sha256sum | cut -c1-16)
cache_root=${STOWAGE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/stowage}
out="$cache_root/storage-e2e/$key"
if [ -x "$out/e2e.test" ] && [ -x "$out/ginkgo" ] && [ -x "$out/agnhost" ] && [ -x "$out/hostpathplugin" ] &&
  [ -x "$out/csi-node-driver-registrar" ]; then
  echo "storage-e2e: cached build $key"
else
  echo "storage-e2e: building $key into $out (minutes on a cold cache)"
  tmp="$out.partial.$$"
  rm -rf "$tmp" && mkdir -p "$tmp"
  # shellcheck source=e2e/scripts/k8s-ldflags.sh
  . ../scripts/k8s-ldflags.sh
  ldflags=$(k8s_ldflags)
  export CGO_ENABLED=0
  start=$(date +%s)
  go test -c -trimpath -ldflags "$ldflags" -o "$tmp/e2e.test" ./suite
  echo "storage-e2e: e2e.test built in $(( $(date +%s) - start ))s"
  go build -trimpath -ldflags "-s -w" -o "$tmp/ginkgo" github.com/onsi/ginkgo/v2/ginkgo
  # agnhost goes into a container image (e2e/scripts/e2e-images.sh): static, like the others.
  go build -trimpath -ldflags "-s -w" -o "$tmp/agnhost" k8s.io/kubernetes/test/images/agnhost
  go build -trimpath -ldflags "-s -w" -o "$tmp/" ./cmd/hostpathplugin ./cmd/csi-node-driver-registrar
  rm -rf "$out" && mv "$tmp" "$out"
fi
ln -sfn "$out" "$here/bin"
