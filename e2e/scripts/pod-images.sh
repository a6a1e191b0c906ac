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
stamp="$version $(cat "$0" "$(dirname "$0")/oci.sh" | sha256sum | cut -c1-16)"
if [ -f "$out/pod-images.stamp" ] && [ "$(cat "$out/pod-images.stamp")" = "$stamp" ] \
  && [ -f "$out/busybox.oci.tar" ] && [ -f "$out/pause.oci.tar" ]; then
  echo "pod-images: cached ($stamp)"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# shellcheck source=e2e/scripts/oci.sh
. "$(dirname "$0")/oci.sh"
busybox_rootfs "$tmp/rootfs"
diff_id=$(tar_layer "$tmp/rootfs" "$tmp/layer.tar.gz")

image() { # image <name> <cmd-json>
  oci_archive "$out/$1.oci.tar" "localhost/$1:stowage" "$tmp/layer.tar.gz" "$diff_id" \
    "{\"Cmd\": $2, \"Env\": [\"PATH=/bin\"], \"WorkingDir\": \"/\"}"
  echo "pod-images: $out/$1.oci.tar ($(du -h "$out/$1.oci.tar" | cut -f1))"
}

image busybox '["sh"]'
image pause '["sh","-c","trap \"exit 0\" TERM; while true; do sleep 3600 & wait $!; done"]'
echo "$stamp" >"$out/pod-images.stamp"
