//! A binder running in-process against its own real control plane, so tests never see each
//! other's volumes.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::events::v1::Event;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use stowage_common::cluster::Cluster;
use stowage_testkit::{ControlPlane, builders, eventually};
use tokio::task::JoinSet;

pub const WAIT: Duration = Duration::from_secs(60);

pub struct Harness {
    pub cp: ControlPlane,
    pub client: Client,
    pub images: tempfile::TempDir,
    pub registry: prometheus::Registry,
    _tasks: JoinSet<()>,
    pub binder: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Harness {
    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    pub async fn start_with(tune: impl FnOnce(&mut stowage_binder::Config)) -> Self {
        let cp = tokio::task::spawn_blocking(ControlPlane::start)
            .await
            .unwrap()
            .expect("control plane");
        let client = cp.client().await;
        let images = tempfile::tempdir().unwrap();
        let registry = prometheus::Registry::new();
        let mut tasks = JoinSet::new();
        let cluster: Arc<Cluster> = Cluster::start(client.clone(), registry.clone(), &mut tasks);
        cluster.ready().await;
        let metrics = stowage_binder::Metrics::new(&registry);
        let mut config = stowage_binder::Config {
            resync: Duration::from_secs(15),
            image_dir: images.path().to_path_buf(),
            max_in_flight: 64,
        };
        tune(&mut config);
        let binder = tokio::spawn(stowage_binder::run(cluster, metrics, config));
        Self {
            cp,
            client,
            images,
            registry,
            _tasks: tasks,
            binder,
        }
    }

    pub async fn namespace(&self, name: &str) {
        builders::create_namespace(&self.client, name).await;
    }

    pub fn pvs(&self) -> Api<PersistentVolume> {
        Api::all(self.client.clone())
    }

    pub fn pvcs(&self, ns: &str) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.client.clone(), ns)
    }

    pub async fn create_pv(&self, pv: PersistentVolume) -> PersistentVolume {
        self.pvs().create(&PostParams::default(), &pv).await.unwrap()
    }

    pub async fn create_pvc(&self, pvc: PersistentVolumeClaim) -> PersistentVolumeClaim {
        let ns = pvc.namespace().unwrap();
        self.pvcs(&ns).create(&PostParams::default(), &pvc).await.unwrap()
    }

    pub async fn create<K>(&self, obj: K) -> K
    where
        K: kube::Resource<Scope = k8s_openapi::ClusterResourceScope, DynamicType = ()>
            + Clone
            + serde::de::DeserializeOwned
            + serde::Serialize
            + std::fmt::Debug,
    {
        Api::<K>::all(self.client.clone())
            .create(&PostParams::default(), &obj)
            .await
            .unwrap()
    }

    /// Waits for a claim in `phase`, returning it.
    pub async fn claim_phase(&self, ns: &str, name: &str, phase: &str) -> PersistentVolumeClaim {
        let api = self.pvcs(ns);
        eventually(WAIT, || async {
            let c = api.get(name).await.map_err(|e| e.to_string())?;
            let p = c
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default();
            if p == phase {
                Ok(c)
            } else {
                Err(format!("claim {ns}/{name} is {p:?}, want {phase}"))
            }
        })
        .await
    }

    pub async fn volume_phase(&self, name: &str, phase: &str) -> PersistentVolume {
        let api = self.pvs();
        eventually(WAIT, || async {
            let v = api.get(name).await.map_err(|e| e.to_string())?;
            let p = v
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default();
            if p == phase {
                Ok(v)
            } else {
                Err(format!("volume {name} is {p:?}, want {phase}"))
            }
        })
        .await
    }

    /// Waits for an event with `reason` about object `name`, returning its note.
    pub async fn event(&self, name: &str, reason: &str) -> String {
        let api: Api<Event> = Api::all(self.client.clone());
        eventually(WAIT, || async {
            let list = api
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            list.items
                .iter()
                .find(|e| {
                    e.reason.as_deref() == Some(reason)
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                })
                .map(|e| e.note.clone().unwrap_or_default())
                .ok_or_else(|| format!("no {reason} event for {name} yet"))
        })
        .await
    }

    /// What the pvc-protection controller would do once the claim is unused (it is not under
    /// test here): drop the finalizer so deletion completes.
    pub async fn delete_claim(&self, ns: &str, name: &str) {
        let api = self.pvcs(ns);
        let patch = serde_json::json!({"metadata": {"finalizers": null}});
        api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        api.delete(name, &Default::default()).await.unwrap();
    }

    pub async fn delete_volume(&self, name: &str) {
        let patch = serde_json::json!({"metadata": {"finalizers": null}});
        self.pvs()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        let _ = self.pvs().delete(name, &Default::default()).await;
    }

    pub fn metrics_text(&self) -> String {
        stowage_common::metrics::encode(&self.registry)
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.binder.abort();
    }
}
