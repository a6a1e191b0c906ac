//! What a work task owes the loop that started it: a report for each piece of work it took on.
//!
//! Loops that run their own task sets (attach/detach's executor, the agent's attacher and volume
//! manager) free a piece of work only when its report comes back. A task that panicked would
//! never report, and its work would stay "running" for good. So a task starts with the failure
//! reports it owes; each real report settles one (`Owed::send`), and the task's guard sends the
//! failures still owed if it is dropped by a panic, so that work is retried with backoff like any
//! failure. An abort (the loop is going away) reports nothing: nobody reads any more.

use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

/// A report that settles a debt: `same_work` tells which owed failure it stands for.
pub trait Work {
    fn same_work(&self, other: &Self) -> bool;
}

/// The failures a task still owes; clones share them (a task may hand pieces to helpers).
pub struct Owed<T> {
    done: mpsc::UnboundedSender<T>,
    left: Arc<Mutex<Vec<T>>>,
}

impl<T> Clone for Owed<T> {
    fn clone(&self) -> Self {
        Self {
            done: self.done.clone(),
            left: self.left.clone(),
        }
    }
}

impl<T: Work> Owed<T> {
    pub fn new(done: &mpsc::UnboundedSender<T>, failures: Vec<T>) -> Self {
        Self {
            done: done.clone(),
            left: Arc::new(Mutex::new(failures)),
        }
    }

    /// Sends a report, which settles the failure owed for the same work.
    pub fn send(&self, report: T) {
        self.left
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|owed| !owed.same_work(&report));
        let _ = self.done.send(report);
    }

    /// Held by the task for its whole life: dropped by a panic, it sends what is still owed.
    pub fn guard(&self) -> OwedGuard<T> {
        OwedGuard(self.clone())
    }
}

pub struct OwedGuard<T>(Owed<T>);

impl<T> Drop for OwedGuard<T> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        tracing::error!("a work task panicked (a bug); its work is reported failed and retried with backoff");
        let left = std::mem::take(&mut *self.0.left.lock().unwrap_or_else(|p| p.into_inner()));
        for report in left {
            let _ = self.0.done.send(report);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct Report(&'static str, bool);

    impl Work for Report {
        fn same_work(&self, other: &Self) -> bool {
            self.0 == other.0
        }
    }

    #[test]
    fn a_panic_sends_only_what_is_still_owed_and_a_clean_end_nothing_more() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        {
            let owed = Owed::new(&tx, vec![Report("a", false), Report("b", false)]);
            let _guard = owed.guard();
            owed.send(Report("a", true));
        }
        assert_eq!(rx.try_recv().ok(), Some(Report("a", true)));
        assert!(rx.try_recv().is_err(), "no panic: nothing more");

        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let owed = Owed::new(&tx, vec![Report("a", false), Report("b", false)]);
            let _guard = owed.guard();
            owed.send(Report("a", true));
            panic!("boom");
        }));
        assert!(r.is_err());
        assert_eq!(rx.try_recv().ok(), Some(Report("a", true)));
        assert_eq!(rx.try_recv().ok(), Some(Report("b", false)));
        assert!(rx.try_recv().is_err());
    }
}
