//! Mount health. A mount is judged broken only from what asking it returns, the way upstream's
//! mount-utils (`IsCorruptedMnt`) and the kubelet do: an error that means the file system behind
//! the path is gone (ENOTCONN, ESTALE, EIO, EACCES, EHOSTDOWN), or an answer that names another
//! device than the mount table. A probe that has not answered is *pending*: slow is not broken,
//! and a running pod's volume is never torn down for being slow.
//!
//! A `stat` stuck in the kernel (a hung network or FUSE file system, a dead image store) cannot
//! be cancelled, so each probe runs on its own detached thread, at most one per path: a path
//! whose previous probe has not returned gets no new thread and is reported pending. The number
//! of stuck threads is therefore bounded by the number of mounts, never by time, and they never
//! occupy the runtime's blocking pool (nor hold up the agent's exit).

use std::collections::{BTreeSet, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use prometheus::IntGauge;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::mountinfo::{DevNo, split_dev};

/// How long a pass waits for a fresh probe before calling the mount pending.
pub const PROBE_WAIT: Duration = Duration::from_secs(2);

/// Linux errno values that mean "the file system behind this path is gone or unusable"
/// (mount-utils' corrupted-mount set).
pub const CORRUPTED: [(i32, &str); 5] = [
    (107, "ENOTCONN"),
    (116, "ESTALE"),
    (5, "EIO"),
    (13, "EACCES"),
    (112, "EHOSTDOWN"),
];

/// Is this errno one of a corrupted mount?
pub fn is_corrupted(errno: Option<i32>) -> bool {
    errno.is_some_and(|e| CORRUPTED.iter().any(|(c, _)| *c == e))
}

/// A failed `stat`, kept as data (errno and words).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatError {
    pub errno: Option<i32>,
    pub message: String,
}

impl StatError {
    fn of(e: &std::io::Error) -> Self {
        Self {
            errno: e.raw_os_error(),
            message: e.to_string(),
        }
    }
}

/// What asking a mount point returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The probe has not returned (yet).
    Pending,
    /// `stat` returned: the path's `st_dev`, or the error.
    Stat(Result<DevNo, StatError>),
}

/// The judgement of one mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    /// Answers and shows the device the mount table names, whose node still has those numbers.
    Healthy,
    /// No answer yet: slow or hung. Left in place, reported; never torn down for this.
    Pending,
    /// Known broken (a corrupted-mount error or another device than the table's): may be torn
    /// down and mounted again. The reason in words.
    Broken(String),
    /// An error that does not prove corruption: left in place, reported, asked again.
    Unknown(String),
}

impl Health {
    pub fn is_broken(&self) -> bool {
        matches!(self, Health::Broken(_))
    }

    /// Neither healthy nor known broken: nothing may be done to it, it is only reported.
    pub fn is_unsure(&self) -> bool {
        matches!(self, Health::Pending | Health::Unknown(_))
    }
}

/// Judges a mount from the probe's answer, the device numbers the table names for its top mount,
/// and the numbers its source device node has now (`None`: not a device node, or gone). Pure.
pub fn judge(answer: &Answer, table: DevNo, source: &str, source_devno: Option<DevNo>) -> Health {
    let seen = match answer {
        Answer::Pending => return Health::Pending,
        Answer::Stat(Err(e)) if is_corrupted(e.errno) => {
            return Health::Broken(format!("stat failed: {}", e.message));
        }
        Answer::Stat(Err(e)) => return Health::Unknown(format!("stat failed: {}", e.message)),
        Answer::Stat(Ok(seen)) => *seen,
    };
    if seen != table {
        return Health::Broken(format!(
            "the path shows device {}:{} but the mount table names {}:{} (something is mounted over it)",
            seen.0, seen.1, table.0, table.1
        ));
    }
    match source_devno {
        Some(d) if d == table => Health::Healthy,
        Some(d) => Health::Broken(format!(
            "its source {source} is now device {}:{}, not {}:{}",
            d.0, d.1, table.0, table.1
        )),
        None => Health::Broken(format!("its source {source:?} is not a device node (any more)")),
    }
}

/// One probe thread's result, `None` until it returns.
type Slot = watch::Receiver<Option<Result<DevNo, StatError>>>;

