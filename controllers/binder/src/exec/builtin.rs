//! The built-in driver's writes: provision a PV, create its image, and delete image and PV after
//! live reads (the cache may lag, and removing an image is final).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use kube::api::{DeleteParams, PostParams};
use kube::{Resource, ResourceExt};
use tokio::time::Instant;

use super::*;
use crate::core::{self};
use crate::loopdev;
use stowage_common::api::writes::is_not_found;
use stowage_common::errors::{ERROR, SUCCESS};
use stowage_common::observe::storageops::{Attempt, VOLUME_DELETE, VOLUME_PROVISION, csi_plugin};
use stowage_common::store::VolumeAttachment;

impl Executor {
    pub(crate) async fn provision(
        &self,
        snap: &Snapshot,
        done: &mut Outcome,
        claim: &str,
        class: &str,
        node: Option<&str>,
    ) -> Result<(), Error> {
        let Some(c) = Self::claim(snap, done, claim) else {
            return Ok(());
        };
        let Some(name) = loopdev::provisioned_name(&c) else {
            return Ok(());
        };
        if snap.pvs.contains_key(&name) {
            return Ok(()); // created already; its own sync creates the image
        }
        let Some(sc) = snap.classes.get(class) else {
            return Ok(());
        };
        let Some(pv) = loopdev::provisioned_pv(&c, sc, node) else {
            let note = "claim has no storage request; cannot provision".to_string();
            done.events
                .push(claim_event(c.object_ref(&()), true, "ProvisioningFailed", note));
            return Ok(());
        };
        self.count("provision_volume");
        match self.pvs.create(&PostParams::default(), &pv).await {
            Ok(created) => done.pvs.push(created),
            // Idempotent by name: an earlier attempt created it.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                if let Some(existing) = self.pvs.get_opt(&name).await? {
                    done.pvs.push(existing);
                }
            }
            Err(e) => {
                self.metrics.provisioning.with_label_values(&[ERROR]).inc();
                let note = format!("failed to create volume {name}: {e}");
                done.events
                    .push(claim_event(c.object_ref(&()), true, "ProvisioningFailed", note));
                return Err(Error::Api(e));
            }
        }
        Ok(())
    }

    pub(crate) async fn create_image(
        &self,
        snap: &Snapshot,
        done: &mut Outcome,
        pv: &str,
    ) -> Result<(), Error> {
        let Some(mut v) = Self::pv(snap, done, pv) else {
            return Ok(());
        };
        let claim = claim_of(&v);
        let handle = volume_handle(&v).unwrap_or_default().to_string();
        let capacity = pv_capacity(&v).unwrap_or(0);
        // KCM's `volume_provision`: one attempt at the storage itself (an in-tree plugin's
        // Provision); any return before the success below is a failed attempt.
        let attempt = Attempt::start(csi_plugin(LOOP_DRIVER), VOLUME_PROVISION);
        let store = self.images.clone();
        let h = handle.clone();
        let made = tokio::task::spawn_blocking(move || {
            // An image made in a directory that is not the store (an unmounted shared file
            // system's empty mount point) would hold the volume's data on the wrong disk. Read
            // uncached: a store unmounted since the last check must not get one (a deletion or
            // an attach in that window finds no image and re-reads the marker instead).
            let marker = store.ready_now()?;
            // A size no file offset can express is refused here, never rounded or truncated.
            let size = u64::try_from(capacity).map_err(|_| loopdev::ImageError::Io {
                path: store.dir().join(format!("{h}.img")),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{capacity} bytes is more than a file can hold"),
                ),
            });
            Ok(size
                .and_then(|size| store.ensure(&h, size))
                .map(|made| (made, marker.id)))
        })
        .await
        .unwrap_or_else(|e| {
            Ok(Err(loopdev::ImageError::Io {
                path: PathBuf::new(),
                source: std::io::Error::other(e),
            }))
        });
        self.metrics.image_store_ready.set(i64::from(made.is_ok()));
        let made = match made {
            Ok(made) => made,
            Err(e) => {
                self.metrics
                    .image_store_refusals
                    .with_label_values(&["create"])
                    .inc();
                if let Some(t) = claim {
                    let note = format!("not creating the image of volume {pv}: {e}; retrying");
                    done.events
                        .push(claim_event(t, true, core::IMAGE_STORE_NOT_READY, note));
                }
                return Err(Error::StoreNotReady(e));
            }
        };
        // Still image-pending until this is done, so the claim cannot bind to a volume that has
        // no file system yet.
        let mut store_id = String::new();
        let made = match made {
            Ok(((path, _), id)) => {
                store_id = id;
                match loopdev::formatted_at_creation(&v) {
                    true => {
                        stowage_loopdriver::image::format_new_image(
                            &path,
                            stowage_loopdriver::csi::caps::FS_TYPE,
                        )
                        .await
                    }
                    false => Ok(()),
                }
            }
            Err(e) => Err(e),
        };
        if let Err(e) = made {
            self.metrics.provisioning.with_label_values(&[ERROR]).inc();
            let msg = format!(
                "cannot create the {} image of volume {pv}: {e}",
                core::human(capacity)
            );
            if e.permanent() {
                // No retry can fix it: the volume ends Failed (still pending, so nothing binds
                // to it) and deletable; its claim reports the reason (`core::loop_refusal`).
                let next = core::with_pv_phase(&v, "Failed", &msg);
                done.pvs
                    .push(self.writes().replace_pv_status(&next, "volume_phase").await?);
                if let Some(t) = claim {
                    done.wake.push(Key::Claim(ref_key(&t)));
                }
                return Ok(());
            }
            if let Some(t) = claim {
                let note = format!("{msg}; retrying");
                done.events.push(claim_event(t, true, "ProvisioningFailed", note));
            }
            return Err(e.into());
        }
        v.annotations_mut().remove(ANN_IMAGE_PENDING);
        v.annotations_mut().insert(ANN_STORE_ID.into(), store_id);
        done.pvs
            .push(self.writes().replace_pv(&v, "provision_image").await?);
        attempt.succeeded();
        self.metrics.provisioning.with_label_values(&[SUCCESS]).inc();
        if let Some(t) = claim {
            let note = format!(
                "Successfully provisioned volume {pv} ({} image {handle}.img)",
                core::human(capacity)
            );
            done.wake.push(Key::Claim(ref_key(&t)));
            done.events
                .push(claim_event(t, false, "ProvisioningSucceeded", note));
        }
        Ok(())
    }

    /// Every built-in handle and the PVs naming it, and every PV a VolumeAttachment names with
    /// the nodes of those attachments, from live (paged) lists that started no earlier than
    /// `since`: the cache may lag a PV or an attachment just created, and removing an image is
    /// final. One pair of lists at a time, shared by every deletion that began before it started,
    /// so a burst of deletions costs a few lists, not one each.
    pub(crate) async fn live_handles(&self, since: Instant) -> Result<LiveHandles, Error> {
        let mut last = self.live.lock().await;
        if let Some(l) = last.as_ref()
            && l.started >= since
        {
            return Ok(l.clone());
        }
        let started = Instant::now();
        let mut by_handle: HashMap<String, Vec<String>> = HashMap::new();
        for_each_listed(&self.pvs, |p| {
            if let Some(h) = loop_handle(&p) {
                by_handle.entry(h.to_string()).or_default().push(p.name_any());
            }
        })
        .await?;
        let vas: kube::Api<VolumeAttachment> = kube::Api::all(self.client.clone());
        let mut attached: HashMap<String, Vec<String>> = HashMap::new();
        for_each_listed(&vas, |va| {
            if let Some(pv) = va.spec.source.persistent_volume_name {
                attached.entry(pv).or_default().push(va.spec.node_name);
            }
        })
        .await?;
        let live = LiveHandles {
            started,
            by_handle: Arc::new(by_handle),
            attached: Arc::new(attached),
        };
        *last = Some(live.clone());
        Ok(live)
    }

    pub(crate) async fn delete_volume(
        &self,
        snap: &Snapshot,
        done: &mut Outcome,
        pv: &str,
    ) -> Result<(), Error> {
        let since = Instant::now();
        if Self::pv(snap, done, pv).is_none() {
            return Ok(());
        }
        // Decide on the live object: what follows cannot be undone.
        let Some(mut v) = self.pvs.get_opt(pv).await? else {
            return Ok(());
        };
        if !core::deleter_wanted(&v) {
            return Ok(()); // its next sync says why and drops the finalizer
        }
        // A volume whose image is still pending was never handed to its claim: no data.
        if !has_ann(&v, ANN_IMAGE_PENDING) && self.claim_still_there(&v).await? {
            return Err(Error::StaleCache(format!("{:?}", claim_ref(&v))));
        }
        let handle = volume_handle(&v).unwrap_or_default().to_string();
        let live = self.live_handles(since).await?;
        // As external-provisioner: nothing is deleted while an attachment names the volume (a
        // node may still have the image behind a loop device and mounted). Retried with the
        // failure backoff; the attach/detach controller and the node's attacher remove it.
        let nodes = live.attached.get(pv).map(Vec::as_slice).unwrap_or_default();
        if let Some(note) = core::still_attached(pv, nodes) {
            done.events.push(volume_event(
                &v,
                true,
                core::DELETE_WAITS_FOR_DETACH,
                note.clone(),
            ));
            return Err(Error::InvalidState(note));
        }
        let sharing: Vec<String> = live
            .by_handle
            .get(&handle)
            .into_iter()
            .flatten()
            .filter(|n| *n != pv)
            .cloned()
            .collect();
        if !sharing.is_empty() {
            let note = format!(
                "image {handle}.img is also the volume of PersistentVolume(s) {}; it is kept, and deleted with this volume once no other PersistentVolume names it",
                sharing.join(", ")
            );
            done.events
                .push(volume_event(&v, true, core::DELETE_REFUSED, note));
            return Ok(());
        }
        if let Some(node) = loop_node(&v).map(str::to_string) {
            // Node-local: the node holding the image removes it, then the finalizer and the
            // object (the agent's `images` loop). This write is the decision, made on the live
            // object with every check above passed; the node acts on nothing less.
            if !has_ann(&v, ANN_DELETE_IMAGE) {
                v.annotations_mut().insert(ANN_DELETE_IMAGE.into(), "true".into());
                done.pvs
                    .push(self.writes().replace_pv(&v, "request_image_delete").await?);
                let note = format!("asked node {node} to delete the image {handle}.img of volume {pv}");
                done.events
                    .push(volume_event(&v, false, core::DELETE_REQUESTED, note));
            }
            return Ok(());
        }
        // KCM's `volume_delete`: one attempt from the image's removal to the object's.
        let attempt = Attempt::start(csi_plugin(LOOP_DRIVER), VOLUME_DELETE);
        let store = self.images.clone();
        let removed = tokio::task::spawn_blocking(move || {
            store.ready()?;
            let removed = store.remove(&handle);
            // "Already gone" from a store unmounted a moment ago is not gone: read the marker
            // again, uncached, before the volume object is deleted for it.
            if matches!(removed, Ok(false)) {
                store.ready_now()?;
            }
            Ok(removed)
        })
        .await
        .unwrap_or_else(|e| {
            Ok(Err(loopdev::ImageError::Io {
                path: PathBuf::new(),
                source: std::io::Error::other(e),
            }))
        });
        self.metrics.image_store_ready.set(i64::from(removed.is_ok()));
        let removed = match removed {
            Ok(r) => r,
            Err(e) => {
                // Not Failed, not deleted: the image may be on a store this node does not see.
                // Retried with the failure backoff until the marker is back.
                self.metrics
                    .image_store_refusals
                    .with_label_values(&["delete"])
                    .inc();
                let note = format!("not deleting the image of volume {pv}: {e}; retrying");
                done.events
                    .push(volume_event(&v, true, core::IMAGE_STORE_NOT_READY, note));
                return Err(Error::StoreNotReady(e));
            }
        };
        match removed {
            Ok(true) => {}
            Ok(false) => {
                let note = format!("image of volume {pv} was already gone; deleting the volume object");
                done.events
                    .push(volume_event(&v, false, "VolumeImageMissing", note));
            }
            Err(e) => {
                self.metrics.deletions.with_label_values(&[ERROR]).inc();
                let msg = format!("cannot delete the image of volume {pv}: {e}");
                // As upstream's updateVolumePhaseWithEvent: the Warning goes with the change to
                // Failed, not with every retry (the phase is in the object, so a restarted or
                // new leader stays quiet too); the retries are counted in the metrics.
                if pv_phase(&v) != "Failed" {
                    done.pvs.push(
                        self.writes()
                            .replace_pv_status(&core::with_pv_phase(&v, "Failed", &msg), "volume_phase")
                            .await?,
                    );
                    done.events
                        .push(volume_event(&v, true, "VolumeFailedDelete", msg));
                }
                return Err(e.into());
            }
        }
        if v.finalizers().iter().any(|f| f == FINALIZER_LOOP_DELETER) {
            v.finalizers_mut().retain(|f| f != FINALIZER_LOOP_DELETER);
            v = self.writes().replace_pv(&v, "deleter_finalizer").await?;
            done.pvs.push(v.clone());
        }
        self.count("delete_volume");
        match self.pvs.delete(pv, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(e.into()),
        }
        attempt.succeeded();
        self.metrics.deletions.with_label_values(&[SUCCESS]).inc();
        // The object may linger behind other finalizers (pv-protection); the watch reports it.
        Ok(())
    }
}

/// Hands every object of `api` to `f`, read live from the apiserver in pages of 500 (not from a
/// cache); a page is dropped before the next is read, so a large list is never held whole.
async fn for_each_listed<K>(api: &kube::Api<K>, mut f: impl FnMut(K)) -> Result<(), kube::Error>
where
    K: Clone + k8s_openapi::serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut lp = kube::api::ListParams::default().limit(500);
    loop {
        let page = api.list(&lp).await?;
        page.items.into_iter().for_each(&mut f);
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => lp = lp.continue_token(&c),
            None => return Ok(()),
        }
    }
}
