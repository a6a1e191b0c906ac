#!/usr/bin/env bash
# A real cluster (one node, or two with REALNODE_NODES=2) with stowage installed by helm, for
# trying it by hand and for the storage e2e suite (REALNODE_IMAGES: more image archives to import).
#   realnode.sh up     control plane + KCM (storage controllers off) + scheduler + containerd +
#                      kubelet per node, the images imported, `helm install` of charts/stowage
#                      (CSI mode). realnode2 runs in network and mount namespaces of its own;
#                      nodes and pods then reach the apiserver at the host's veth address.
#   realnode.sh down   stops everything and removes what it left (mounts, loop devices, netns,
#                      cgroups, processes)
#   realnode.sh demo   up, a claim and a pod that writes to it, the state printed, then down
# KUBECONFIG=.realnode/kubeconfig afterwards. Root is required.
# REALNODE_EXTERNAL=1 also serves the loop driver as the third-party driver ext.loop.stowage.dev
# (node plugins, controller plugin, the upstream external-provisioner and external-attacher;
# docs/csi.md) and creates its CSIDriver. REALNODE_KCM=storage keeps kube-controller-manager's own
# storage controllers and scales stowage-controller to zero: the same cluster under KCM's.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
cd "$top"
dir="$top/.realnode"
kubectl="$top/e2e/bin/kubectl"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
nodes=${REALNODE_NODES:-1}
last=realnode
[ "$nodes" -gt 1 ] && last=realnode$nodes
export KUBECONFIG="$dir/kubeconfig"

up() {
  if [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; then
    echo "realnode: already up (KUBECONFIG=$KUBECONFIG)"; return
  fi
  rm -rf "$dir" && mkdir -p "$dir/images"
  # The install step that marks the image store (docs/operator-guide.md, the image store marker).
  "$top/target/debug/stowage-controller" init-image-store "$dir/images" >/dev/null
  # REALNODE_IMAGES: more OCI archives for every node's containerd (the storage e2e suite's).
  local extra=() img
  for img in ${REALNODE_IMAGES:-}; do extra+=(--image "$img"); done
  [ "${REALNODE_EXTERNAL:-0}" = 1 ] && extra+=(--external-driver-images "$dir/images")
  [ "${REALNODE_KCM:-}" = storage ] && extra+=(--kcm-controllers '*')
  setsid "$top/target/debug/stowage-devcluster" --dir "$dir" --real-node --nodes "$nodes" \
    --image target/image/busybox.oci.tar --image target/image/pause.oci.tar \
    --image target/image/curl.oci.tar \
    --image "target/image/stowage-$version.oci.tar" "${extra[@]}" >"$dir/devcluster.log" 2>&1 &
  echo $! >"$dir/pid"
  for _ in $(seq 480); do
    grep -q "node $last ready" "$dir/devcluster.log" && break
    kill -0 "$(cat "$dir/pid")" 2>/dev/null || { cat "$dir/devcluster.log"; exit 1; }
    sleep 0.5
  done
  grep -q "node $last ready" "$dir/devcluster.log" || { cat "$dir/devcluster.log"; exit 1; }
  # 127.0.0.1 for one node; the host's veth address, which every node's netns reaches, for more.
  api=$(sed -n 's|^nodes and pods reach the apiserver at https://||p' "$dir/devcluster.log" | head -1)
  host=${api%:*} port=${api##*:}
  kubelet_dir=$(sed -n 's|^node realnode ready (kubelet root \([^,]*\),.*|\1|p' "$dir/devcluster.log")
  cat >"$dir/values.yaml" <<VALUES
image: {repository: localhost/stowage, tag: "$version", pullPolicy: Never}
apiServer: {host: $host, port: "$port"}
imageStore: {path: $dir/images}
controller: {replicas: 1, hostNetwork: true}
agent: {mode: csi, kubeletDir: $kubelet_dir, hostNetwork: true}
storageClass: {create: true, default: true, name: loop, volumeBindingMode: WaitForFirstConsumer}
tests: {image: {repository: localhost/curl, tag: stowage, pullPolicy: Never}, hostNetwork: true}
VALUES
  ./e2e/scripts/helm.sh install st charts/stowage -n stowage --create-namespace -f "$dir/values.yaml" --wait --timeout 3m >/dev/null
  # KCM's storage controllers run: stowage's must not (the chart keeps one replica at least).
  if [ "${REALNODE_KCM:-}" = storage ]; then
    "$kubectl" scale deployment st-stowage-controller -n stowage --replicas=0 >/dev/null
    "$kubectl" rollout status deployment st-stowage-controller -n stowage --timeout=60s >/dev/null
  fi
  if [ "${REALNODE_EXTERNAL:-0}" = 1 ]; then
    "$kubectl" apply -f - >/dev/null <<'YAML'
apiVersion: storage.k8s.io/v1
kind: CSIDriver
metadata: {name: ext.loop.stowage.dev}
spec: {attachRequired: true, podInfoOnMount: false, fsGroupPolicy: File, volumeLifecycleModes: [Persistent]}
YAML
  fi
  "$kubectl" get nodes -o wide
  "$kubectl" get pods -n stowage -o wide
  echo "realnode: up ($nodes node(s)); export KUBECONFIG=$KUBECONFIG (e2e/bin/kubectl)"
}

down() {
  [ -f "$dir/pid" ] || { echo "realnode: not running"; return; }
  pid=$(cat "$dir/pid")
  # The devcluster stops the node (kubelet, containers, containerd) and removes what it left.
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  for img in "$dir"/images/*.img; do
    [ -e "$img" ] || continue
    losetup -j "$img" | cut -d: -f1 | while read -r d; do losetup -d "$d"; done
  done
  rm -rf "$dir"
  echo "realnode: down"
}

demo() {
  up
  trap down EXIT
  "$kubectl" create namespace demo
  "$kubectl" apply -n demo -f - <<'YAML'
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data}
spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 64Mi}}}
---
apiVersion: v1
kind: Pod
metadata: {name: app}
spec:
  containers:
  - name: c
    image: localhost/busybox:stowage
    imagePullPolicy: Never
    command: [sh, -c, 'echo hello > /data/hello; df -h /data; sleep 3600']
    volumeMounts: [{name: v, mountPath: /data}]
  volumes: [{name: v, persistentVolumeClaim: {claimName: data}}]
YAML
  "$kubectl" wait -n demo --for=condition=Ready pod/app --timeout=180s
  "$kubectl" get pv,pvc,volumeattachment,pod -A
  "$kubectl" logs -n demo app
  if [ "${DEMO_WAIT:-1}" = 1 ] && [ -t 0 ]; then
    echo "demo-node: Ctrl-C to stop"; sleep infinity
  fi
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  demo) demo ;;
  *) echo "usage: $0 up|down|demo" >&2; exit 2 ;;
esac
