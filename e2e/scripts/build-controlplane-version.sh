#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager and kubectl of another Kubernetes minor for the
# version matrix (make test-versions), and kube-scheduler and kubelet too where that minor's
# go.mod names them (the real-node scenarios, make test-versions-realnode):
# build-controlplane-version.sh 1.35 builds from the module
# pinned in e2e/versions/1.35 into ${cache}/controlplane-1.35/<hash of its module files>, links
# e2e/versions/1.35/bin to it, and links the main control plane's etcd beside them (etcd 3.6 serves
# every apiserver of the matrix, so it is not built again). A warm cache makes this a no-op.
set -euo pipefail
minor=${1:?usage: build-controlplane-version.sh MINOR (a directory of e2e/versions)}
here=$(cd "$(dirname "$0")/.." && pwd)
dir="$here/versions/$minor"
[ -f "$dir/go.mod" ] || { echo "controlplane-$minor: no $dir/go.mod" >&2; exit 2; }

# etcd comes from the main build (a no-op when it is cached).
"$here/scripts/build-controlplane.sh" >/dev/null
etcd=$(readlink -f "$here/bin/etcd")

cd "$dir"
key=$(cat go.mod go.sum "$here/scripts/build-controlplane-version.sh" "$here/scripts/k8s-ldflags.sh" | sha256sum | cut -c1-16)
cache_root=${STOWAGE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/stowage}
out="$cache_root/controlplane-$minor/$key"
bins=(kube-apiserver kube-controller-manager kubectl)
# A real node of this minor needs its scheduler and kubelet as well.
if grep -q 'k8s.io/kubernetes/cmd/kubelet$' go.mod; then bins+=(kube-scheduler kubelet); fi

complete=1
for b in "${bins[@]}"; do [ -x "$out/$b" ] || complete=0; done
if [ "$complete" = 1 ]; then
  echo "controlplane-$minor: cached build $key"
else
  echo "controlplane-$minor: building $key into $out (about 10 minutes on a cold cache)"
  tmp="$out.partial.$$"
  rm -rf "$tmp" && mkdir -p "$tmp"
  # shellcheck source=e2e/scripts/k8s-ldflags.sh
  . "$here/scripts/k8s-ldflags.sh"
  ldflags=$(k8s_ldflags)
  export CGO_ENABLED=0
  for b in "${bins[@]}"; do
    echo "controlplane-$minor: go build $b"
    go build -trimpath -ldflags "$ldflags" -o "$tmp/$b" "k8s.io/kubernetes/cmd/$b"
  done
  rm -rf "$out" && mv "$tmp" "$out"
fi
ln -sfn "$etcd" "$out/etcd"
ln -sfn "$out" "$dir/bin"
"$dir/bin/kube-apiserver" --version
