//! The volume expansion controller: upstream's persistentvolume-expander (resize map, hand-off to
//! external resizers) plus the controller half of the external-resizer for the built-in driver
//! `loop.stowage.dev`, in the one controller shape (docs/architecture.md): a pure decision core
//! (`core`), store events into keys (`ingest`), the `Controller` owning the decision task
//! (`controller`), an `Executor` running each claim's writes in the shared window (`exec`), and the
//! fold of their outcomes (`results`).

pub mod controller;
pub mod core;
pub mod error;
pub mod exec;
pub mod ingest;
pub mod metrics;
pub mod results;

pub use controller::{Config, run};
pub use metrics::Metrics;
