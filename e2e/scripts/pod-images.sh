#!/usr/bin/env bash
# Builds the two images the real-node cluster runs, offline from Debian's busybox-static:
#   localhost/busybox:stowage  test pods (Cmd sh)
#   localhost/pause:stowage    the pod sandbox (sleeps until TERM; no registry serves the upstream pause)
# as OCI archives target/image/{busybox,pause}.oci.tar that `ctr images import` names by their
# io.containerd.image.name annotation. Cached by the package version and this script's hash.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$top/target/image}
mkdir -p "$out"
for tool in jq gzip sha256sum dpkg-deb apt-get; do
  command -v "$tool" >/dev/null || { echo "pod-images: $tool missing (make deps)" >&2; exit 1; }
done

version=$(apt-cache policy busybox-static | awk '/Candidate:/ {print $2}')
stamp="$version $(sha256sum "$0" | cut -c1-16)"
if [ -f "$out/pod-images.stamp" ] && [ "$(cat "$out/pod-images.stamp")" = "$stamp" ] \
  && [ -f "$out/busybox.oci.tar" ] && [ -f "$out/pause.oci.tar" ]; then
  echo "pod-images: cached ($stamp)"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download -qq busybox-static >/dev/null)
rootfs="$tmp/rootfs"
dpkg-deb -x "$tmp"/busybox-static_*.deb "$rootfs"
# Every applet as a link, so pods can run sh, sleep, df, dd, stat … by name.
for a in $("$rootfs/bin/busybox" --list); do
  [ "$a" = busybox ] || ln -sf busybox "$rootfs/bin/$a"
done
mkdir -p "$rootfs"/{etc,proc,sys,dev,tmp,data}
chmod 1777 "$rootfs/tmp"
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$rootfs/etc/passwd"
printf 'root:x:0:\nnobody:x:65534:\n' >"$rootfs/etc/group"
# Deterministic layer: sorted names, one mtime, numeric root ownership.
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$rootfs" -cf "$tmp/layer.tar" .
diff_id=$(sha256sum "$tmp/layer.tar" | cut -d' ' -f1)
gzip -n -9 "$tmp/layer.tar"

arch=$(dpkg --print-architecture)
case "$arch" in armhf) arch=arm ;; i386) arch=386 ;; ppc64el) arch=ppc64le ;; esac

add_blob() { # add_blob <layout> <file> → prints the digest (hex)
  local d
  d=$(sha256sum "$2" | cut -d' ' -f1)
  mkdir -p "$1/blobs/sha256"
  cp "$2" "$1/blobs/sha256/$d"
  echo "$d"
}

image() { # image <name> <cmd-json>
  local name=$1 cmd=$2 layout="$tmp/$1" l cd cs md ms
  mkdir -p "$layout"
  l=$(add_blob "$layout" "$tmp/layer.tar.gz")
  jq -n --arg arch "$arch" --arg diff "sha256:$diff_id" --argjson cmd "$cmd" '{
    created: "1970-01-01T00:00:00Z", architecture: $arch, os: "linux",
    config: {Cmd: $cmd, Env: ["PATH=/bin"], WorkingDir: "/"},
    rootfs: {type: "layers", diff_ids: [$diff]}}' >"$tmp/$name-config.json"
  cd=$(add_blob "$layout" "$tmp/$name-config.json")
  cs=$(stat -c %s "$tmp/$name-config.json")
  jq -n --arg cd "sha256:$cd" --argjson cs "$cs" --arg l "sha256:$l" \
    --argjson ls "$(stat -c %s "$tmp/layer.tar.gz")" '{
    schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
    config: {mediaType: "application/vnd.oci.image.config.v1+json", digest: $cd, size: $cs},
    layers: [{mediaType: "application/vnd.oci.image.layer.v1.tar+gzip", digest: $l, size: $ls}]}' \
    >"$tmp/$name-manifest.json"
  md=$(add_blob "$layout" "$tmp/$name-manifest.json")
  ms=$(stat -c %s "$tmp/$name-manifest.json")
  jq -n --arg md "sha256:$md" --argjson ms "$ms" --arg arch "$arch" \
    --arg ref "localhost/$name:stowage" '{
    schemaVersion: 2, mediaType: "application/vnd.oci.image.index.v1+json",
    manifests: [{mediaType: "application/vnd.oci.image.manifest.v1+json", digest: $md, size: $ms,
      platform: {architecture: $arch, os: "linux"},
      annotations: {"io.containerd.image.name": $ref, "org.opencontainers.image.ref.name": "stowage"}}]}' \
    >"$layout/index.json"
  echo '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$layout" \
    -cf "$out/$name.oci.tar.partial" oci-layout index.json blobs
  mv "$out/$name.oci.tar.partial" "$out/$name.oci.tar"
  echo "pod-images: $out/$name.oci.tar ($(du -h "$out/$name.oci.tar" | cut -f1))"
}

image busybox '["sh"]'
image pause '["sh","-c","trap \"exit 0\" TERM; while true; do sleep 3600 & wait $!; done"]'
echo "$stamp" >"$out/pod-images.stamp"
