//! The agent's one error type: why the volume manager could not see the node. Nothing is decided
//! or published on such a pass: an empty table read as "nothing mounted" would drop every volume
//! from `volumesInUse` and let the controller detach what pods are using. `metric_label()` is the
//! `error` label of `stowage_agent_observe_errors_total`. (A failed operation step is reported
//! by its Events and logs and counted by operation; it never becomes a label of its own.)

use stowage_common::errors::MetricLabel;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read the mount table {path}: {error}")]
    MountTable { path: String, error: std::io::Error },
    #[error("cannot list {path}: {error}")]
    VolumeDirs { path: String, error: std::io::Error },
}

impl Error {
    /// The Event reason on the Node.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::MountTable { .. } => "MountTableUnreadable",
            Error::VolumeDirs { .. } => "VolumeDirUnreadable",
        }
    }
}

impl MetricLabel for Error {
    fn metric_label(&self) -> &'static str {
        match self {
            Error::MountTable { .. } => "mount_table",
            Error::VolumeDirs { .. } => "volume_dirs",
        }
    }
}
