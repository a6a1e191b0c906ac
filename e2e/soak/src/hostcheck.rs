//! What the soak checks on the host itself, every second: one kernel plays every node here.

use std::collections::{BTreeMap, BTreeSet};

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
