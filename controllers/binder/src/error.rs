//! The binder's one error type: what a sync or its write task fails with. Its `metric_label` is
//! the `error` label of `stowage_binder_reconcile_errors_total`.

use stowage_common::errors::{MetricLabel, PANIC, api_label, is_conflict};

use crate::loopdev::ImageError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The apiserver refused a read or a write (a 409 is a conflict: someone wrote first), or did
    /// not answer.
    #[error("{0}")]
    Api(#[from] kube::Error),
    /// The built-in driver's image could not be created or removed.
    #[error("{0}")]
    Image(#[from] ImageError),
    /// The image store has no marker: nothing is created or deleted there until it has.
    #[error("{0}")]
    StoreNotReady(#[from] stowage_loopdriver::NotReady),
    /// A live read found the claim a volume names still there: the cache had not seen it yet.
    #[error("claim {0} still exists; not releasing its volume")]
    StaleCache(String),
    /// The objects are in a state no write of ours can mend (the core's `RetryLater`).
    #[error("{0}")]
    InvalidState(String),
    /// The write task died without reporting (a bug; its key is retried).
    #[error("write task panicked")]
    Panic,
}

impl Error {
    /// A resourceVersion conflict: expected under concurrency, retried at the queue's quick pace
    /// (it passes once the cache catches up) and not logged as a failure.
    pub fn is_conflict(&self) -> bool {
        matches!(self, Error::Api(e) if is_conflict(e))
    }
}

impl MetricLabel for Error {
    fn metric_label(&self) -> &'static str {
        match self {
            Error::Api(e) => api_label(e),
            Error::Image(_) => "image",
            Error::StoreNotReady(_) => "image_store_not_ready",
            Error::StaleCache(_) => "stale_cache",
            Error::InvalidState(_) => "invalid_state",
            Error::Panic => PANIC,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_shared_vocabulary() {
        let api = |code| Error::Api(stowage_common::errors::api_error(code));
        assert_eq!(api(409).metric_label(), "conflict");
        assert!(api(409).is_conflict() && !api(500).is_conflict());
        assert_eq!(api(500).metric_label(), "server_error");
        assert_eq!(Error::StaleCache("ns/c".into()).metric_label(), "stale_cache");
        assert_eq!(Error::InvalidState("x".into()).metric_label(), "invalid_state");
        assert_eq!(Error::Panic.metric_label(), "panic");
    }
}
