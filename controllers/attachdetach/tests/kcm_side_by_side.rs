//! In-tree, migrated, inline and mixed volumes, checked against kube-controller-manager's own
//! attach/detach controller: the same objects go to a fresh control plane once under
//! kube-controller-manager (only `persistentvolume-attach-detach-controller`, from `e2e/bin`)
//! and once under stowage, and the states both settle in must be the same: VolumeAttachments
//! (name, attacher, node, source), every node's `status.volumesAttached`, and the events on
//! each pod (reason and note). No kubelet or external attacher runs; the test plays the attacher (it sets
//! `status.attached` on every VolumeAttachment) for both.
//!
//! The world, one scenario per pod:
//! - `ebs-pod` on node-a: a claim bound to an `awsElasticBlockStore` PV (migrated to
//!   `ebs.csi.aws.com`);
//! - `inline-pod` on node-a: an inline `gcePersistentDisk` (migrated, `inlineVolumeSpec`);
//! - `iscsi-pod` on node-a: a claim bound to an iSCSI PV (in-tree: node status only);
//! - `mixed-pod` on node-a: a CSI PV and an inline FC volume in one pod;
//! - `unmigrated-pod` on node-b, whose CSINode lists no migrated plugin: a Cinder PV;
//! - `no-csinode-pod` on node-c, which has no CSINode at all: an inline `awsElasticBlockStore`;
//! - node-a starts with a `volumesAttached` entry of a plugin neither controller has, which its
//!   `volumesInUse` lists (kube-controller-manager then keeps it steadily; see
//!   docs/attachdetach.md for what it does otherwise).
//!
//! - node-b and node-c start with iSCSI attachments no pod wants, node-c's still in use: the
//!   first goes, the second stays (the unmount wait).
//!
//! Then `second-pod` on node-c wants the ReadWriteOnce migrated volume `ebs-pod` holds on node-a
//! (a multi-attach refusal), and last every pod is deleted; both must settle in the same state
//! after each step. Event notes are compared to the byte.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{CSINode, VolumeAttachment};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use stowage_testkit::controlplane::Kcm;
use stowage_testkit::{ControlPlane, builders};
use tokio::task::JoinSet;

const NS: &str = "adc";
/// A bound on waiting, never a claim about speed.
const LIMIT: Duration = Duration::from_secs(90);
/// How long a state must hold to count as settled.
const QUIET: Duration = Duration::from_secs(4);
/// An entry of a plugin neither controller has (in-tree EBS was removed in v1.27).
const FOREIGN: &str = "kubernetes.io/aws-ebs/aws://us-east-1a/vol-legacy";
/// iSCSI attachments from before the controller started, unused and still in use.
const ISCSI_STALE: &str = "kubernetes.io/iscsi/10.0.0.9:3260:iqn.2003-01.org.example:stale:0";
const ISCSI_BUSY: &str = "kubernetes.io/iscsi/10.0.0.9:3260:iqn.2003-01.org.example:busy:0";

#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct State {
    /// VolumeAttachments as `{name, attacher, nodeName, source}`, JSON text.
    attachments: BTreeSet<String>,
    /// node → (unique name, device path).
    attached: BTreeMap<String, BTreeSet<(String, String)>>,
    /// (pod, reason, note) of the events on pods.
    events: BTreeSet<(String, String, String)>,
}

enum Runner {
    Stowage,
    Upstream,
}

