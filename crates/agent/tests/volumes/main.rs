//! The agent against the real apiserver, with real loop devices, ext4 and mounts. No controllers
//! run: the tests create VolumeAttachments where the attach/detach controller would (and delete
//! them only once the node no longer lists the volume in use, as it does).

mod env;
mod faults;
mod lifecycle;
mod observe;
mod store;
mod sweep;
