//! Offline repairs: the `e2fsck -f -p` and `resize2fs` stage runs before mounting an ext4 that is
//! smaller than its device.
//!
//! Either tool killed halfway can leave the file system inconsistent, and a CO cancels a slow
//! stage (the kubelet's CSI timeout, a client gone) by dropping the RPC, so the repair is not
//! the RPC's: it runs in a task of its own, with no time limit and no kill, and holds the
//! volume's operation lock until it ends. The stage that started it waits a while for it; a later
//! stage finds it still running (Aborted, the CO retries) or finished, and takes its result.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tonic::Status;

use crate::csi::{VolumeGuard, sys_status};
use crate::fence;

/// How long the stage that starts a repair waits for it before answering Aborted. Only the
/// waiting stops then; the repair goes on.
pub const REPAIR_WAIT: Duration = Duration::from_secs(60);

/// The programs a repair runs: `e2fsck` and `resize2fs` unless a test puts something in front.
#[derive(Debug, Clone)]
pub struct RepairTools {
    pub e2fsck: String,
    pub resize2fs: String,
}

impl Default for RepairTools {
    fn default() -> Self {
        Self {
            e2fsck: "e2fsck".into(),
            resize2fs: "resize2fs".into(),
        }
    }
}

/// `None` while the repair runs, then its result.
type Outcome = Option<Result<(), Status>>;

struct Repair {
    device: String,
    outcome: watch::Receiver<Outcome>,
}

/// The node's offline repairs, running or finished and not yet taken, by volume id.
#[derive(Clone)]
pub struct OfflineRepairs {
    repairs: Arc<Mutex<HashMap<String, Repair>>>,
    tools: Arc<RepairTools>,
    wait: Duration,
}

impl Default for OfflineRepairs {
    fn default() -> Self {
        Self::new(RepairTools::default(), REPAIR_WAIT)
    }
}

impl std::fmt::Debug for OfflineRepairs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<String> = self.lock().keys().cloned().collect();
        f.debug_struct("OfflineRepairs")
            .field("volumes", &ids)
            .field("tools", &self.tools)
            .field("wait", &self.wait)
            .finish()
    }
}

fn in_progress(id: &str, device: &str) -> Status {
    Status::aborted(format!(
        "an offline check and resize of volume {id}'s file system on {device} (e2fsck, resize2fs) \
         is in progress; it runs to its end, never interrupted: retry later"
    ))
}

