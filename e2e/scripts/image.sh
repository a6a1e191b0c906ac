#!/usr/bin/env bash
# Builds the stowage image (the one the Containerfile describes) offline, as an OCI image archive:
# no registry and no container daemon, only Debian's package mirror through apt.
#
#   layer 1  the Debian base: minbase + util-linux, mount, e2fsprogs, xfsprogs, slimmed as Debian's -slim
#            images are (no man pages, docs except copyright, locales), plus the "nonroot" user
#            65532:65532. Built by mmdebstrap from the machine's configured Debian mirror and cached
#            under ${XDG_CACHE_HOME:-~/.cache}/stowage/image-base/<hash of its inputs>.
#   layer 2  /usr/local/bin/stowage-controller and stowage-agent from `cargo build --release`.
#
# Output: target/image/stowage-<version>.oci.tar, an OCI image layout named <repository>:<version>
# (index.json carries io.containerd.image.name, so `ctr images import` keeps the name), checked
# with skopeo. Usage: e2e/scripts/image.sh   (make image). Root is needed (mmdebstrap root mode).
#
# Environment:
#   STOWAGE_IMAGE_REPOSITORY  image repository (default localhost/stowage, the chart's default)
#   STOWAGE_DEBIAN_SUITE      Debian suite of the base (default: this machine's, /etc/os-release):
#                             the binaries are built here and link against this machine's glibc,
#                             so the base must not be an older suite.
#   STOWAGE_DEBIAN_SOURCES    deb822 .sources file for mmdebstrap (default: the machine's Debian one)
#   STOWAGE_IMAGE_BIN_DIR     take stowage-controller and stowage-agent from this directory instead
#                             of running `cargo build --release` (binaries built elsewhere, same suite)
#   STOWAGE_IMAGE_REFRESH=1   rebuild the base layer even when cached (to pick up Debian updates:
#                             the cache key is what we ask for, not what the mirror serves today)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
started=$SECONDS
phase() { echo "image: $* (+$((SECONDS - started))s)" >&2; }

# --- What to build -------------------------------------------------------------------------------
version=$(sed -n '/^\[workspace\.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
[ -n "$version" ] || { echo "image: no [workspace.package] version in Cargo.toml" >&2; exit 1; }
repository=${STOWAGE_IMAGE_REPOSITORY:-localhost/stowage}
ref="$repository:$version"
out_dir="$root/target/image"
archive="$out_dir/stowage-$version.oci.tar"

# shellcheck disable=SC1091
. /etc/os-release
suite=${STOWAGE_DEBIAN_SUITE:-${VERSION_CODENAME:-}}
[ -n "$suite" ] || { echo "image: no VERSION_CODENAME in /etc/os-release; set STOWAGE_DEBIAN_SUITE" >&2; exit 1; }
arch=$(dpkg --print-architecture)
case "$arch" in amd64 | arm64 | ppc64el | s390x | riscv64) ;; *) echo "image: unsupported architecture $arch" >&2; exit 1 ;; esac
oci_arch=$arch
[ "$arch" = ppc64el ] && oci_arch=ppc64le

for tool in mmdebstrap skopeo jq gzip sha256sum flock; do
  command -v "$tool" >/dev/null || { echo "image: $tool is missing; run e2e/scripts/install-deps.sh (make deps)" >&2; exit 1; }
done

# The machine's Debian mirror. A deb822 file is passed to mmdebstrap as is; without one, the
# official mirror for the suite and its updates and security suites.
sources=${STOWAGE_DEBIAN_SOURCES:-/etc/apt/sources.list.d/debian.sources}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/stowage-image.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
if [ ! -f "$sources" ]; then
  sources="$tmp/debian.sources"
  cat >"$sources" <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: $suite $suite-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: $suite-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
fi

# What the agent runs: losetup, mount/umount (mount); blkid, findmnt (util-linux); mkfs.ext4,
# resize2fs, e2fsck (e2fsprogs); mkfs.xfs, xfs_growfs (xfsprogs). The Containerfile installs the
# same list.
packages=util-linux,mount,e2fsprogs,xfsprogs
# The uid/gid the controller runs as (the image's User; the chart's runAsUser).
uid=65532

