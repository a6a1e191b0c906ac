//! The `Executor`: runs the API writes (and image steps) of one sync's actions inside the shared
//! in-flight window, starting from a snapshot of the cache and recording what it wrote in the
//! batch's `Outcome`. The built-in driver's steps are in `exec/builtin.rs`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::{Api, Client, Resource, ResourceExt};
use stowage_common::observe::events::{Events, Occurrence, Repeat};
use tokio::time::Instant;

use crate::core::{self, Action, Cache, Event, Target};
use crate::error::Error;
use crate::key::{Key, subject};
use crate::loopdev;
use crate::metrics::Metrics;
use crate::pv::*;
use stowage_common::api::writes::Writes;

/// What a batch of writes reports back.
pub(crate) struct Outcome {
    pub(crate) reserved: Option<String>,
    pub(crate) pvs: Vec<PersistentVolume>,
    pub(crate) claims: Vec<PersistentVolumeClaim>,
    /// Objects the batch deleted.
    pub(crate) deleted_pvs: Vec<String>,
    pub(crate) wake: Vec<Key>,
    /// Events the writes produced, with the object they are about (it may be gone from the
    /// cache by the time they land); the decision task sends each once per change of its text.
    pub(crate) events: Vec<(Event, ObjectReference)>,
    pub(crate) error: Option<Error>,
}

impl Outcome {
    /// Nothing written yet (`reserved`: the volume its bind reserved).
    pub(crate) fn empty(reserved: Option<String>) -> Self {
        Self {
            reserved,
            pvs: vec![],
            claims: vec![],
            deleted_pvs: vec![],
            wake: vec![],
            events: vec![],
            error: None,
        }
    }
}

/// Everything a write task needs. Shared behind one `Arc` (`Controller::executor`): kube's `Api`
/// carries its resource's names and path as owned strings, and a client handle allocates when
/// cloned, so a copy per write task cost a dozen allocations.
pub(crate) struct Executor {
    pub(crate) client: Client,
    pub(crate) pvs: Api<PersistentVolume>,
    pub(crate) events: Events,
    pub(crate) metrics: Metrics,
    /// The image store, its marker check cached across write tasks (shared mode only: in local
    /// mode each node's agent reaches its own).
    pub(crate) images: loopdev::ImageStore,
    pub(crate) store_mode: stowage_loopdriver::StoreMode,
    /// The newest live lists of built-in handles and of attachments (see `live_handles`).
    pub(crate) live: tokio::sync::Mutex<Option<LiveHandles>>,
    /// A periodic marker check is running (a hung store must not pile them up).
    pub(crate) store_check: Arc<std::sync::atomic::AtomicBool>,
    /// When each claim's provisioning and each volume's deletion began, for KCM's end-to-end
    /// `volume_operation_total_seconds` (kept for the leadership term, as KCM keeps its own).
    pub(crate) timestamps: stowage_common::observe::storageops::Timestamps,
}

/// Built-in handle → PV names, and PV name → nodes of the VolumeAttachments naming it, from live
/// lists started at `started`.
#[derive(Clone)]
pub(crate) struct LiveHandles {
    pub(crate) started: Instant,
    pub(crate) by_handle: Arc<HashMap<String, Vec<String>>>,
    pub(crate) attached: Arc<HashMap<String, Vec<String>>>,
}

/// Applies an `Action::Annotate` to an object's metadata.
pub(crate) fn edit_metadata<K: ResourceExt>(
    o: &mut K,
    set: &BTreeMap<String, String>,
    remove: &[String],
    drop: &[String],
    add: &[String],
) {
    let anns = o.annotations_mut();
    for k in remove {
        anns.remove(k);
    }
    anns.extend(set.iter().map(|(k, v)| (k.clone(), v.clone())));
    let fins = o.finalizers_mut();
    fins.retain(|f| !drop.contains(f));
    for f in add {
        if !fins.contains(f) {
            fins.push(f.clone());
        }
    }
}

