//! What the integration tests, the demo and the benchmarks share: the real upstream control plane
//! started on loopback, builders for the objects stowage works on, and polling helpers.

pub mod binary;
pub mod builders;
pub mod controlplane;
pub mod host;
pub mod inproc;
pub mod kubectl;
pub mod metricsdoc;
pub mod process;
pub mod realnode;
pub mod scrape;
pub mod wait;

pub use controlplane::{ControlPlane, shared};
pub use inproc::InProcess;
pub use wait::eventually;

/// A name no other test in this run uses (cluster-scoped objects share one apiserver).
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{:08x}", rand::random::<u32>())
}
