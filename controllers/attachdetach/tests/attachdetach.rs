//! The controller against a real kube-apiserver (one per test, so controllers of different tests
//! never see each other's objects). No kubelet or external attacher runs: tests play both, by
//! writing node status (Ready, volumesInUse) and VolumeAttachment status themselves.

use std::time::Duration;

use k8s_openapi::api::core::v1::{
    Namespace, Node, PersistentVolume, PersistentVolumeClaim, Pod, ServiceAccount,
};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use prometheus::Registry;
use serde_json::json;
use stowage_attachdetach::objects::{attachment_name, unique_volume_name};
use stowage_attachdetach::{Config, Metrics, run};
use stowage_common::cluster::Cluster;
use stowage_testkit::{ControlPlane, builders, eventually};
use tokio::task::JoinSet;

const DRIVER: &str = "loop.stowage.dev";
/// A bound on waiting, never a claim about speed.
const LIMIT: Duration = Duration::from_secs(60);
const NS: &str = "apps";

/// One controller with its own informers; dropping it stops both.
struct Controller {
    registry: Registry,
    _tasks: JoinSet<()>,
}

impl Controller {
    fn start(client: &Client, config: Config) -> Self {
        let registry = Registry::new();
        let mut tasks = JoinSet::new();
        let cluster = Cluster::start(client.clone(), registry.clone(), &mut tasks);
        let metrics = Metrics::new(&registry);
        tasks.spawn(async move {
            if let Err(e) = run(cluster, metrics, config).await {
                panic!("controller failed: {e:#}");
            }
        });
        Self {
            registry,
            _tasks: tasks,
        }
    }

    /// Sum of the samples of `name` whose labels include `label` (all samples when `None`).
    fn metric(&self, name: &str, label: Option<(&str, &str)>) -> f64 {
        let text = stowage_common::metrics::encode(&self.registry);
        let parsed = stowage_testkit::scrape::parse(&text).expect("valid exposition");
        parsed
            .samples
            .get(name)
            .into_iter()
            .flatten()
            .filter(|(l, _)| label.is_none_or(|(k, v)| l.get(k).map(String::as_str) == Some(v)))
            .map(|(_, v)| v)
            .sum()
    }
}

struct World {
    _cp: ControlPlane,
    client: Client,
}

impl World {
    async fn start() -> Self {
        let cp = tokio::task::spawn_blocking(ControlPlane::start)
            .await
            .unwrap()
            .expect("control plane");
        let client = cp.client().await;
        let (ns, sa) = builders::namespace(NS);
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
        Api::<ServiceAccount>::namespaced(client.clone(), NS)
            .create(&PostParams::default(), &sa)
            .await
            .unwrap();
        Self { _cp: cp, client }
    }

    fn vas(&self) -> Api<VolumeAttachment> {
        Api::all(self.client.clone())
    }

    fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), NS)
    }

    /// The common start: a Ready node-a and a bound ReadWriteOnce volume vol-1 (claim vol-1).
    async fn with_one_volume() -> Self {
        let w = Self::start().await;
        w.node("node-a", true).await;
        w.bound_volume("vol-1", &["ReadWriteOnce"]).await;
        w
    }

    /// A managed node with its Ready condition set through the status subresource.
    async fn node(&self, name: &str, ready: bool) {
        self.nodes()
            .create(
                &PostParams::default(),
                &builders::node(name).controller_attach().build(),
            )
            .await
            .unwrap();
        self.node_status(name, json!({ "conditions": [ready_condition(ready)] }))
            .await;
    }

    async fn node_status(&self, name: &str, status: serde_json::Value) {
        self.nodes()
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": status })),
            )
            .await
            .unwrap();
    }

    /// What a kubelet reports while it has the volume mounted.
    async fn in_use(&self, node: &str, pvs: &[&str]) {
        let names: Vec<String> = pvs.iter().map(|pv| unique_volume_name(DRIVER, pv)).collect();
        self.node_status(node, json!({ "volumesInUse": names })).await;
    }

    /// A claim and its volume, bound to each other as the binder would leave them.
    async fn bound_volume(&self, pv: &str, modes: &[&str]) {
        let claim = Api::<PersistentVolumeClaim>::namespaced(self.client.clone(), NS)
            .create(
                &PostParams::default(),
                &builders::pvc(NS, pv).access_modes(modes).volume_name(pv).build(),
            )
            .await
            .unwrap();
        let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
        pvs.create(
            &PostParams::default(),
            &builders::pv(pv)
                .access_modes(modes)
                .claim_ref(NS, pv, &claim.uid().unwrap())
                .build(),
        )
        .await
        .unwrap();
        let bound = Patch::Merge(json!({ "status": { "phase": "Bound" } }));
        pvs.patch_status(pv, &PatchParams::default(), &bound)
            .await
            .unwrap();
        Api::<PersistentVolumeClaim>::namespaced(self.client.clone(), NS)
            .patch_status(pv, &PatchParams::default(), &bound)
            .await
            .unwrap();
    }

    async fn pod(&self, name: &str, claim: &str, node: &str) {
        self.pods()
            .create(
                &PostParams::default(),
                &builders::pod(NS, name).claim("data", claim).node(node).build(),
            )
            .await
            .unwrap();
    }

    /// Waits for a Warning event with `reason` on pod `pod` and returns its note.
    async fn warning_note(&self, pod: &str, reason: &str) -> String {
        let events: Api<Event> = Api::namespaced(self.client.clone(), NS);
        eventually(LIMIT, || {
            let events = events.clone();
            async move {
                let list = events
                    .list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?;
                list.items
                    .into_iter()
                    .find(|e| {
                        e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pod)
                            && e.reason.as_deref() == Some(reason)
                            && e.type_.as_deref() == Some("Warning")
                    })
                    .and_then(|e| e.note)
                    .ok_or_else(|| format!("no {reason} event on pod {pod}"))
            }
        })
        .await
    }

    /// Gone at once: no kubelet runs to finish a graceful deletion.
    async fn delete_pod(&self, name: &str) {
        self.pods()
            .delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }

    async fn wait_va(&self, pv: &str, node: &str) -> VolumeAttachment {
        let name = attachment_name(pv, DRIVER, node);
        let vas = self.vas();
        eventually(LIMIT, || {
            let vas = vas.clone();
            let name = name.clone();
            async move {
                vas.get_opt(&name)
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| format!("no VolumeAttachment {name} for {pv} on {node}"))
            }
        })
        .await
    }

    async fn wait_no_va(&self, pv: &str, node: &str) {
        let name = attachment_name(pv, DRIVER, node);
        let vas = self.vas();
        eventually(LIMIT, || {
            let vas = vas.clone();
            let name = name.clone();
            async move {
                match vas.get_opt(&name).await.map_err(|e| e.to_string())? {
                    Some(_) => Err(format!("VolumeAttachment {name} for {pv} on {node} still exists")),
                    None => Ok(()),
                }
            }
        })
        .await
    }

    /// What the external attacher does once the volume is attached.
    async fn mark_attached(&self, pv: &str, node: &str, device: &str) {
        let name = attachment_name(pv, DRIVER, node);
        let patch = json!({ "status": { "attached": true, "attachmentMetadata": { "devicePath": device } } });
        self.vas()
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .unwrap();
    }

    /// A pod on `node` using `pv`, and the attachment the controller creates for it, marked
    /// attached at `device` as the external attacher would.
    async fn attached_pod(&self, pod: &str, pv: &str, node: &str, device: &str) {
        self.pod(pod, pv, node).await;
        self.wait_va(pv, node).await;
        self.mark_attached(pv, node, device).await;
    }

    /// Waits until the node's status.volumesAttached is exactly `want` (unique name, path).
    async fn wait_node_attached(&self, node: &str, want: Vec<(String, String)>) {
        let nodes = self.nodes();
        eventually(LIMIT, || {
            let nodes = nodes.clone();
            let want = want.clone();
            async move {
                let n = nodes.get(node).await.map_err(|e| e.to_string())?;
                let mut got: Vec<(String, String)> = n
                    .status
                    .and_then(|s| s.volumes_attached)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|v| (v.name, v.device_path))
                    .collect();
                got.sort();
                if got == want {
                    Ok(())
                } else {
                    Err(format!("node {node} volumesAttached {got:?}, want {want:?}"))
                }
            }
        })
        .await
    }
}

fn ready_condition(ready: bool) -> serde_json::Value {
    json!({ "type": "Ready", "status": if ready { "True" } else { "False" } })
}

