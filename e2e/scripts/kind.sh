#!/usr/bin/env bash
# A real kind cluster on this machine, made the way docs/distributions.md tells a user to.
#   kind.sh docker   the rig's dockerd (its own socket, data root and runtime; see below)
#   kind.sh image    the node image (kind-node-image.sh), kind itself and the test pods' image
#   kind.sh up       docker + image + the guide's kind section (docs/distributions.md, "kind"):
#                    its cluster configuration and its commands (create, load, helm install), as
#                    written; KUBECONFIG=.kind/kubeconfig
#   kind.sh down     deletes the cluster and stops the rig's dockerd
# What the rig changes, and why (docs/distributions.md, "What has been tried"):
#   - dockerd's runtime is e2e/kind/rig-runc: root here lacks CAP_SYS_RESOURCE, which Docker
#     20.10 gives every --privileged container;
#   - the node image is built here (no registry serves kindest/node), passed with --image.
# Root is required.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
cd "$top"
dir="$top/.kind"
rig=/run/stowage-rig
export DOCKER_HOST=unix://$rig/docker.sock
export KUBECONFIG="$dir/kubeconfig"
# The name the guide gives its cluster.
cluster=stowage

docker_up() {
  if [ -f "$rig/docker.pid" ] && kill -0 "$(cat "$rig/docker.pid")" 2>/dev/null; then return; fi
  if ! command -v dockerd >/dev/null; then
    echo "kind: installing docker.io (its service neither started nor enabled)"
    local policy=/usr/sbin/policy-rc.d
    [ -e "$policy" ] || { printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && trap 'rm -f "$policy"' EXIT; }
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
  fi
  mkdir -p "$rig" /var/lib/stowage-rig
  # Its own socket, data root and exec root: nothing of a Docker the machine may run is touched.
  setsid dockerd --data-root /var/lib/stowage-rig/docker --exec-root "$rig/docker" \
    -H "$DOCKER_HOST" --pidfile "$rig/docker.pid" \
    --add-runtime rig="$top/e2e/kind/rig-runc" --default-runtime rig \
    --exec-opt native.cgroupdriver=cgroupfs >"$rig/dockerd.log" 2>&1 &
  for _ in $(seq 120); do
    docker version >/dev/null 2>&1 && return
    sleep 0.5
  done
  tail -20 "$rig/dockerd.log" >&2
  echo "kind: dockerd did not start" >&2
  exit 1
}

docker_down() {
  [ -f "$rig/docker.pid" ] || return 0
  local pid
  pid=$(cat "$rig/docker.pid")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  rm -f "$rig/docker.pid"
}

tools() {
  e2e/scripts/build-go-tool.sh kind kind sigs.k8s.io/kind >&2
  make -s controlplane >&2
}

# The node image, and the test pods' image (stowage's own is the guide's `make image`).
image() {
  docker_up
  tools
  e2e/scripts/kind-node-image.sh
  e2e/scripts/pod-images.sh >&2
}

# The guide's kind section: its cluster configuration (the YAML block that starts with
# `kind: Cluster`, saved as the file its commands name) and its commands (the sh blocks, but the
# one that edits KCM's manifest, which is the way back), one a line.
guide() {
  python3 - "$top/docs/distributions.md" "$1" <<'PY'
import re, sys
guide, what = open(sys.argv[1]).read(), sys.argv[2]
section = guide.split("\n## kind\n", 1)[1].split("\n## ", 1)[0]
if what == "config":
    print(next(b for b in re.findall(r"```yaml\n(.*?)```", section, re.S) if "kind: Cluster" in b), end="")
else:
    for b in re.findall(r"```sh\n(.*?)```", section, re.S):
        if "docker exec" not in b:
            print(b, end="")
PY
}

up() {
  image
  if kind get clusters 2>/dev/null | grep -qx "$cluster"; then
    echo "kind: cluster $cluster already up (KUBECONFIG=$KUBECONFIG)"
    return
  fi
  mkdir -p "$dir/bin"
  # A script, not a link: helm.sh finds its module beside itself.
  printf '#!/bin/sh\nexec %s "$@"\n' "$top/e2e/scripts/helm.sh" >"$dir/bin/helm"
  chmod 755 "$dir/bin/helm"
  PATH="$dir/bin:$PATH"
  guide config >"$top/kind-stowage.yaml"
  trap 'rm -f "$top/kind-stowage.yaml"' EXIT
  local k8s line
  k8s=$(e2e/bin/kubelet --version | awk '{print $2}')
  while IFS= read -r line; do
    [ -n "$line" ] || continue
    # The rig's node image (kindest/node is not served here).
    [[ "$line" == "kind create cluster"* ]] && line="$line --image stowage.dev/kind-node:$k8s"
    echo "+ $line"
    # Its own stdin: a command that reads stdin must not eat the guide's next lines.
    bash -euo pipefail -c "$line" </dev/null
  done < <(guide commands)
  kind load image-archive target/image/busybox.oci.tar --name "$cluster"
  echo "kind: up; KUBECONFIG=$KUBECONFIG"
}


down() {
  if [ -f "$rig/docker.pid" ] && [ -x e2e/kind/bin/kind ]; then
    e2e/kind/bin/kind delete cluster --name "$cluster" --kubeconfig "$KUBECONFIG" || true
  fi
  docker_down
  rm -rf "$dir"
}

PATH="$top/e2e/kind/bin:$top/e2e/bin:$PATH"
case "${1:-}" in
  docker) docker_up ;;
  image) image ;;
  up) up ;;
  down) down ;;
  *) echo "usage: $0 docker|image|up|down" >&2; exit 2 ;;
esac
