//! Observability: the metrics registry and server, events, logging, KCM-compatible operation metrics.

pub mod events;
pub mod logging;
pub mod metrics;
pub mod secure;
pub mod serve;
pub mod storageops;