/// An event about the claim `reference` names.
pub(crate) fn claim_event(
    reference: ObjectReference,
    warning: bool,
    reason: &'static str,
    note: String,
) -> (Event, ObjectReference) {
    let e = Event {
        target: Target::Claim(ref_key(&reference)),
        warning,
        reason,
        note,
    };
    (e, reference)
}

/// The cache key (namespace/name) of the claim `r` names.
pub(crate) fn ref_key(r: &ObjectReference) -> String {
    format!(
        "{}/{}",
        r.namespace.as_deref().unwrap_or(""),
        r.name.as_deref().unwrap_or("")
    )
}

/// An event about volume `pv`.
pub(crate) fn volume_event(
    pv: &PersistentVolume,
    warning: bool,
    reason: &'static str,
    note: String,
) -> (Event, ObjectReference) {
    let e = Event {
        target: Target::Volume(pv.name_any()),
        warning,
        reason,
        note,
    };
    (e, pv.object_ref(&()))
}

/// A reference to the claim a volume's claimRef names.
pub(crate) fn claim_of(pv: &PersistentVolume) -> Option<ObjectReference> {
    claim_ref(pv).map(|(ns, n, uid)| ObjectReference {
        kind: Some("PersistentVolumeClaim".into()),
        api_version: Some("v1".into()),
        namespace: Some(ns.into()),
        name: Some(n.into()),
        uid: (!uid.is_empty()).then(|| uid.into()),
        ..Default::default()
    })
}

/// The last copy of object `key` written in this batch, else the one the batch started from.
pub(crate) fn newest<K: Clone>(
    written: &[K],
    start: &HashMap<String, Arc<K>>,
    key: &str,
    key_of: impl Fn(&K) -> String,
) -> Option<K> {
    written
        .iter()
        .rev()
        .find(|o| key_of(o) == key)
        .cloned()
        .or_else(|| start.get(key).map(|o| (**o).clone()))
}

/// The objects the writes of one sync start from (as the cache had them).
pub(crate) struct Snapshot {
    pub(crate) pvs: HashMap<String, Arc<PersistentVolume>>,
    pub(crate) claims: HashMap<String, Arc<PersistentVolumeClaim>>,
    pub(crate) classes: HashMap<String, Arc<StorageClass>>,
}

impl Snapshot {
    pub(crate) fn of(cache: &Cache, writes: &[Action]) -> Self {
        let mut s = Snapshot {
            pvs: HashMap::new(),
            claims: HashMap::new(),
            classes: HashMap::new(),
        };
        let mut pv = |n: &str| {
            if let Some(p) = cache.decode_pv(n) {
                s.pvs.insert(n.to_string(), p);
            }
        };
        let mut claim_names = Vec::new();
        for w in writes {
            match w {
                Action::Bind { pv: p, claim } => {
                    pv(p);
                    claim_names.push(claim.clone());
                }
                Action::VolumePhase { pv: p, .. }
                | Action::Release { pv: p }
                | Action::Unbind { pv: p }
                | Action::CreateLoopImage { pv: p }
                | Action::DeleteLoopVolume { pv: p }
                | Action::SetDeleterFinalizer { pv: p, .. } => pv(p),
                Action::ClaimPhase { claim, .. }
                | Action::ClaimCondition { claim, .. }
                | Action::SetProvisioner { claim, .. }
                | Action::SetDefaultClass { claim, .. }
                | Action::ProvisionLoop { claim, .. } => claim_names.push(claim.clone()),
                Action::Annotate {
                    target: Target::Volume(p),
                    ..
                } => pv(p),
                Action::Annotate {
                    target: Target::Claim(claim),
                    ..
                } => claim_names.push(claim.clone()),
                Action::WakeClaim(_) | Action::Event(_) | Action::RetryLater { .. } => {}
            }
        }
        for c in claim_names {
            if let Some(obj) = cache.decode_claim(&c) {
                // A provisioned volume that already exists makes provisioning a no-op.
                if let Some(name) = loopdev::provisioned_name(&obj)
                    && let Some(p) = cache.decode_pv(&name)
                {
                    s.pvs.insert(name, p);
                }
                s.claims.insert(c, obj);
            }
        }
        s
    }
}

