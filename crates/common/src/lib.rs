//! Plumbing shared by `stowage-controller` and `stowage-agent`.

pub mod attachment;
pub mod backoff;
pub mod client;
pub mod clientmetrics;
pub mod errors;
pub mod events;
pub mod inflight;
pub mod informer;
pub mod informers;
pub mod leader;
pub mod lean;
pub mod logging;
pub mod metrics;
pub mod objects;
pub mod packed;
pub mod pv;
pub mod quantity;
pub mod queue;
pub mod ratelimit;
pub mod secure;
pub mod serve;
pub mod shutdown;
pub mod slim;
pub mod storageops;
pub mod transport;
pub mod writes;
