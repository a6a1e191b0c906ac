//! Results: what a write task reports back (`Outcome`), folded into the cache and the queue by
//! the decision task (`settle`), which then says what comes next for the key; and the binder's
//! retry curve for failures other than conflicts.

use std::time::Duration;

use stowage_common::runtime::driver::Next;
use stowage_common::runtime::inflight::{Landed, Window};
use stowage_common::store::IntoStored;

use crate::core::Cache;
use crate::error::Error;
use crate::exec::Outcome;
use crate::ingest::Ingest;
use crate::key::Key;

/// Frees the volumes reserved for `key`'s bind, when no report of it will come back (a task or
/// a sync that panicked); a volume whose own bind is still running keeps its reservation.
pub(crate) fn release_reservations(cache: &mut Cache, window: &Window<Key, Outcome>, key: &Key) {
    match key {
        Key::Claim(k) => cache.release_claim(k, |pv| window.is_running(&Key::Volume(pv.to_string()))),
        Key::Volume(n) => {
            cache.reserved.remove(n);
        }
    }
}

/// Takes a batch's results: newest objects into the cache (through `ing`, as changes), its
/// reservation released, its events said, and what comes next for the key: done (again at once
/// if it changed meanwhile), or its failure.
pub(crate) fn settle(
    mut ing: Ingest<'_>,
    window: &mut Window<Key, Outcome>,
    landed: Landed<Key, Outcome>,
) -> Result<Next, Error> {
    ing.executor.metrics.in_flight.set(window.len() as i64);
    let done = landed.result.unwrap_or_else(|| {
        // The task died with its report: free what it may have reserved and retry the key.
        release_reservations(ing.cache, window, &landed.key);
        Outcome {
            error: Some(Error::Panic),
            ..Outcome::empty(None)
        }
    });
    if let Some(pv) = &done.reserved {
        ing.cache.reserved.remove(pv);
        if window.take_dirty(&Key::Volume(pv.clone())) {
            ing.queue.add(Key::Volume(pv.clone()));
        }
    }
    for name in &done.deleted_pvs {
        if let Some(pv) = ing.cache.remove_pv(name) {
            ing.pv_gone(&pv);
        }
    }
    // Stored as the informers store them (which also drops the responses' managedFields).
    for pv in done.pvs {
        ing.pv_seen(pv.into_stored());
    }
    for c in done.claims {
        ing.claim_seen(c.into_stored());
    }
    for k in done.wake {
        ing.queue.add(k);
    }
    for (e, reference) in done.events {
        ing.executor.report(ing.cache, e, reference);
    }
    match done.error {
        Some(error) => Err(error),
        None if landed.dirty => Ok(Next::Again),
        None => Ok(Next::Done),
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
