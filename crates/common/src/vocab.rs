//! The API's own words for storage, shared by the controllers and the agent: condition types,
//! status values and the patches that use them. Pure: no client, no store.

pub mod annotations;
pub mod migration;
pub mod resize;