enum Running {
    Stowage(#[allow(dead_code)] JoinSet<()>),
    Upstream(#[allow(dead_code)] Kcm),
}

async fn start(runner: &Runner, cp: &ControlPlane, client: &Client) -> Running {
    match runner {
        Runner::Stowage => {
            let mut tasks = JoinSet::new();
            let registry = stowage_common::observe::metrics::Registry::new();
            let cluster = stowage_common::store::informers::Informers::start(
                client.clone(),
                registry.clone(),
                &mut tasks,
            );
            // As stowage-controller does: controllers start once the stores are filled.
            cluster.ready().await;
            let metrics = stowage_attachdetach::Metrics::new(&registry);
            let config = stowage_attachdetach::Config {
                resync: Duration::from_secs(5),
                ..Default::default()
            };
            tasks.spawn(async move {
                if let Err(e) = stowage_attachdetach::run(cluster, metrics, config).await {
                    panic!("controller failed: {e:#}");
                }
            });
            Running::Stowage(tasks)
        }
        Runner::Upstream => Running::Upstream(cp.start_kcm("persistentvolume-attach-detach-controller", &[])),
    }
}

async fn create<K>(api: &Api<K>, v: Value) -> K
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let obj: K = serde_json::from_value(v).expect("a valid object");
    api.create(&PostParams::default(), &obj).await.expect("created")
}

/// Nodes (node-a with the foreign entry in use), their CSINodes, and the namespace: what must
/// exist before a controller starts, as a cluster it takes over.
async fn before_start(client: &Client) {
    let (ns, sa) = builders::namespace(NS);
    Api::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    Api::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &sa)
        .await
        .unwrap();
    let nodes: Api<Node> = Api::all(client.clone());
    for name in ["node-a", "node-b", "node-c"] {
        create(
            &nodes,
            json!({
                "metadata": { "name": name, "annotations": {
                    "volumes.kubernetes.io/controller-managed-attach-detach": "true" } }
            }),
        )
        .await;
        let ready = json!([{ "type": "Ready", "status": "True",
            "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z",
            "reason": "KubeletReady", "message": "ready" }]);
        // What a previous controller left: node-b an iSCSI attachment no pod wants and the node
        // no longer uses, node-c one it still uses.
        let status = match name {
            "node-a" => json!({ "status": { "conditions": ready,
                "volumesAttached": [{ "name": FOREIGN, "devicePath": "/dev/xvdz" }],
                "volumesInUse": [FOREIGN] } }),
            "node-b" => json!({ "status": { "conditions": ready,
                "volumesAttached": [{ "name": ISCSI_STALE, "devicePath": "" }] } }),
            _ => json!({ "status": { "conditions": ready,
                "volumesAttached": [{ "name": ISCSI_BUSY, "devicePath": "" }],
                "volumesInUse": [ISCSI_BUSY] } }),
        };
        nodes
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap();
    }
    let csinodes: Api<CSINode> = Api::all(client.clone());
    create(
        &csinodes,
        json!({
            "metadata": { "name": "node-a", "annotations": {
                "storage.alpha.kubernetes.io/migrated-plugins": "kubernetes.io/aws-ebs,kubernetes.io/gce-pd" } },
            "spec": { "drivers": [
                { "name": "ebs.csi.aws.com", "nodeID": "i-a" },
                { "name": "pd.csi.storage.gke.io", "nodeID": "projects/p/zones/z/instances/node-a" },
                { "name": "hostpath.csi.example", "nodeID": "node-a" } ] }
        }),
    )
    .await;
    create(
        &csinodes,
        json!({ "metadata": { "name": "node-b" }, "spec": { "drivers": [] } }),
    )
    .await;
}

/// A claim bound to a new PV with `source` (no binder runs: both sides of the bind are written).
async fn bound_claim(client: &Client, name: &str, source: Value) {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pv = format!("{name}-pv");
    let claim = create(
        &claims,
        json!({
            "metadata": { "name": name, "namespace": NS },
            "spec": { "accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": pv,
                      "resources": { "requests": { "storage": "1Gi" } } }
        }),
    )
    .await;
    let mut spec = json!({
        "capacity": { "storage": "1Gi" }, "accessModes": ["ReadWriteOnce"],
        "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
        "claimRef": { "namespace": NS, "name": name, "uid": claim.uid() }
    });
    for (k, v) in source.as_object().unwrap() {
        spec[k] = v.clone();
    }
    create(&pvs, json!({ "metadata": { "name": pv }, "spec": spec })).await;
    let bound = Patch::Merge(json!({ "status": { "phase": "Bound" } }));
    pvs.patch_status(&pv, &PatchParams::default(), &bound)
        .await
        .unwrap();
    claims
        .patch_status(name, &PatchParams::default(), &bound)
        .await
        .unwrap();
}

