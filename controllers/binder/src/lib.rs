//! The PV/PVC binder: upstream's persistentvolume-binder behaviour in the one controller shape
//! (docs/architecture.md): a pure decision core (`core`), store events into keys (`ingest`), the
//! `Controller` owning the decision task (`controller`), an `Executor` that writes concurrently in
//! the shared window with a per-volume reservation (`exec`), and the fold of write outcomes
//! (`results`). An ordered volume index (`index`) serves matching. The built-in driver
//! `loop.stowage.dev` is provisioned and deleted here (`loopdev`).

pub mod controller;
pub mod core;
pub mod error;
pub mod exec;
pub mod index;
pub mod ingest;
pub mod key;
pub mod loopdev;
pub mod results;
// The PV/PVC readers and quantities are shared with the other controllers.
pub use stowage_common::store::quantity;
pub mod metrics;
pub mod pv;

pub mod selector;

pub use controller::{Config, Prepared, prepare, run};
pub use metrics::Metrics;