struct InFlight {
    rx: Slot,
    since: Instant,
}

/// Runs `stat` probes, one thread per path at most. Shared by the concurrent checks of a pass.
pub struct Prober {
    slots: Mutex<HashMap<PathBuf, InFlight>>,
    /// Probe threads that have not returned (the `stowage_agent_mount_probes_in_flight` gauge).
    in_flight: IntGauge,
    wait: Duration,
    /// The probe itself; `stat` in production.
    probe: fn(&Path) -> std::io::Result<DevNo>,
}

fn stat_probe(path: &Path) -> std::io::Result<DevNo> {
    std::fs::metadata(path).map(|m| split_dev(m.dev()))
}

impl Prober {
    pub fn new(in_flight: IntGauge) -> Self {
        Self::with_probe(in_flight, PROBE_WAIT, stat_probe)
    }

    /// With another probe and wait (tests).
    pub fn with_probe(
        in_flight: IntGauge,
        wait: Duration,
        probe: fn(&Path) -> std::io::Result<DevNo>,
    ) -> Self {
        Self {
            slots: Mutex::new(HashMap::new()),
            in_flight,
            wait,
            probe,
        }
    }

    /// Asks `path`. When its previous probe is still out, answers `Pending` at once (with how
    /// long it has been out) and starts nothing; else starts one probe and waits for it a little.
    pub async fn ask(&self, path: &Path) -> (Answer, Option<Duration>) {
        let mut rx = {
            let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(f) = slots.get(path) {
                if f.rx.borrow().is_none() && f.rx.has_changed().is_ok() {
                    return (Answer::Pending, Some(f.since.elapsed()));
                }
                // Answered since (late): ask afresh, an old answer may be stale.
                slots.remove(path);
            }
            let (tx, rx) = watch::channel(None);
            let gauge = self.in_flight.clone();
            let probe = self.probe;
            let owned = path.to_path_buf();
            gauge.inc();
            let spawned = std::thread::Builder::new()
                .name("mount-probe".into())
                .spawn(move || {
                    let r = probe(&owned).map_err(|e| StatError::of(&e));
                    gauge.dec();
                    let _ = tx.send(Some(r));
                });
            if let Err(e) = spawned {
                self.in_flight.dec();
                return (Answer::Stat(Err(StatError::of(&e))), None);
            }
            slots.insert(
                path.to_path_buf(),
                InFlight {
                    rx: rx.clone(),
                    since: Instant::now(),
                },
            );
            rx
        };
        match tokio::time::timeout(self.wait, rx.wait_for(Option::is_some)).await {
            Ok(Ok(v)) => {
                let r = v.clone().unwrap_or_else(unreachable_answer);
                drop(v);
                self.slots.lock().unwrap_or_else(|p| p.into_inner()).remove(path);
                (Answer::Stat(r), None)
            }
            // The thread ended without a word (it cannot panic in practice): ask again next time.
            Ok(Err(_)) => {
                self.slots.lock().unwrap_or_else(|p| p.into_inner()).remove(path);
                (
                    Answer::Stat(Err(StatError {
                        errno: None,
                        message: "the probe ended without an answer".into(),
                    })),
                    None,
                )
            }
            Err(_) => (Answer::Pending, Some(self.wait)),
        }
    }

    /// Forgets answered probes of paths not seen in this pass; probes still out are kept, so a
    /// path that comes back while its thread is stuck still gets no second one.
    pub fn retain_seen(&self, seen: &BTreeSet<PathBuf>) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots.retain(|p, f| seen.contains(p) || f.rx.borrow().is_none());
    }

    /// Probes out now.
    pub fn in_flight(&self) -> usize {
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|f| f.rx.borrow().is_none())
            .count()
    }
}

