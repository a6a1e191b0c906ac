#!/usr/bin/env bash
# A real cluster (one node, or two with REALNODE_NODES=2) with stowage installed by helm, for
# trying it by hand and for the storage e2e suite (REALNODE_IMAGES: more image archives to import).
#   realnode.sh up     control plane + KCM (storage controllers off) + scheduler + containerd +
#                      kubelet per node, the images imported, `helm install` of charts/stowage
#                      (CSI mode). realnode2 runs in network and mount namespaces of its own;
#                      nodes and pods then reach the apiserver at the host's veth address.
#   realnode.sh down   stops everything and removes what it left (mounts, loop devices, netns,
#                      cgroups, processes)
#   realnode.sh demo   up, a claim and a pod writing to it, an online grow, Delete vs Retain and
#                      the Prometheus view (make demo), then down
# KUBECONFIG=.realnode/kubeconfig afterwards. Root is required.
# REALNODE_EXTERNAL=1 also serves the loop driver as the third-party driver ext.loop.stowage.dev
# (node plugins, controller plugin, the upstream external-provisioner and external-attacher;
# docs/csi.md) and creates its CSIDriver. REALNODE_KCM=storage keeps kube-controller-manager's own
# storage controllers and scales stowage-controller to zero: the same cluster under KCM's.
# REALNODE_SSH=1 gives every node SSH and a kubelet unit (see up).
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
cd "$top"
dir="$top/.realnode"
kubectl="$top/e2e/bin/kubectl"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
nodes=${REALNODE_NODES:-1}
last=realnode
[ "$nodes" -gt 1 ] && last=realnode$nodes
# shared (default): one image store for every node; local: one per node (REALNODE_STORE).
store_mode=${REALNODE_STORE:-shared}
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
  # REALNODE_SSH=1: every node serves SSH on its node IP for root (the key in devcluster.log), and
  # `systemctl start|stop|restart kubelet` there acts on its kubelet (upstream's disruptive tests).
  [ "${REALNODE_SSH:-0}" = 1 ] && extra+=(--ssh)
  # The store is a shared mount on each node, as on a real host (the chart's HostToContainer
  # propagation needs it). REALNODE_STORE=local: every node but the first gets a directory of its
  # own there (nodes share no store, stowage in local mode); otherwise one directory for all
  # nodes (shared mode).
  extra+=(--image-store "$dir/images")
  [ "$store_mode" = local ] && extra+=(--own-image-stores)
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
imageStore: {mode: $store_mode, path: $dir/images}
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
  # The store's shared mount on node 1 (the host).
  while mountpoint -q "$dir/images"; do umount -l "$dir/images"; done
  rm -rf "$dir"
  echo "realnode: down"
}

say() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
k() { "$kubectl" "$@"; }
wait_for() { # wait_for <what> <seconds> <command...>
  local what=$1 limit=$2; shift 2
  for _ in $(seq 1 $((limit * 2))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  echo "demo: timed out waiting for $what" >&2
  k get pv,pvc,volumeattachment,pod -A >&2 || true
  k get events -A --sort-by=.lastTimestamp >&2 | tail -n 20 || true
  exit 1
}
# The YAML of a pod of the real node's busybox image in <namespace>, running `sh -c <command>`
# (no single quotes in it) with each <claim>:<path> mounted.
busybox_pod() { # busybox_pod <namespace> <name> <command> <claim>:<path>...
  local ns=$1 name=$2 cmd=$3 i=0 m mounts="" volumes=""
  shift 3
  for m in "$@"; do
    mounts+="    - {name: v$i, mountPath: ${m#*:}}"$'\n'
    volumes+="  - {name: v$i, persistentVolumeClaim: {claimName: ${m%%:*}}}"$'\n'
    i=$((i + 1))
  done
  cat <<YAML
apiVersion: v1
kind: Pod
metadata: {name: $name, namespace: $ns}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: c
    image: localhost/busybox:stowage
    imagePullPolicy: Never
    command: [sh, -c, '$cmd']
    volumeMounts:
${mounts%$'\n'}
  volumes:
${volumes%$'\n'}
YAML
}
phase_is() { [ "$(k get "$1" -o jsonpath='{.status.phase}' ${2:+-n "$2"})" = "$3" ]; }

# The product as a user meets it: helm-installed stowage on a real kubelet, a claim and a pod
# writing data, an online grow, Delete vs Retain, and Prometheus scraping the controller and the
# agent (when the prometheus binary is there: `make deps` installs Debian's package).
demo() {
  up
  trap 'stop_prometheus; down' EXIT
  say "a claim (class loop, WaitForFirstConsumer) and a pod writing to it"
  k create namespace demo >/dev/null
  {
    cat <<'YAML'
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data, namespace: demo}
spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 64Mi}}}
---
YAML
    busybox_pod demo app 'echo hello from stowage > /data/hello; sleep 3600' data:/data
  } | k apply -f -
  start_prometheus
  k wait -n demo --for=condition=Ready pod/app --timeout=180s
  k get pv,pvc,volumeattachment,pod -A
  echo "in the pod: $(k exec -n demo app -- cat /data/hello)"
  k exec -n demo app -- df -h /data

  say "growing the claim to 128Mi while the pod runs (controller: image and PV; kubelet + agent: file system)"
  k patch pvc -n demo data --type=merge -p '{"spec":{"resources":{"requests":{"storage":"128Mi"}}}}'
  grown() { [ "$(k get pvc -n demo data -o jsonpath='{.status.capacity.storage}')" = 128Mi ]; }
  for _ in $(seq 60); do grown && break; sleep 1; done
  if ! grown; then
    # A kernel or container without CAP_SYS_RESOURCE refuses ext4's online resize: the claim
    # says so (NodeResizeError) and the file system grows at the volume's next stage, as the
    # FileSystemResizePending condition asks: the pod is started again.
    k get pvc -n demo data -o jsonpath='{range .status.conditions[*]}{.type}: {.message}{"\n"}{end}'
    echo "demo: online growth refused on this machine; starting the pod again, the file system grows as it is staged"
    k delete pod -n demo app --wait=true >/dev/null
    busybox_pod demo app 'cat /data/hello; sleep 3600' data:/data | k apply -f -
    k wait -n demo --for=condition=Ready pod/app --timeout=180s
  fi
  wait_for "the claim to reach 128Mi" 180 grown
  k get pvc -n demo data
  k exec -n demo app -- df -h /data
  echo "in the pod: $(k exec -n demo app -- cat /data/hello)"

  say "Delete vs Retain: one claim of each class, written by one pod, then pod and claims deleted"
  {
    cat <<'YAML'
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: loop-retain}
provisioner: loop.stowage.dev
reclaimPolicy: Retain
volumeBindingMode: WaitForFirstConsumer
allowVolumeExpansion: true
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: scratch, namespace: demo}
spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 32Mi}}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: keep, namespace: demo}
spec: {storageClassName: loop-retain, accessModes: [ReadWriteOnce], resources: {requests: {storage: 32Mi}}}
---
YAML
    busybox_pod demo writer 'date > /scratch/at; date > /keep/at; sync; sleep 3600' scratch:/scratch keep:/keep
  } | k apply -f -
  k wait -n demo --for=condition=Ready pod/writer --timeout=180s
  scratch_pv=$(k get pvc -n demo scratch -o jsonpath='{.spec.volumeName}')
  keep_pv=$(k get pvc -n demo keep -o jsonpath='{.spec.volumeName}')
  scratch_img=$(k get pv "$scratch_pv" -o jsonpath='{.spec.csi.volumeHandle}').img
  keep_img=$(k get pv "$keep_pv" -o jsonpath='{.spec.csi.volumeHandle}').img
  k get pv,pvc -A
  k delete pod -n demo writer --wait=true >/dev/null
  k delete pvc -n demo scratch keep --wait=false >/dev/null
  wait_for "the Delete volume to go" 180 sh -c "! '$kubectl' get pv $scratch_pv"
  wait_for "the Retain volume to be Released" 180 phase_is "pv/$keep_pv" "" Released
  k get pv,pvc,volumeattachment -A
  echo "image of the Delete volume ($scratch_img): $([ -e "$dir/images/$scratch_img" ] && echo still there || echo deleted)"
  echo "image of the Retain volume ($keep_img): $([ -e "$dir/images/$keep_img" ] && echo kept || echo GONE)"

  show_prometheus
  if [ "${DEMO_WAIT:-1}" = 1 ] && [ -t 0 ]; then
    echo "demo: the cluster stays up; KUBECONFIG=$KUBECONFIG. Ctrl-C to stop and clean up"; sleep infinity
  fi
}

