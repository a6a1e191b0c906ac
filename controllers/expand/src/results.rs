//! Results: what one claim's work reports back (`Outcome`), folded into the controller's copies,
//! the queue (retry, backoff) and metrics.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use stowage_common::runtime::inflight::Landed;
use stowage_common::store::informer::is_newer;
use tokio::time::Instant;

use crate::controller::Controller;
use crate::error::Error;
use crate::ingest::split;
use stowage_common::errors::MetricLabel;
use stowage_common::errors::PANIC;

/// What one claim's work reports back.
pub(crate) struct Outcome {
    pub(crate) claims: Vec<PersistentVolumeClaim>,
    pub(crate) pvs: Vec<PersistentVolume>,
    /// When this process started an expansion of the claim (for the total duration).
    pub(crate) started: Option<Instant>,
    pub(crate) error: Option<Error>,
}

impl Controller {
    pub(crate) fn finish(&mut self, landed: Landed<String, Outcome>) {
        let key = landed.key;
        let Some(done) = landed.result else {
            // The task died without a report: retry the claim with backoff.
            self.executor.metrics.errors.with_label_values(&[PANIC]).inc();
            self.queue.retry(key, Instant::now());
            return;
        };
        for c in done.claims {
            let c = Arc::new(c);
            self.claims.insert(key.clone(), c);
        }
        for v in done.pvs {
            self.pvs.insert(v.name_any(), Arc::new(v));
        }
        if let Some(t) = done.started {
            self.resizing.insert(key.clone(), Some(t));
        }
        if let Some(c) = self.claim(&key) {
            self.observe(&key, &c);
        }
        match done.error {
            Some(e) => {
                self.executor
                    .metrics
                    .errors
                    .with_label_values(&[e.metric_label()])
                    .inc();
                if e.retry() {
                    self.queue.retry(key.clone(), Instant::now());
                }
            }
            None => self.queue.succeeded(&key),
        }
        // Changed by someone else meanwhile: decide again on the newer object now.
        if landed.dirty {
            let (ns, name) = split(&key);
            let stored = self.cluster.pvcs.store().get(&ObjectRef::new(name).within(ns));
            let mine = self.claims.get(&key);
            let theirs_newer = match (&stored, mine) {
                (Some(s), Some(m)) => {
                    is_newer(s.resource_version().as_deref(), m.resource_version().as_deref())
                }
                _ => true,
            };
            if theirs_newer {
                self.queue.add(key);
            }
        }
    }
}
