#!/usr/bin/env bash
# Kubernetes' storage e2e tests against loop.stowage.dev with stowage as the storage control plane,
# on the real-node cluster:
#   1. build e2e.test, ginkgo, agnhost and the CSI mock stand-ins (cached, build-storage-e2e.sh)
#      and the test images under the names the tests ask for (e2e-images.sh, csimock-images.sh);
#   2. bring the real-node cluster up with E2E_NODES kubelets (default 2), stowage installed by helm
#      from the locally built image, the test images imported into every node's containerd; check
#      that every node reports every test image before anything runs (a missing one would be pulled,
#      and pulls are refused on this machine);
#   3. run, in E2E_PROCS parallel ginkgo processes, the External Storage suites for this driver
#      (focus External.Storage.*loop.stowage.dev) and the storage controllers' own tests
#      (e2e/storage/controllers.txt: protection, the PV lifecycle, VolumeAttachment, StatefulSets,
#      local PVs, the CSI mock suite's attach, reclaim, capacity and limit tests),
#      [Disruptive], [Serial], [Feature:…] and [Flaky] skipped; then the controllers' [Serial] and
#      [Disruptive] tests in a one-process pass of their own, and the External suites'
#      [Disruptive] ones (a kubelet stopped and started over SSH with volumes in use: every node
#      serves SSH, realnode.sh REALNODE_SSH) in another;
#   4. write JUnit, ginkgo's JSON reports and a Markdown summary (per suite: ran, passed, failed,
#      skipped, time) to e2e/results/storage-<time>/, print the summary, take the cluster down.
# Environment: E2E_NODES (2), E2E_PROCS (3), E2E_SUITES (all, external: the driver's suites, or
# controllers: the controllers' tests), E2E_SUBSET=1 (only the tests of e2e/storage/subset.txt and
# subset-controllers.txt, as make test runs them), E2E_FOCUS (a regex narrowing each group's
# focus: `<group>.*(E2E_FOCUS)`, so it names what follows the group's text),
# E2E_RESULTS (the results dir), E2E_DRIVER (loop.stowage.dev, or ext.loop.stowage.dev: the loop
# driver as a third-party driver behind the upstream sidecars, e2e/storage/<driver>.yaml),
# E2E_CONTROLLERS (stowage, or kcm: kube-controller-manager's own storage controllers, stowage's
# controller scaled to zero; for side-by-side runs), E2E_STORE (shared, or local: every node its
# own image store and stowage in local mode; the driver then claims topology, capacity and single-
# node volumes, and E2E_SUBSET runs e2e/storage/subset-local.txt). Exit status: 0 when every pass
# did. Root is needed.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
cd "$top"
nodes=${E2E_NODES:-2}
procs=${E2E_PROCS:-3}
driver_name=${E2E_DRIVER:-loop.stowage.dev}
controllers=${E2E_CONTROLLERS:-stowage}
suites=${E2E_SUITES:-all}
case "$suites" in all|external|controllers) ;; *) echo "e2e-storage: E2E_SUITES=$suites: all, external or controllers" >&2; exit 2 ;; esac
tag=""
[ "$driver_name" != loop.stowage.dev ] && tag="$tag-$driver_name"
[ "$controllers" != stowage ] && tag="$tag-$controllers"
store=${E2E_STORE:-shared}
[ "$store" != shared ] && tag="$tag-$store"
results=${E2E_RESULTS:-$top/e2e/results/storage$tag-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$results"
start=$(date +%s)

./e2e/scripts/build-storage-e2e.sh
./e2e/scripts/e2e-images.sh
./e2e/scripts/csimock-images.sh
mapfile -t images < <(cat target/image/e2e-images.refs target/image/e2e-csimock-images.refs)
bin="$top/e2e/storage/bin"

# The driver definition as the machine allows: without CAP_SYS_RESOURCE (bit 24 of the effective
# set) the kernel refuses to grow a mounted ext4, so online expansion is not claimed here.
driver="$results/$driver_name.yaml"
cp "e2e/storage/$driver_name.yaml" "$driver"
if [ "$store" = local ]; then
  # Each volume lives in one node's store: it is reachable from that node only (the suite skips
  # the tests that move a volume), the node plugin reports the topology key, the agents publish
  # CSIStorageCapacity objects, and XFS is made too (a volume that never moves needs no MMP).
  sed -i -e 's/^\(\s*singleNodeVolume:\) false/\1 true/' -e 's/^\(\s*topology:\) false/\1 true/' \
    -e 's/^\(\s*capacity:\) false/\1 true/' \
    -e 's|^\(\s*\)Name: loop.stowage.dev$|&\n\1TopologyKeys: [topology.loop.stowage.dev/node]|' \
    -e 's|^\(\s*\)ext4: {}$|&\n\1xfs: {}|' "$driver"
  # Node-local volumes want delayed binding (the chart's class is WaitForFirstConsumer): two
  # claims a pod uses, bound at once, may land on two nodes, and the pod then fits neither. The
  # suite's classes come from this one; the tests that ask for a binding mode still set it.
  cat >"$results/storageclass-local.yaml" <<CLASS
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: loop-local}
provisioner: loop.stowage.dev
volumeBindingMode: WaitForFirstConsumer
CLASS
  sed -i "s|^\(\s*\)FromName: true|\1FromFile: $results/storageclass-local.yaml|" "$driver"
  echo "e2e-storage: local image stores: topology, capacity, single-node volumes and xfs claimed, WaitForFirstConsumer classes"