impl OfflineRepairs {
    /// `wait`: how long the stage that starts a repair waits for it.
    pub fn new(tools: RepairTools, wait: Duration) -> Self {
        Self {
            repairs: Arc::default(),
            tools: Arc::new(tools),
            wait,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Repair>> {
        self.repairs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Aborted, saying so, when a repair of `id` is running.
    pub fn busy(&self, id: &str) -> Option<Status> {
        let repairs = self.lock();
        let r = repairs.get(id)?;
        let running = r.outcome.borrow().is_none() && r.outcome.has_changed().is_ok();
        running.then(|| in_progress(id, &r.device))
    }

    /// The result of a finished repair of `id`, once (it is forgotten then).
    pub fn take_finished(&self, id: &str) -> Option<Result<(), Status>> {
        let mut repairs = self.lock();
        let r = repairs.get(id)?;
        let outcome = r.outcome.borrow().clone();
        let result = match outcome {
            Some(result) => result,
            // The task ended without a result (it panicked or the runtime is going away).
            None if r.outcome.has_changed().is_err() => Err(Status::internal(format!(
                "the offline check and resize of volume {id} on {} ended without a result",
                r.device
            ))),
            None => return None,
        };
        repairs.remove(id);
        Some(result)
    }

    /// Forgets a finished repair's result (unstage: the next stage looks afresh).
    pub fn forget(&self, id: &str) {
        let _ = self.take_finished(id);
    }

    /// Starts the repair of `device`, which holds `guard` (the volume's operation lock) until it
    /// ends, then waits for it up to the configured time.
    /// `record`: where the repair keeps this node's record of it while its tools run
    /// (`fence::repair`).
    pub async fn run(
        &self,
        id: &str,
        device: &str,
        record: PathBuf,
        guard: Arc<VolumeGuard>,
    ) -> Result<(), Status> {
        let (tx, rx) = watch::channel(None);
        self.lock().insert(
            id.to_string(),
            Repair {
                device: device.to_string(),
                outcome: rx.clone(),
            },
        );
        let tools = self.tools.clone();
        let (volume, dev) = (id.to_string(), device.to_string());
        // Spawned, not awaited here: dropping the RPC must not drop (kill) the repair.
        tokio::spawn(async move {
            let result = repair(&tools, &dev, &record).await;
            match &result {
                Ok(()) => tracing::info!(volume, device = dev, "offline check and resize done"),
                Err(e) => {
                    tracing::warn!(volume, device = dev, error = %e.message(), "offline check and resize failed")
                }
            }
            // The result is in place before the lock is free, so the next call finds it.
            tx.send_replace(Some(result));
            drop(guard);
        });
        self.wait_for(id, device, rx).await
    }

    async fn wait_for(&self, id: &str, device: &str, mut rx: watch::Receiver<Outcome>) -> Result<(), Status> {
        match tokio::time::timeout(self.wait, rx.wait_for(Option::is_some)).await {
            Err(_) => Err(in_progress(id, device)),
            Ok(_) => self.take_finished(id).unwrap_or(Ok(())),
        }
    }

    /// Waits until every running repair has ended (a server shutting down lets them finish).
    pub async fn wait_all(&self) {
        let running: Vec<_> = self.lock().values().map(|r| r.outcome.clone()).collect();
        for mut rx in running {
            let _ = rx.wait_for(Option::is_some).await;
        }
    }
}

async fn repair(tools: &RepairTools, dev: &str, record: &Path) -> Result<(), Status> {
    fence::repair(&tools.e2fsck, &tools.resize2fs, dev, record)
        .await
        .map_err(|(step, e)| sys_status(step, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csi::VolumeLocks;
    use tonic::Code;

    /// A program that waits for `release` to exist, then exits with the code in `release`.
    fn held_tool(dir: &Path, name: &str) -> String {
        let path = dir.join(name);
        let release = dir.join(format!("{name}.release"));
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\nwhile [ ! -e {r} ]; do sleep 0.02; done\necho \"$@\" >> {r}.args\nexit $(cat {r})\n",
                r = release.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path.display().to_string()
    }

    fn release(dir: &Path, name: &str, code: i32) {
        let tmp = dir.join(format!("{name}.tmp"));
        std::fs::write(&tmp, code.to_string()).unwrap();
        std::fs::rename(tmp, dir.join(format!("{name}.release"))).unwrap();
    }

    #[tokio::test]
    async fn a_repair_outlives_its_caller_holds_the_lock_and_leaves_its_result() {
        let dir = tempfile::tempdir().unwrap();
        let tools = RepairTools {
            e2fsck: "true".into(),
            resize2fs: held_tool(dir.path(), "resize"),
        };
        let repairs = OfflineRepairs::new(tools, Duration::from_secs(3600));
        let locks = VolumeLocks::default();
        let guard = Arc::new(locks.try_lock("v").unwrap());

        // The caller is dropped while it waits (an RPC cancelled).
        let call = tokio::spawn({
            let repairs = repairs.clone();
            let record = dir.path().join("record");
            async move { repairs.run("v", "/dev/fake", record, guard).await }
        });
        while repairs.busy("v").is_none() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        call.abort();
        assert!(call.await.unwrap_err().is_cancelled());

        let busy = repairs.busy("v").expect("still running");
        assert_eq!(busy.code(), Code::Aborted);
        assert!(busy.message().contains("in progress"), "{busy:?}");
        assert!(repairs.take_finished("v").is_none());
        assert!(locks.try_lock("v").is_err(), "the repair holds the volume's lock");
        assert!(repairs.busy("w").is_none() && repairs.take_finished("w").is_none());

        release(dir.path(), "resize", 0);
        tokio::time::timeout(Duration::from_secs(30), repairs.wait_all())
            .await
            .unwrap();
        assert!(repairs.busy("v").is_none());
        // The result is in place before the lock is free.
        let _lock = loop {
            if let Ok(l) = locks.try_lock("v") {
                break l;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert!(repairs.take_finished("v").unwrap().is_ok());
        assert!(repairs.take_finished("v").is_none(), "taken once");
        let args = std::fs::read_to_string(dir.path().join("resize.release.args")).unwrap();
        assert_eq!(args.trim(), "/dev/fake", "ran once, on the device");
    }

    #[tokio::test]
    async fn a_caller_stops_waiting_after_its_time_and_a_failure_is_reported_once() {
        let dir = tempfile::tempdir().unwrap();
        let tools = RepairTools {
            e2fsck: held_tool(dir.path(), "fsck"),
            resize2fs: "true".into(),
        };
        let repairs = OfflineRepairs::new(tools, Duration::from_millis(50));
        let locks = VolumeLocks::default();
        let guard = Arc::new(locks.try_lock("v").unwrap());
        let e = repairs
            .run("v", "/dev/fake", dir.path().join("record"), guard)
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Aborted, "{e:?}");
        assert!(e.message().contains("in progress"), "{e:?}");
        assert!(repairs.busy("v").is_some());

        // e2fsck's 4: errors left uncorrected; resize2fs never runs after it.
        release(dir.path(), "fsck", 4);
        repairs.wait_all().await;
        let e = repairs.take_finished("v").unwrap().unwrap_err();
        assert_eq!(e.code(), Code::Internal, "{e:?}");
        assert!(
            e.message().starts_with("e2fsck: ") && e.message().contains("exit Some(4)"),
            "{e:?}"
        );
        assert!(repairs.take_finished("v").is_none());

        // Taken: the next one starts afresh (and now succeeds).
        let guard = Arc::new(locks.try_lock("v").unwrap());
        release(dir.path(), "fsck", 0);
        if let Err(e) = repairs
            .run("v", "/dev/fake", dir.path().join("record"), guard)
            .await
        {
            // A slow machine: 50 ms may not be enough for two processes.
            assert_eq!(e.code(), Code::Aborted, "{e:?}");
            repairs.wait_all().await;
            repairs.take_finished("v").unwrap().unwrap();
        }
        assert!(repairs.take_finished("v").is_none());
        let args = std::fs::read_to_string(dir.path().join("fsck.release.args")).unwrap();
        assert_eq!(args.lines().count(), 2, "one e2fsck per repair: {args}");
    }
}
