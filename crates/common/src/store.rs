//! The shared informers and the objects they keep (the read model).

pub mod attachment;
pub mod informer;
pub mod informers;
pub mod lean;
pub mod objects;
pub mod packed;
pub mod pv;
pub mod quantity;
pub mod slim;
