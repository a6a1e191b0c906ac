//! The controller's error type.

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
}

impl Error {
    /// A stable category, used as metric label.
    pub fn category(&self) -> &'static str {
        match self {
            Error::NodeStatus(_) => "NodeStatusNotUpdated",
            Error::StillInUse(_) => "VolumeInUse",
            Error::NodeUnreadable { .. } => "NodeUnreadable",
            Error::Api(e) => api_category(e),
        }
    }
}

pub(crate) fn api_category(e: &kube::Error) -> &'static str {
    match e {
        kube::Error::Api(s) => match s.code {
            403 => "Forbidden",
            404 => "NotFound",
            409 => "Conflict",
            422 => "Invalid",
            429 => "Throttled",
            _ => "ApiError",
        },
        _ => "ApiError",
    }
}

pub(crate) fn code_is(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}