fn short_wait() -> Config {
    Config {
        max_wait_for_unmount: Duration::from_secs(2),
        ..Default::default()
    }
}

/// Waits until the controller has run at least `n` more passes than `after`.
async fn passes(c: &Controller, after: f64, n: f64) {
    eventually(LIMIT, || async move {
        let got = c.metric("stowage_attachdetach_reconcile_total", None);
        if got >= after + n {
            Ok(())
        } else {
            Err(format!("{got} reconciler passes"))
        }
    })
    .await
}

#[tokio::test]
async fn scheduled_pod_gets_an_attachment_and_the_node_reports_it() {
    let w = World::with_one_volume().await;
    let c = Controller::start(&w.client, Config::default());
    w.pod("app", "vol-1", "node-a").await;

    let va = w.wait_va("vol-1", "node-a").await;
    assert_eq!(va.spec.attacher, DRIVER);
    assert_eq!(va.spec.node_name, "node-a");
    assert_eq!(va.spec.source.persistent_volume_name.as_deref(), Some("vol-1"));

    // Nothing is reported attached before the attacher says so; then with its device path.
    w.mark_attached("vol-1", "node-a", "/dev/loop7").await;
    w.wait_node_attached(
        "node-a",
        vec![(unique_volume_name(DRIVER, "vol-1"), "/dev/loop7".into())],
    )
    .await;
    eventually(LIMIT, || async {
        let v = c.metric(
            "stowage_attachdetach_volumes",
            Some(("state", "actual_state_of_world")),
        );
        if v == 1.0 {
            Ok(())
        } else {
            Err(format!("actual volumes gauge {v}"))
        }
    })
    .await;
    assert_eq!(
        c.metric(
            "stowage_attachdetach_volumes",
            Some(("state", "desired_state_of_world"))
        ),
        1.0
    );
}

#[tokio::test]
async fn deleted_pod_loses_its_attachment() {
    let w = World::with_one_volume().await;
    let c = Controller::start(&w.client, Config::default());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    w.wait_node_attached(
        "node-a",
        vec![(unique_volume_name(DRIVER, "vol-1"), "/dev/loop1".into())],
    )
    .await;

    w.delete_pod("app").await;
    w.wait_no_va("vol-1", "node-a").await;
    w.wait_node_attached("node-a", vec![]).await;
    assert_eq!(c.metric("stowage_attachdetach_forced_detaches_total", None), 0.0);
}

#[tokio::test]
async fn volume_in_use_on_a_ready_node_waits_for_unmount() {
    let w = World::with_one_volume().await;
    // Even a short max wait never forces a detach from a Ready node.
    let c = Controller::start(&w.client, short_wait());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    w.in_use("node-a", &["vol-1"]).await;

    w.delete_pod("app").await;
    eventually(LIMIT, || async {
        let waiting = c.metric("stowage_attachdetach_detaches_waiting_for_unmount", None);
        let longest = c.metric("stowage_attachdetach_longest_unmount_wait_seconds", None);
        // Well past the max wait: the detach is still held back.
        if waiting == 1.0 && longest > 4.0 {
            Ok(())
        } else {
            Err(format!("waiting {waiting}, longest wait {longest}s"))
        }
    })
    .await;
    assert!(
        w.vas()
            .get_opt(&attachment_name("vol-1", DRIVER, "node-a"))
            .await
            .unwrap()
            .is_some()
    );

    // The kubelet unmounts: now it goes.
    w.in_use("node-a", &[]).await;
    w.wait_no_va("vol-1", "node-a").await;
    assert_eq!(c.metric("stowage_attachdetach_forced_detaches_total", None), 0.0);
}

#[tokio::test]
async fn volume_in_use_on_a_not_ready_node_is_detached_after_the_max_wait() {
    let w = World::with_one_volume().await;
    let c = Controller::start(&w.client, short_wait());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    w.node_status("node-a", json!({ "conditions": [ready_condition(false)], "volumesInUse": [unique_volume_name(DRIVER, "vol-1")] }))
        .await;

    w.delete_pod("app").await;
    w.wait_no_va("vol-1", "node-a").await;
    assert_eq!(
        c.metric(
            "stowage_attachdetach_forced_detaches_total",
            Some(("reason", "timeout"))
        ),
        1.0
    );
    assert!(c.metric("stowage_attachdetach_unmount_wait_seconds_sum", None) >= 2.0);
}

