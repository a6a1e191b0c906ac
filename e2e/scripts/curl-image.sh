#!/usr/bin/env bash
# Builds localhost/curl:stowage, the image the chart's `helm test` checker runs on the real node
# (crates/chart-tests/tests/realnode/main.rs; the chart's default is docker.io/curlimages/curl): sh,
# sed, date and curl from Debian, no registry needed. busybox's wget cannot be used instead: its
# TLS client sends no signature_algorithms, which Go's TLS (1.25 and later, so kube-apiserver
# 1.35 and later) refuses ("missing signature_algorithms from TLS 1.2 peer").
#
# Output: target/image/curl.oci.tar (index.json names it, so `ctr images import` keeps the name).
# The Debian layer is made by mmdebstrap from the machine's apt sources and cached under
# ${XDG_CACHE_HOME:-~/.cache}/stowage/curl-image/<hash of its inputs>; a warm cache only repacks
# (a second), and an archive already made from that layer is kept as is. Root is needed.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$top/target/image}
archive="$out/curl.oci.tar"
ref=localhost/curl:stowage
for tool in mmdebstrap jq gzip sha256sum dpkg flock; do
  command -v "$tool" >/dev/null || { echo "curl-image: $tool is missing (make deps)" >&2; exit 1; }
done

# shellcheck disable=SC1091
. /etc/os-release
suite=${STOWAGE_DEBIAN_SUITE:-${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}}
arch=$(dpkg --print-architecture)
oci_arch=$arch
[ "$arch" = ppc64el ] && oci_arch=ppc64le
sources=${STOWAGE_DEBIAN_SOURCES:-/etc/apt/sources.list.d/debian.sources}
[ -f "$sources" ] || { echo "curl-image: no $sources; set STOWAGE_DEBIAN_SOURCES" >&2; exit 1; }

# minbase has sh, coreutils, sed and grep; curl brings its TLS stack. Slimmed as image.sh does.
args=(
  --mode=root --variant=minbase --arch="$arch" --include=curl
  --aptopt='APT::Install-Recommends "false"'
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*'
  --customize-hook='rm -f "$1"/var/log/*.log "$1"/var/cache/ldconfig/aux-cache'
  --skip=output/dev
)
key=$({ printf '%s\n' "$suite" "$arch" "${args[@]}"; grep -v '^#' "$sources"; mmdebstrap --version; sha256sum <"$0"; } | sha256sum | cut -c1-16)
cache_root=${STOWAGE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/stowage}
layer="$cache_root/curl-image/$key"

mkdir -p "$cache_root/curl-image" "$out"
exec 9>"$cache_root/curl-image/.lock"
flock 9 # parallel callers build once
if [ ! -s "$layer/layer.tar.gz" ]; then
  echo "curl-image: building the $suite layer $key with mmdebstrap (a minute or two)" >&2
  part="$layer.partial.$$"
  rm -rf "$part" && mkdir -p "$part"
  if ! SOURCE_DATE_EPOCH=0 mmdebstrap "${args[@]}" "$suite" "$part/layer.tar" "$sources" >"$part/mmdebstrap.log" 2>&1; then
    tail -n 30 "$part/mmdebstrap.log" >&2
    echo "curl-image: mmdebstrap failed; log in $part/mmdebstrap.log" >&2
    exit 1
  fi
  sha256sum <"$part/layer.tar" | cut -d' ' -f1 >"$part/diff_id"
  gzip -n -6 "$part/layer.tar"
  rm -rf "$layer" && mv "$part" "$layer"
fi
if [ -s "$archive" ] && [ "$(cat "$out/curl-image.stamp" 2>/dev/null)" = "$key" ]; then
  echo "curl-image: cached ($key)"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
layout="$tmp/layout"
mkdir -p "$layout/blobs/sha256"
add_blob() { # add_blob FILE → "<sha256 hex> <size>"
  local d
  d=$(sha256sum <"$1" | cut -d' ' -f1)
  cp "$1" "$layout/blobs/sha256/$d"
  echo "$d $(stat -c %s "$1")"
}
read -r layer_digest layer_size <<<"$(add_blob "$layer/layer.tar.gz")"
jq -n --arg arch "$oci_arch" --arg diff "sha256:$(cat "$layer/diff_id")" '{
  created: "1970-01-01T00:00:00Z", architecture: $arch, os: "linux",
  config: {Cmd: ["sh"], Env: ["PATH=/usr/local/bin:/usr/bin:/bin"], WorkingDir: "/"},
  rootfs: {type: "layers", diff_ids: [$diff]}}' >"$tmp/config.json"
read -r config_digest config_size <<<"$(add_blob "$tmp/config.json")"
jq -n --arg cd "sha256:$config_digest" --argjson cs "$config_size" \
  --arg l "sha256:$layer_digest" --argjson ls "$layer_size" '{
  schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
  config: {mediaType: "application/vnd.oci.image.config.v1+json", digest: $cd, size: $cs},
  layers: [{mediaType: "application/vnd.oci.image.layer.v1.tar+gzip", digest: $l, size: $ls}]}' \
  >"$tmp/manifest.json"
read -r manifest_digest manifest_size <<<"$(add_blob "$tmp/manifest.json")"
jq -n --arg md "sha256:$manifest_digest" --argjson ms "$manifest_size" --arg arch "$oci_arch" \
  --arg ref "$ref" '{
  schemaVersion: 2, mediaType: "application/vnd.oci.image.index.v1+json",
  manifests: [{mediaType: "application/vnd.oci.image.manifest.v1+json", digest: $md, size: $ms,
    platform: {architecture: $arch, os: "linux"},
    annotations: {"io.containerd.image.name": $ref, "org.opencontainers.image.ref.name": "stowage"}}]}' \
  >"$layout/index.json"
echo '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$layout" \
  -cf "$archive.partial" oci-layout index.json blobs
mv "$archive.partial" "$archive"
echo "$key" >"$out/curl-image.stamp"
echo "curl-image: $archive ($ref, $((layer_size / 1024 / 1024)) MiB)"
