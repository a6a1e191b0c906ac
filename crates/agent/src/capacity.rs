//! Local mode: storage capacity tracking. This node's store is published as one
//! `CSIStorageCapacity` per storage class of the driver, for the topology segment of this node
//! (`TOPOLOGY_KEY=<node>`), so the scheduler places a WaitForFirstConsumer claim's pod only on a
//! node whose store can hold the volume (the CSIDriver says `storageCapacity: true`). What is
//! published is what the store can promise: the bytes its file system has available, less what
//! the existing sparse images may still take (`stowage_loopdriver::image::promisable`), as
//! `capacity` and as `maximumVolumeSize` (one volume is one file in that file system). It is
//! refreshed every `PERIOD` (from the store's file system; the apiserver is written only when the
//! value changed), at once after this node made or deleted an image, and when the classes or the
//! published objects change; external-provisioner's distributed capacity tracking publishes the same
//! objects for node-local drivers.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::storage::v1::{CSIStorageCapacity, StorageClass};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::reflector::Store;
use stowage_loopdriver::{DRIVER, TOPOLOGY_KEY};
use tokio::sync::{Notify, watch};

use crate::ctx::Ctx;

/// Labels of the objects this node publishes (external-provisioner's keys), so each agent lists
/// and replaces only its own.
pub const DRIVER_LABEL: &str = "csi.storage.k8s.io/drivername";
pub const MANAGED_BY_LABEL: &str = "csi.storage.k8s.io/managed-by";
pub const MANAGED_BY: &str = "stowage-agent";

const PERIOD: Duration = Duration::from_secs(10);

/// The name of this node's object for `class`: stable across restarts (so an agent replaces its
/// own), short whatever the names' lengths (FNV-1a of both).
pub fn object_name(node: &str, class: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node.bytes().chain([0]).chain(class.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("csisc-loop-{h:016x}")
}

/// The objects this node should publish: one per class of the driver, `bytes` each.
pub fn desired(
    node: &str,
    namespace: &str,
    classes: &[Arc<StorageClass>],
    bytes: u64,
    owner: Option<&OwnerReference>,
) -> BTreeMap<String, CSIStorageCapacity> {
    classes
        .iter()
        .filter(|c| c.provisioner == DRIVER)
        .map(|c| {
            let class = c.name_any();
            let name = object_name(node, &class);
            let q = Quantity(bytes.to_string());
            let obj = CSIStorageCapacity {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(namespace.into()),
                    labels: Some(labels(node)),
                    owner_references: owner.map(|o| vec![o.clone()]),
                    ..Default::default()
                },
                storage_class_name: class,
                node_topology: Some(LabelSelector {
                    match_labels: Some(BTreeMap::from([(TOPOLOGY_KEY.to_string(), node.to_string())])),
                    ..Default::default()
                }),
                capacity: Some(q.clone()),
                maximum_volume_size: Some(q),
            };
            (name, obj)
        })
        .collect()
}

fn labels(node: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (DRIVER_LABEL.to_string(), DRIVER.to_string()),
        (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
        (TOPOLOGY_KEY.to_string(), node.to_string()),
    ])
}

/// What to write so the published objects are the desired ones.
#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    pub create: Vec<CSIStorageCapacity>,
    /// Desired objects with the existing object's resourceVersion (a guarded replace).
    pub replace: Vec<CSIStorageCapacity>,
    pub delete: Vec<String>,
}

pub fn plan(existing: &[CSIStorageCapacity], mut want: BTreeMap<String, CSIStorageCapacity>) -> Plan {
    let mut p = Plan::default();
    let mut seen = BTreeSet::new();
    for e in existing {
        let name = e.name_any();
        seen.insert(name.clone());
        match want.remove(&name) {
            // A class no longer there (or renamed): its object goes.
            None => p.delete.push(name),
            Some(mut w) => {
                let same = e.capacity == w.capacity
                    && e.maximum_volume_size == w.maximum_volume_size
                    && e.storage_class_name == w.storage_class_name
                    && e.node_topology == w.node_topology
                    && e.metadata.owner_references == w.metadata.owner_references;
                if !same {
                    w.metadata.resource_version = e.metadata.resource_version.clone();
                    p.replace.push(w);
                }
            }
        }
    }
    p.create = want
        .into_values()
        .filter(|w| !seen.contains(&w.name_any()))
        .collect();
    p
}

/// The agent's DaemonSet, from its own pod's controller reference: the owner of what it publishes,
/// so uninstalling the chart removes the objects with it.
fn owner(pods: &Store<Pod>, namespace: &str) -> Option<OwnerReference> {
    let name = std::env::var("POD_NAME").ok()?;
    let pod = pods.get(&kube::runtime::reflector::ObjectRef::new(&name).within(namespace))?;
    pod.owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .map(|o| OwnerReference {
            block_owner_deletion: None,
            ..o.clone()
        })
}

/// The label selector of this node's own objects (what its watch and its plan cover).
pub fn selector(node: &str) -> String {
    format!("{MANAGED_BY_LABEL}={MANAGED_BY},{TOPOLOGY_KEY}={node}")
}

