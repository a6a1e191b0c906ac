//! Ingest: store and watch events become queued claim keys; the objects this controller wrote are
//! kept until the stores catch up (newest resourceVersion wins).

use std::collections::HashSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use stowage_common::store::informer::is_newer;
use stowage_common::store::pv::{claim_key, claim_ref, claim_volume_name};

use crate::controller::Controller;
use crate::core::{self};

pub(crate) fn split(key: &str) -> (&str, &str) {
    key.split_once('/').unwrap_or(("", key))
}

pub(crate) fn newest<K: kube::Resource>(a: Option<Arc<K>>, b: Option<&Arc<K>>) -> Option<Arc<K>> {
    match (a, b) {
        (Some(a), Some(b))
            if is_newer(
                b.meta().resource_version.as_deref(),
                a.meta().resource_version.as_deref(),
            ) =>
        {
            Some(b.clone())
        }
        (Some(a), _) => Some(a),
        (None, b) => b.cloned(),
    }
}

impl Controller {
    pub(crate) fn claim(&self, key: &str) -> Option<Arc<PersistentVolumeClaim>> {
        let (ns, name) = split(key);
        let stored = self.cluster.pvcs.store().get(&ObjectRef::new(name).within(ns));
        // A claim gone from the store is gone, whatever we wrote before.
        let stored = Arc::new(stored?.decode());
        newest(Some(stored), self.claims.get(key))
    }

    pub(crate) fn pv(&self, name: &str) -> Option<Arc<PersistentVolume>> {
        let stored = Arc::new(self.cluster.pvs.store().get(&ObjectRef::new(name))?.decode());
        newest(Some(stored), self.pvs.get(name))
    }

    /// Queues every bound claim (the periodic net, and after a relist).
    pub(crate) fn resync(&mut self) {
        let live: HashSet<String> = self
            .cluster
            .pvcs
            .store()
            .state()
            .iter()
            .map(|c| claim_key(c.as_ref()))
            .collect();
        self.claims.retain(|k, _| live.contains(k));
        self.resizing.retain(|k, _| live.contains(k));
        let live_pvs: HashSet<String> = self
            .cluster
            .pvs
            .store()
            .state()
            .iter()
            .map(|p| p.name_any())
            .collect();
        self.pvs.retain(|k, _| live_pvs.contains(k));
        for key in live {
            if let Some(c) = self.claim(&key) {
                self.observe(&key, &c);
                if !claim_volume_name(&c).is_empty() {
                    self.queue.add(key);
                }
            }
        }
    }

    pub(crate) fn claim_seen(&mut self, c: &PersistentVolumeClaim) {
        let key = claim_key(c);
        // Our own writes come back through the watch; they are known already and must not
        // bypass the backoff of a failing claim.
        if let Some(mine) = self.claims.get(&key) {
            let (seen, written) = (c.resource_version(), mine.resource_version());
            if !is_newer(seen.as_deref(), written.as_deref()) {
                // Our write's own echo: the store holds it now, so our copy can go.
                if seen == written {
                    self.claims.remove(&key);
                }
                return;
            }
            self.claims.remove(&key);
        }
        self.observe(&key, c);
        if !self.window.defer_if_running(&key) && !claim_volume_name(c).is_empty() {
            self.queue.add(key);
        }
    }

    pub(crate) fn claim_gone(&mut self, c: &PersistentVolumeClaim) {
        let key = claim_key(c);
        self.claims.remove(&key);
        self.resizing.remove(&key);
        self.executor.events.forget(&crate::exec::subject(&key));
    }

    pub(crate) fn pv_seen(&mut self, pv: &PersistentVolume) {
        let name = pv.name_any();
        if let Some(mine) = self.pvs.get(&name) {
            let (seen, written) = (pv.resource_version(), mine.resource_version());
            if !is_newer(seen.as_deref(), written.as_deref()) {
                // Our write's own echo: the store holds it now, so our copy can go.
                if seen == written {
                    self.pvs.remove(&name);
                }
                return;
            }
            self.pvs.remove(&name);
        }
        self.queue_claim_of(pv);
    }

    pub(crate) fn queue_claim_of(&mut self, pv: &PersistentVolume) {
        if let Some((ns, name, _)) = claim_ref(pv) {
            let key = format!("{ns}/{name}");
            if !self.window.defer_if_running(&key) {
                self.queue.add(key);
            }
        }
    }

    pub(crate) fn wake_class(&mut self, class: &str) {
        // The few fields this reads are decoded, not each whole claim.
        for stored in self.cluster.pvcs.store().state() {
            let Ok(binding) = stored.binding() else { continue };
            if binding.class.as_deref() == Some(class) && !binding.volume_name.is_empty() {
                self.queue.add(claim_key(stored.as_ref()));
            }
        }
    }

    /// Tracks resizes under way (a gauge) and, when one this process started ends, its duration.
    pub(crate) fn observe(&mut self, key: &str, c: &PersistentVolumeClaim) {
        if core::resize_status(c).is_some() {
            self.resizing.entry(key.to_string()).or_insert(None);
        } else if let Some(Some(started)) = self.resizing.remove(key) {
            let reached = match (core::capacity(c), core::allocated(c)) {
                (Some(cap), Some(a)) => cap.bytes >= a.bytes,
                _ => false,
            };
            if reached {
                self.executor
                    .metrics
                    .expansion_seconds
                    .with_label_values(&["total"])
                    .observe(started.elapsed().as_secs_f64());
            }
        }
    }
}
