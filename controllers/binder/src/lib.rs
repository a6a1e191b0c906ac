//! The PV/PVC binder: upstream's persistentvolume-binder behaviour with a pure decision core
//! (`core`), an ordered volume index (`index`), and an executor that writes concurrently with a
//! per-volume reservation (`exec`). The built-in driver `loop.stowage.dev` is provisioned and
//! deleted here (`loopdev`).

pub mod core;
pub mod exec;
pub mod index;
pub mod loopdev;
// The PV/PVC readers and quantities are shared with the other controllers.
pub use stowage_common::{pv as objects, quantity};
pub mod metrics;

pub mod selector;

#[cfg(test)]
mod fidelity_tests;
#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod safety_tests;

pub use exec::{Config, run};
pub use metrics::Metrics;
