//! Results: what one claim's work reports back (`Outcome`), folded into what the controller knows;
//! the driver settles the key (retry, backoff) from what `finish` says.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use stowage_common::runtime::driver::Next;
use stowage_common::runtime::inflight::Landed;
use stowage_common::store::informer::is_newer;
use tokio::time::Instant;

use crate::error::Error;
use crate::ingest::{Known, split};

/// What one claim's work reports back.
pub(crate) struct Outcome {
    pub(crate) claims: Vec<PersistentVolumeClaim>,
    pub(crate) pvs: Vec<PersistentVolume>,
    /// When this process started an expansion of the claim (for the total duration).
    pub(crate) started: Option<Instant>,
    pub(crate) error: Option<Error>,
}

/// What became of a claim's work: what comes next for it, and whether it changed meanwhile
/// (then a failed claim is synced again at once, its backoff cut short by the newer object).
pub(crate) struct Finished {
    pub(crate) next: Result<Next, Error>,
    pub(crate) changed: bool,
}

impl Known {
    /// Takes a claim's results into the copies this controller keeps and says what comes next
    /// for it: done (again at once if someone else changed it meanwhile), or its failure.
    pub(crate) fn finish(&mut self, landed: Landed<String, Outcome>) -> Finished {
        let key = landed.key;
        let Some(done) = landed.result else {
            // The task died without a report: the claim is retried with backoff.
            return Finished {
                next: Err(Error::Panic),
                changed: false,
            };
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
        // Changed by someone else meanwhile (not only by these writes): decide again on the
        // newer object now, failed or not.
        let changed = landed.dirty && {
            let (ns, name) = split(&key);
            let stored = self.cluster.pvcs.store().get(&ObjectRef::new(name).within(ns));
            match (&stored, self.claims.get(&key)) {
                (Some(s), Some(m)) => {
                    is_newer(s.resource_version().as_deref(), m.resource_version().as_deref())
                }
                _ => true,
            }
        };
        let next = match done.error {
            Some(e) => Err(e),
            None if changed => Ok(Next::Again),
            None => Ok(Next::Done),
        };
        Finished { next, changed }
    }
}
