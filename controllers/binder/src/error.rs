//! The binder's one error type.

use crate::loopdev;
use stowage_common::writes::is_conflict;

#[derive(Debug, thiserror::Error)]
pub(crate) enum WriteError {
    #[error("conflict: the object changed since it was read")]
    Conflict,
    #[error("{0}")]
    Api(kube::Error),
    #[error("{0}")]
    Image(#[from] loopdev::ImageError),
    #[error("claim {0} still exists; not releasing its volume")]
    ClaimStillThere(String),
}

impl WriteError {
    /// A stable category, used as metric label.
    pub(crate) fn category(&self) -> &'static str {
        match self {
            WriteError::Conflict => "Conflict",
            WriteError::Api(_) => "ApiError",
            WriteError::Image(_) => "ImageError",
            WriteError::ClaimStillThere(_) => "StaleCache",
        }
    }
}

/// Conflicts are their own category (expected under concurrency, retried quietly).
impl From<kube::Error> for WriteError {
    fn from(e: kube::Error) -> Self {
        if is_conflict(&e) {
            WriteError::Conflict
        } else {
            WriteError::Api(e)
        }
    }
}
