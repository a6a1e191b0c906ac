//! What the soak checks on the host itself, every second: one kernel plays every node here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Mutex;

use crate::cluster::Roots;
use crate::host;
use crate::report::Record;
use crate::workload::LOOP_DRIVER;

/// No volume's device is mounted under two nodes' directories at once (one kernel here plays
/// both nodes, so this is what "two writers" looks like on the host).
pub(crate) fn check_device_mounts(record: &Record, roots: &Roots) {
    let mut by_volume: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (node, root) in roots {
        let global = root.join("plugins").join(LOOP_DRIVER).join("globalmount");
        for m in host::mounts_under(&global).unwrap_or_default() {
            if let Some(pv) = m.target.file_name() {
                by_volume
                    .entry(pv.to_string_lossy().into_owned())
                    .or_default()
                    .insert(node.clone());
            }
        }
    }
    record.checks("single-writer-mount", 1);
    for (pv, nodes) in by_volume {
        if nodes.len() > 1 {
            record.violation(
                &format!("mount2:{pv}:{nodes:?}"),
                "volume mounted on two nodes",
                format!("{pv} has device mounts under {nodes:?}"),
            );
        }
    }
}

/// No image is backed by two loop devices at once: two devices are two writers of one file
/// system, whichever nodes they belong to (the attachment and mount checks see only what the API
/// and the mount table say). Matched by inode on the image store's own file system.
///
/// Except a partitioned node's device (`fenced`): its kernel keeps it while another node attaches
/// the image, as a real one would, and multi-mount protection is what keeps the second device
/// from being mounted (the mount check above still applies, and the partition's own check).
pub(crate) fn check_image_devices(record: &Record, images: &Path, fenced: &Mutex<BTreeSet<String>>) {
    let twice = match host::loop_devices().and_then(|d| Ok(host::images_on_two_devices(images, &d)?)) {
        Ok(t) => t,
        Err(e) => {
            record.note("loop-device-list-failed", &format!("{e:#}"));
            return;
        }
    };
    record.checks("single-writer-loop-device", 1);
    let fenced = fenced.lock().unwrap_or_else(|p| p.into_inner()).clone();
    for (image, devices) in twice {
        let unfenced = devices.iter().filter(|d| !fenced.contains(*d)).count();
        if unfenced <= 1 && devices.len() == 2 {
            record.checks("partitioned-device-fenced", 1);
            continue;
        }
        record.violation(
            &format!("loop2:{image}:{devices:?}"),
            "image backed by two loop devices",
            format!("{image} is backed by {devices:?} at once"),
        );
    }
}

/// The host checks, once.
pub(crate) fn check_host(record: &Record, roots: &Roots, images: &Path, fenced: &Mutex<BTreeSet<String>>) {
    check_device_mounts(record, roots);
    check_image_devices(record, images, fenced);
}
