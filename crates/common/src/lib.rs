//! Plumbing shared by `stowage-controller` and `stowage-agent`.

pub mod api;
pub mod errors;
pub mod observe;
pub mod runtime;
pub mod store;
pub mod vocab;
