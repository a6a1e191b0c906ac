#!/usr/bin/env bash
# The demo: a real kube-apiserver + etcd, stowage-controller, two stowage-agents (node-a, node-b)
# with real loop devices and ext4, the claims of docs/examples/ moving Pending → Bound, pods
# getting mounted volumes, a claim growing, and Delete vs Retain on release.
#
# Runs until Ctrl-C when started from a terminal (DEMO_WAIT=0 to exit after the summary); every
# exit path stops the processes and removes mounts, loop devices and data.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
cd "$top"
demo="$top/.demo"
bin="$top/target/debug"
kubectl="$top/e2e/bin/kubectl"
images="$demo/images"
export KUBECONFIG="$demo/cp/kubeconfig"
pids=()

say() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
k() { "$kubectl" "$@"; }

cleanup() {
  set +e
  say "stopping: agents, controller, control plane; removing mounts, loop devices and data"
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  # Pod bind mounts first, then device mounts (deepest paths first).
  if [ -d "$demo" ]; then
    findmnt -rn -o TARGET | grep "^$demo/" | sort -r | while read -r m; do umount -l "$m"; done
    for img in "$images"/*.img; do
      [ -e "$img" ] || continue
      losetup -j "$img" | cut -d: -f1 | while read -r dev; do losetup -d "$dev"; done
    done
    rm -rf "$demo"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_for() { # wait_for <what> <seconds> <command...>
  local what=$1 limit=$2; shift 2
  for _ in $(seq 1 $((limit * 2))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  echo "demo: timed out waiting for $what; logs are in $demo/*.log:" >&2
  tail -n 5 "$demo"/*.log >&2
  exit 1
}

[ "$(id -u)" = 0 ] || { echo "demo: loop devices and mounts need root" >&2; exit 1; }
cleanup; trap cleanup EXIT
mkdir -p "$demo" "$images"
# The install step: nothing creates, deletes or attaches images in a directory without the marker.
"$bin/stowage-controller" init-image-store "$images"

say "starting the upstream control plane (etcd + kube-apiserver $("$top/e2e/bin/kube-apiserver" --version | cut -d' ' -f2))"
"$bin/stowage-devcluster" --dir "$demo/cp" >"$demo/cp.log" 2>&1 &
pids+=($!)
wait_for "the apiserver" 120 grep -q "ready at" "$demo/cp.log"
cat "$demo/cp.log"

say "starting stowage-controller (binder, pv/pvc-protection, attachdetach, expand) — metrics on :8080"
"$bin/stowage-controller" --kubeconfig "$KUBECONFIG" --image-dir "$images" \
  --leader-elect-resource-namespace default --metrics-bind-address 127.0.0.1:8080 >"$demo/controller.log" 2>&1 &
pids+=($!)
for n in a b; do
  port=$((8080 + $(printf '%d' "'$n") - 96))
  say "starting stowage-agent for node-$n (root dir $demo/node-$n) — metrics on :$port"
  "$bin/stowage-agent" --kubeconfig "$KUBECONFIG" --node-name "node-$n" --root-dir "$demo/node-$n" \
    --image-dir "$images" --register-node --metrics-bind-address "127.0.0.1:$port" >"$demo/agent-$n.log" 2>&1 &
  pids+=($!)
done
wait_for "the controller to lead" 60 sh -c "curl -s 127.0.0.1:8080/metrics | grep -q '^stowage_leader 1'"
wait_for "node-a and node-b to register" 60 k get node node-a node-b
k get nodes

say "creating the images of the two static volumes (sparse files, 64Mi and 128Mi)"
truncate -s 64M "$images/static-small.img"
truncate -s 128M "$images/static-large.img"
ls -ls "$images"

say "applying docs/examples/ (namespace, CSIDriver, storage classes, static PVs, claims, pods)"
k apply -f docs/examples/
k get pv,pvc -n demo

say "watching claims move Pending → Bound"
for c in web-data db-data cache-data; do
  wait_for "claim $c to bind" 120 sh -c "'$kubectl' get pvc -n demo $c -o jsonpath='{.status.phase}' | grep -q Bound"
done
k get pv,pvc -n demo

say "pods get their volumes: VolumeAttachments attached, devices formatted and mounted by the agents"
for pod in web db; do
  uid=$(k get pod -n demo "$pod" -o jsonpath='{.metadata.uid}')
  node=$(k get pod -n demo "$pod" -o jsonpath='{.spec.nodeName}')
  dir="$demo/$node/pods/$uid/volumes"
  wait_for "the volume of pod $pod to be mounted" 120 sh -c "findmnt -rn -o TARGET | grep -q '^$dir/'"
  echo "pod $pod on $node:"; findmnt -rn -o TARGET,SOURCE,FSTYPE | grep "^$dir/" | sed 's/^/  /'
done
k get volumeattachments
web_mnt=$(findmnt -rn -o TARGET | grep "^$demo/node-a/pods/" | head -n1)
echo "hello from stowage" >"$web_mnt/index.html"
echo "wrote $web_mnt/index.html"

say "growing cache-data from 64Mi to 128Mi (allowVolumeExpansion: true; no pod uses it yet)"
k patch pvc -n demo cache-data --type=merge -p '{"spec":{"resources":{"requests":{"storage":"128Mi"}}}}'
wait_for "the controller half of the expansion" 120 sh -c "'$kubectl' get pvc -n demo cache-data -o jsonpath='{.status.allocatedResourceStatuses.storage}' | grep -q NodeResizePending"
k get pvc -n demo cache-data -o jsonpath='{"image grown, PV capacity "}{.status.allocatedResources.storage}{", waiting for the node: "}{.status.conditions[*].type}{"\n"}'
say "a pod starts on node-a with cache-data: the agent grows the file system as it mounts the volume"
cat <<YAML | k apply -f -
apiVersion: v1
kind: Pod
metadata: {name: cache, namespace: demo}
spec:
  nodeName: node-a
  containers: [{name: cache, image: redis, volumeMounts: [{name: data, mountPath: /data}]}]
  volumes: [{name: data, persistentVolumeClaim: {claimName: cache-data}}]
YAML
wait_for "cache-data to reach 128Mi" 120 sh -c "'$kubectl' get pvc -n demo cache-data -o jsonpath='{.status.capacity.storage}' | grep -q 128Mi"
k get pvc -n demo cache-data
cache_uid=$(k get pod -n demo cache -o jsonpath='{.metadata.uid}')
df -h "$(findmnt -rn -o TARGET | grep "^$demo/node-a/pods/$cache_uid/" | head -n1)" | sed 's/^/  /'

say "releasing: deleting pod db and claim db-data (Delete policy) and pod web and claim web-data (Retain)"
# No kubelet runs here to finish a graceful pod deletion, so the demo deletes at once, as a
# kubelet would after its containers stopped; the agents then unmount and the VAs go.
k delete pod -n demo db web --grace-period=0 --force
k delete pvc -n demo db-data web-data --wait=false
wait_for "web-data's volume to be Released" 120 sh -c "'$kubectl' get pv static-small -o jsonpath='{.status.phase}' | grep -q Released"
db_pv=$(k get pv -o jsonpath='{range .items[?(@.spec.claimRef.name=="db-data")]}{.metadata.name}{end}')
[ -z "$db_pv" ] || wait_for "db-data's volume to be deleted" 120 sh -c "! '$kubectl' get pv $db_pv"
k get pv,pvc -n demo
echo "static-small is Released and its image kept: $(ls -ls "$images/static-small.img")"

say "summary"
k get pv,pvc,volumeattachments -A
cat <<MSG

  controller metrics  http://127.0.0.1:8080/metrics
  agent node-a        http://127.0.0.1:8081/metrics
  agent node-b        http://127.0.0.1:8082/metrics
  kubeconfig          $KUBECONFIG   (e.g. $kubectl get pv,pvc -A)
  logs                $demo/*.log
MSG
if [ -t 0 ] && [ "${DEMO_WAIT:-1}" != 0 ]; then
  say "running; press Ctrl-C to stop and clean up"
  while true; do sleep 3600; done
fi
