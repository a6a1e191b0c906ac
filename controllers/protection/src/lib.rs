//! The pvc-protection and pv-protection controllers: they take off the finalizers that the
//! apiserver's StorageObjectInUseProtection admission puts on every claim and volume, once nothing
//! uses the object any more, and put them back on objects that lack them. See docs/protection.md.
//!
//! `core` decides (pure), `index` finds a claim's pods, `stowage_common::queue` orders the work, `write` makes
//! guarded patches, and `pvc`/`pv` are the thin async layers over the shared stores.

pub mod core;
pub mod index;
pub mod metrics;
mod pv;
mod pvc;

pub mod write;

pub use metrics::Metrics;
pub use pv::run_pv_protection;
pub use pvc::{REASON_CLAIM_IN_USE, run_pvc_protection};
