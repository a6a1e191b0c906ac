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

# shellcheck source=e2e/scripts/oci.sh
. "$(dirname "$0")/oci.sh"
mkdir -p "$out"
# minbase has sh, coreutils, sed and grep; curl brings its TLS stack.
layer=$(debian_layer curl-image curl)
key=$(basename "$layer")
stamp="$key $(sha256sum <"$(dirname "$0")/oci.sh" | cut -c1-16)"
if [ -s "$archive" ] && [ "$(cat "$out/curl-image.stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "curl-image: cached ($key)"
  exit 0
fi

oci_archive "$archive" "$ref" "$layer/layer.tar.gz" "$(cat "$layer/diff_id")" \
  '{"Cmd": ["sh"], "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "WorkingDir": "/"}'
layer_size=$(stat -c %s "$layer/layer.tar.gz")
echo "$stamp" >"$out/curl-image.stamp"
echo "curl-image: $archive ($ref, $((layer_size / 1024 / 1024)) MiB)"
