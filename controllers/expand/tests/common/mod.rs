//! The expand controller in-process against its own real control plane. Claims are bound by
//! hand (PV and claim pre-bound, phases set through the status subresource), as the binder
//! would leave them; the node half is played through the API the way the kubelet does.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use stowage_testkit::builders::{pv, pvc};
pub use stowage_testkit::inproc::WAIT;
use stowage_testkit::{InProcess, eventually};

stowage_testkit::in_process_harness!(
    /// The expand controller in-process; everything generic comes from `InProcess` (by deref).
    Harness
);

impl Harness {
    /// A control plane with the controller not yet running.
    pub async fn new() -> Self {
        Self(InProcess::new().await)
    }

    pub async fn start() -> Self {
        let mut h = Self::new().await;
        h.run_controller().await;
        h
    }

    pub async fn run_controller(&mut self) {
        let cluster = self.cluster().await;
        let metrics = stowage_expand::Metrics::new(&self.registry);
        let config = stowage_expand::Config {
            image_dir: self.images.path().to_path_buf(),
            resync: Duration::from_secs(10),
            max_in_flight: 10,
        };
        self.run(stowage_expand::run(cluster, metrics, config));
    }

    pub fn classes(&self) -> Api<StorageClass> {
        Api::all(self.client.clone())
    }

    pub fn image(&self, handle: &str) -> PathBuf {
        self.images.path().join(format!("{handle}.img"))
    }

    pub fn image_size(&self, handle: &str) -> u64 {
        std::fs::metadata(self.image(handle)).unwrap().len()
    }

    /// A claim bound to a volume of `driver` (handle = PV name) of `size`, as the binder leaves
    /// them: both pre-bound, PV Bound, claim Bound with its capacity. Loop volumes get their
    /// image file.
    pub async fn bound(
        &self,
        ns: &str,
        name: &str,
        class: &str,
        size: &str,
        driver: &str,
        block: bool,
    ) -> String {
        let pv_name = format!("pv-{name}");
        let mut c = pvc(ns, name).request(size).class(class).volume_name(&pv_name);
        if block {
            c = c.block();
        }
        let c = self
            .pvcs(ns)
            .create(&PostParams::default(), &c.build())
            .await
            .unwrap();
        let mut v = pv(&pv_name)
            .capacity(size)
            .class(class)
            .driver(driver, &pv_name)
            .claim_ref(ns, name, c.metadata.uid.as_deref().unwrap());
        if block {
            v = v.block();
        }
        let mut v = self
            .pvs()
            .create(&PostParams::default(), &v.build())
            .await
            .unwrap();
        v.status.get_or_insert_with(Default::default).phase = Some("Bound".into());
        self.pvs()
            .replace_status(&pv_name, &PostParams::default(), &v)
            .await
            .unwrap();
        let mut c = c;
        let st = c.status.get_or_insert_with(Default::default);
        st.phase = Some("Bound".into());
        st.access_modes = Some(vec!["ReadWriteOnce".into()]);
        st.capacity = Some(
            [(
                "storage".to_string(),
                k8s_openapi::apimachinery::pkg::api::resource::Quantity(size.into()),
            )]
            .into(),
        );
        self.pvcs(ns)
            .replace_status(name, &PostParams::default(), &c)
            .await
            .unwrap();
        if driver == "loop.stowage.dev" {
            let bytes = stowage_common::store::quantity::bytes(size).unwrap() as u64;
            stowage_loopdriver::ImageStore::new(self.images.path())
                .ensure(&pv_name, bytes)
                .unwrap();
        }
        pv_name
    }

    /// What a user does: `kubectl patch pvc … spec.resources.requests.storage`, once.
    pub async fn try_request(&self, ns: &str, name: &str, size: &str) -> Result<(), kube::Error> {
        let patch = serde_json::json!({"spec": {"resources": {"requests": {"storage": size}}}});
        self.pvcs(ns)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
    }

