#!/usr/bin/env bash
# Builds the kind rig's node image offline and imports it into the rig's dockerd:
#   stowage.dev/kind-node:<Kubernetes version>
# No registry this rig reaches serves kindest/node or kindest/base, so the image is made here:
#   - a Debian root file system (mmdebstrap: systemd, containerd, runc, Debian's CNI plugins,
#     iptables, conntrack, xfsprogs, ...) with kubelet, kubeadm and kubectl of the release
#     e2e/go.mod pins, the units and files of e2e/kind/node, and /kind/version and
#     /kind/manifests as kind expects them;
#   - the control-plane images kubeadm runs (`kubeadm config images list`) as OCI archives under
#     /kind/images, imported into the node's containerd at boot: kube-apiserver,
#     kube-controller-manager, kube-scheduler and kube-proxy from the same release, etcd from its
#     server module, CoreDNS from its module, pause compiled from the Kubernetes tree's source.
# Cached under the user's cache dir by the hash of every input; a warm cache only re-imports.
#   e2e/scripts/kind-node-image.sh        (make kind-node-image; needs root and the rig's dockerd)
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
cd "$top"
# shellcheck source=e2e/scripts/oci.sh
. e2e/scripts/oci.sh
export DOCKER_HOST=${DOCKER_HOST:-unix:///run/stowage-rig/docker.sock}
cache_root=${STOWAGE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/stowage}

# --- The binaries (each cached by its own inputs) ------------------------------------------------
make -s controlplane kubeadm >/dev/null
# shellcheck source=e2e/scripts/k8s-ldflags.sh
. e2e/scripts/k8s-ldflags.sh
GO_TOOL_LDFLAGS=$(cd e2e/kube-proxy && k8s_ldflags) e2e/scripts/build-go-tool.sh kube-proxy kube-proxy k8s.io/kubernetes/cmd/kube-proxy
e2e/scripts/build-go-tool.sh coredns coredns github.com/coredns/coredns
k8s=$(e2e/bin/kubelet --version | awk '{print $2}')
bins=(e2e/bin/kubelet e2e/bin/kubectl e2e/kubeadm/bin/kubeadm e2e/bin/kube-apiserver
  e2e/bin/kube-controller-manager e2e/bin/kube-scheduler e2e/bin/etcd e2e/kube-proxy/bin/kube-proxy
  e2e/coredns/bin/coredns)
pause_src=$(cd e2e/kubeadm && go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c

# shellcheck disable=SC1091
. /etc/os-release
suite=${STOWAGE_DEBIAN_SUITE:-$VERSION_CODENAME}
sources=${STOWAGE_DEBIAN_SOURCES:-/etc/apt/sources.list.d/debian.sources}
node_packages=systemd,systemd-sysv,dbus,sudo,containerd,runc,containernetworking-plugins,iptables,nftables,conntrack,iproute2,ethtool,util-linux,mount,kmod,e2fsprogs,xfsprogs,ca-certificates,procps,socat,libseccomp2,bash
proxy_packages=iptables,nftables,conntrack,kmod
key=$(
  {
    # shellcheck disable=SC2046 # the node's files, one argument each (no spaces in their names)
    sha256sum "${bins[@]}" "$pause_src" $(find e2e/kind/node -type f | sort) "$0" e2e/scripts/oci.sh | cut -c1-64
    grep -v '^#' "$sources" 2>/dev/null || true
    echo "$suite $node_packages $proxy_packages"
  } | sha256sum | cut -c1-16
)
ref="stowage.dev/kind-node:$k8s"
if [ "$(docker image inspect -f '{{index .Config.Labels "dev.stowage.rig-key"}}' "$ref" 2>/dev/null)" = "$key" ]; then
  echo "kind-node-image: $ref is current ($key)"
  exit 0
fi
out="$cache_root/kind-node/$key"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kind-node.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

debootstrap() { # debootstrap <dir> <packages>
  local log
  log="$tmp/mmdebstrap-$(basename "$1").log"
  if ! SOURCE_DATE_EPOCH=0 mmdebstrap --mode=root --variant=minbase --include="$2" \
    --aptopt='APT::Install-Recommends "false"' --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --skip=output/dev "$suite" "$1" "$sources" >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    exit 1
  fi
}

# image <archive> <ref> <rootfs dir> <config JSON>
image() {
  local diff
  diff=$(tar_layer "$3" "$tmp/layer.tar.gz")
  oci_archive "$1" "$2" "$tmp/layer.tar.gz" "$diff" "$4"
  rm -f "$tmp/layer.tar.gz"
}

if [ ! -f "$out/node.tar" ]; then
  echo "kind-node-image: building $key into $out (minutes on a cold cache)"
  images="$tmp/images"
  mkdir -p "$images"
  # Static binaries: the binary under /usr/local/bin, a /tmp, and nothing else.
  static() { # static <name> <binary> <tag>
    local r="$tmp/rootfs-$1"
    mkdir -p "$r/usr/local/bin" "$r/tmp" "$r/etc"
    chmod 1777 "$r/tmp"
    cp "$2" "$r/usr/local/bin/"
    echo 'root:x:0:0:root:/root:/sbin/nologin' >"$r/etc/passwd"
    image "$images/$1.tar" "registry.k8s.io/$1:$3" "$r" \
      '{"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "WorkingDir": "/"}'
  }
  for c in kube-apiserver kube-controller-manager kube-scheduler; do
    static "$c" "e2e/bin/$c" "$k8s"
  done
  tags=$(e2e/kubeadm/bin/kubeadm config images list --kubernetes-version "$k8s")
  tag() { grep "/$1:" <<<"$tags" | sed 's/.*://'; }
  static etcd e2e/bin/etcd "$(tag etcd)"
  # kube-proxy programs iptables or nftables: Debian's tools in a minimal root.
  debootstrap "$tmp/rootfs-kube-proxy" "$proxy_packages"
  cp e2e/kube-proxy/bin/kube-proxy "$tmp/rootfs-kube-proxy/usr/local/bin/"
  image "$images/kube-proxy.tar" "registry.k8s.io/kube-proxy:$k8s" "$tmp/rootfs-kube-proxy" \
    '{"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"], "WorkingDir": "/"}'
  mkdir -p "$tmp/rootfs-coredns"
  cp e2e/coredns/bin/coredns "$tmp/rootfs-coredns/coredns"
  image "$images/coredns.tar" "registry.k8s.io/coredns/coredns:$(tag coredns)" "$tmp/rootfs-coredns" \
    '{"Entrypoint": ["/coredns"], "ExposedPorts": {"53/tcp": {}, "53/udp": {}}}'
  mkdir -p "$tmp/rootfs-pause"
  gcc -Os -static -Wall -Werror -DVERSION="rig-$k8s" -o "$tmp/rootfs-pause/pause" "$pause_src"
  image "$images/pause.tar" "registry.k8s.io/pause:$(tag pause)" "$tmp/rootfs-pause" \
    '{"Entrypoint": ["/pause"], "User": "65535:65535"}'

  r="$tmp/node"
  debootstrap "$r" "$node_packages"
  install -m 0755 e2e/bin/kubelet e2e/bin/kubectl e2e/kubeadm/bin/kubeadm "$r/usr/bin/"
  install -m 0755 e2e/kind/node/entrypoint "$r/usr/local/bin/entrypoint"
  install -D -m 0644 e2e/kind/node/containerd.toml "$r/etc/containerd/config.toml"
  install -D -m 0644 e2e/kind/node/kubelet.default "$r/etc/default/kubelet"
  install -m 0644 e2e/kind/node/kubelet.service e2e/kind/node/kubelet.slice \
    e2e/kind/node/rig-images.service e2e/kind/node/rig-dns-udp.service \
    e2e/kind/node/rig-dns-tcp.service "$r/etc/systemd/system/"
  install -D -m 0644 e2e/kind/node/kubelet.service.d/10-kubeadm.conf "$r/etc/systemd/system/kubelet.service.d/10-kubeadm.conf"
  for u in containerd systemd-journald; do
    install -D -m 0644 e2e/kind/node/oom.conf.d/rig.conf "$r/etc/systemd/system/$u.service.d/rig-oom.conf"
  done
  # Only what a node runs: no gettys, udev, module loading or binfmt registration (kernel-wide).
  rm -f "$r"/etc/systemd/system/*.wants/* "$r"/lib/systemd/system/multi-user.target.wants/*
  for u in getty@tty1 console-getty serial-getty@ systemd-udevd systemd-udev-trigger \
    systemd-modules-load systemd-binfmt systemd-remount-fs systemd-firstboot apt-daily \
    apt-daily-upgrade e2scrub_all e2scrub_reap; do
    ln -sf /dev/null "$r/etc/systemd/system/$u.service"
  done
  mkdir -p "$r/etc/systemd/system/multi-user.target.wants"
  for u in kubelet rig-images rig-dns-udp rig-dns-tcp; do
    ln -sf "/etc/systemd/system/$u.service" "$r/etc/systemd/system/multi-user.target.wants/$u.service"
  done
  for u in containerd dbus; do
    ln -sf "/lib/systemd/system/$u.service" "$r/etc/systemd/system/multi-user.target.wants/$u.service"
  done
  echo 'ReadKMsg=no' >>"$r/etc/systemd/journald.conf"
  mkdir -p "$r/etc/kubernetes/manifests" "$r/kind/manifests" "$r/kind/images" "$r/var/lib/kubelet"
  echo "$k8s" >"$r/kind/version"
  install -m 0644 e2e/kind/node/default-cni.yaml e2e/kind/node/default-storage.yaml "$r/kind/manifests/"
  cp "$images"/*.tar "$r/kind/images/"
  rm -f "$r/etc/machine-id" && touch "$r/etc/machine-id"
  mkdir -p "$out.partial"
  tar --numeric-owner -C "$r" -cf "$out.partial/node.tar" .
  rm -rf "$out" && mv "$out.partial" "$out"
fi
docker import --change "LABEL dev.stowage.rig-key=$key" "$out/node.tar" "$ref-rootfs" >/dev/null
# `docker import` takes no STOPSIGNAL; systemd stops cleanly on SIGRTMIN+3.
printf 'FROM %s\nENV container=docker\nSTOPSIGNAL SIGRTMIN+3\nENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]\n' "$ref-rootfs" |
  docker build -q -t "$ref" - >/dev/null
docker rmi "$ref-rootfs" >/dev/null
echo "kind-node-image: $ref ($key, $(du -h "$out/node.tar" | cut -f1))"
