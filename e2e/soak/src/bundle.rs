//! What a run leaves behind: the log scan for panics, object dumps, and the bundle of a failing
//! (or `--keep`) run.

use std::path::{Path, PathBuf};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::events::v1::Event as KubeEvent;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::Client;
use kube::api::{Api, ListParams};

use crate::Options;
use crate::report::{Record, Summary};

/// A panic in any controller or agent log is a violation (they must turn bad input into Events
/// and retries, never panic).
pub(crate) fn scan_logs(record: &Record, dirs: &[PathBuf]) {
    for d in dirs {
        let Ok(rd) = std::fs::read_dir(d) else { continue };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !(name.starts_with("controller-") || name.starts_with("soak-node-")) {
                continue;
            }
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            record.checks("no-panic-in-logs", 1);
            for (i, line) in text.lines().enumerate() {
                if line.contains("panicked at") || line.contains("RUST_BACKTRACE") {
                    record.violation(
                        &format!("panic:{name}:{i}"),
                        "panic in a log",
                        format!("{name}:{}: {line}", i + 1),
                    );
                }
            }
        }
    }
}

/// Object dumps (JSON) for the bundle.
pub(crate) async fn dump(client: &Client, to: &Path) {
    let _ = std::fs::create_dir_all(to);
    let lp = ListParams::default();
    macro_rules! put {
        ($file:literal, $api:expr) => {
            let text = match $api.list(&lp).await {
                Ok(l) => serde_json::to_string_pretty(&l.items).unwrap_or_default(),
                Err(e) => format!("{{\"error\": {:?}}}", e.to_string()),
            };
            let _ = std::fs::write(to.join($file), text);
        };
    }
    put!(
        "persistentvolumes.json",
        Api::<PersistentVolume>::all(client.clone())
    );
    put!(
        "persistentvolumeclaims.json",
        Api::<PersistentVolumeClaim>::all(client.clone())
    );
    put!(
        "volumeattachments.json",
        Api::<VolumeAttachment>::all(client.clone())
    );
    put!("nodes.json", Api::<Node>::all(client.clone()));
    put!("pods.json", Api::<Pod>::all(client.clone()));
    put!("events.json", Api::<KubeEvent>::all(client.clone()));
    put!("leases.json", Api::<Lease>::all(client.clone()));
}

/// Copies logs, dumps and the timeline into `<results>/soak-<seed>-<unix time>/`.
pub(crate) fn bundle(opts: &Options, dir: &Path, summary: &Summary) -> anyhow::Result<PathBuf> {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let out = opts.results.join(format!("soak-{}-{stamp}", opts.seed));
    std::fs::create_dir_all(out.join("logs"))?;
    let copy_dir = |from: &Path, to: &Path, only_logs: bool| {
        let _ = std::fs::create_dir_all(to);
        if let Ok(rd) = std::fs::read_dir(from) {
            for e in rd.flatten() {
                let name = e.file_name();
                let n = name.to_string_lossy();
                if e.path().is_file() && (!only_logs || n.ends_with(".log")) {
                    let _ = std::fs::copy(e.path(), to.join(&name));
                }
            }
        }
    };
    copy_dir(&dir.join("logs"), &out.join("logs"), true);
    copy_dir(&dir.join("cp"), &out.join("logs"), true);
    copy_dir(&dir.join("dumps-quiesced"), &out.join("dumps-quiesced"), false);
    copy_dir(&dir.join("dumps-final"), &out.join("dumps-final"), false);
    let _ = std::fs::copy(dir.join("timeline.jsonl"), out.join("timeline.jsonl"));
    std::fs::write(out.join("summary.txt"), summary.render())?;
    std::fs::write(out.join("summary.json"), serde_json::to_string_pretty(summary)?)?;
    Ok(out)
}
