//! The expand controller's one error type. Its `metric_label` is the `error` label of
//! `stowage_expand_reconcile_errors_total` and `stowage_expand_failures_total`.

use stowage_common::errors::{MetricLabel, api_label};
use stowage_loopdriver::ImageError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The apiserver refused a write (a 409 is a conflict: someone wrote first), or did not
    /// answer.
    #[error("{0}")]
    Api(#[from] kube::Error),
    /// The built-in driver's image could not be grown; `infeasible` when no retry at the same
    /// size can fix it.
    #[error("{error}")]
    Image { error: ImageError, infeasible: bool },
    /// A write task died without its report (a bug); the claim is retried.
    #[error("the claim's write task panicked")]
    Panic,
}

impl Error {
    /// An infeasible expansion is not retried on a timer; a changed request (or the slow retry
    /// of the core) starts the next attempt.
    pub(crate) fn retry(&self) -> bool {
        !matches!(self, Error::Image { infeasible: true, .. })
    }
}

impl MetricLabel for Error {
    fn metric_label(&self) -> &'static str {
        match self {
            Error::Api(e) => api_label(e),
            Error::Image { infeasible: true, .. } => "infeasible",
            Error::Image { .. } => "image",
            Error::Panic => stowage_common::errors::PANIC,
        }
    }
}

/// The `error` label of an expansion the class does not allow (no `Error`: nothing failed, the
/// core refused it).
pub const NOT_ALLOWED: &str = "not_allowed";

/// Errors that no retry at the same size can fix.
pub(crate) fn infeasible(e: &ImageError) -> bool {
    match e {
        ImageError::BadHandle(_) => true,
        ImageError::Io { source, .. } => matches!(
            source.raw_os_error(),
            Some(libc::EFBIG | libc::EINVAL | libc::ENAMETOOLONG)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_shared_vocabulary() {
        let conflict = Error::Api(stowage_common::errors::api_error(409));
        assert_eq!(conflict.metric_label(), "conflict");
        let io = || ImageError::Io {
            path: "x".into(),
            source: std::io::Error::other("x"),
        };
        assert_eq!(
            Error::Image {
                error: io(),
                infeasible: true
            }
            .metric_label(),
            "infeasible"
        );
        assert_eq!(
            Error::Image {
                error: io(),
                infeasible: false
            }
            .metric_label(),
            "image"
        );
        assert!(
            !Error::Image {
                error: io(),
                infeasible: true
            }
            .retry()
        );
    }
}
