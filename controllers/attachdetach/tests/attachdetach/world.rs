//! The test world: one control plane per test, a controller on its own informers, helpers that
//! play the kubelet and the external attacher. (The JoinSet holds the informers' and the
//! controller's tasks, as `Informers::start` takes it; it is not a write window.)

pub(crate) use std::time::Duration;

pub(crate) use k8s_openapi::api::core::v1::{
    Namespace, Node, PersistentVolume, PersistentVolumeClaim, Pod, ServiceAccount,
};
pub(crate) use k8s_openapi::api::events::v1::Event;
pub(crate) use k8s_openapi::api::storage::v1::VolumeAttachment;
pub(crate) use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
pub(crate) use kube::{Api, Client, ResourceExt};
pub(crate) use serde_json::json;
pub(crate) use stowage_attachdetach::read::{attachment_name, unique_volume_name};
pub(crate) use stowage_attachdetach::{Config, Metrics, run};
pub(crate) use stowage_common::observe::metrics::Registry;
pub(crate) use stowage_common::store::informers::Informers;
pub(crate) use stowage_testkit::{ControlPlane, builders, eventually};
pub(crate) use tokio::task::JoinSet;

pub(crate) const DRIVER: &str = "loop.stowage.dev";
/// A bound on waiting, never a claim about speed.
pub(crate) const LIMIT: Duration = Duration::from_secs(60);
pub(crate) const NS: &str = "apps";

/// One controller with its own informers; dropping it stops both.
pub(crate) struct Controller {
    pub(crate) registry: Registry,
    pub(crate) _tasks: JoinSet<()>,
}

impl Controller {
    pub(crate) fn start(client: &Client, config: Config) -> Self {
        let registry = Registry::new();
        let mut tasks = JoinSet::new();
        let cluster = Informers::start(client.clone(), registry.clone(), &mut tasks);
        Self::run_on(cluster, registry, tasks, config)
    }

    /// The controller on informers the caller started on `tasks`.
    pub(crate) fn run_on(
        cluster: std::sync::Arc<Informers>,
        registry: Registry,
        mut tasks: JoinSet<()>,
        config: Config,
    ) -> Self {
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

    /// Sum of the samples of `name` whose labels include all of `labels`.
    pub(crate) fn metric_with(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let text = stowage_common::observe::metrics::encode(&self.registry);
        let parsed = stowage_testkit::scrape::parse(&text).expect("valid exposition");
        parsed
            .samples
            .get(name)
            .into_iter()
            .flatten()
            .filter(|(l, _)| {
                labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|(_, v)| v)
            .sum()
    }

    /// Sum of the samples of `name` whose labels include `label` (all samples when `None`).
    pub(crate) fn metric(&self, name: &str, label: Option<(&str, &str)>) -> f64 {
        let text = stowage_common::observe::metrics::encode(&self.registry);
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

pub(crate) struct World {
    pub(crate) _cp: ControlPlane,
    pub(crate) client: Client,
}

impl World {
    pub(crate) async fn start() -> Self {
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

    pub(crate) fn vas(&self) -> Api<VolumeAttachment> {
        Api::all(self.client.clone())
    }

    pub(crate) fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    pub(crate) fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), NS)
    }

    /// The common start: a Ready node-a and a bound ReadWriteOnce volume vol-1 (claim vol-1).
    pub(crate) async fn with_one_volume() -> Self {
        let w = Self::start().await;
        w.node("node-a", true).await;
        w.bound_volume("vol-1", &["ReadWriteOnce"]).await;
        w
    }

    /// A managed node with its Ready condition set through the status subresource.
    pub(crate) async fn node(&self, name: &str, ready: bool) {
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

    pub(crate) async fn node_status(&self, name: &str, status: serde_json::Value) {
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
    pub(crate) async fn in_use(&self, node: &str, pvs: &[&str]) {
        let names: Vec<String> = pvs.iter().map(|pv| unique_volume_name(DRIVER, pv)).collect();
        self.node_status(node, json!({ "volumesInUse": names })).await;
    }

    /// A claim and its volume, bound to each other as the binder would leave them.
    pub(crate) async fn bound_volume(&self, pv: &str, modes: &[&str]) {
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

    pub(crate) async fn pod(&self, name: &str, claim: &str, node: &str) {
        self.pods()
            .create(
                &PostParams::default(),
                &builders::pod(NS, name).claim("data", claim).node(node).build(),
            )
            .await
            .unwrap();
    }

    /// Waits for a Warning event with `reason` on pod `pod` and returns its note.
    pub(crate) async fn warning_note(&self, pod: &str, reason: &str) -> String {
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
    pub(crate) async fn delete_pod(&self, name: &str) {
        self.pods()
            .delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }

    pub(crate) async fn wait_va(&self, pv: &str, node: &str) -> VolumeAttachment {
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

    pub(crate) async fn wait_no_va(&self, pv: &str, node: &str) {
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
    pub(crate) async fn mark_attached(&self, pv: &str, node: &str, device: &str) {
        let name = attachment_name(pv, DRIVER, node);
        let patch = json!({ "status": { "attached": true, "attachmentMetadata": { "devicePath": device } } });
        self.vas()
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .unwrap();
    }

    /// A pod on `node` using `pv`, and the attachment the controller creates for it, marked
    /// attached at `device` as the external attacher would.
    pub(crate) async fn attached_pod(&self, pod: &str, pv: &str, node: &str, device: &str) {
        self.pod(pod, pv, node).await;
        self.wait_va(pv, node).await;
        self.mark_attached(pv, node, device).await;
    }

    /// Waits until the node's status.volumesAttached is exactly `want` (unique name, path).
    pub(crate) async fn wait_node_attached(&self, node: &str, want: Vec<(String, String)>) {
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

pub(crate) fn ready_condition(ready: bool) -> serde_json::Value {
    json!({ "type": "Ready", "status": if ready { "True" } else { "False" } })
}

pub(crate) fn short_wait() -> Config {
    Config {
        max_wait_for_unmount: Duration::from_secs(2),
        ..Default::default()
    }
}

/// Waits until the controller has run at least `n` more passes than `after`.
pub(crate) async fn passes(c: &Controller, after: f64, n: f64) {
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
