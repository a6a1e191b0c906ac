# Sourced by the image scripts: writes an OCI image archive of one layer that `ctr images import`
# names by its io.containerd.image.name annotation (no registry is needed or tried).
#   oci_archive <archive> <ref> <layer.tar.gz> <diff_id sha256 hex> <image config JSON object>
# The config object is the image's `config` (Cmd, Entrypoint, Env, User, WorkingDir, …).
# Deterministic: one mtime, sorted names, numeric root ownership.
oci_archive() {
  local archive=$1 ref=$2 layer=$3 diff_id=$4 config=$5
  local work arch layout ld ls cd cs md ms
  work=$(mktemp -d)
  layout="$work/layout"
  mkdir -p "$layout/blobs/sha256"
  arch=$(dpkg --print-architecture)
  case "$arch" in armhf) arch=arm ;; i386) arch=386 ;; ppc64el) arch=ppc64le ;; esac
  _oci_blob() { # _oci_blob FILE → "<sha256 hex> <size>"
    local d
    d=$(sha256sum <"$1" | cut -d' ' -f1)
    cp "$1" "$layout/blobs/sha256/$d"
    echo "$d $(stat -c %s "$1")"
  }
  read -r ld ls <<<"$(_oci_blob "$layer")"
  jq -n --arg arch "$arch" --arg diff "sha256:$diff_id" --argjson config "$config" '{
    created: "1970-01-01T00:00:00Z", architecture: $arch, os: "linux", config: $config,
    rootfs: {type: "layers", diff_ids: [$diff]}}' >"$work/config.json"
  read -r cd cs <<<"$(_oci_blob "$work/config.json")"
  jq -n --arg cd "sha256:$cd" --argjson cs "$cs" --arg l "sha256:$ld" --argjson ls "$ls" '{
    schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
    config: {mediaType: "application/vnd.oci.image.config.v1+json", digest: $cd, size: $cs},
    layers: [{mediaType: "application/vnd.oci.image.layer.v1.tar+gzip", digest: $l, size: $ls}]}' \
    >"$work/manifest.json"
  read -r md ms <<<"$(_oci_blob "$work/manifest.json")"
  jq -n --arg md "sha256:$md" --argjson ms "$ms" --arg arch "$arch" --arg ref "$ref" '{
    schemaVersion: 2, mediaType: "application/vnd.oci.image.index.v1+json",
    manifests: [{mediaType: "application/vnd.oci.image.manifest.v1+json", digest: $md, size: $ms,
      platform: {architecture: $arch, os: "linux"},
      annotations: {"io.containerd.image.name": $ref, "org.opencontainers.image.ref.name": ($ref | sub(".*:"; ""))}}]}' \
    >"$layout/index.json"
  echo '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$layout" \
    -cf "$archive.partial" oci-layout index.json blobs
  mv "$archive.partial" "$archive"
  rm -rf "$work"
}

# tar_layer <rootfs dir> <layer.tar.gz> → prints the layer's diff_id (sha256 of the tar).
tar_layer() {
  local tarball=${2%.gz}
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$1" -cf "$tarball" .
  sha256sum "$tarball" | cut -d' ' -f1
  gzip -n -9 -f "$tarball"
}

# busybox_rootfs <dir>: Debian's busybox-static with every applet as a link (sh, sleep, dd, stat,
# nsenter, mount … by name), /etc/passwd and /etc/group, a sticky /tmp. Needs apt-get download.
busybox_rootfs() {
  local dir=$1 dl
  dl=$(mktemp -d)
  (cd "$dl" && apt-get download -qq busybox-static >/dev/null)
  dpkg-deb -x "$dl"/busybox-static_*.deb "$dir"
  rm -rf "$dl"
  local a
  for a in $("$dir/bin/busybox" --list); do
    [ "$a" = busybox ] || ln -sf busybox "$dir/bin/$a"
  done
  mkdir -p "$dir"/{etc,proc,sys,dev,tmp,data}
  chmod 1777 "$dir/tmp"
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$dir/etc/passwd"
  printf 'root:x:0:\nnobody:x:65534:\n' >"$dir/etc/group"
}

# debian_layer <cache name> <package,…>: a minbase Debian layer (sh, GNU coreutils, sed, grep) of
# the machine's own suite and apt sources plus the packages, made by mmdebstrap and cached under
# ~/.cache/stowage/<cache name>/<hash of the inputs>; prints that directory, which holds
# layer.tar.gz and diff_id. Slimmed as image.sh does. Root is needed.
debian_layer() {
  local name=$1 include=$2 suite arch sources key cache_root layer part
  # shellcheck disable=SC1091
  suite=${STOWAGE_DEBIAN_SUITE:-$(. /etc/os-release && echo "${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}")}
  arch=$(dpkg --print-architecture)
  sources=${STOWAGE_DEBIAN_SOURCES:-/etc/apt/sources.list.d/debian.sources}
  [ -f "$sources" ] || { echo "$name: no $sources; set STOWAGE_DEBIAN_SOURCES" >&2; return 1; }
  local args=(
    --mode=root --variant=minbase --arch="$arch" --include="$include"
    --aptopt='APT::Install-Recommends "false"'
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*'
    --customize-hook='rm -f "$1"/var/log/*.log "$1"/var/cache/ldconfig/aux-cache'
    --skip=output/dev
  )
  key=$({ printf '%s\n' "$suite" "$arch" "${args[@]}"; grep -v '^#' "$sources"; mmdebstrap --version; } | sha256sum | cut -c1-16)
  cache_root=${STOWAGE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/stowage}
  layer="$cache_root/$name/$key"
  mkdir -p "$cache_root/$name"
  (
    exec 9>"$cache_root/$name/.lock"
    flock 9 # parallel callers build once
    if [ ! -s "$layer/layer.tar.gz" ]; then
      echo "$name: building the $suite layer $key with mmdebstrap (a minute or two)" >&2
      part="$layer.partial.$$"
      rm -rf "$part" && mkdir -p "$part"
      if ! SOURCE_DATE_EPOCH=0 mmdebstrap "${args[@]}" "$suite" "$part/layer.tar" "$sources" >"$part/mmdebstrap.log" 2>&1; then
        tail -n 30 "$part/mmdebstrap.log" >&2
        echo "$name: mmdebstrap failed; log in $part/mmdebstrap.log" >&2
        exit 1
      fi
      sha256sum <"$part/layer.tar" | cut -d' ' -f1 >"$part/diff_id"
      gzip -n -6 "$part/layer.tar"
      rm -rf "$layer" && mv "$part" "$layer"
    fi
  ) || return 1
  echo "$layer"
}
