//! Every operation task of the agent's loops reports back, also when it panics.
//!
//! The volume manager keeps its own task set rather than `stowage_common::inflight::Window`
//! (decided in issue 17; the attacher's own reason is at the top of `attacher/mod.rs`): the window
//! runs one task per key with keys compared for equality, while the volume manager's keys nest (a
//! key without a pod stands for the whole volume and excludes every pod's operation on it,
//! `tracker::OpKey::conflicts`), its backoff is per key *and* kind of operation, and it decides
//! every volume in one pass over the mount table rather than per queued key. What the window
//! would give is kept here: an operation's key is freed only by its `Outcome`, and `Owed` makes
//! sure a task that dies without one (a panic) still sends a failed one, so the key is retried
//! with backoff instead of staying "running" for good.

use tokio::sync::mpsc;

/// The failure report a running task owes its loop until it sends its real `Outcome`. Dropped
/// unpaid (the task panicked, or was aborted at shutdown when nobody listens any more), it sends
/// the failure.
pub(crate) struct Owed<T> {
    tx: mpsc::UnboundedSender<T>,
    failure: Option<T>,
}

impl<T> Owed<T> {
    pub(crate) fn new(tx: &mpsc::UnboundedSender<T>, failure: T) -> Self {
        Self {
            tx: tx.clone(),
            failure: Some(failure),
        }
    }

    /// Sends the task's real outcome, which settles the debt.
    pub(crate) fn pay(mut self, outcome: T) {
        self.failure = None;
        let _ = self.tx.send(outcome);
    }
}

impl<T> Drop for Owed<T> {
    fn drop(&mut self) {
        if let Some(f) = self.failure.take() {
            if std::thread::panicking() {
                tracing::error!("an operation task panicked (a bug); its operation is retried with backoff");
            }
            // Also when aborted at shutdown: harmless, nobody reads any more.
            let _ = self.tx.send(f);
        }
    }
}

/// A test hook, in debug builds only: `--debug-panic-once=<operation>:<pv>` makes the next
/// `<operation>` (attach, mount) of that PV panic once, so tests can prove a panicked operation
/// is retried. Release builds have neither the flag nor the check.
#[cfg(debug_assertions)]
static PANIC_ONCE: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

#[cfg(debug_assertions)]
pub(crate) fn arm(hooks: &[String]) {
    PANIC_ONCE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend(hooks.iter().cloned());
}

/// Panics if the test hook asks for it (debug builds); does nothing otherwise.
pub(crate) fn test_hook(operation: &str, pv: &str) {
    #[cfg(debug_assertions)]
    {
        let want = format!("{operation}:{pv}");
        let fire = {
            let mut hooks = PANIC_ONCE.lock().unwrap_or_else(|p| p.into_inner());
            let at = hooks.iter().position(|h| *h == want);
            at.map(|i| hooks.remove(i)).is_some()
        };
        if fire {
            panic!("test hook: the {operation} of {pv} panics");
        }
    }
    #[cfg(not(debug_assertions))]
    let _ = (operation, pv);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unpaid_debt_is_sent_and_a_paid_one_is_not() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        Owed::new(&tx, "failed").pay("ok");
        assert_eq!(rx.try_recv().ok(), Some("ok"));
        assert!(rx.try_recv().is_err(), "paid: nothing more");
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _owed = Owed::new(&tx, "failed");
            panic!("boom");
        }));
        assert!(r.is_err());
        assert_eq!(rx.try_recv().ok(), Some("failed"));
    }
}
