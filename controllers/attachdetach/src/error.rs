//! The controller's one error type. `metric_label()` is the `error` label of
//! `stowage_attachdetach_reconcile_errors_total`, in the vocabulary every controller shares
//! (`stowage_common::errors`).

use stowage_common::errors::{MetricLabel, PANIC, api_label, is_conflict, is_not_found};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Api(#[from] kube::Error),
    /// The node still advertises the volume and could not be told otherwise: never detach then.
    #[error("node status not updated before detach: {0}")]
    NodeStatus(String),
    /// The live Node lists the volume in `status.volumesInUse` (upstream's
    /// `verifyVolumeIsSafeToDetach`): the informer's copy was older than the node's truth.
    #[error("volume is still in use on node {0} (status.volumesInUse); detach refused")]
    StillInUse(String),
    /// The live Node could not be read, so the detach could not be proven safe.
    #[error("could not read node {node} to check that the volume is unmounted: {error}")]
    NodeUnreadable { node: String, error: String },
    /// The live Node exists without the out-of-service taint: the node came back since the
    /// informer's copy, so its own agent detaches the volume; releasing the attachment for it
    /// could leave the volume attached and mounted there.
    #[error("node {0} is back in service; its attachment is left to its own detach")]
    NodeBack(String),
    /// The write task panicked (a bug); its work is retried with backoff like any failure.
    #[error("the write task panicked")]
    Panic,
}

impl Error {
    pub fn is_conflict(&self) -> bool {
        matches!(self, Error::Api(e) if is_conflict(e))
    }

    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::Api(e) if is_not_found(e))
    }
}

impl MetricLabel for Error {
    fn metric_label(&self) -> &'static str {
        match self {
            Error::Api(e) => api_label(e),
            Error::NodeStatus(_) => "node_status_not_updated",
            Error::StillInUse(_) => "volume_in_use",
            Error::NodeUnreadable { .. } => "node_unreadable",
            Error::NodeBack(_) => "node_back",
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
        assert!(api(409).is_conflict() && !api(404).is_conflict());
        assert!(api(404).is_not_found());
        assert_eq!(
            Error::NodeStatus("x".into()).metric_label(),
            "node_status_not_updated"
        );
        assert_eq!(Error::StillInUse("n".into()).metric_label(), "volume_in_use");
        assert_eq!(Error::Panic.metric_label(), "panic");
    }
}
