#!/usr/bin/env bash
# Builds the container images Kubernetes' storage e2e suite runs, offline, under the exact names
# the suite asks for (it pulls with IfNotPresent, so a name that is present is never pulled):
#   busybox            Debian's busybox-static, every applet linked (the suite's default test image)
#   agnhost            the real agnhost of the same Kubernetes release (e2e/storage/bin/agnhost, built
#                      from k8s.io/kubernetes/test/images/agnhost by build-storage-e2e.sh) on that
#                      busybox root, entrypoint /agnhost, command pause, as upstream; the subPath
#                      suite runs its `mounttest`; host-exec pods run its nsenter, util-linux's as in
#                      upstream's image (the machine's, with the libraries it links)
#   nginx              the "exec" volume test runs a shell script in it and nothing else; it serves
#                      HTTP on :80 with busybox httpd when started without a command
#   glibc-dns-testing  as upstream, Debian (the machine's suite, minbase: GNU coreutils) with
#                      dnsutils; the multiVolume tests' pods write with GNU dd's oflag=nocache
#   agnhost-prev       the tag of the previous agnhost that StatefulSet pods run (test-webserver):
#                      the same image as agnhost, under that name
#   pause              the CSI mock tests' pods: busybox sleeping until TERM, as the real node's
#                      sandbox image (no registry serves the upstream pause)
# The names and tags come from `e2e.test -list-storage-images` (e2e/storage/suite), so a new
# release renames them itself.
# Output: target/image/e2e-<name>.oci.tar and the list of their names e2e-images.refs, cached by the busybox-static version, the agnhost
# binary and these scripts.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$top/target/image}
bin="$top/e2e/storage/bin"
mkdir -p "$out"
for tool in jq gzip sha256sum dpkg-deb apt-get mmdebstrap flock; do
  command -v "$tool" >/dev/null || { echo "e2e-images: $tool missing (make deps)" >&2; exit 1; }
done
[ -x "$bin/e2e.test" ] && [ -x "$bin/agnhost" ] || {
  echo "e2e-images: e2e/storage/bin is not built (e2e/scripts/build-storage-e2e.sh)" >&2; exit 1; }

# In this order: the suite's test main prints the exact names its pods ask for.
names=(busybox agnhost nginx glibc-dns-testing agnhost-prev pause)
mapfile -t refs < <("$bin/e2e.test" -list-storage-images)
[ "${#refs[@]}" = "${#names[@]}" ] || { echo "e2e-images: e2e.test -list-storage-images: ${refs[*]}" >&2; exit 1; }
for i in "${!names[@]}"; do
  case "${refs[$i]}" in */"${names[$i]%-prev}":*) ;; *) echo "e2e-images: ${refs[$i]} is not ${names[$i]}" >&2; exit 1 ;; esac
done

# shellcheck source=e2e/scripts/oci.sh
. "$(dirname "$0")/oci.sh"
debian=$(debian_layer glibc-dns-testing-image dnsutils)
version=$(apt-cache policy busybox-static | awk '/Candidate:/ {print $2}')
nsenter_version=$(dpkg-query -W -f '${Version}' util-linux libc6)
stamp="$version $nsenter_version $(basename "$debian") $(cat "$0" "$(dirname "$0")/oci.sh" "$bin/agnhost" | sha256sum | cut -c1-16) ${refs[*]}"
ready=1
for n in "${names[@]}"; do [ -f "$out/e2e-$n.oci.tar" ] || ready=0; done
[ -f "$out/e2e-images.refs" ] || ready=0
if [ "$ready" = 1 ] && [ "$(cat "$out/e2e-images.stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "e2e-images: cached"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
busybox_rootfs "$tmp/busybox"
busybox_diff=$(tar_layer "$tmp/busybox" "$tmp/busybox.tar.gz")

# agnhost: upstream's image also has the user and group one SupplementalGroups test names.
cp -a "$tmp/busybox" "$tmp/agnhost"
install -m 0755 "$bin/agnhost" "$tmp/agnhost/agnhost"
ln -s agnhost "$tmp/agnhost/agnhost-2"
echo 'user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh' >>"$tmp/agnhost/etc/passwd"
echo 'group-defined-in-image:x:50000:user-defined-in-image' >>"$tmp/agnhost/etc/group"
mkdir -p "$tmp/agnhost/uploads"
# porter's certificate and key at /, as upstream adds them: the StatefulSet tests' readiness probe
# fetches /localhost.crt from test-webserver (which serves /), and breaks it by moving the file.
porter="$(cd "$top/e2e/storage" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)/test/images/agnhost/porter"
install -m 0644 "$porter/localhost.crt" "$porter/localhost.key" "$tmp/agnhost/"
# util-linux's nsenter, as upstream's image installs it: host-exec pods run `nsenter
# --mount=/rootfs/proc/1/ns/mnt -- sh -c …`, which must exec the node's own sh and tools. Busybox's
# applet runs its built-in ash and applets instead (its losetup lacks what the local-PV tests use).
rm -f "$tmp/agnhost/bin/nsenter"
install -m 0755 /usr/bin/nsenter "$tmp/agnhost/bin/nsenter"
for lib in $(ldd /usr/bin/nsenter | grep -o '/[^ ]*'); do
  mkdir -p "$tmp/agnhost$(dirname "$lib")"
  cp -L "$lib" "$tmp/agnhost$lib"
done
agnhost_diff=$(tar_layer "$tmp/agnhost" "$tmp/agnhost.tar.gz")

env='"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"], "WorkingDir": "/"'
for i in "${!names[@]}"; do
  n=${names[$i]} ref=${refs[$i]}
  layer="$tmp/busybox.tar.gz" diff=$busybox_diff
  case "$n" in
    agnhost|agnhost-prev) layer="$tmp/agnhost.tar.gz" diff=$agnhost_diff
      config="{\"Entrypoint\": [\"/agnhost\"], \"Cmd\": [\"pause\"], $env}" ;;
    nginx) config="{\"Cmd\": [\"httpd\", \"-f\", \"-p\", \"80\", \"-h\", \"/tmp\"], $env}" ;;
    pause) config="{\"Cmd\": [\"sh\", \"-c\", \"trap 'exit 0' TERM; while true; do sleep 3600 & wait \$!; done\"], $env}" ;;
    glibc-dns-testing) layer="$debian/layer.tar.gz" diff=$(cat "$debian/diff_id")
      config="{\"Cmd\": [\"bash\"], $env}" ;;
    *) config="{\"Cmd\": [\"sh\"], $env}" ;;
  esac
  oci_archive "$out/e2e-$n.oci.tar" "$ref" "$layer" "$diff" "$config"
  echo "e2e-images: $ref ($(du -h "$out/e2e-$n.oci.tar" | cut -f1))"
done
printf '%s\n' "${refs[@]}" >"$out/e2e-images.refs"
echo "$stamp" >"$out/e2e-images.stamp"
