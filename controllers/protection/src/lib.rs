//! The pvc-protection and pv-protection controllers: they take off the finalizers that the
//! apiserver's StorageObjectInUseProtection admission puts on every claim and volume, once nothing
//! uses the object any more, and put them back on objects that lack them. See docs/protection.md.
//!
//! The one controller shape (docs/architecture.md), with two controllers: `core` decides (pure),
//! the shared informers' `Feed`s bring the changes, `index` finds a claim's pods, `stowage_common::runtime::queue`
//! orders the work, `exec` makes guarded patches, and `pvc::Controller` / `pv::Controller` own
//! the two decision loops.

pub mod core;
pub mod error;
pub mod exec;
pub mod index;
pub mod metrics;
mod pv;
mod pvc;

pub use metrics::Metrics;
pub use pv::run_pv_protection;
pub use pvc::{REASON_CLAIM_IN_USE, run_pvc_protection};
