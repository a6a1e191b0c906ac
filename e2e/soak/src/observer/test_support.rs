//! Builders shared by the observer's unit tests.

use std::sync::Arc;

use super::{ClaimSnap, NodeSnap, Observer, PvSnap, VaSnap};
use crate::report::Record;

pub(crate) fn claim(vol: Option<&str>, phase: &str) -> ClaimSnap {
    ClaimSnap {
        name: "ns/c".into(),
        volume: vol.map(String::from),
        phase: Some(phase.into()),
    }
}

pub(crate) fn pv(uid: Option<&str>) -> PvSnap {
    PvSnap {
        claim_uid: uid.map(String::from),
        claim: uid.map(|_| "ns/c".into()),
        phase: None,
        unique: Some("loop.stowage.dev^h".into()),
        read_only: false,
    }
}

pub(crate) fn observer() -> (Arc<Observer>, Arc<Record>, tempfile::TempDir) {
    let d = tempfile::tempdir().unwrap();
    let r = Arc::new(Record::new(d.path()).unwrap());
    (Observer::new(r.clone()), r, d)
}

pub(crate) fn va(node: &str, attached: bool, deleting: bool) -> VaSnap {
    VaSnap {
        name: format!("va-{node}"),
        node: node.into(),
        pv: Some("v".into()),
        attached,
        deleting,
    }
}

/// A node's status: `in_use` in `volumesInUse`, `attached` in `volumesAttached` (apart: the agent
/// lists a volume in use before the controller lists it attached, and the controller drops it
/// from `volumesAttached` before it detaches).
pub(crate) fn node(in_use: &[&str], attached: &[&str], oos: bool) -> NodeSnap {
    NodeSnap {
        in_use: in_use.iter().map(|s| s.to_string()).collect(),
        attached: attached.iter().map(|s| s.to_string()).collect(),
        out_of_service: oos,
    }
}