fi
capeff=$(awk '/^CapEff:/ {print $2}' /proc/self/status)
if (( (16#$capeff >> 24 & 1) == 0 )); then
  sed -i 's/^\(\s*onlineExpansion:\) true/\1 false/' "$driver"
  echo "e2e-storage: no CAP_SYS_RESOURCE here: online expansion is not claimed (docs/csi.md)"
fi

# Upstream's host-exec pods (the local-PV tests, the volumeMode ones that list a pod's volume dirs)
# reach a node's host through nsenter --mount=/rootfs/proc/1/ns/mnt: every node has a PID
# namespace of its own whose PID 1 lives in the node's mount namespace (the testkit's nodens).
skip='\[Disruptive\]|\[Serial\]|\[Feature:[^]]*\]|\[Flaky\]'

archives=()
for f in target/image/e2e-*.oci.tar; do archives+=("$f"); done
export REALNODE_NODES=$nodes REALNODE_IMAGES="${archives[*]}" REALNODE_STORE=$store
[ "$driver_name" = ext.loop.stowage.dev ] && export REALNODE_EXTERNAL=1
[ "$controllers" = kcm ] && export REALNODE_KCM=storage
# The disruptive tests SSH to a node to stop, start and restart its kubelet and to read its mounts.
export REALNODE_SSH=1
trap './e2e/scripts/realnode.sh down >/dev/null 2>&1 || true' EXIT
# A fresh cluster: one a run before this left behind (or is still taking down) would be reused.
./e2e/scripts/realnode.sh down >/dev/null 2>&1 || true
./e2e/scripts/realnode.sh up
export KUBECONFIG=$top/.realnode/kubeconfig
kubectl=$top/e2e/bin/kubectl
echo "e2e-storage: cluster up after $(( $(date +%s) - start ))s"
# The framework's SSH client: the cluster's key, as root (KUBE_SSH_KEY_PATH wins over the
# provider's default key).
KUBE_SSH_KEY_PATH=$(sed -n 's|^nodes serve SSH .*, key \(.*\)$|\1|p' .realnode/devcluster.log | head -1)
[ -n "$KUBE_SSH_KEY_PATH" ] || { echo "e2e-storage: the nodes serve no SSH" >&2; exit 1; }
export KUBE_SSH_KEY_PATH KUBE_SSH_USER=root

# Every node must hold every test image before the suite starts.
missing=0
for node in $("$kubectl" get nodes -o jsonpath='{.items[*].metadata.name}'); do
  have=$("$kubectl" get node "$node" -o jsonpath='{range .status.images[*]}{.names}{"\n"}{end}')
  for ref in "${images[@]}"; do
    grep -qF "\"$ref\"" <<<"$have" || { echo "e2e-storage: node $node lacks $ref" >&2; missing=1; }
  done
done
[ "$missing" = 0 ] || exit 1

# The controllers' tests use the cluster's default class: the driver under test owns it. For the
# third-party driver that is a class of its own (the chart's class stays, not default), so that
# stowage's and KCM's controllers are compared on one driver behind the same upstream sidecars.
if [ "$suites" != external ] && [ "$driver_name" != loop.stowage.dev ]; then
  "$kubectl" annotate storageclass loop storageclass.kubernetes.io/is-default-class=false --overwrite >/dev/null
  "$kubectl" apply -f - >/dev/null <<CLASS
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: ext-loop
  annotations: {storageclass.kubernetes.io/is-default-class: "true"}
provisioner: $driver_name
volumeBindingMode: WaitForFirstConsumer
CLASS
  echo "e2e-storage: default class ext-loop ($driver_name) for the controllers' tests"
fi

kubelet_dir=$(sed -n 's/^agent: {mode: csi, kubeletDir: \([^,]*\),.*/\1/p' .realnode/values.yaml)
# The focus: one expression per selected test group (ginkgo ORs its --focus flags), each narrowed
# by E2E_FOCUS; `scope` tells the summary which of the binary's tests the run is about.
focus=() scope=() external_focus=()
narrow() { if [ -n "${E2E_FOCUS:-}" ]; then echo "$1.*($E2E_FOCUS)"; else echo "$1"; fi; }
if [ "$suites" != controllers ]; then
  external="External.Storage.*Driver: ${driver_name//./\\.}\\]"
  scope+=("$external")
  if [ "${E2E_SUBSET:-0}" = 1 ]; then
    subset=e2e/storage/subset.txt
    [ "$store" = local ] && subset=e2e/storage/subset-local.txt
    external="$external.*($(grep -v '^#' "$subset" | paste -sd'|'))"
  fi
  focus+=("$(narrow "$external")")
  external_focus=("--focus=$(narrow "$external")")
fi
# The controllers' tests that skip themselves unless the provider is one of the framework's SSH
# providers (csimock's kubelet restart) also get a pass with -provider=local (the same no-op
# provider as skeleton, under which GenericPersistentVolume skips itself instead).
ssh_focus=()
if [ "$suites" != external ]; then
  list=e2e/storage/controllers.txt
  [ "${E2E_SUBSET:-0}" = 1 ] && list=e2e/storage/subset-controllers.txt
  mapfile -t own < <(grep -v '^#' e2e/storage/controllers.txt)
  scope+=("${own[@]}")
  while read -r line; do focus+=("$(narrow "$line")"); done < <(grep -v '^#' "$list")
  while read -r line; do ssh_focus+=("--focus=$(narrow "$line")"); done < <(grep -v '^#' "$list" | grep -F 'when kubelet restart')
fi
focus_flags=()
for f in "${focus[@]}"; do focus_flags+=("--focus=$f"); done
scope_flags=()
for f in "${scope[@]}"; do scope_flags+=("--scope=$f"); done
# -num-nodes as a cluster's e2e job passes it (tests that need two nodes skip themselves without).
suite_args=(-kubeconfig="$KUBECONFIG" -storage.testdriver="$driver" -kubelet-root-dir="$kubelet_dir"
  -provider=skeleton -node-os-distro=debian -num-nodes="$nodes")
rc=0
set +e
"$bin/ginkgo" --procs="$procs" --timeout=3h --no-color --poll-progress-after=10m \
  "${focus_flags[@]}" --skip="$skip" \
  --output-dir="$results" --junit-report=junit.xml --json-report=report.json \
  "$bin/e2e.test" -- "${suite_args[@]}" >"$results/e2e.log" 2>&1 || rc=1
reports=("$results/report.json")
# The controllers' [Serial] and [Disruptive] tests (a cordoned node, the default class changed, a
# kubelet stopped), one at a time with nothing else running.
if [ "$suites" != external ]; then
  "$bin/ginkgo" --procs=1 --timeout=1h --no-color --poll-progress-after=10m \
    "${focus_flags[@]}" --label-filter='Serial || Disruptive' --skip='External.Storage|\[Feature:[^]]*\]|\[Flaky\]' \
    --output-dir="$results" --junit-report=junit-serial.xml --json-report=report-serial.json \
    "$bin/e2e.test" -- "${suite_args[@]}" >"$results/e2e-serial.log" 2>&1 || rc=1
  reports+=("$results/report-serial.json")
fi
if [ ${#ssh_focus[@]} -gt 0 ]; then
  "$bin/ginkgo" --procs=1 --timeout=1h --no-color --poll-progress-after=10m \
    "${ssh_focus[@]}" --label-filter='Serial || Disruptive' --skip='External.Storage|\[Feature:[^]]*\]|\[Flaky\]' \
    --output-dir="$results" --junit-report=junit-ssh-provider.xml --json-report=report-ssh-provider.json \
    "$bin/e2e.test" -- "${suite_args[@]/-provider=skeleton/-provider=local}" >"$results/e2e-ssh-provider.log" 2>&1 || rc=1
  reports+=("$results/report-ssh-provider.json")
fi
# The External suites' [Disruptive] tests: the kubelet of a pod's node stopped, started or
# restarted over SSH while the pod's volume is in use, one at a time. Their [Serial] ones (limits,
# stress) are not run.
if [ "$suites" != controllers ]; then
  "$bin/ginkgo" --procs=1 --timeout=1h --no-color --poll-progress-after=10m \
    "${external_focus[@]}" --label-filter='Disruptive' --skip='\[Serial\]|\[Feature:[^]]*\]|\[Flaky\]' \
    --output-dir="$results" --junit-report=junit-disruptive.xml --json-report=report-disruptive.json \
    "$bin/e2e.test" -- "${suite_args[@]}" >"$results/e2e-disruptive.log" 2>&1 || rc=1
  reports+=("$results/report-disruptive.json")
fi
set -e
python3 e2e/scripts/e2e-summary.py "${scope_flags[@]}" --wall "$(( $(date +%s) - start ))" "${reports[@]}" \
  >"$results/summary.md" || rc=1
cat "$results/summary.md"
echo "e2e-storage: logs, JUnit and reports in $results"
exit $rc
