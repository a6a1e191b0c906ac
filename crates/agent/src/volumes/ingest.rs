//! What the volume manager sees: the desired state from the caches and the actual state from
//! the mount table and the directories on disk.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use futures::future::join_all;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::ObjectRef;

use super::*;
use crate::ctx::Ctx;
use crate::error::Error;
use crate::mountinfo::{self, MountEntry};
use crate::paths::Place;
use crate::probe::{self, Answer, Health, Prober};
use crate::state::{Actual, Desired, Lookups, Mounted, PodMount, desired};
use crate::sys;

pub(crate) async fn observe_and_decide(
    ctx: &Ctx,
    link: &NodeLink,
    expanded: &BTreeMap<String, String>,
    prober: &Prober,
) -> Result<(Desired, Actual), Error> {
    // The node first: without it nothing can be decided safely.
    let a = observe(ctx, prober).await?;
    let reported = link.reported.borrow().clone();
    let attached = link
        .node
        .store()
        .get(&ObjectRef::new(&ctx.node))
        .map(|n| volumes_attached(&n))
        .unwrap_or_default();
    let pods = ctx.pods.store().state();
    let d = {
        let lookups = Lookups {
            pvc: &|ns, n| ctx.pvc(ns, n),
            pv: &|n| ctx.pv(n),
            va: &|pv, h| ctx.va_for(pv, h),
            reported: &reported,
            attached: &attached,
            expanded,
            now: Timestamp::now(),
        };
        desired(pods.iter().map(|p| p.as_ref()), &lookups)
    };
    Ok((d, a))
}

/// The unique names a Node's status lists in `volumesAttached`.
pub(crate) fn volumes_attached(node: &Node) -> BTreeSet<String> {
    node.status
        .iter()
        .flat_map(|s| s.volumes_attached.iter().flatten())
        .map(|v| v.name.clone())
        .collect()
}

/// The actual state: mounts under the root dir from the mount table, plus leftover directories
/// and block device files found on disk, each judged for health. Any read error of the table or
/// of the directories is an error, never an empty (or partial) state.
pub async fn observe(ctx: &Ctx, prober: &Prober) -> Result<Actual, Error> {
    let table = mountinfo::read_from(&ctx.mount_table)
        .await
        .map_err(|error| Error::MountTable {
            path: ctx.mount_table.display().to_string(),
            error,
        })?;
    let layout = &ctx.layout;
    let mut places: BTreeMap<Place, Vec<MountEntry>> = BTreeMap::new();
    for m in table {
        if let Some(p) = layout.parse(&m.mount_point) {
            places.entry(p).or_default().push(m);
        }
    }
    for p in scan_dirs(layout).await? {
        places.entry(p).or_default();
    }
    let seen: BTreeSet<_> = places.keys().map(|p| layout.path_of(p)).collect();
    let checks = places.into_iter().map(|(place, entries)| async move {
        let path = layout.path_of(&place);
        let state = match &place {
            Place::PodDevice { .. } => device_file_state(&path).await,
            _ => mount_state(prober, &path, &entries).await,
        };
        (place, state)
    });
    let mut actual = Actual::default();
    for (place, state) in join_all(checks).await {
        match place {
            Place::Global { pv } => actual.volumes.entry(pv).or_default().device = Some(state),
            Place::PodMount { uid, pv } => {
                actual
                    .volumes
                    .entry(pv)
                    .or_default()
                    .pods
                    .insert(uid, PodMount { block: false, state });
            }
            Place::PodDevice { uid, pv } => {
                actual
                    .volumes
                    .entry(pv)
                    .or_default()
                    .pods
                    .insert(uid, PodMount { block: true, state });
            }
        }
    }
    prober.retain_seen(&seen);
    Ok(actual)
}

/// A mount's health, judged from its probe (`probe::judge`): the top mount's device as `stat`
/// shows it, and its source device node's numbers.
pub(crate) async fn mount_state(prober: &Prober, path: &Path, entries: &[MountEntry]) -> Mounted {
    let Some(top) = entries.last() else {
        return Mounted::absent();
    };
    let (answer, _) = prober.ask(path).await;
    let source_devno = match answer {
        Answer::Stat(Ok(_)) => sys::rdev(Path::new(&top.source)).await,
        _ => None,
    };
    Mounted {
        mounted: true,
        health: probe::judge(&answer, top.devno, &top.source, source_devno),
        devno: Some(top.devno),
        source: Some(top.source.clone()),
        read_only: top.read_only(),
    }
}

/// A block volume's device file is healthy while the loop device it names is still bound.
pub(crate) async fn device_file_state(path: &Path) -> Mounted {
    let meta = tokio::fs::symlink_metadata(path).await.ok();
    let devno = meta
        .filter(|m| m.file_type().is_block_device())
        .map(|m| mountinfo::split_dev(m.rdev()));
    let health = match devno {
        Some((maj, min)) => {
            let sysfs = format!("/sys/dev/block/{maj}:{min}/loop/backing_file");
            if tokio::fs::metadata(sysfs).await.is_ok() {
                Health::Healthy
            } else {
                Health::Broken(format!("loop device {maj}:{min} is no longer bound"))
            }
        }
        None => Health::Unknown("no device node".into()),
    };
    Mounted {
        mounted: devno.is_some(),
        health,
        devno,
        source: None,
        read_only: false,
    }
}

/// Names in `dir`; a directory that does not exist is empty, any other error is an error (a
/// directory that cannot be read must not look like one without volumes).
pub(crate) async fn list(dir: &Path) -> Result<Vec<String>, Error> {
    let err = |error| Error::VolumeDirs {
        path: dir.display().to_string(),
        error,
    };
    let mut rd = match tokio::fs::read_dir(dir).await {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(err(e)),
    };
    let mut out = vec![];
    while let Some(e) = rd.next_entry().await.map_err(err)? {
        if let Some(n) = e.file_name().to_str() {
            out.push(n.to_string());
        }
    }
    Ok(out)
}

/// Directories and files the agent made that may outlive their mounts (a crash between mount
/// and bookkeeping, a failed teardown): found here, they are cleaned up or reused.
pub(crate) async fn scan_dirs(layout: &crate::paths::Layout) -> Result<Vec<Place>, Error> {
    let mut out = vec![];
    for pv in list(&layout.global_dir()).await? {
        out.push(Place::Global { pv });
    }
    for uid in list(&layout.pods_dir()).await? {
        let pod = layout.pods_dir().join(&uid);
        for pv in list(&pod.join("volumes").join(crate::paths::CSI_PLUGIN_DIR)).await? {
            out.push(Place::PodMount { uid: uid.clone(), pv });
        }
        for pv in list(&pod.join("volumeDevices").join(crate::paths::CSI_PLUGIN_DIR)).await? {
            out.push(Place::PodDevice { uid: uid.clone(), pv });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_common::errors::MetricLabel;

    #[tokio::test]
    async fn an_unreadable_directory_is_an_error_not_an_empty_one() {
        let dir = std::env::temp_dir().join(format!("stowage-list-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("v1")).unwrap();
        assert_eq!(list(&dir).await.unwrap(), vec!["v1".to_string()]);
        assert!(
            list(&dir.join("missing")).await.unwrap().is_empty(),
            "absent is empty"
        );
        // Not a directory (as any other read error): the pass must not go on without it.
        std::fs::write(dir.join("file"), b"").unwrap();
        let e = list(&dir.join("file")).await.unwrap_err();
        assert_eq!(e.reason(), "VolumeDirUnreadable");
        assert_eq!(e.metric_label(), "volume_dirs");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
