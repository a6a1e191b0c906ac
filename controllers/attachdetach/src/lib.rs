//! The attach/detach controller: upstream's attachdetach-controller behaviour for CSI volumes,
//! migrated in-tree volumes (translated to their CSI drivers) and iSCSI/FC.
//!
//! Files, in the order a newcomer reads them: `core` (the pure pass: desired, actual and nodes
//! in, actions out), `desired` and `actual` (the two states, pure), `controller` (`Controller`,
//! the one task that owns the state and runs passes; only that file holds it), `state` (the
//! decision state, and `Parts`: that state with the handles a part works through), `ingest`
//! (informer events into the state), `start` (the actions of a pass started as write tasks),
//! `exec` (`Executor` and `Outcome`: the write tasks and what they report), `results` (the
//! reports folded back into the state, metrics and events), `error`, `metrics`, `read`. The
//! files import one another in one direction.

pub mod actual;
pub mod controller;
pub mod core;
pub mod desired;
pub mod error;
pub mod exec;
pub mod ingest;
pub mod metrics;
pub mod read;
pub mod results;
pub mod start;
pub mod state;
pub mod translate;
pub mod vecmap;

use std::time::Duration;

pub use controller::run;
pub use metrics::Metrics;

/// Controller settings; `Default` has upstream's values.
#[derive(Debug, Clone)]
pub struct Config {
    /// How long a detach waits for a not-Ready node to unmount before it is forced
    /// (--max-wait-for-unmount; upstream's fixed maxWaitForUnmountDuration).
    pub max_wait_for_unmount: Duration,
    /// Never force a detach because of the timeout (--disable-force-detach-on-timeout); the
    /// out-of-service taint and a deleted node still detach at once.
    pub disable_force_detach_on_timeout: bool,
    /// Full rebuild of desired and actual state from the stores (upstream's populator period);
    /// also confirms attachments carried over from node status against VolumeAttachments.
    pub resync: Duration,
    /// VolumeAttachment creates in flight at once.
    pub max_attaches_in_flight: usize,
    /// Detaches (node status patch + VolumeAttachment delete) in flight at once; a separate
    /// budget, so attaches never queue behind a burst of detaches.
    pub max_detaches_in_flight: usize,
    /// Where a test steps into the write tasks; none outside this crate's tests.
    #[doc(hidden)]
    pub hooks: exec::Hooks,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_wait_for_unmount: Duration::from_secs(6 * 60),
            disable_force_detach_on_timeout: false,
            resync: Duration::from_secs(60),
            max_attaches_in_flight: 32,
            max_detaches_in_flight: 32,
            hooks: exec::Hooks::default(),
        }
    }
}