impl Executor {
    /// Says `e` about the object `reference` names unless it repeats the last event about that
    /// object: a condition that persists is reported once per change of its text, however often
    /// it is retried. Only objects still in `cache` are remembered (their removal forgets them).
    pub(crate) fn report(&self, cache: &Cache, e: Event, reference: ObjectReference) {
        let subject = subject(&e.target);
        let known = match &e.target {
            Target::Claim(k) => cache.has_claim(k),
            Target::Volume(n) => cache.has_pv(n),
        };
        let (warning, reason) = (e.warning, e.reason);
        let said = self.events.report(
            &subject,
            Repeat::OnChange,
            &reference,
            Occurrence {
                warning,
                reason,
                action: "Binding",
                note: e.note,
            },
        );
        if !known {
            self.events.forget(&subject);
        }
        if said && warning {
            self.metrics.warnings.with_label_values(&[reason]).inc();
        }
    }
}

/// The object an event about `t` is on, as `cache` has it.
pub(crate) fn reference(cache: &Cache, t: &Target) -> Option<ObjectReference> {
    Some(match t {
        Target::Claim(k) => cache.decode_claim(k)?.object_ref(&()),
        Target::Volume(n) => cache.decode_pv(n)?.object_ref(&()),
    })
}

impl Executor {
    /// Reads the image store's marker now, off the decision loop, for the readiness gauge (and
    /// the cache the image steps use); logs when readiness changes. The store can be unmounted
    /// while nothing is provisioned or deleted, and the gauge should say so.
    pub(crate) fn check_store(&self) {
        use std::sync::atomic::Ordering;
        // Local mode: the stores are the nodes'; each agent reports its own.
        if self.store_mode.is_local() || self.store_check.swap(true, Ordering::AcqRel) {
            return;
        }
        let (store, gauge, running) = (
            self.images.clone(),
            self.metrics.image_store_ready.clone(),
            self.store_check.clone(),
        );
        tokio::task::spawn_blocking(move || {
            let r = store.ready_now();
            let was = gauge.get();
            gauge.set(i64::from(r.is_ok()));
            match r {
                Ok(m) if was != 1 => {
                    tracing::info!(dir = %store.dir().display(), id = %m.id, "image store ready")
                }
                Err(e) if was != 0 => {
                    tracing::warn!(error = %e, "image store not ready: no image is created or deleted")
                }
                _ => {}
            }
            running.store(false, Ordering::Release);
        });
    }

