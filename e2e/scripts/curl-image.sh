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
stamp="$key $(sha256sum <"$(dirname "$0")/oci.sh" | cut -c1-16)"
if [ -s "$archive" ] && [ "$(cat "$out/curl-image.stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "curl-image: cached ($key)"
  exit 0
fi

# shellcheck source=e2e/scripts/oci.sh
. "$(dirname "$0")/oci.sh"
oci_archive "$archive" "$ref" "$layer/layer.tar.gz" "$(cat "$layer/diff_id")" \
  '{"Cmd": ["sh"], "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "WorkingDir": "/"}'
layer_size=$(stat -c %s "$layer/layer.tar.gz")
echo "$stamp" >"$out/curl-image.stamp"
echo "curl-image: $archive ($ref, $((layer_size / 1024 / 1024)) MiB)"
