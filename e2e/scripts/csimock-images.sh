#!/usr/bin/env bash
# Builds, offline, the images Kubernetes' CSI mock e2e tests (test/e2e/storage/csimock) deploy,
# under the exact names their manifests ask for (test/e2e/testing-manifests/storage-csi/mock/ of
# the pinned k8s.io/kubernetes, read from the module, so a new release renames them itself):
#   hostpathplugin             e2e/storage/cmd/hostpathplugin: the proxy and mock-driver modes the
#                              manifests start (a stand-in: its module is not served; docs/csi.md)
#   csi-node-driver-registrar  e2e/storage/cmd/csi-node-driver-registrar (a stand-in, as above)
#   csi-provisioner            the upstream external-provisioner make sidecars builds (e2e/sidecars)
#   csi-attacher               the upstream external-attacher, likewise
#   busybox                    the tag the mock pod's shell container names, Debian's busybox-static
# Each binary is the image's entrypoint on a busybox root, as upstream's images run them with
# `args` only. csi-resizer and csi-snapshotter are not built: the tests that deploy them
# (expansion, snapshots) are kubelet- or snapshot-side and not run (docs/csi.md).
# Output: target/image/e2e-csimock-<name>.oci.tar and their names in e2e-csimock-images.refs,
# cached by the binaries, the busybox-static version and these scripts.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$top/target/image}
bin="$top/e2e/storage/bin"
mkdir -p "$out"
declare -A binary=(
  [hostpathplugin]="$bin/hostpathplugin"
  [csi-node-driver-registrar]="$bin/csi-node-driver-registrar"
  [csi-provisioner]="$top/e2e/sidecars/provisioner/bin/csi-provisioner"
  [csi-attacher]="$top/e2e/sidecars/attacher/bin/csi-attacher"
)
for n in "${!binary[@]}"; do
  [ -x "${binary[$n]}" ] || { echo "csimock-images: ${binary[$n]} missing (make storage-e2e-suite sidecars)" >&2; exit 1; }
done

manifests="$(cd "$top/e2e/storage" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)/test/e2e/testing-manifests/storage-csi/mock"
mapfile -t refs < <(sed -n 's/^\s*image:\s*//p' "$manifests"/*.yaml | sort -u |
  grep -Ev '/(csi-resizer|csi-snapshotter):')
names=()
for ref in "${refs[@]}"; do
  n=${ref##*/}
  n=${n%%:*}
  [ "$n" = busybox ] || [ -n "${binary[$n]:-}" ] || { echo "csimock-images: nothing builds $ref" >&2; exit 1; }
  names+=("$n")
done

# shellcheck source=e2e/scripts/oci.sh
. "$(dirname "$0")/oci.sh"
version=$(apt-cache policy busybox-static | awk '/Candidate:/ {print $2}')
stamp="$version $(cat "$0" "$(dirname "$0")/oci.sh" "${binary[@]}" | sha256sum | cut -c1-16) ${refs[*]}"
ready=1
for n in "${names[@]}"; do [ -f "$out/e2e-csimock-$n.oci.tar" ] || ready=0; done
if [ "$ready" = 1 ] && [ "$(cat "$out/e2e-csimock-images.stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "csimock-images: cached"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
busybox_rootfs "$tmp/busybox"
env='"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"], "WorkingDir": "/"'
for i in "${!refs[@]}"; do
  n=${names[$i]} ref=${refs[$i]}
  root="$tmp/root-$n"
  cp -a "$tmp/busybox" "$root"
  if [ "$n" = busybox ]; then
    config="{\"Cmd\": [\"sh\"], $env}"
  else
    install -m 0755 "${binary[$n]}" "$root/$n"
    config="{\"Entrypoint\": [\"/$n\"], $env}"
  fi
  diff=$(tar_layer "$root" "$tmp/$n.tar.gz")
  oci_archive "$out/e2e-csimock-$n.oci.tar" "$ref" "$tmp/$n.tar.gz" "$diff" "$config"
  rm -rf "$root" "$tmp/$n.tar.gz"
  echo "csimock-images: $ref ($(du -h "$out/e2e-csimock-$n.oci.tar" | cut -f1))"
done
printf '%s\n' "${refs[@]}" >"$out/e2e-csimock-images.refs"
echo "$stamp" >"$out/e2e-csimock-images.stamp"
