#!/usr/bin/env bash
# Builds the upstream control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubelet for the real-node cluster, kubectl) from
# the Go modules pinned in e2e/go.mod, into a cache keyed by the hash of the module files, and
# links e2e/bin to it. A warm cache makes this a no-op; a change to go.mod/go.sum rebuilds.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

key=$(cat go.mod go.sum cmd/etcd/main.go scripts/build-controlplane.sh scripts/k8s-ldflags.sh | sha256sum | cut -c1-16)
cache_root=${STOWAGE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/stowage}
out="$cache_root/controlplane/$key"
bins=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl)

complete=1
for b in "${bins[@]}"; do [ -x "$out/$b" ] || complete=0; done
if [ "$complete" = 1 ]; then
  echo "controlplane: cached build $key"
else
  echo "controlplane: building $key into $out (minutes on a cold cache)"
  tmp="$out.partial.$$"
  rm -rf "$tmp" && mkdir -p "$tmp"
  # shellcheck source=e2e/scripts/k8s-ldflags.sh
  . scripts/k8s-ldflags.sh
  ldflags=$(k8s_ldflags)
  export CGO_ENABLED=0
  go build -trimpath -ldflags "-s -w" -o "$tmp/etcd" ./cmd/etcd
  for b in kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl; do
    echo "controlplane: go build $b"
    go build -trimpath -ldflags "$ldflags" -o "$tmp/$b" "k8s.io/kubernetes/cmd/$b"
  done
  rm -rf "$out" && mv "$tmp" "$out"
fi
ln -sfn "$out" "$here/bin"
"$here/bin/kube-apiserver" --version
