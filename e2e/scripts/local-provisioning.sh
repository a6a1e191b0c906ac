#!/usr/bin/env bash
# Local-mode provisioning measured on a real cluster (real scheduler, kubelets and agents):
# N claims of a WaitForFirstConsumer class of loop.stowage.dev created together with their pods
# (one apply, as a StatefulSet does), then
#   - claims provisioned per second: N over the time from the first claim's creation to the last
#     PV's creation (each PV is made once its pod's node is chosen, on that node);
#   - scheduling to a running pod: each pod's PodScheduled to its Ready condition (the volume's
#     image made on the node, attached, formatted, mounted; the container started), median and
#     maximum;
#   - the deletion of all of them: claims deleted to the last PV gone (images deleted on their
#     nodes).
# Times are the apiserver's (second resolution), so N should be tens.
#   KUBECONFIG=... e2e/scripts/local-provisioning.sh [N=30] [class=loop] [image=localhost/busybox:stowage]
# Needs kubectl (e2e/bin), python3, and the class; the pods' image must be on every node.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
kubectl="$top/e2e/bin/kubectl"
n=${1:-30}
class=${2:-loop}
image=${3:-localhost/busybox:stowage}
ns=provisioning-bench

"$kubectl" delete namespace "$ns" --ignore-not-found --wait >/dev/null
"$kubectl" create namespace "$ns" >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
manifest="$work/manifest.yaml"
for i in $(seq 1 "$n"); do
  cat >>"$manifest" <<EOF
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: c$i, namespace: $ns}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: $class
  resources: {requests: {storage: 16Mi}}
---
apiVersion: v1
kind: Pod
metadata: {name: p$i, namespace: $ns, labels: {app: provisioning-bench}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: c
    image: $image
    imagePullPolicy: Never
    command: [sh, -c, 'echo ok > /data/f && sleep 3600']
    volumeMounts: [{name: v, mountPath: /data}]
  volumes: [{name: v, persistentVolumeClaim: {claimName: c$i}}]
---
EOF
done
"$kubectl" apply -f "$manifest" >/dev/null
"$kubectl" wait -n "$ns" --for=condition=Ready pod -l app=provisioning-bench --timeout=600s >/dev/null

"$kubectl" get pods -n "$ns" -o json >"$work/pods.json"
"$kubectl" get pvc -n "$ns" -o json >"$work/claims.json"
"$kubectl" get pv -o json >"$work/pvs.json"
start_delete=$(date +%s.%N)
"$kubectl" delete pod -n "$ns" --all --wait=false >/dev/null
"$kubectl" delete pvc -n "$ns" --all --wait=false >/dev/null
while "$kubectl" get pv -o jsonpath='{range .items[*]}{.spec.claimRef.namespace}{"\n"}{end}' | grep -qx "$ns"; do
  sleep 0.2
done
deleted=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$start_delete" "$(date +%s.%N)")
"$kubectl" delete namespace "$ns" --wait=false >/dev/null

python3 - "$n" "$deleted" "$work" "$ns" <<'PY'
import json, statistics, sys
from datetime import datetime
n, deleted, work, ns = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
t = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
load = lambda f: json.load(open(f"{work}/{f}.json"))["items"]
pods, claims = load("pods"), load("claims")
pvs = [v for v in load("pvs") if (v["spec"].get("claimRef") or {}).get("namespace") == ns]
first_claim = min(t(c["metadata"]["creationTimestamp"]) for c in claims)
last_pv = max(t(v["metadata"]["creationTimestamp"]) for v in pvs)
waits = []
nodes = {}
for p in pods:
    cond = {c["type"]: t(c["lastTransitionTime"]) for c in p["status"]["conditions"]}
    waits.append(cond["Ready"] - cond["PodScheduled"])
    nodes[p["spec"]["nodeName"]] = nodes.get(p["spec"]["nodeName"], 0) + 1
span = max(last_pv - first_claim, 1.0)
print(f"| claims (with pods) | nodes (pods each) | provisioned per second | scheduled to running, median | max | all deleted |")
print(f"| --- | --- | --- | --- | --- | --- |")
spread = ", ".join(f"{k} {v}" for k, v in sorted(nodes.items()))
print(f"| {n} | {spread} | {len(pvs) / span:.1f} ({len(pvs)} in {span:.0f} s) | {statistics.median(waits):.0f} s | {max(waits):.0f} s | {deleted} s |")
PY