async fn pod(client: &Client, name: &str, node: &str, volumes: Value) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    create(
        &pods,
        json!({
            "metadata": { "name": name, "namespace": NS },
            "spec": { "nodeName": node, "volumes": volumes,
                      "containers": [{ "name": "c", "image": "registry.invalid/none" }] }
        }),
    )
    .await;
}

fn claim_volume(claim: &str) -> Value {
    json!({ "name": claim, "persistentVolumeClaim": { "claimName": claim } })
}

async fn workload(client: &Client) {
    bound_claim(
        client,
        "ebs",
        json!({ "awsElasticBlockStore": { "volumeID": "aws://us-east-1a/vol-0aaa" } }),
    )
    .await;
    bound_claim(
        client,
        "iscsi",
        json!({ "iscsi": { "targetPortal": "10.0.0.5:3260", "iqn": "iqn.2003-01.org.example:disk1", "lun": 0 } }),
    )
    .await;
    bound_claim(
        client,
        "csi",
        json!({ "csi": { "driver": "hostpath.csi.example", "volumeHandle": "h-1" } }),
    )
    .await;
    bound_claim(client, "cinder", json!({ "cinder": { "volumeID": "cinder-1" } })).await;
    pod(client, "ebs-pod", "node-a", json!([claim_volume("ebs")])).await;
    pod(
        client,
        "inline-pod",
        "node-a",
        json!([{ "name": "pd", "gcePersistentDisk": { "pdName": "pd-inline", "fsType": "ext4" } }]),
    )
    .await;
    pod(client, "iscsi-pod", "node-a", json!([claim_volume("iscsi")])).await;
    pod(
        client,
        "mixed-pod",
        "node-a",
        json!([claim_volume("csi"),
               { "name": "fc", "fc": { "targetWWNs": ["500a0981891b8dc5"], "lun": 2 } }]),
    )
    .await;
    pod(
        client,
        "unmigrated-pod",
        "node-b",
        json!([claim_volume("cinder")]),
    )
    .await;
    pod(
        client,
        "no-csinode-pod",
        "node-c",
        json!([{ "name": "ebs", "awsElasticBlockStore": { "volumeID": "vol-0ccc" } }]),
    )
    .await;
}

/// The state now; plays the external attacher on the way (every attachment becomes attached).
async fn observe(client: &Client) -> State {
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    let mut state = State::default();
    for va in vas.list(&ListParams::default()).await.unwrap().items {
        let name = va.name_any();
        if va.metadata.deletion_timestamp.is_none() && !va.status.as_ref().is_some_and(|s| s.attached) {
            let attached = Patch::Merge(json!({ "status": { "attached": true } }));
            let _ = vas.patch_status(&name, &PatchParams::default(), &attached).await;
        }
        let source = serde_json::to_value(&va.spec.source).unwrap();
        state.attachments.insert(
            json!({ "name": name, "attacher": va.spec.attacher, "nodeName": va.spec.node_name,
                    "source": source })
            .to_string(),
        );
    }
    let nodes: Api<Node> = Api::all(client.clone());
    for n in nodes.list(&ListParams::default()).await.unwrap().items {
        let list = n
            .status
            .and_then(|s| s.volumes_attached)
            .unwrap_or_default()
            .into_iter()
            .map(|v| (v.name, v.device_path))
            .collect();
        state.attached.insert(n.metadata.name.unwrap_or_default(), list);
    }
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    for e in events.list(&ListParams::default()).await.unwrap().items {
        if e.involved_object.kind.as_deref() == Some("Pod") {
            state.events.insert((
                e.involved_object.name.unwrap_or_default(),
                e.reason.unwrap_or_default(),
                e.message.unwrap_or_default(),
            ));
        }
    }
    state
}

/// The state once it has held for [`QUIET`] and `done` says it is complete.
async fn settle(client: &Client, done: impl Fn(&State) -> bool) -> State {
    let deadline = Instant::now() + LIMIT;
    let mut last = observe(client).await;
    let mut since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = observe(client).await;
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() >= QUIET && done(&last) {
            return last;
        }
        assert!(Instant::now() < deadline, "never settled; last state: {last:#?}");
    }
}