#[tokio::test]
async fn out_of_service_taint_detaches_at_once() {
    let w = World::with_one_volume().await;
    // The max wait is the default (6 min): only the taint can make this detach happen.
    let c = Controller::start(&w.client, Config::default());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    w.node_status("node-a", json!({ "conditions": [ready_condition(false)], "volumesInUse": [unique_volume_name(DRIVER, "vol-1")] }))
        .await;
    w.delete_pod("app").await;
    eventually(LIMIT, || async {
        let waiting = c.metric("stowage_attachdetach_detaches_waiting_for_unmount", None);
        if waiting == 1.0 {
            Ok(())
        } else {
            Err(format!("{waiting} detaches waiting"))
        }
    })
    .await;

    let taint = json!({ "spec": { "taints": [{ "key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute" }] } });
    w.nodes()
        .patch("node-a", &PatchParams::default(), &Patch::Merge(taint))
        .await
        .unwrap();
    w.wait_no_va("vol-1", "node-a").await;
    assert_eq!(
        c.metric(
            "stowage_attachdetach_forced_detaches_total",
            Some(("reason", "out-of-service"))
        ),
        1.0
    );
}

#[tokio::test]
async fn single_node_volume_moves_only_after_the_first_pod_is_gone() {
    let w = World::start().await;
    w.node("node-a", true).await;
    w.node("node-b", true).await;
    w.bound_volume("vol-1", &["ReadWriteOnce"]).await;
    let c = Controller::start(&w.client, Config::default());
    w.attached_pod("first", "vol-1", "node-a", "/dev/loop1").await;

    w.pod("second", "vol-1", "node-b").await;
    let note = w.warning_note("second", "FailedAttachVolume").await;
    assert!(
        note.starts_with("Multi-Attach error for volume \"vol-1\" Volume is already used by pod(s) first"),
        "{note}"
    );
    assert!(
        note.contains("first"),
        "the holding pod is named in its own namespace: {note}"
    );
    assert_eq!(
        c.metric("stowage_attachdetach_multi_attach_errors_total", None),
        1.0
    );
    // Whatever else happened meanwhile, node-b got nothing.
    assert!(
        w.vas()
            .get_opt(&attachment_name("vol-1", DRIVER, "node-b"))
            .await
            .unwrap()
            .is_none()
    );

    w.delete_pod("first").await;
    w.wait_no_va("vol-1", "node-a").await;
    w.wait_va("vol-1", "node-b").await;
}

#[tokio::test]
async fn restart_keeps_what_should_stay_attached() {
    let w = World::with_one_volume().await;
    w.bound_volume("vol-2", &["ReadWriteOnce"]).await;
    let first = Controller::start(&w.client, Config::default());
    w.pod("app-1", "vol-1", "node-a").await;
    w.pod("app-2", "vol-2", "node-a").await;
    w.wait_va("vol-1", "node-a").await;
    w.wait_va("vol-2", "node-a").await;
    w.mark_attached("vol-1", "node-a", "/dev/loop1").await;
    w.mark_attached("vol-2", "node-a", "/dev/loop2").await;
    let both = vec![
        (unique_volume_name(DRIVER, "vol-1"), "/dev/loop1".to_string()),
        (unique_volume_name(DRIVER, "vol-2"), "/dev/loop2".to_string()),
    ];
    w.wait_node_attached("node-a", both.clone()).await;
    drop(first);

    let before: Vec<String> = w
        .vas()
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|v| v.uid().unwrap())
        .collect();
    let second = Controller::start(&w.client, Config::default());
    // The first pass is where a wrong view of the world at start would act.
    passes(&second, 0.0, 1.0).await;
    // Pods come and go while it runs; the rest stays put.
    w.delete_pod("app-2").await;
    w.wait_no_va("vol-2", "node-a").await;
    let after = w
        .vas()
        .get(&attachment_name("vol-1", DRIVER, "node-a"))
        .await
        .unwrap();
    assert!(
        before.contains(&after.uid().unwrap()),
        "vol-1's attachment was re-created"
    );
    assert!(after.metadata.deletion_timestamp.is_none());
    w.wait_node_attached("node-a", vec![both[0].clone()]).await;
    assert_eq!(
        second.metric(
            "stowage_attachdetach_operations_total",
            Some(("operation", "attach"))
        ),
        0.0
    );
}

