//! The binder's keys: what its queue holds (a claim or a volume), and the events gate's subject
//! of each object it reports on.

use stowage_common::observe::events::Subject;

use crate::core::Target;

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    Claim(String),
    Volume(String),
}

impl Key {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Key::Claim(_) => "claim",
            Key::Volume(_) => "volume",
        }
    }
}

/// The events gate's subject of an object the binder reports on.
pub(crate) fn subject(t: &Target) -> Subject {
    match t {
        Target::Claim(k) => Subject::new("claim", k),
        Target::Volume(n) => Subject::new("volume", n),
    }
}