/// (with pods, after the pods are gone)
/// (with pods, with a pod the multi-attach rule refuses, after the pods are gone)
async fn run(runner: Runner) -> (State, State, State) {
    let cp = ControlPlane::start().expect("control plane");
    let client = cp.client().await;
    before_start(&client).await;
    let _running = start(&runner, &cp, &client).await;
    workload(&client).await;
    // Four attachments (EBS, inline PD, CSI, Cinder), all in node status, and the in-tree ones.
    let with_pods = settle(&client, |s| {
        s.attachments.len() >= 5 && s.attached.get("node-a").is_some_and(|a| a.len() >= 6)
    })
    .await;
    pod(&client, "second-pod", "node-c", json!([claim_volume("ebs")])).await;
    let refused = settle(&client, |s| s.events.iter().any(|e| e.0 == "second-pod")).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    for p in pods.list(&ListParams::default()).await.unwrap().items {
        pods.delete(&p.name_any(), &now).await.unwrap();
    }
    let after = settle(&client, |s| s.attachments.is_empty()).await;
    (with_pods, refused, after)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_tree_migrated_and_inline_volumes_match_kube_controller_manager() {
    let (upstream, upstream_refused, upstream_after) = run(Runner::Upstream).await;
    let (stowage, stowage_refused, stowage_after) = run(Runner::Stowage).await;
    eprintln!(
        "kube-controller-manager settled in {upstream:#?}\nthen {upstream_refused:#?}\nthen {upstream_after:#?}"
    );
    assert_eq!(stowage.attachments, upstream.attachments, "attachments with pods");
    assert_eq!(stowage.attached, upstream.attached, "node status with pods");
    assert_eq!(stowage.events, upstream.events, "events on pods");
    assert_eq!(stowage_refused, upstream_refused, "with the second pod");
    assert_eq!(stowage_after, upstream_after, "after the pods are gone");
    // What both must show, so that agreeing on nothing cannot pass.
    let a = &stowage.attached["node-a"];
    for name in [
        FOREIGN,
        "kubernetes.io/csi/ebs.csi.aws.com^vol-0aaa",
        "kubernetes.io/csi/pd.csi.storage.gke.io^projects/UNSPECIFIED/zones/UNSPECIFIED/disks/pd-inline",
        "kubernetes.io/iscsi/10.0.0.5:3260:iqn.2003-01.org.example:disk1:0",
        "kubernetes.io/csi/hostpath.csi.example^h-1",
        "kubernetes.io/fc/[500a0981891b8dc5]:2",
    ] {
        assert!(a.iter().any(|(n, _)| n == name), "node-a lacks {name}: {a:?}");
    }
    assert!(
        stowage.attached["node-b"]
            .iter()
            .any(|(n, _)| n == "kubernetes.io/csi/cinder.csi.openstack.org^cinder-1"),
        "node-b: {:?}",
        stowage.attached["node-b"]
    );
    assert!(
        stowage.attached["node-c"]
            .iter()
            .any(|(n, _)| n == "kubernetes.io/csi/ebs.csi.aws.com^vol-0ccc"),
        "node-c: {:?}",
        stowage.attached["node-c"]
    );
    assert!(
        stowage_refused
            .events
            .iter()
            .any(|(p, r, _)| p == "second-pod" && r == "FailedAttachVolume"),
        "{:?}",
        stowage_refused.events
    );
    assert!(
        !stowage.attached["node-b"].iter().any(|(n, _)| n == ISCSI_STALE),
        "the unused iSCSI attachment went"
    );
    assert!(
        stowage_after.attached["node-c"]
            .iter()
            .any(|(n, _)| n == ISCSI_BUSY),
        "the used one stays"
    );
    assert_eq!(
        stowage_after.attached["node-a"],
        BTreeSet::from([(FOREIGN.to_string(), "/dev/xvdz".to_string())]),
        "only the foreign entry stays"
    );
}
