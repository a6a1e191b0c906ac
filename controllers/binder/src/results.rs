//! Results: what a write task reports back (`Outcome`), folded into the cache, the queue
//! (requeue, backoff), metrics and events by the decision task.

use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume, PersistentVolumeClaim};
use stowage_common::runtime::driver::Next;
use stowage_common::runtime::inflight::Landed;
use stowage_common::store::IntoStored;

use crate::controller::{Controller, Key};
use crate::core::Event;
use crate::error::Error;

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

impl Controller {
    /// Frees the volumes reserved for `key`'s bind, when no report of it will come back to (a
    /// task or a sync that panicked).
    pub(crate) fn release_reservations(&mut self, key: &Key) {
        match key {
            Key::Claim(k) => {
                let window = &self.window;
                self.cache
                    .release_claim(k, |pv| window.is_running(&Key::Volume(pv.to_string())))
            }
            Key::Volume(n) => {
                self.cache.reserved.remove(n);
            }
        }
    }

    /// Takes a batch's results: newest objects into the cache, reservation released, and what
    /// comes next for the key: done (again at once if it changed meanwhile), or its failure.
    pub(crate) fn finish(&mut self, landed: Landed<Key, Outcome>) -> Result<Next, Error> {
        self.executor.metrics.in_flight.set(self.window.len() as i64);
        let done = landed.result.unwrap_or_else(|| {
            // The task died with its report: free what it may have reserved and retry the key.
            self.release_reservations(&landed.key);
            Outcome {
                error: Some(Error::Panic),
                ..Outcome::empty(None)
            }
        });
        if let Some(pv) = &done.reserved {
            self.cache.reserved.remove(pv);
            if self.window.take_dirty(&Key::Volume(pv.clone())) {
                self.queue.add(Key::Volume(pv.clone()));
            }
        }
        for name in &done.deleted_pvs {
            if let Some(pv) = self.cache.remove_pv(name) {
                self.pv_gone(&pv);
            }
        }
        // Stored as the informers store them (which also drops the responses' managedFields).
        for pv in done.pvs {
            self.pv_seen(pv.into_stored());
        }
        for c in done.claims {
            self.claim_seen(c.into_stored());
        }
        for k in done.wake {
            self.queue.add(k);
        }
        for (e, reference) in done.events {
            self.send_event(e, reference);
        }
        match done.error {
            Some(error) => Err(error),
            None if landed.dirty => Ok(Next::Again),
            None => Ok(Next::Done),
        }
    }
}

/// Retry delay after `n` earlier consecutive failures that are not conflicts (an image that
/// cannot be created or removed, an API error): 1 s doubling to 5 min, external-provisioner's
/// defaults for provisioning and deletion retries. Conflicts keep the queue's quick 5 ms → 60 s
/// steps: they pass as soon as the cache catches up.
pub fn failure_backoff(n: u32) -> Duration {
    const START: Duration = Duration::from_secs(1);
    const MAX: Duration = Duration::from_secs(300);
    stowage_common::runtime::backoff::exponential(START, MAX, n.saturating_add(1))
}