/// Publishes this node's capacity. `objects` is a watch of this node's own objects
/// ([`selector`]), so a pass reads no list from the apiserver: it writes only what differs, and a
/// change someone else made (an object deleted by hand) wakes it through `nudge` as well.
pub async fn run(
    ctx: Arc<Ctx>,
    namespace: String,
    classes: Store<StorageClass>,
    objects: Store<CSIStorageCapacity>,
    nudge: Arc<Notify>,
    mut stop: watch::Receiver<bool>,
) {
    let api: Api<CSIStorageCapacity> = Api::namespaced(ctx.client.clone(), &namespace);
    let mut last_error = false;
    loop {
        let started = std::time::Instant::now();
        match publish(&ctx, &api, &namespace, &classes, &objects).await {
            Ok(wrote) => {
                if last_error {
                    tracing::info!("storage capacity published again");
                }
                last_error = false;
                if wrote {
                    ctx.metrics.record("publish_capacity", started, true);
                }
            }
            Err(e) => {
                // Logged once per failing spell; the next pass retries.
                if !last_error {
                    tracing::warn!(error = %e, "cannot publish this node's storage capacity; retrying");
                }
                last_error = true;
                ctx.metrics.record("publish_capacity", started, false);
            }
        }
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            _ = nudge.notified() => {}
            _ = tokio::time::sleep(PERIOD) => {}
        }
    }
}

/// One pass; whether it wrote anything.
async fn publish(
    ctx: &Ctx,
    api: &Api<CSIStorageCapacity>,
    namespace: &str,
    classes: &Store<StorageClass>,
    objects: &Store<CSIStorageCapacity>,
) -> anyhow::Result<bool> {
    let store = ctx.images.clone();
    let unwritten = tokio::task::spawn_blocking(move || store.unwritten()).await??;
    let usage = stowage_loopdriver::sys::statvfs(ctx.images.dir())
        .await?
        .ok_or_else(|| anyhow::anyhow!("the image store did not answer statvfs"))?;
    let bytes = stowage_loopdriver::image::promisable(usage.bytes_available, unwritten);
    let want = desired(
        &ctx.node,
        namespace,
        &classes.state(),
        bytes,
        owner(ctx.pods.store(), namespace).as_ref(),
    );
    let existing: Vec<CSIStorageCapacity> = objects.state().iter().map(|o| (**o).clone()).collect();
    let p = plan(&existing, want);
    for o in &p.create {
        match api.create(&PostParams::default(), o).await {
            Ok(_) => {}
            // Made by an earlier pass whose answer was lost: the next pass replaces it.
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    for o in &p.replace {
        match api.replace(&o.name_any(), &PostParams::default(), o).await {
            Ok(_) => {}
            // The watch had not yet shown this node's previous write; its event wakes the next
            // pass, which replaces the object as it is now.
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    for name in &p.delete {
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    let wrote = !(p.create.is_empty() && p.replace.is_empty() && p.delete.is_empty());
    if wrote {
        tracing::debug!(
            bytes,
            created = p.create.len(),
            replaced = p.replace.len(),
            deleted = p.delete.len(),
            "storage capacity published"
        );
    }
    Ok(wrote)
}

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_testkit::builders::storage_class;

    fn classes() -> Vec<Arc<StorageClass>> {
        vec![
            Arc::new(storage_class("loop", DRIVER).build()),
            Arc::new(storage_class("fast", DRIVER).build()),
            Arc::new(storage_class("other", "example.com/csi").build()),
        ]
    }

    #[test]
    fn one_object_per_class_of_the_driver_for_this_nodes_segment() {
        let want = desired("node-a", "ns", &classes(), 5 << 30, None);
        assert_eq!(want.len(), 2, "not for another driver's class");
        let o = &want[&object_name("node-a", "loop")];
        assert_eq!(o.storage_class_name, "loop");
        assert_eq!(o.capacity, Some(Quantity((5u64 << 30).to_string())));
        assert_eq!(o.maximum_volume_size, o.capacity);
        assert_eq!(
            o.node_topology.as_ref().unwrap().match_labels.as_ref().unwrap()[TOPOLOGY_KEY],
            "node-a"
        );
        assert_ne!(object_name("node-a", "loop"), object_name("node-b", "loop"));
        assert_ne!(
            object_name("a", "bc"),
            object_name("ab", "c"),
            "the names are separated"
        );
        assert!(object_name(&"n".repeat(253), &"c".repeat(253)).len() < 64);
    }

    #[test]
    fn the_plan_creates_replaces_changed_and_deletes_what_no_class_wants() {
        let now = desired("node-a", "ns", &classes(), 100, None);
        let p = plan(&[], now.clone());
        assert_eq!(p.create.len(), 2);
        let mut existing: Vec<CSIStorageCapacity> = now.values().cloned().collect();
        for e in &mut existing {
            e.metadata.resource_version = Some("7".into());
        }
        assert_eq!(
            plan(&existing, now.clone()),
            Plan::default(),
            "nothing changed, nothing written"
        );
        let grown = desired("node-a", "ns", &classes(), 50, None);
        let p = plan(&existing, grown);
        assert_eq!(p.replace.len(), 2);
        assert!(
            p.replace
                .iter()
                .all(|r| r.metadata.resource_version.as_deref() == Some("7"))
        );
        let fewer = desired("node-a", "ns", &classes()[..1], 100, None);
        let p = plan(&existing, fewer);
        assert_eq!(p.delete, vec![object_name("node-a", "fast")]);
        assert!(p.create.is_empty() && p.replace.is_empty());
    }
}