fn unreachable_answer() -> Result<DevNo, StatError> {
    Err(StatError {
        errno: None,
        message: "no answer".into(),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    const DEV: DevNo = (7, 3);

    fn err(errno: i32) -> Answer {
        Answer::Stat(Err(StatError {
            errno: Some(errno),
            message: format!("os error {errno}"),
        }))
    }

    #[test]
    fn slow_is_never_broken() {
        assert_eq!(
            judge(&Answer::Pending, DEV, "/dev/loop3", Some(DEV)),
            Health::Pending
        );
        assert_eq!(judge(&Answer::Pending, DEV, "stale", None), Health::Pending);
    }

    #[test]
    fn only_corrupted_mount_errors_mean_broken() {
        for (errno, _) in CORRUPTED {
            assert!(
                judge(&err(errno), DEV, "/dev/loop3", Some(DEV)).is_broken(),
                "{errno}"
            );
        }
        // ENOENT, EPERM, ENOMEM, EINTR, ELOOP, ENAMETOOLONG: not proof of a dead file system.
        for errno in [2, 1, 12, 4, 40, 36] {
            let h = judge(&err(errno), DEV, "/dev/loop3", Some(DEV));
            assert!(matches!(h, Health::Unknown(_)), "{errno}: {h:?}");
            assert!(h.is_unsure());
        }
        let no_errno = Answer::Stat(Err(StatError {
            errno: None,
            message: "x".into(),
        }));
        assert!(judge(&no_errno, DEV, "/dev/loop3", Some(DEV)).is_unsure());
    }

    #[test]
    fn an_answer_naming_another_device_is_broken() {
        assert_eq!(
            judge(&Answer::Stat(Ok(DEV)), DEV, "/dev/loop3", Some(DEV)),
            Health::Healthy
        );
        // Something stacked over the mount, or the table and the path disagree.
        assert!(judge(&Answer::Stat(Ok((0, 51))), DEV, "/dev/loop3", Some(DEV)).is_broken());
        // The source node is gone, is not a device, or is another device now.
        assert!(judge(&Answer::Stat(Ok(DEV)), DEV, "stale", None).is_broken());
        assert!(judge(&Answer::Stat(Ok(DEV)), DEV, "/dev/loop3", Some((7, 9))).is_broken());
    }

    static CALLS: AtomicUsize = AtomicUsize::new(0);
    static RELEASE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    fn hanging(_: &Path) -> std::io::Result<DevNo> {
        CALLS.fetch_add(1, Ordering::SeqCst);
        while !RELEASE.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(DEV)
    }

    #[tokio::test]
    async fn a_hung_probe_gets_no_second_thread() {
        let gauge = IntGauge::new("probes", "probes").unwrap();
        let p = Prober::with_probe(gauge.clone(), Duration::from_millis(20), hanging);
        let path = Path::new("/hung");
        for _ in 0..20 {
            assert_eq!(p.ask(path).await.0, Answer::Pending);
        }
        // On a loaded machine the one thread may not have been scheduled yet: wait for it to
        // start (a bound for a broken test), then check that there is exactly one.
        for _ in 0..2000 {
            if CALLS.load(Ordering::SeqCst) > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(CALLS.load(Ordering::SeqCst), 1, "one thread for the hung path");
        assert_eq!(gauge.get(), 1);
        assert_eq!(p.in_flight(), 1);
        // Not seen any more: the stuck probe is still remembered.
        p.retain_seen(&BTreeSet::new());
        assert_eq!(p.ask(path).await.0, Answer::Pending);
        assert_eq!(CALLS.load(Ordering::SeqCst), 1);
        RELEASE.store(true, Ordering::SeqCst);
        // Once it returned, the next ask is a fresh probe that answers.
        let answered = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let (Answer::Stat(r), _) = p.ask(path).await {
                    return r;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap();
        assert_eq!(answered, Ok(DEV));
        assert_eq!(gauge.get(), 0);
        assert_eq!(p.in_flight(), 0);
    }

    #[tokio::test]
    async fn real_stat_answers() {
        let gauge = IntGauge::new("probes2", "probes").unwrap();
        let p = Prober::new(gauge.clone());
        let (a, _) = p.ask(Path::new("/")).await;
        assert!(matches!(a, Answer::Stat(Ok(_))), "{a:?}");
        let (a, _) = p.ask(Path::new("/nonexistent/stowage")).await;
        match a {
            Answer::Stat(Err(e)) => assert_eq!(e.errno, Some(2)),
            other => panic!("{other:?}"),
        }
        assert_eq!(gauge.get(), 0);
    }
}