/// A deleted Node is unhealthy, not proof of an unmount: its last volumesInUse holds the detach
/// back (upstream keeps the node and its volumesInUse), so nothing is detached at once.
#[tokio::test]
async fn deleted_node_keeps_attachments_it_last_reported_in_use() {
    let w = World::with_one_volume().await;
    let c = Controller::start(&w.client, Config::default());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    w.in_use("node-a", &["vol-1"]).await;

    w.nodes()
        .delete("node-a", &DeleteParams::default())
        .await
        .unwrap();
    w.delete_pod("app").await;
    eventually(LIMIT, || async {
        let waiting = c.metric("stowage_attachdetach_detaches_waiting_for_unmount", None);
        let longest = c.metric("stowage_attachdetach_longest_unmount_wait_seconds", None);
        if waiting == 1.0 && longest >= 2.0 {
            Ok(())
        } else {
            Err(format!("waiting {waiting}, longest wait {longest}s"))
        }
    })
    .await;
    let va = w
        .vas()
        .get_opt(&attachment_name("vol-1", DRIVER, "node-a"))
        .await
        .unwrap()
        .expect("the attachment of a gone node's mounted volume stays");
    assert!(va.metadata.deletion_timestamp.is_none());
    assert_eq!(c.metric("stowage_attachdetach_forced_detaches_total", None), 0.0);
}

/// ...and after --max-wait-for-unmount the gone node's volume is force-detached.
#[tokio::test]
async fn deleted_node_is_force_detached_after_the_max_wait() {
    let w = World::with_one_volume().await;
    let c = Controller::start(&w.client, short_wait());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    w.in_use("node-a", &["vol-1"]).await;

    w.nodes()
        .delete("node-a", &DeleteParams::default())
        .await
        .unwrap();
    w.delete_pod("app").await;
    w.wait_no_va("vol-1", "node-a").await;
    assert_eq!(
        c.metric(
            "stowage_attachdetach_forced_detaches_total",
            Some(("reason", "node-deleted"))
        ),
        1.0
    );
    assert!(c.metric("stowage_attachdetach_unmount_wait_seconds_sum", None) >= 2.0);
}

/// A generic ephemeral volume is the claim `<pod>-<volume>` that the pod controls; its volume is
/// attached like any other (upstream's populator resolves it the same way).
#[tokio::test]
async fn generic_ephemeral_volume_gets_an_attachment() {
    let w = World::start().await;
    w.node("node-a", true).await;
    let c = Controller::start(&w.client, Config::default());
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": "app", "namespace": NS },
        "spec": {
            "nodeName": "node-a",
            "containers": [{ "name": "c", "image": "busybox",
                "volumeMounts": [{ "name": "scratch", "mountPath": "/scratch" }] }],
            "volumes": [{ "name": "scratch", "ephemeral": { "volumeClaimTemplate": { "spec": {
                "accessModes": ["ReadWriteOnce"], "resources": { "requests": { "storage": "1Gi" } }
            } } } }]
        }
    }))
    .unwrap();
    let pod = w.pods().create(&PostParams::default(), &pod).await.unwrap();
    // What the ephemeral-volume controller makes: the claim, controlled by the pod.
    let claims = Api::<PersistentVolumeClaim>::namespaced(w.client.clone(), NS);
    let mut claim = builders::pvc(NS, "app-scratch")
        .access_modes(&["ReadWriteOnce"])
        .volume_name("eph-1")
        .build();
    claim.metadata.owner_references = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: "app".into(),
            uid: pod.uid().unwrap(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        },
    ]);
    let claim = claims.create(&PostParams::default(), &claim).await.unwrap();
    let pvs: Api<PersistentVolume> = Api::all(w.client.clone());
    pvs.create(
        &PostParams::default(),
        &builders::pv("eph-1")
            .access_modes(&["ReadWriteOnce"])
            .claim_ref(NS, "app-scratch", &claim.uid().unwrap())
            .build(),
    )
    .await
    .unwrap();
    let bound = Patch::Merge(json!({ "status": { "phase": "Bound" } }));
    pvs.patch_status("eph-1", &PatchParams::default(), &bound)
        .await
        .unwrap();
    claims
        .patch_status("app-scratch", &PatchParams::default(), &bound)
        .await
        .unwrap();

    let va = w.wait_va("eph-1", "node-a").await;
    assert_eq!(va.spec.source.persistent_volume_name.as_deref(), Some("eph-1"));
    drop(c);
}