# --- Layer 1: the Debian base, cached by its inputs ----------------------------------------------
# shellcheck disable=SC2016 # the hooks expand $1 in mmdebstrap's shell, not here
mmdebstrap_args=(
  --mode=root --variant=minbase --arch="$arch" --include="$packages"
  --aptopt='APT::Install-Recommends "false"'
  # merged /usr without the usrmerge package (which would pull in perl), as Debian's images are.
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
  # Slim as debian:<suite>-slim: no man pages, info, locales or docs, but keep the copyright files.
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/lintian/*'
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
  --customize-hook="chroot \"\$1\" groupadd --gid $uid nonroot"
  --customize-hook="chroot \"\$1\" useradd --no-log-init --uid $uid --gid $uid --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin nonroot"
  --customize-hook='rm -f "$1"/etc/passwd- "$1"/etc/group- "$1"/etc/shadow- "$1"/etc/gshadow- "$1"/var/log/*.log'
  # No device nodes: a container gets its /dev from the runtime (an empty /dev is added below).
  --skip=output/dev
)
base_key=$(
  {
    printf '%s\n' "$suite" "$arch" "${mmdebstrap_args[@]}"
    grep -v '^#' "$sources"
    mmdebstrap --version
    echo 3 # bump when the way the layer is packed below changes
  } | sha256sum | cut -c1-16
)
cache_root=${STOWAGE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/stowage}
base="$cache_root/image-base/$base_key"

build_base() {
  phase "building the $suite base layer $base_key with mmdebstrap (a few minutes on a cold cache)"
  local part="$base.partial.$$"
  rm -rf "$part" && mkdir -p "$part"
  # A fixed timestamp: file times in the layer do not depend on when it was built.
  # Its chatter goes to a log beside the layer, shown when it fails.
  if ! SOURCE_DATE_EPOCH=0 mmdebstrap "${mmdebstrap_args[@]}" "$suite" "$part/layer.tar" "$sources" >"$part/mmdebstrap.log" 2>&1; then
    tail -n 50 "$part/mmdebstrap.log" >&2
    echo "image: mmdebstrap failed; full log in $part/mmdebstrap.log" >&2
    exit 1
  fi
  # An empty /dev, as in Debian's images: the runtime mounts its own there.
  mkdir -m 0755 "$part/empty" "$part/empty/dev"
  tar --append --file="$part/layer.tar" --no-recursion --mtime=@0 --owner=0 --group=0 \
    --numeric-owner --format=posix --pax-option='exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime' \
    -C "$part/empty" ./dev
  rm -r "$part/empty"
  sha256sum <"$part/layer.tar" | cut -d' ' -f1 >"$part/diff_id"
  gzip -n -6 "$part/layer.tar"
  # The package list, for the image's history and for anyone wondering what is inside.
  tar -xOf "$part/layer.tar.gz" ./var/lib/dpkg/status |
    awk '/^Package:/{p=$2} /^Version:/{print p"="$2}' >"$part/packages"
  rm -rf "$base" && mv "$part" "$base"
}

mkdir -p "$cache_root/image-base"
exec 9>"$cache_root/image-base/.lock"
flock 9 # parallel callers build the base once
if [ "${STOWAGE_IMAGE_REFRESH:-0}" = 1 ] || [ ! -s "$base/layer.tar.gz" ] || [ ! -s "$base/diff_id" ]; then
  build_base
else
  phase "base layer $base_key cached in $base"
fi
exec 9>&-

# One build of the archive at a time (a test may start one while `make image` runs).
mkdir -p "$out_dir"
exec 8>"$out_dir/.lock"
flock 8

# --- Layer 2: the release binaries -----------------------------------------------------------------
if [ -n "${STOWAGE_IMAGE_BIN_DIR:-}" ]; then
  bin_dir=$STOWAGE_IMAGE_BIN_DIR
  phase "binaries from $bin_dir (STOWAGE_IMAGE_BIN_DIR; no cargo build)"
else
  phase "cargo build --release -p stowage-controller -p stowage-agent"
  cargo build --release --locked -p stowage-controller -p stowage-agent
  bin_dir=$(cargo metadata --format-version 1 --no-deps | jq -r .target_directory)/release
fi

# Times in the image come from the last commit, so the same tree gives the same layer bytes.
epoch=$(git log -1 --format=%ct 2>/dev/null || echo 0)
created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
# Built from uncommitted changes: say so in the revision label.
if [ "$revision" != unknown ] && ! git diff --quiet HEAD -- 2>/dev/null; then revision="$revision-dirty"; fi

phase "packing the binaries layer"
stage="$tmp/bin-layer"
for b in stowage-controller stowage-agent; do
  install -D -m 0755 "$bin_dir/$b" "$stage/usr/local/bin/$b"
done
tar --create --sort=name --mtime="@$epoch" --owner=0 --group=0 --numeric-owner --format=posix \
  --pax-option='exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime' \
  -C "$stage" ./usr >"$tmp/bin-layer.tar"
bin_diff_id=$(sha256sum <"$tmp/bin-layer.tar" | cut -d' ' -f1)
gzip -n -6 "$tmp/bin-layer.tar"

# --- The OCI image layout ------------------------------------------------------------------------
layout="$tmp/layout"
mkdir -p "$layout/blobs/sha256"
# add_blob FILE: copies FILE into blobs/ and prints "<sha256 hex> <size>".
add_blob() {
  local digest size
  digest=$(sha256sum <"$1" | cut -d' ' -f1)
  size=$(stat -c %s "$1")
  cp --reflink=auto "$1" "$layout/blobs/sha256/$digest"
  echo "$digest $size"
}
blob=$(add_blob "$base/layer.tar.gz"); read -r base_digest base_size <<<"$blob"
blob=$(add_blob "$tmp/bin-layer.tar.gz"); read -r bin_digest bin_size <<<"$blob"
base_diff_id=$(cat "$base/diff_id")

jq -n --arg created "$created" --arg arch "$oci_arch" --arg version "$version" \
  --arg revision "$revision" --arg suite "$suite" --arg user "$uid:$uid" \
  --arg base_diff "sha256:$base_diff_id" --arg bin_diff "sha256:$bin_diff_id" \
  --arg base_by "mmdebstrap --variant=minbase --include=$packages $suite (slim, user nonroot $uid)" \
  --arg base_pkgs "$(tr '\n' ' ' <"$base/packages")" '{
  created: $created, architecture: $arch, os: "linux",
  config: {
    User: $user,
    Env: ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
    Entrypoint: ["/usr/local/bin/stowage-controller"],
    WorkingDir: "/",
    Labels: {
      "org.opencontainers.image.title": "stowage",
      "org.opencontainers.image.description": "stowage-controller and stowage-agent (loop.stowage.dev); the agent runs as root in the chart",
      "org.opencontainers.image.version": $version,
      "org.opencontainers.image.revision": $revision,
      "org.opencontainers.image.licenses": "Apache-2.0",
      "org.opencontainers.image.url": "https://stowage.dev",
      "dev.stowage.debian-suite": $suite
    }
  },
  rootfs: {type: "layers", diff_ids: [$base_diff, $bin_diff]},
  history: [
    {created: $created, created_by: $base_by, comment: $base_pkgs},
    {created: $created, created_by: "COPY stowage-controller stowage-agent /usr/local/bin/"}
  ]
}' >"$tmp/config.json"
blob=$(add_blob "$tmp/config.json"); read -r config_digest config_size <<<"$blob"

jq -n --arg cd "sha256:$config_digest" --argjson cs "$config_size" \
  --arg l1 "sha256:$base_digest" --argjson s1 "$base_size" \
  --arg l2 "sha256:$bin_digest" --argjson s2 "$bin_size" --arg created "$created" '{
  schemaVersion: 2,
  mediaType: "application/vnd.oci.image.manifest.v1+json",
  config: {mediaType: "application/vnd.oci.image.config.v1+json", digest: $cd, size: $cs},
  layers: [
    {mediaType: "application/vnd.oci.image.layer.v1.tar+gzip", digest: $l1, size: $s1},
    {mediaType: "application/vnd.oci.image.layer.v1.tar+gzip", digest: $l2, size: $s2}
  ],
  annotations: {"org.opencontainers.image.created": $created}
}' >"$tmp/manifest.json"
blob=$(add_blob "$tmp/manifest.json"); read -r manifest_digest manifest_size <<<"$blob"

# ref.name is the tag (as containerd's own export writes it); io.containerd.image.name the full
# name, which `ctr images import` uses.
jq -n --arg md "sha256:$manifest_digest" --argjson ms "$manifest_size" --arg arch "$oci_arch" \
  --arg ref "$ref" --arg tag "$version" '{
  schemaVersion: 2,
  mediaType: "application/vnd.oci.image.index.v1+json",
  manifests: [{
    mediaType: "application/vnd.oci.image.manifest.v1+json", digest: $md, size: $ms,
    platform: {architecture: $arch, os: "linux"},
    annotations: {"io.containerd.image.name": $ref, "org.opencontainers.image.ref.name": $tag}
  }]
}' >"$layout/index.json"
echo '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"

tar --create --sort=name --mtime="@$epoch" --owner=0 --group=0 --numeric-owner --format=posix \
  --pax-option='exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime' \
  -C "$layout" oci-layout index.json blobs >"$archive.partial"
mv "$archive.partial" "$archive"

# --- Check it with a real OCI implementation (containers/image): reads the layout, the manifest
# and the config, and copying re-reads every blob against its digest.
phase "checking the archive with skopeo"
skopeo inspect --raw "oci-archive:$archive" | jq -e --arg d "sha256:$config_digest" '.config.digest == $d' >/dev/null
skopeo inspect --config "oci-archive:$archive" | jq -e --arg u "$uid:$uid" '.config.User == $u' >/dev/null
skopeo --insecure-policy copy --quiet "oci-archive:$archive" "oci:$tmp/copy:$version"

size=$(stat -c %s "$archive")
phase "done"
echo "image: $ref"
echo "image: $archive ($((size / 1024 / 1024)) MiB, $size bytes; layers: base $((base_size / 1024 / 1024)) MiB, binaries $((bin_size / 1024 / 1024)) MiB)"
echo "image: import with \`ctr -n k8s.io images import $archive\`, push with \`skopeo copy oci-archive:$archive docker://<registry>/stowage:$version\`"