    /// A request the class allows. The apiserver's PersistentVolumeClaimResize admission reads
    /// classes from its own informer, which may not have seen a class just created or just
    /// patched to allow expansion yet; its 403 is retried, any other error fails the test.
    pub async fn request(&self, ns: &str, name: &str, size: &str) {
        eventually(WAIT, || async {
            match self.try_request(ns, name, size).await {
                Ok(()) => Ok(()),
                Err(kube::Error::Api(s)) if s.code == 403 => Err(format!("admission lags: {}", s.message)),
                Err(e) => panic!("resize {ns}/{name} to {size}: {e}"),
            }
        })
        .await
    }

    /// Plays the node's part once the controller's is done, as the kubelet would: capacity =
    /// allocation, the storage status entry and the resize conditions gone (resourceVersion
    /// checked, so a concurrent change wins and we try again).
    pub async fn node_finishes(&self, ns: &str, name: &str) -> PersistentVolumeClaim {
        let api = self.pvcs(ns);
        eventually(WAIT, || async {
            let c = api.get_status(name).await.map_err(|e| e.to_string())?;
            let st = c.status.clone().unwrap_or_default();
            let pending = st
                .allocated_resource_statuses
                .as_ref()
                .and_then(|m| m.get("storage"))
                .is_some_and(|s| s == "NodeResizePending");
            if !pending {
                return Err(format!("claim {ns}/{name} not NodeResizePending yet: {st:?}"));
            }
            let size = st.allocated_resources.as_ref().unwrap()["storage"].0.clone();
            let conds: Vec<_> = st
                .conditions
                .unwrap_or_default()
                .into_iter()
                .filter(|c| {
                    !["FileSystemResizePending", "Resizing", "NodeResizeError"].contains(&c.type_.as_str())
                })
                .collect();
            let patch = serde_json::json!({
                "metadata": {"resourceVersion": c.metadata.resource_version},
                "status": {
                    "capacity": {"storage": size},
                    "allocatedResourceStatuses": {"storage": null},
                    "conditions": conds,
                }
            });
            api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(|e| e.to_string())
        })
        .await
    }

    pub async fn events(&self, ns: &str, name: &str, reason: &str) -> Vec<Event> {
        self.0.events(Some(ns), name, reason).await
    }

    /// Waits for an event with `reason` about claim `name`, returning its note.
    pub async fn event(&self, ns: &str, name: &str, reason: &str) -> String {
        self.wait_event(Some(ns), name, reason).await
    }
}

pub fn status_entry(c: &PersistentVolumeClaim) -> Option<String> {
    c.status
        .as_ref()?
        .allocated_resource_statuses
        .as_ref()?
        .get("storage")
        .cloned()
}

pub fn allocated(c: &PersistentVolumeClaim) -> Option<String> {
    Some(
        c.status
            .as_ref()?
            .allocated_resources
            .as_ref()?
            .get("storage")?
            .0
            .clone(),
    )
}

pub fn capacity(c: &PersistentVolumeClaim) -> Option<String> {
    Some(c.status.as_ref()?.capacity.as_ref()?.get("storage")?.0.clone())
}

pub fn conditions(c: &PersistentVolumeClaim) -> Vec<String> {
    c.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .map(|cs| {
            cs.iter()
                .filter(|c| c.status == "True")
                .map(|c| c.type_.clone())
                .collect()
        })
        .unwrap_or_default()
}

pub fn pv_capacity(v: &PersistentVolume) -> String {
    v.spec.as_ref().unwrap().capacity.as_ref().unwrap()["storage"]
        .0
        .clone()
}

/// Makes a file immutable (even root cannot write it) until dropped, so a test that panics
/// leaves nothing immutable behind.
pub struct Immutable(PathBuf);

impl Immutable {
    pub fn set(path: &Path) -> Self {
        chattr("+i", path);
        Self(path.to_path_buf())
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        chattr("-i", &self.0);
    }
}

fn chattr(flag: &str, path: &Path) {
    let st = std::process::Command::new("chattr")
        .arg(flag)
        .arg(path)
        .status()
        .expect("chattr");
    assert!(st.success(), "chattr {flag} {}", path.display());
}

pub fn anns(o: &impl ResourceExt) -> std::collections::BTreeMap<String, String> {
    o.annotations().clone()
}
