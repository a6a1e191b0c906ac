//! Plumbing shared by `stowage-controller` and `stowage-agent`.

pub mod client;
pub mod leader;
pub mod logging;
pub mod metrics;
pub mod ratelimit;
pub mod serve;
pub mod shutdown;