/// A ReadWriteMany loop volume still goes to one node at a time: ext4 on a loop image must not be
/// mounted read-write by two kernels. The waiting pod is told the rule.
#[tokio::test]
async fn read_write_many_loop_volume_is_attached_to_one_node_only() {
    let w = World::start().await;
    w.node("node-a", true).await;
    w.node("node-b", true).await;
    w.bound_volume("vol-1", &["ReadWriteMany"]).await;
    let c = Controller::start(&w.client, Config::default());
    w.attached_pod("first", "vol-1", "node-a", "/dev/loop1").await;

    w.pod("second", "vol-1", "node-b").await;
    let note = w.warning_note("second", "FailedAttachVolume").await;
    assert!(note.contains("one node at a time"), "{note}");
    assert!(
        w.vas()
            .get_opt(&attachment_name("vol-1", DRIVER, "node-b"))
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(
        c.metric("stowage_attachdetach_multi_attach_errors_total", None),
        1.0
    );
    // Once the first node lets go, the second gets it.
    w.delete_pod("first").await;
    w.wait_no_va("vol-1", "node-a").await;
    w.wait_va("vol-1", "node-b").await;
}

/// A forced detach of a node that is gone must finish although no agent is left there to drop
/// the attacher's finalizer: the controller releases it, says so, and the volume can move.
#[tokio::test]
async fn a_gone_nodes_attachment_is_released_after_the_forced_detach() {
    let w = World::start().await;
    w.node("node-a", true).await;
    w.node("node-b", true).await;
    w.bound_volume("vol-1", &["ReadWriteOnce"]).await;
    let c = Controller::start(&w.client, short_wait());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    w.in_use("node-a", &["vol-1"]).await;
    // What node-a's agent did when it attached: its finalizer holds the VolumeAttachment.
    let name = attachment_name("vol-1", DRIVER, "node-a");
    w.vas()
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(
                json!({ "metadata": { "finalizers": [stowage_common::objects::LOOP_ATTACHER_FINALIZER] } }),
            ),
        )
        .await
        .unwrap();

    // node-a dies with the agent; its pod is replaced on node-b.
    w.nodes()
        .delete("node-a", &DeleteParams::default())
        .await
        .unwrap();
    w.delete_pod("app").await;
    w.pod("app-2", "vol-1", "node-b").await;
    w.wait_no_va("vol-1", "node-a").await;
    w.wait_va("vol-1", "node-b").await;
    assert_eq!(
        c.metric(
            "stowage_attachdetach_operations_total",
            Some(("operation", "release"))
        ),
        1.0
    );
}

/// A loop PV carries the attacher's finalizer while a VolumeAttachment names it (as
/// external-attacher keeps it), so it cannot vanish under an attachment; it goes with the last one.
#[tokio::test]
async fn an_attached_loop_volume_is_protected_by_the_attacher_finalizer() {
    let w = World::with_one_volume().await;
    let _c = Controller::start(&w.client, Config::default());
    let pvs: Api<PersistentVolume> = Api::all(w.client.clone());
    let has_finalizer = |want: bool| {
        let pvs = pvs.clone();
        async move {
            eventually(LIMIT, || {
                let pvs = pvs.clone();
                async move {
                    let pv = pvs.get("vol-1").await.map_err(|e| e.to_string())?;
                    let has = pv
                        .finalizers()
                        .iter()
                        .any(|f| f == stowage_common::objects::LOOP_ATTACHER_FINALIZER);
                    if has == want {
                        Ok(())
                    } else {
                        Err(format!("finalizers of vol-1: {:?}", pv.finalizers()))
                    }
                }
            })
            .await
        }
    };
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    has_finalizer(true).await;

    w.delete_pod("app").await;
    w.wait_no_va("vol-1", "node-a").await;
    has_finalizer(false).await;
}
