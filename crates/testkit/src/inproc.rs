//! One controller running in the test process against its own real control plane (so tests never
//! see each other's objects), with the shared informers started here as the binary would.
//! Controller test harnesses wrap this and add what only their scenarios need.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::events::v1::Event;
use kube::api::{ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use stowage_common::store::informers::Informers;
use tokio::task::{JoinHandle, JoinSet};

use crate::{ControlPlane, builders, eventually};

/// How long a scenario step may take before the test fails with the last reason it saw.
pub const WAIT: Duration = Duration::from_secs(60);

/// Declares a controller's test harness: a newtype over [`InProcess`] that reaches everything
/// generic by deref, so each controller's tests add only what is theirs.
#[macro_export]
macro_rules! in_process_harness {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        pub struct $name($crate::InProcess);

        impl ::std::ops::Deref for $name {
            type Target = $crate::InProcess;
            fn deref(&self) -> &$crate::InProcess {
                &self.0
            }
        }

        impl ::std::ops::DerefMut for $name {
            fn deref_mut(&mut self) -> &mut $crate::InProcess {
                &mut self.0
            }
        }
    };
}

pub struct InProcess {
    pub cp: ControlPlane,
    pub client: Client,
    /// The image directory handed to controllers that manage loop volumes, marked as the image
    /// store (`ImageStore::init`, the install step); a test of the unmarked case removes
    /// `stowage_loopdriver::image::MARKER`.
    pub images: tempfile::TempDir,
    pub registry: stowage_common::observe::metrics::Registry,
    informers: JoinSet<()>,
    controller: Option<JoinHandle<anyhow::Result<()>>>,
}

impl InProcess {
    /// A fresh control plane; no informers and no controller yet.
    pub async fn new() -> Self {
        let cp = tokio::task::spawn_blocking(ControlPlane::start)
            .await
            .expect("control plane start task")
            .expect("control plane");
        let client = cp.client().await;
        let images = tempfile::tempdir().expect("temporary image directory");
        stowage_loopdriver::ImageStore::new(images.path())
            .init()
            .expect("image store marker");
        Self {
            cp,
            client,
            images,
            registry: stowage_common::observe::metrics::Registry::new(),
            informers: JoinSet::new(),
            controller: None,
        }
    }

    /// Starts the shared informers and waits for their first lists.
    pub async fn cluster(&mut self) -> Arc<Informers> {
        let cluster = Informers::start(self.client.clone(), self.registry.clone(), &mut self.informers);
        cluster.ready().await;
        cluster
    }

    /// Runs the controller; it is aborted when this harness drops.
    pub fn run(&mut self, controller: impl Future<Output = anyhow::Result<()>> + Send + 'static) {
        self.controller = Some(tokio::spawn(controller));
    }

    /// Whether the controller has stopped (it should only when told to).
    pub fn controller_finished(&self) -> bool {
        self.controller.as_ref().is_some_and(|c| c.is_finished())
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

    pub fn pods(&self, ns: &str) -> Api<k8s_openapi::api::core::v1::Pod> {
        Api::namespaced(self.client.clone(), ns)
    }

    pub async fn create_pv(&self, pv: PersistentVolume) -> PersistentVolume {
        self.pvs().create(&PostParams::default(), &pv).await.unwrap()
    }

    pub async fn create_pvc(&self, pvc: PersistentVolumeClaim) -> PersistentVolumeClaim {
        let ns = pvc.namespace().expect("claims are namespaced");
        self.pvcs(&ns).create(&PostParams::default(), &pvc).await.unwrap()
    }

    /// Creates any cluster-scoped object (classes, nodes, drivers).
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

    /// Waits until `ok` holds for the claim (`what` names the wait in the failure), returning it.
    pub async fn claim_until(
        &self,
        ns: &str,
        name: &str,
        what: &str,
        ok: impl Fn(&PersistentVolumeClaim) -> bool,
    ) -> PersistentVolumeClaim {
        let api = self.pvcs(ns);
        eventually(WAIT, || async {
            let c = api.get(name).await.map_err(|e| e.to_string())?;
            if ok(&c) {
                Ok(c)
            } else {
                Err(format!("claim {ns}/{name}: want {what}; status {:?}", c.status))
            }
        })
        .await
    }

    /// Waits for a claim in `phase`, returning it.
    pub async fn claim_phase(&self, ns: &str, name: &str, phase: &str) -> PersistentVolumeClaim {
        self.claim_until(ns, name, &format!("phase {phase}"), |c| {
            c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some(phase)
        })
        .await
    }

    /// Waits for a volume in `phase`, returning it.
    pub async fn volume_phase(&self, name: &str, phase: &str) -> PersistentVolume {
        let api = self.pvs();
        eventually(WAIT, || async {
            let v = api.get(name).await.map_err(|e| e.to_string())?;
            match v.status.as_ref().and_then(|s| s.phase.as_deref()) {
                Some(p) if p == phase => Ok(v),
                p => Err(format!("volume {name} is {p:?}, want {phase}")),
            }
        })
        .await
    }

    /// Events with `reason` about object `name` (in namespace `ns`, or anywhere).
    pub async fn events(&self, ns: Option<&str>, name: &str, reason: &str) -> Vec<Event> {
        let api: Api<Event> = match ns {
            Some(ns) => Api::namespaced(self.client.clone(), ns),
            None => Api::all(self.client.clone()),
        };
        api.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
            })
            .collect()
    }

    /// Waits for an event with `reason` about object `name`, returning its note.
    pub async fn wait_event(&self, ns: Option<&str>, name: &str, reason: &str) -> String {
        eventually(WAIT, || async {
            self.events(ns, name, reason)
                .await
                .first()
                .map(|e| e.note.clone().unwrap_or_default())
                .ok_or_else(|| format!("no {reason} event for {name} yet"))
        })
        .await
    }

    /// The sum over every series of the family `name` in this harness's registry.
    pub fn metric_sum(&self, name: &str) -> f64 {
        crate::scrape::parse(&self.metrics_text())
            .map(|m| m.sum(name))
            .unwrap_or(0.0)
    }

    /// Waits until the counter family `name` has grown past its value now: "the controller has
    /// looked again" (a resync, a retry), after which a "nothing happened" check means something.
    pub async fn until_counter_grows(&self, name: &str) {
        self.until_counter_grows_by(name, 1.0).await
    }

    /// Waits until the counter family `name` has grown by at least `n` from its value now.
    pub async fn until_counter_grows_by(&self, name: &str, n: f64) {
        let before = self.metric_sum(name);
        eventually(WAIT, || async {
            let now = self.metric_sum(name);
            if now >= before + n {
                Ok(())
            } else {
                Err(format!("{name} grew {} of {n}", now - before))
            }
        })
        .await
    }

    /// Waits until the gauge family `name` (summed over its series) reads `value`: an in-flight
    /// gauge back at 0 says every write started before has landed.
    pub async fn until_gauge_is(&self, name: &str, value: f64) {
        eventually(WAIT, || async {
            let now = self.metric_sum(name);
            if now == value {
                Ok(())
            } else {
                Err(format!("{name} is {now}, not {value}"))
            }
        })
        .await
    }

    pub fn metrics_text(&self) -> String {
        stowage_common::observe::metrics::encode(&self.registry)
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(c) = &self.controller {
            c.abort();
        }
    }
}
