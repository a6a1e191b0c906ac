//! The volume expansion controller: upstream's persistentvolume-expander (resize map, hand-off to
//! external resizers) plus the controller half of the external-resizer for the built-in driver
//! `loop.stowage.dev`. A pure decision core (`core`) and a thin executor (`exec`).

pub mod core;
pub mod exec;
pub mod metrics;

pub use exec::{Config, run};
pub use metrics::Metrics;
