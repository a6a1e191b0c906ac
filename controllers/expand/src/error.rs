//! The expand controller's one error type.

use stowage_common::writes::is_conflict;
use stowage_loopdriver::ImageError;

#[derive(Debug, thiserror::Error)]
pub(crate) enum WorkError {
    #[error("conflict: the object changed since it was read")]
    Conflict,
    #[error("{0}")]
    Api(#[from] kube::Error),
    #[error("{error}")]
    Image { error: ImageError, infeasible: bool },
}

impl WorkError {
    pub(crate) fn category(&self) -> &'static str {
        match self {
            WorkError::Conflict => "Conflict",
            WorkError::Api(_) => "ApiError",
            WorkError::Image { infeasible: true, .. } => "Infeasible",
            WorkError::Image { .. } => "ImageError",
        }
    }

    /// An infeasible expansion is not retried on a timer; a changed request (or the slow retry
    /// of the core) starts the next attempt.
    pub(crate) fn retry(&self) -> bool {
        !matches!(self, WorkError::Image { infeasible: true, .. })
    }
}

pub(crate) fn api_err(e: kube::Error) -> WorkError {
    if is_conflict(&e) {
        WorkError::Conflict
    } else {
        WorkError::Api(e)
    }
}

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
