//! The CSI v1 services of `loop.stowage.dev`: Identity, Node and Controller over gRPC.
//!
//! Every method checks its arguments first (InvalidArgument), then whether the volume exists
//! (NotFound), then takes the volume's operation lock (Aborted when another call on the same
//! volume is running), and only then touches the image, the device or the mount table. Every
//! method is idempotent: a repeat of a call that succeeded succeeds again and changes nothing.

pub mod authority;
pub mod caps;
pub mod controller;
pub mod identity;
pub mod metrics;
pub mod node;
pub mod registration;
pub mod server;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use tonic::Status;

/// The generated CSI v1 messages and services (`csi.proto` of the pinned spec module).
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("csi.v1");
}

pub use caps::{Mode, Requested};

/// Volumes with an operation in flight. CSI lets a CO send a second call for a volume while the
/// first runs; the answer is Aborted, and the CO retries (the spec's "operation pending").
#[derive(Debug, Clone, Default)]
pub struct VolumeLocks(Arc<Mutex<HashSet<String>>>);

pub struct VolumeGuard {
    set: Arc<Mutex<HashSet<String>>>,
    id: String,
}

impl VolumeLocks {
    pub fn try_lock(&self, id: &str) -> Result<VolumeGuard, Status> {
        let mut set = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if !set.insert(id.to_string()) {
            return Err(Status::aborted(format!(
                "an operation on volume {id} is already in progress"
            )));
        }
        Ok(VolumeGuard {
            set: self.0.clone(),
            id: id.to_string(),
        })
    }
}

impl Drop for VolumeGuard {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

/// A required string argument.
pub(crate) fn required<'a>(value: &'a str, what: &str) -> Result<&'a str, Status> {
    if value.is_empty() {
        Err(Status::invalid_argument(format!("{what} is required")))
    } else {
        Ok(value)
    }
}

/// Errors of the node's tools, as CSI codes: a tool that did not answer in time may still be
/// working (Aborted would invite an immediate retry onto a busy device; Unavailable backs off),
/// anything else is Internal with the tool's own words.
pub(crate) fn sys_status(what: &str, e: crate::sys::SysError) -> Status {
    match e {
        crate::sys::SysError::Timeout { .. } => Status::unavailable(format!("{what}: {e}")),
        // The mount did not happen and will not until the other user is gone: a final error
        // (the kubelet keeps no uncertain mount), retried as the CO retries any stage.
        crate::sys::SysError::Fenced(_) => Status::failed_precondition(format!("{what}: {e}")),
        e => Status::internal(format!("{what}: {e}")),
    }
}

pub(crate) fn image_status(e: crate::ImageError) -> Status {
    use std::io::ErrorKind;
    match &e {
        crate::ImageError::BadHandle(_) => Status::invalid_argument(e.to_string()),
        crate::ImageError::Io { source, .. } => match source.kind() {
            ErrorKind::NotFound => Status::not_found(e.to_string()),
            ErrorKind::FileTooLarge | ErrorKind::InvalidInput => Status::out_of_range(e.to_string()),
            ErrorKind::StorageFull | ErrorKind::QuotaExceeded => Status::resource_exhausted(e.to_string()),
            _ => Status::internal(e.to_string()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_operation_on_a_volume_is_aborted_until_the_first_ends() {
        let locks = VolumeLocks::default();
        let g = locks.try_lock("v").unwrap();
        assert_eq!(locks.try_lock("v").err().unwrap().code(), tonic::Code::Aborted);
        let _other = locks.try_lock("w").expect("other volumes are independent");
        drop(g);
        locks.try_lock("v").expect("free again once the first ended");
    }
}