# Prometheus (Debian's package, run as a plain process) scraping the controller and the agent on
# the host network, over HTTPS with a token bound to the chart's metrics-reader role when the
# chart serves the secure port, else plain HTTP.
start_prometheus() {
  command -v prometheus >/dev/null || { echo "demo: no prometheus binary (make deps installs it); skipping the Prometheus view"; return; }
  local deploy=st-stowage-controller scheme port aport
  scheme=$(k get deploy -n stowage $deploy -o jsonpath='{.spec.template.spec.containers[0].livenessProbe.httpGet.scheme}')
  port=$(k get deploy -n stowage $deploy -o jsonpath='{.spec.template.spec.containers[0].ports[0].containerPort}')
  aport=$(k get ds -n stowage st-stowage-agent -o jsonpath='{.spec.template.spec.containers[0].ports[0].containerPort}')
  mkdir -p "$dir/prometheus"
  k create serviceaccount -n stowage demo-prometheus >/dev/null
  k create clusterrolebinding demo-prometheus --clusterrole=st-stowage-metrics-reader \
    --serviceaccount=stowage:demo-prometheus >/dev/null
  k create token -n stowage demo-prometheus --duration=24h >"$dir/prometheus/token"
  cat >"$dir/prometheus/prometheus.yml" <<CONF
global: {scrape_interval: 5s, evaluation_interval: 5s}
scrape_configs:
- job_name: stowage-controller
  scheme: $(echo "${scheme:-HTTP}" | tr 'A-Z' 'a-z')
  authorization: {credentials_file: $dir/prometheus/token}
  tls_config: {insecure_skip_verify: true}
  static_configs: [{targets: ["127.0.0.1:$port"]}]
- job_name: stowage-agent
  static_configs: [{targets: ["127.0.0.1:$aport"], labels: {node: realnode}}]
CONF
  prometheus --config.file="$dir/prometheus/prometheus.yml" --storage.tsdb.path="$dir/prometheus/data" \
    --web.listen-address=127.0.0.1:9099 >"$dir/prometheus/log" 2>&1 &
  echo $! >"$dir/prometheus/pid"
  echo "prometheus: http://127.0.0.1:9099 (scraping the controller over ${scheme:-HTTP} and the agent)"
}

stop_prometheus() {
  [ -f "$dir/prometheus/pid" ] && kill "$(cat "$dir/prometheus/pid")" 2>/dev/null || true
}

show_prometheus() {
  [ -f "$dir/prometheus/pid" ] || return 0
  say "the Prometheus view (http://127.0.0.1:9099)"
  sleep 6 # one more scrape after the last step
  local q
  for q in 'up' \
    'sum by (result) (stowage_binder_provisioning_total)' \
    'sum by (result) (stowage_binder_deletions_total)' \
    'sum by (state) (stowage_expand_expansions_total) > 0' \
    'sum by (operation_name, status) (storage_operation_duration_seconds_count)' \
    'sum by (operation, result) (stowage_attachdetach_operations_total) > 0' \
    'sum by (method_name, grpc_status_code) (csi_sidecar_operations_seconds_count)' \
    'histogram_quantile(0.99, sum by (le) (rate(stowage_binder_claim_bind_latency_seconds_bucket[5m])))'; do
    echo "# $q"
    curl -sG http://127.0.0.1:9099/api/v1/query --data-urlencode "query=$q" |
      python3 -c 'import json,sys
for r in json.load(sys.stdin)["data"]["result"]:
    m={k:v for k,v in r["metric"].items() if k not in ("__name__","instance")}
    print("  ", m, r["value"][1])'
  done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  demo) demo ;;
  *) echo "usage: $0 up|down|demo" >&2; exit 2 ;;
esac