    pub(crate) fn claims(&self, ns: &str) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.client.clone(), ns)
    }

    pub(crate) fn count(&self, op: &str) {
        self.metrics.writes.with_label_values(&[op]).inc();
    }

    pub(crate) fn writes(&self) -> Writes {
        Writes::new(self.client.clone(), self.metrics.writes.clone())
    }

    /// The newest copy of a PV within this batch (an earlier write may have returned it).
    pub(crate) fn pv(snap: &Snapshot, done: &Outcome, name: &str) -> Option<PersistentVolume> {
        newest(&done.pvs, &snap.pvs, name, |p| p.name_any())
    }

    pub(crate) fn claim(snap: &Snapshot, done: &Outcome, key: &str) -> Option<PersistentVolumeClaim> {
        newest(&done.claims, &snap.claims, key, claim_key)
    }

    /// Whether the claim a volume points at still exists with the UID it names (a live read:
    /// the cache may lag a claim just created by someone else, and what follows is destructive).
    pub(crate) async fn claim_still_there(&self, pv: &PersistentVolume) -> Result<bool, Error> {
        let Some((ns, name, uid)) = claim_ref(pv) else {
            return Ok(false);
        };
        match self.claims(ns).get_opt(name).await? {
            Some(c) => Ok(c.metadata.uid.as_deref() == Some(uid) && {
                let vol = claim_volume_name(&c);
                vol.is_empty() || vol == pv.name_any()
            }),
            None => Ok(false),
        }
    }

    /// Carries out one action, timing the end-to-end operations KCM's PV controller times:
    /// a claim's provisioning from the first step to Bound, a volume's deletion from its start
    /// to the object's removal (`ingest::Ingest::pv_gone`); each failed step on the way is counted.
    pub(crate) async fn apply(
        &self,
        action: &Action,
        snap: &Snapshot,
        done: &mut Outcome,
    ) -> Result<(), Error> {
        use stowage_common::observe::storageops::{DELETE, PROVISION};
        let timed = match action {
            Action::SetProvisioner { claim, provisioner } => {
                self.timestamps.start(claim, provisioner, PROVISION);
                Some(claim.clone())
            }
            Action::ProvisionLoop { claim, .. } => {
                self.timestamps.start(claim, LOOP_DRIVER, PROVISION);
                Some(claim.clone())
            }
            // Built-in volumes only: other drivers' volumes are deleted by their provisioner.
            Action::DeleteLoopVolume { pv } => {
                self.timestamps.start(pv, LOOP_DRIVER, DELETE);
                Some(pv.clone())
            }
            Action::CreateLoopImage { pv } => Self::pv(snap, done, pv)
                .and_then(|v| claim_of(&v))
                .map(|r| ref_key(&r)),
            Action::Bind { claim, .. } => Some(claim.clone()),
            _ => None,
        };
        let result = self.apply_action(action, snap, done).await;
        match (&timed, &result) {
            (Some(key), Err(_)) => self.timestamps.failed(key),
            (Some(key), Ok(())) if matches!(action, Action::Bind { .. }) => self.timestamps.finished(key),
            _ => {}
        }
        result
    }

    async fn apply_action(&self, action: &Action, snap: &Snapshot, done: &mut Outcome) -> Result<(), Error> {
        match action {
            Action::Bind { pv, claim } => {
                let (Some(mut v), Some(mut c)) = (Self::pv(snap, done, pv), Self::claim(snap, done, claim))
                else {
                    return Ok(());
                };
                if let Some(next) = core::bound_pv_spec(&v, &c) {
                    v = self.writes().replace_pv(&next, "bind_volume").await?;
                    done.pvs.push(v.clone());
                }
                if let Some(next) = core::bound_pv_status(&v) {
                    v = self
                        .writes()
                        .replace_pv_status(&next, "bind_volume_status")
                        .await?;
                    done.pvs.push(v.clone());
                }
                if let Some(next) = core::bound_claim_spec(&c, pv) {
                    c = self.writes().replace_claim(&next, "bind_claim").await?;
                    done.claims.push(c.clone());
                }
                if let Some(next) = core::bound_claim_status(&c, &v) {
                    let became_bound = claim_phase(&c) != "Bound";
                    c = self
                        .writes()
                        .replace_claim_status(&next, "bind_claim_status")
                        .await?;
                    if became_bound && let Some(created) = c.metadata.creation_timestamp.as_ref() {
                        let age = k8s_openapi::jiff::Timestamp::now().duration_since(created.0);
                        self.metrics.bind_latency.observe(age.as_secs_f64().max(0.0));
                    }
                    done.claims.push(c);
                }
            }
            Action::ClaimPhase { claim, phase } => {
                let Some(c) = Self::claim(snap, done, claim) else {
                    return Ok(());
                };
                if let Some(next) = core::with_claim_phase(&c, phase) {
                    done.claims
                        .push(self.writes().replace_claim_status(&next, "claim_phase").await?);
                }
            }
            Action::VolumePhase { pv, phase, message } => {
                let Some(v) = Self::pv(snap, done, pv) else {
                    return Ok(());
                };
                done.pvs.push(
                    self.writes()
                        .replace_pv_status(&core::with_pv_phase(&v, phase, message), "volume_phase")
                        .await?,
                );
            }
            Action::Release { pv } => {
                let Some(v) = Self::pv(snap, done, pv) else {
                    return Ok(());
                };
                if self.claim_still_there(&v).await? {
                    // Our cache had not seen the claim yet; sync both again.
                    if let Some((ns, n, _)) = claim_ref(&v) {
                        done.wake.push(Key::Claim(format!("{ns}/{n}")));
                    }
                    return Err(Error::StaleCache(format!("{:?}", claim_ref(&v))));
                }
                let next = core::with_pv_phase(&v, "Released", "");
                done.pvs
                    .push(self.writes().replace_pv_status(&next, "volume_phase").await?);
                done.wake.push(Key::Volume(pv.clone()));
            }
            Action::Unbind { pv } => {
                let Some(v) = Self::pv(snap, done, pv) else {
                    return Ok(());
                };
                let v = self
                    .writes()
                    .replace_pv(&core::unbound_pv(&v), "unbind_volume")
                    .await?;
                done.pvs.push(v.clone());
                if pv_phase(&v) != "Available" {
                    let next = core::with_pv_phase(&v, "Available", "");
                    done.pvs
                        .push(self.writes().replace_pv_status(&next, "volume_phase").await?);
                }
            }
            Action::SetProvisioner { claim, provisioner } => {
                let Some(mut c) = Self::claim(snap, done, claim) else {
                    return Ok(());
                };
                c.annotations_mut()
                    .insert(ANN_STORAGE_PROVISIONER.into(), provisioner.clone());
                c.annotations_mut()
                    .insert(ANN_BETA_STORAGE_PROVISIONER.into(), provisioner.clone());
                done.claims
                    .push(self.writes().replace_claim(&c, "set_provisioner").await?);
            }
            Action::SetDefaultClass { claim, class } => {
                let Some(mut c) = Self::claim(snap, done, claim) else {
                    return Ok(());
                };
                c.spec.get_or_insert_with(Default::default).storage_class_name = Some(class.clone());
                done.claims
                    .push(self.writes().replace_claim(&c, "set_default_class").await?);
            }
            Action::ProvisionLoop { claim, class, node } => {
                self.provision(snap, done, claim, class, node.as_deref()).await?
            }
            Action::CreateLoopImage { pv } => self.create_image(snap, done, pv).await?,
            Action::DeleteLoopVolume { pv } => self.delete_volume(snap, done, pv).await?,
            Action::SetDeleterFinalizer { pv, present } => {
                let Some(mut v) = Self::pv(snap, done, pv) else {
                    return Ok(());
                };
                let fins = v.finalizers_mut();
                fins.retain(|f| f != FINALIZER_LOOP_DELETER);
                if *present {
                    fins.push(FINALIZER_LOOP_DELETER.into());
                }
                done.pvs
                    .push(self.writes().replace_pv(&v, "deleter_finalizer").await?);
            }
            Action::ClaimCondition {
                claim,
                reason,
                message,
            } => {
                let Some(c) = Self::claim(snap, done, claim) else {
                    return Ok(());
                };
                let next =
                    core::with_pending_condition(&c, reason, message, k8s_openapi::jiff::Timestamp::now());
                done.claims.push(
                    self.writes()
                        .replace_claim_status(&next, "claim_condition")
                        .await?,
                );
            }
            Action::Annotate {
                target,
                set,
                remove,
                drop_finalizers,
                add_finalizers,
                op,
            } => match target {
                Target::Claim(claim) => {
                    let Some(mut c) = Self::claim(snap, done, claim) else {
                        return Ok(());
                    };
                    edit_metadata(&mut c, set, remove, drop_finalizers, add_finalizers);
                    done.claims.push(self.writes().replace_claim(&c, op).await?);
                }
                Target::Volume(pv) => {
                    let Some(mut v) = Self::pv(snap, done, pv) else {
                        return Ok(());
                    };
                    edit_metadata(&mut v, set, remove, drop_finalizers, add_finalizers);
                    done.pvs.push(self.writes().replace_pv(&v, op).await?);
                }
            },
            Action::WakeClaim(_) | Action::Event(_) | Action::RetryLater { .. } => {}
        }
        Ok(())
    }
}

mod builtin;
#[cfg(test)]
mod live_tests;
