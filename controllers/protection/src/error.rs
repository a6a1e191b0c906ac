//! The protection controllers' one error type. Its `metric_label` is the `error` label of
//! `stowage_protection_reconcile_errors_total`.

use stowage_common::errors::{MetricLabel, api_label};

/// Why a sync did not finish.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The object changed since we read it (a failed `test` of the guarded patch, or a
    /// conflict): look again.
    #[error("object changed since it was read")]
    Stale,
    /// Anything else the apiserver or the connection said.
    #[error("{0}")]
    Api(kube::Error),
}

impl MetricLabel for Error {
    fn metric_label(&self) -> &'static str {
        match self {
            // A failed `test` (422) means the same as a 409: someone wrote first.
            Error::Stale => "conflict",
            Error::Api(e) => api_label(e),
        }
    }
}
