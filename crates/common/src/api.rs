//! The apiserver client: transport, rate limits, client metrics, write helpers.

pub mod attachments;
pub mod client;
pub mod clientmetrics;
pub mod identity;
pub mod ratelimit;
pub mod transport;
pub mod writes;
