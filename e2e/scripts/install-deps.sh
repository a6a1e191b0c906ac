#!/usr/bin/env bash
# Installs the OS tools stowage needs on a fresh Debian machine: losetup/mount (util-linux, mount),
# mkfs.ext4/resize2fs (e2fsprogs), mkfs.xfs/xfs_growfs (xfsprogs), blkid; for `make image` (e2e/scripts/image.sh): mmdebstrap (the
# Debian base layer), skopeo (checks the OCI archive), jq (writes its JSON); for the real-node
# cluster: containerd + runc (ctr), the CNI plugins, tini (node 2's PID 1), and a static busybox for the pod and sandbox
# images; prometheus and openssh-server (Debian's packages: the tests run their binaries, never
# their services). Go and Rust come with the machine image.
set -euo pipefail
missing=()
for tool in losetup:util-linux mount:mount mkfs.ext4:e2fsprogs resize2fs:e2fsprogs mkfs.xfs:xfsprogs xfs_growfs:xfsprogs blkid:util-linux findmnt:util-linux curl:curl \
  mmdebstrap:mmdebstrap skopeo:skopeo jq:jq containerd:containerd runc:runc ctr:containerd \
  /usr/lib/cni/bridge:containernetworking-plugins /bin/busybox:busybox-static tini:tini; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool##*:}")
done
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u | grep .)
for tool in go cargo; do
  command -v "$tool" >/dev/null 2>&1 || { echo "deps: $tool is required and not on PATH" >&2; exit 1; }
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # No recommends: skopeo's would add container networking plugins the build does not use.
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Packages whose service the tests run themselves, with their own configuration: prometheus (the
# real-node Prometheus test), openssh-server (the real nodes' SSH for upstream's disruptive storage
# tests, on each node's own address). Their services are neither started nor enabled.
services=()
command -v prometheus >/dev/null 2>&1 || services+=(prometheus)
[ -x /usr/sbin/sshd ] || services+=(openssh-server)
if [ ${#services[@]} -gt 0 ]; then
  echo "deps: installing ${services[*]} (their services neither started nor enabled)"
  export DEBIAN_FRONTEND=noninteractive
  # policy-rc.d answering 101 is Debian's way to keep a package's postinst from starting its
  # service; a machine that already has one (container images do) keeps its own.
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy"
    trap 'rm -f "$policy"' EXIT
  fi
  [ ${#missing[@]} -gt 0 ] || apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${services[@]}" >/dev/null
  # Nor started at the next boot.
  if command -v systemctl >/dev/null; then
    systemctl disable prometheus.service ssh.service >/dev/null 2>&1 || true
  fi
fi
