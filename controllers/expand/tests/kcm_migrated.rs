//! A migrated in-tree claim being resized, checked against kube-controller-manager's own expand
//! controller: the same objects go to a fresh control plane once under kube-controller-manager
//! (only `persistentvolume-expander-controller`, from `e2e/bin`) and once under stowage, and the
//! claim's resizer annotation and status, the PV's capacity and the events on the claim (reason
//! and note) must end the same.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use stowage_testkit::controlplane::Kcm;
use stowage_testkit::{ControlPlane, builders};
use tokio::task::JoinSet;

const NS: &str = "app";
/// A bound on waiting, never a claim about speed.
const LIMIT: Duration = Duration::from_secs(90);
/// How long a state must hold to count as settled.
const QUIET: Duration = Duration::from_secs(4);

#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct State {
    resizer: Option<String>,
    /// The claim's status as JSON text (capacity, allocation, conditions without their times).
    claim_status: String,
    pv_capacity: String,
    /// (reason, note) of the events on the claim.
    events: BTreeSet<(String, String)>,
}

#[allow(dead_code)]
enum Running {
    Stowage(JoinSet<()>),
    Upstream(Kcm),
}

async fn start(upstream: bool, cp: &ControlPlane, client: &Client) -> Running {
    if upstream {
        return Running::Upstream(cp.start_kcm("persistentvolume-expander-controller", &[]));
    }
    let mut tasks = JoinSet::new();
    let registry = stowage_common::observe::metrics::Registry::new();
    let cluster =
        stowage_common::store::informers::Informers::start(client.clone(), registry.clone(), &mut tasks);
    // As stowage-controller does: controllers start once the stores are filled.
    cluster.ready().await;
    let metrics = stowage_expand::Metrics::new(&registry);
    let config = stowage_expand::Config {
        image_dir: std::env::temp_dir(),
        resync: Duration::from_secs(5),
        max_in_flight: 10,
    };
    tasks.spawn(async move {
        if let Err(e) = stowage_expand::run(cluster, metrics, config).await {
            panic!("controller failed: {e:#}");
        }
    });
    Running::Stowage(tasks)
}

/// A class of the in-tree EBS provisioner, and a claim bound to an `awsElasticBlockStore` PV of
/// 1Gi (no binder runs: both sides of the bind are written).
async fn world(client: &Client) {
    let (ns, sa) = builders::namespace(NS);
    Api::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    Api::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &sa)
        .await
        .unwrap();
    let classes: Api<StorageClass> = Api::all(client.clone());
    let class: StorageClass = serde_json::from_value(json!({
        "metadata": { "name": "ebs" }, "provisioner": "kubernetes.io/aws-ebs",
        "allowVolumeExpansion": true
    }))
    .unwrap();
    classes.create(&PostParams::default(), &class).await.unwrap();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": { "name": "legacy", "namespace": NS },
        "spec": { "accessModes": ["ReadWriteOnce"], "storageClassName": "ebs", "volumeName": "pv-legacy",
                  "resources": { "requests": { "storage": "1Gi" } } }
    }))
    .unwrap();
    let claim = claims.create(&PostParams::default(), &claim).await.unwrap();
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pv: PersistentVolume = serde_json::from_value(json!({
        "metadata": { "name": "pv-legacy" },
        "spec": { "capacity": { "storage": "1Gi" }, "accessModes": ["ReadWriteOnce"],
                  "storageClassName": "ebs", "persistentVolumeReclaimPolicy": "Retain",
                  "awsElasticBlockStore": { "volumeID": "aws://us-east-1a/vol-0abc" },
                  "claimRef": { "namespace": NS, "name": "legacy", "uid": claim.metadata.uid } }
    }))
    .unwrap();
    pvs.create(&PostParams::default(), &pv).await.unwrap();
    let pp = PatchParams::default();
    pvs.patch_status(
        "pv-legacy",
        &pp,
        &Patch::Merge(json!({ "status": { "phase": "Bound" } })),
    )
    .await
    .unwrap();
    let bound = json!({ "status": { "phase": "Bound", "accessModes": ["ReadWriteOnce"],
                                    "capacity": { "storage": "1Gi" } } });
    claims
        .patch_status("legacy", &pp, &Patch::Merge(bound))
        .await
        .unwrap();
}

/// The user's resize; the admission plugin reads classes from its informer, so a 403 right after
/// the class was created is retried.
async fn resize(client: &Client) {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let patch = json!({ "spec": { "resources": { "requests": { "storage": "2Gi" } } } });
    let deadline = Instant::now() + LIMIT;
    loop {
        match claims
            .patch("legacy", &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return,
            Err(kube::Error::Api(e)) if e.code == 403 && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(e) => panic!("resize refused: {e}"),
        }
    }
}

async fn observe(client: &Client) -> State {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let c = claims.get("legacy").await.unwrap();
    let mut status = serde_json::to_value(&c.status).unwrap();
    for cond in status["conditions"].as_array_mut().into_iter().flatten() {
        cond.as_object_mut().unwrap().remove("lastProbeTime");
        cond.as_object_mut().unwrap().remove("lastTransitionTime");
    }
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pv = pvs.get("pv-legacy").await.unwrap();
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let events = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some("legacy"))
        .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
        .collect();
    State {
        resizer: c
            .metadata
            .annotations
            .and_then(|a| a.get("volume.kubernetes.io/storage-resizer").cloned()),
        claim_status: status.to_string(),
        pv_capacity: serde_json::to_value(pv.spec.and_then(|s| s.capacity))
            .unwrap()
            .to_string(),
        events,
    }
}

async fn run(upstream: bool) -> State {
    let cp = ControlPlane::start().expect("control plane");
    let client = cp.client().await;
    world(&client).await;
    let _running = start(upstream, &cp, &client).await;
    resize(&client).await;
    let deadline = Instant::now() + LIMIT;
    let mut last = observe(&client).await;
    let mut since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = observe(&client).await;
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() >= QUIET && last.resizer.is_some() && !last.events.is_empty() {
            return last;
        }
        assert!(Instant::now() < deadline, "never settled; last state: {last:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrated_claim_is_handed_to_its_csi_resizer_as_kube_controller_manager_does() {
    let upstream = run(true).await;
    let stowage = run(false).await;
    eprintln!("kube-controller-manager settled in {upstream:#?}");
    assert_eq!(stowage, upstream);
    assert_eq!(stowage.resizer.as_deref(), Some("ebs.csi.aws.com"));
}
