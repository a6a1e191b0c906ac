//! Creating the workloads' objects fast (unlimited client, many requests in flight) and removing
//! them completely between runs, so no run sees another run's objects in its caches.

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{CSIDriver, StorageClass, VolumeAttachment};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use stowage_testkit::builders;

/// Every object a run creates carries this label with the run's id.
pub const RUN_LABEL: &str = "bench.stowage.dev/run";

#[derive(Clone)]
pub struct Objects {
    pub client: Client,
    pub concurrency: usize,
    /// Write requests the bench itself sent inside a measured window (subtracted from the
    /// apiserver's count so only the controller's writes remain).
    pub own_writes: Arc<AtomicU64>,
}

pub fn label<K: Resource>(mut o: K, run: &str) -> K {
    o.meta_mut()
        .labels
        .get_or_insert_with(Default::default)
        .insert(RUN_LABEL.into(), run.into());
    o
}

/// Names of a run's objects, shared by the workloads that create them and the floor that pairs
/// them: object `i` is `claim-<i>` / `pod-<i>` and its volume `<run>-pv-<i>`; the warm-up
/// object's index is `warm`.
pub fn pv_name(run: &str, i: usize) -> String {
    format!("{run}-pv-{i:05}")
}

pub fn claim_name(i: usize) -> String {
    format!("claim-{i:05}")
}

pub fn pod_name(i: usize) -> String {
    format!("pod-{i:05}")
}

/// The attachable CSI driver of an attach run.
pub fn attach_driver(run: &str) -> String {
    format!("{run}.attach.bench.stowage.dev")
}

/// The volume made for claim or pod `name` (`claim-00012`, `pod-00012`, `warm`, `pod-warm`):
/// pairing by index name, so the floor needs no matching logic.
pub fn paired_volume(run: &str, name: &str) -> String {
    let index = name
        .strip_prefix("claim-")
        .or_else(|| name.strip_prefix("pod-"))
        .unwrap_or(name);
    format!("{run}-pv-{index}")
}

fn already_exists(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// One pre-bound PV/PVC pair.
pub struct Pair {
    pub pv: String,
    pub claim: String,
}

/// `n` pairs named by index, plus the warm-up pair.
pub fn pairs(
    n: usize,
    pv: impl Fn(usize) -> String,
    claim: impl Fn(usize) -> String,
    warm_pv: &str,
    warm_claim: &str,
) -> Vec<Pair> {
    (0..n)
        .map(|i| Pair {
            pv: pv(i),
            claim: claim(i),
        })
        .chain([Pair {
            pv: warm_pv.into(),
            claim: warm_claim.into(),
        }])
        .collect()
}

impl Objects {
    pub fn count_own_write(&self) {
        self.own_writes.fetch_add(1, Ordering::Relaxed);
    }

    /// Creates every object, `concurrency` at a time (an object left by an earlier try is fine).
    pub async fn create_all<K>(&self, api: &Api<K>, objs: Vec<K>) -> anyhow::Result<()>
    where
        K: Resource + Clone + Serialize + DeserializeOwned + Debug,
    {
        futures::stream::iter(objs)
            .map(|o| async move {
                match api.create(&PostParams::default(), &o).await {
                    Err(e) if !already_exists(&e) => Err(e).context(format!("create {}", o.name_any())),
                    _ => Ok(()),
                }
            })
            .buffer_unordered(self.concurrency)
            .try_for_each(|()| async { Ok(()) })
            .await
    }

    /// A namespace with its `default` ServiceAccount (pod admission needs it).
    pub async fn namespace(&self, ns: &str, run: &str) -> anyhow::Result<()> {
        let (n, sa) = builders::namespace(ns);
        self.create_all(&Api::all(self.client.clone()), vec![label(n, run)])
            .await?;
        self.create_all(&Api::namespaced(self.client.clone(), ns), vec![sa])
            .await
    }

    /// Creates the volumes and marks them Available, as volumes in a running cluster already are,
    /// so the measured window holds only the binding.
    pub async fn available_pvs(&self, pvs: Vec<PersistentVolume>) -> anyhow::Result<()> {
        let api: Api<PersistentVolume> = Api::all(self.client.clone());
        let names: Vec<String> = pvs.iter().map(|p| p.name_any()).collect();
        self.create_all(&api, pvs).await?;
        let status = json!({"status": {"phase": "Available"}});
        futures::stream::iter(names)
            .map(|n| {
                let (api, status) = (&api, &status);
                async move {
                    api.patch_status(&n, &PatchParams::default(), &Patch::Merge(status))
                        .await
                        .with_context(|| format!("mark {n} Available"))
                        .map(|_| ())
                }
            })
            .buffer_unordered(self.concurrency)
            .try_for_each(|()| async { Ok(()) })
            .await
    }

    /// PV/PVC pairs already bound to each other, status included, as the binder leaves them:
    /// the claim first (its UID goes into the volume's claimRef), then the volume, then both
    /// statuses.
    pub async fn bound_pairs(
        &self,
        ns: &str,
        run: &str,
        pairs: Vec<Pair>,
        class: &str,
        driver: &str,
        capacity: &str,
    ) -> anyhow::Result<()> {
        let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
        let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), ns);
        futures::stream::iter(pairs)
            .map(|p| {
                let (pvs, pvcs) = (&pvs, &pvcs);
                async move {
                    let claim = builders::pvc(ns, &p.claim)
                        .request(capacity)
                        .class(class)
                        .volume_name(&p.pv)
                        .annotation("pv.kubernetes.io/bind-completed", "yes")
                        .build();
                    let claim = pvcs
                        .create(&PostParams::default(), &label(claim, run))
                        .await
                        .with_context(|| format!("create claim {}", p.claim))?;
                    let pv = builders::pv(&p.pv)
                        .capacity(capacity)
                        .class(class)
                        .driver(driver, &p.pv)
                        .claim_ref(ns, &p.claim, &claim.uid().unwrap_or_default())
                        .annotation("pv.kubernetes.io/bound-by-controller", "yes")
                        .build();
                    pvs.create(&PostParams::default(), &label(pv, run))
                        .await
                        .with_context(|| format!("create volume {}", p.pv))?;
                    let pp = PatchParams::default();
                    pvs.patch_status(&p.pv, &pp, &Patch::Merge(json!({"status": {"phase": "Bound"}})))
                        .await
                        .with_context(|| format!("volume {} status", p.pv))?;
                    let st = json!({"status": {"phase": "Bound", "accessModes": ["ReadWriteOnce"],
                        "capacity": {"storage": capacity}}});
                    pvcs.patch_status(&p.claim, &pp, &Patch::Merge(st))
                        .await
                        .with_context(|| format!("claim {} status", p.claim))?;
                    anyhow::Ok(())
                }
            })
            .buffer_unordered(self.concurrency)
            .try_for_each(|()| async { Ok(()) })
            .await
    }

    /// Ready nodes whose volumes the attach/detach controller manages.
    pub async fn nodes(&self, names: &[String], run: &str) -> anyhow::Result<()> {
        let api: Api<Node> = Api::all(self.client.clone());
        let nodes = names
            .iter()
            .map(|n| label(builders::node(n).controller_attach().build(), run))
            .collect();
        self.create_all(&api, nodes).await?;
        let status = json!({"status": {"conditions": [{"type": "Ready", "status": "True",
            "reason": "KubeletReady", "message": "bench node"}]}});
        for n in names {
            api.patch_status(n, &PatchParams::default(), &Patch::Merge(&status))
                .await
                .with_context(|| format!("node {n} status"))?;
        }
        Ok(())
    }

    /// Removes everything of run `run`: finalizers dropped (no protection controller runs between
    /// runs), pods force-deleted (no kubelet confirms), then waits until the lists are empty.
    pub async fn cleanup(&self, run: &str, ns: &str, pv_prefix: &str) -> anyhow::Result<()> {
        let c = &self.client;
        let by_label = ListParams::default().labels(&format!("{RUN_LABEL}={run}"));
        self.delete_matching(Api::<Pod>::namespaced(c.clone(), ns), &by_label, |_| true)
            .await?;
        // Attachments are the controllers' objects, without our label: match their volume.
        self.delete_matching(
            Api::<VolumeAttachment>::all(c.clone()),
            &ListParams::default(),
            |va| {
                va.spec
                    .source
                    .persistent_volume_name
                    .as_deref()
                    .is_some_and(|p| p.starts_with(pv_prefix))
            },
        )
        .await?;
        self.delete_matching(
            Api::<PersistentVolumeClaim>::namespaced(c.clone(), ns),
            &by_label,
            |_| true,
        )
        .await?;
        self.delete_matching(Api::<PersistentVolume>::all(c.clone()), &by_label, |_| true)
            .await?;
        self.delete_matching(Api::<Node>::all(c.clone()), &by_label, |_| true)
            .await?;
        self.delete_matching(Api::<CSIDriver>::all(c.clone()), &by_label, |_| true)
            .await?;
        self.delete_matching(Api::<StorageClass>::all(c.clone()), &by_label, |_| true)
            .await
        // The namespace stays (no namespace controller runs to finish its deletion); it is empty.
    }

    async fn delete_matching<K>(
        &self,
        api: Api<K>,
        lp: &ListParams,
        keep: impl Fn(&K) -> bool,
    ) -> anyhow::Result<()>
    where
        K: Resource + Clone + DeserializeOwned + Debug,
    {
        let deadline = Instant::now() + Duration::from_secs(300);
        let drop_finalizers = json!({"metadata": {"finalizers": null}});
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        };
        loop {
            let left: Vec<K> = api
                .list(lp)
                .await?
                .items
                .into_iter()
                .filter(|o| keep(o))
                .collect();
            if left.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{} objects still present after cleanup", left.len());
            }
            futures::stream::iter(left)
                .for_each_concurrent(self.concurrency, |o| {
                    let (api, drop_finalizers, dp) = (&api, &drop_finalizers, &dp);
                    async move {
                        let name = o.name_any();
                        // Errors (already gone, a race) are fine: the next list decides.
                        if !o.finalizers().is_empty() {
                            let _ = api
                                .patch(&name, &PatchParams::default(), &Patch::Merge(drop_finalizers))
                                .await;
                        }
                        if o.meta().deletion_timestamp.is_none() || o.finalizers().is_empty() {
                            let _ = api.delete(&name, dp).await;
                        }
                    }
                })
                .await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

/// A pod on `node` using `claim`.
pub fn pod(ns: &str, name: &str, claim: &str, node: &str, run: &str) -> Pod {
    label(
        builders::pod(ns, name).claim("data", claim).node(node).build(),
        run,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_pairs_objects_with_the_volumes_made_for_them() {
        assert_eq!(paired_volume("b1", &claim_name(12)), pv_name("b1", 12));
        assert_eq!(paired_volume("b1", &pod_name(7)), pv_name("b1", 7));
        assert_eq!(paired_volume("b1", "warm"), "b1-pv-warm");
        assert_eq!(paired_volume("b1", "pod-warm"), "b1-pv-warm");
    }
}
