//! The one run loop of the keyed controllers (binder, expand, pv- and pvc-protection), in the manner
//! of kube-runtime's `Controller::run(reconcile, error_policy, ctx)`: the controller says what its
//! inputs are, how a change becomes queued keys, how one key is reconciled and what a failure
//! costs; the loop does the rest the same way for all of them.
//!
//! One pass of the loop:
//! 1. takes in every input already announced (feeds, timers) and every write task that landed,
//!    so a decision sees the newest view and a burst of changes to one object becomes one sync;
//! 2. reconciles up to `batch` ready keys while the write window has room;
//! 3. otherwise waits for the first of: a landing write, an input, the next delayed key.
//!
//! A reconcile or a write task that fails goes to the controller's error policy, which says when
//! the key comes back (`Retry`); the loop applies it to the queue, the one place a key's failures
//! are counted and forgotten (one backoff per controller: the queue's, or the policy's own curve
//! over the queue's failure count). One that panics is counted and retried after the queue's
//! backoff instead of ending the controller. A feed whose watch ended ends the loop with that
//! error, as the informers are gone.

use std::hash::Hash;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::stream::{BoxStream, SelectAll};
use futures::{FutureExt, StreamExt};
use tokio::time::Instant;

use crate::runtime::inflight::{Landed, Window};
use crate::runtime::queue::WorkQueue;
use crate::store::informer::{Change, Feed};

/// What became of a reconciled key, or of its write task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Done: the queue forgets its failures.
    Done,
    /// Done, and again at once: its object changed while its writes ran.
    Again,
    /// Not settled yet: its write task is running (`landed` settles it), or it was deferred
    /// behind the running writes of its key and comes again when they land.
    Pending,
}

/// When a failed key comes back: the error policy's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// After the queue's own exponential backoff over the key's failures.
    Backoff,
    /// After this delay (the policy's own curve, from the failures it was given); still counted
    /// as a failure, so a change of the object does not cut the wait short.
    After(Duration),
    /// Not by itself: only a change of the object brings it back.
    Never,
}

/// One controller, as the driver sees it.
pub trait Reconciler: Send {
    type Key: Clone + Eq + Hash + Ord + std::fmt::Debug + Send + 'static;
    /// A change from one of the controller's inputs (see [`Inputs`]).
    type Input: Send + 'static;
    /// What a write task hands back when it lands.
    type Done: Send + 'static;
    type Error: std::fmt::Display + Send;

    /// The controller's work queue: the loop pops, retries and settles its keys; the
    /// controller only adds keys (in `input`, `flush`), as its changes touch them.
    fn queue(&mut self) -> &mut WorkQueue<Self::Key>;
    /// The controller's write window, if its writes run as tasks of their own (a bind is four
    /// writes, an expansion a file and two objects: several keys write at once while decisions
    /// stay serial); a controller without one writes inside `reconcile`, one key at a time.
    fn window(&mut self) -> Option<&mut Window<Self::Key, Self::Done>> {
        None
    }
    /// Takes in one change: updates what the controller keeps and queues the keys it touches.
    fn input(&mut self, input: Self::Input);
    /// Decides one key, and either writes or starts the writes.
    fn reconcile(&mut self, key: Self::Key) -> impl Future<Output = Result<Next, Self::Error>> + Send;
    /// Takes in what a write task brought back (the objects it wrote, which the stores have not
    /// seen yet), and says what comes next for its key.
    fn landed(&mut self, _landed: Landed<Self::Key, Self::Done>) -> Result<Next, Self::Error> {
        Ok(Next::Done)
    }
    /// When a key whose reconcile or write task failed comes back; `failures` counts its
    /// failures before this one. The controller's rule for its errors (and their metrics) lives
    /// here; by default, after the queue's backoff.
    fn error_policy(&mut self, key: &Self::Key, error: Self::Error, failures: u32) -> Retry {
        tracing::debug!(?key, %error, failures, "reconcile failed, retrying");
        Retry::Backoff
    }
    /// A reconcile panicked (a bug): counted by the controller, which frees what the reconcile
    /// may have held (the binder's reservations); the key is retried with backoff.
    fn panicked(&mut self, _key: &Self::Key) {}
    /// Runs once a burst of inputs is taken in, before keys are popped: what the controller
    /// gathered from the burst becomes queued keys once (the binder wakes the unbound claims of a
    /// class once, however many of its volumes changed).
    fn flush(&mut self) {}
    /// Runs before the loop waits: the controller's own gauges (queue depth, work in progress),
    /// set when they change least often.
    fn before_wait(&mut self) {}
}

/// The inputs of a controller, merged: its feeds and its timers.
pub struct Inputs<I> {
    streams: SelectAll<BoxStream<'static, anyhow::Result<I>>>,
}

impl<I: Send + 'static> Default for Inputs<I> {
    fn default() -> Self {
        Self {
            streams: SelectAll::new(),
        }
    }
}

impl<I: Send + 'static> Inputs<I> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a store's change feed; `wrap` names its changes as the controller's inputs.
    pub fn feed<K: Clone + Send + Sync + 'static>(
        mut self,
        feed: Feed<K>,
        wrap: impl Fn(Change<K>) -> I + Send + 'static,
    ) -> Self {
        let s = futures::stream::unfold(feed, move |mut f| async move {
            let next = f.next().await;
            Some((next, f))
        })
        .map(move |r| r.map(&wrap));
        self.streams.push(s.boxed());
        self
    }

    /// Adds a timer: `tick` at `first`, then every `period` (missed ticks are caught up, as
    /// tokio's intervals do).
    pub fn every(mut self, first: Instant, period: Duration, tick: impl Fn() -> I + Send + 'static) -> Self {
        let s = futures::stream::unfold(tokio::time::interval_at(first, period), |mut i| async move {
            i.tick().await;
            Some(((), i))
        })
        .map(move |()| Ok(tick()));
        self.streams.push(s.boxed());
        self
    }

    /// An input already announced, if any.
    pub fn ready(&mut self) -> anyhow::Result<Option<I>> {
        match self.streams.next().now_or_never() {
            Some(Some(r)) => r.map(Some),
            _ => Ok(None),
        }
    }

    /// The next input; pending forever without inputs. Cancel-safe.
    pub async fn next(&mut self) -> anyhow::Result<I> {
        match self.streams.next().await {
            Some(r) => r,
            None => std::future::pending().await,
        }
    }
}

/// How the loop paces a controller.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// Keys reconciled before inputs are taken in again: 1 for a controller that writes inline
    /// (each decision on the newest view), more for one whose writes run as tasks (a bounded
    /// batch, so results and changes are not starved).
    pub batch: usize,
}

impl Default for Pace {
    fn default() -> Self {
        Self { batch: 256 }
    }
}

/// Runs `r` on `inputs` until an input fails (a feed's watch ended) or the future is dropped
/// (leadership lost: dropping the controller's window aborts its writes).
pub async fn run<R: Reconciler>(mut r: R, mut inputs: Inputs<R::Input>, pace: Pace) -> anyhow::Result<()> {
    loop {
        while let Some(i) = inputs.ready()? {
            r.input(i);
        }
        if let Some(w) = r.window()
            && let Some(l) = w.next().now_or_never()
        {
            land(&mut r, l);
            continue;
        }
        r.flush();
        let has_room = r.window().is_none_or(|w| w.has_room());
        let now = Instant::now();
        // Delayed keys become ready only when popped: one that fell due counts as ready.
        let due_now = r.queue().next_due().is_some_and(|at| at <= now);
        if has_room && (r.queue().has_ready() || due_now) {
            for _ in 0..pace.batch.max(1) {
                if !r.window().is_none_or(|w| w.has_room()) {
                    break;
                }
                let Some(key) = r.queue().pop(Instant::now()) else {
                    break;
                };
                reconcile_one(&mut r, key).await;
            }
            continue;
        }
        r.before_wait();
        r.queue().report(Instant::now());
        // A full window needs no timer: a landing write wakes the loop.
        let due = r.queue().next_due().filter(|_| has_room);
        tokio::select! {
            biased;
            l = async {
                match r.window() {
                    Some(w) => w.next().await,
                    None => std::future::pending().await,
                }
            } => land(&mut r, l),
            i = inputs.next() => r.input(i?),
            () = async {
                match due {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
    }
}

async fn reconcile_one<R: Reconciler>(r: &mut R, key: R::Key) {
    let outcome = AssertUnwindSafe(r.reconcile(key.clone())).catch_unwind().await;
    match outcome {
        Ok(result) => settle(r, key, result),
        Err(_) => {
            tracing::error!(?key, "reconcile panicked; retrying with backoff");
            r.panicked(&key);
            r.queue().retry(key, Instant::now());
        }
    }
}

/// A write task landed: the controller takes in its report, the loop settles the key.
fn land<R: Reconciler>(r: &mut R, l: Landed<R::Key, R::Done>) {
    let key = l.key.clone();
    let result = r.landed(l);
    settle(r, key, result);
}

/// What a reconcile or a landed task said, applied to the queue: the one place a key's failures
/// are counted (`retry`) and forgotten (`succeeded`).
fn settle<R: Reconciler>(r: &mut R, key: R::Key, result: Result<Next, R::Error>) {
    let now = Instant::now();
    match result {
        Ok(Next::Done) => r.queue().succeeded(&key),
        Ok(Next::Again) => {
            r.queue().succeeded(&key);
            r.queue().add(key);
        }
        Ok(Next::Pending) => {}
        Err(e) => {
            let failures = r.queue().failures(&key);
            match r.error_policy(&key, e, failures) {
                Retry::Backoff => {
                    r.queue().retry(key, now);
                }
                Retry::After(delay) => r.queue().retry_after(key, now, delay),
                Retry::Never => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tokio::sync::broadcast;

    /// A controller whose reconcile of "boom" panics once, of "fail" fails once, and of any
    /// other key writes in a task (when windowed) or inline.
    struct Toy {
        queue: WorkQueue<String>,
        window: Option<Window<String, String>>,
        log: Arc<Mutex<Vec<String>>>,
        failed: bool,
        panicked: bool,
    }

    impl Reconciler for Toy {
        type Key = String;
        type Input = Change<String>;
        type Done = String;
        type Error = String;

        fn queue(&mut self) -> &mut WorkQueue<String> {
            &mut self.queue
        }
        fn window(&mut self) -> Option<&mut Window<String, String>> {
            self.window.as_mut()
        }
        fn input(&mut self, input: Change<String>) {
            if let Change::Applied(k) = input {
                self.queue.add(k.to_string());
            }
        }
        async fn reconcile(&mut self, key: String) -> Result<Next, String> {
            if key == "boom" && !self.panicked {
                self.panicked = true;
                panic!("a bug");
            }
            if key == "fail" && !self.failed {
                self.failed = true;
                return Err("not yet".into());
            }
            match &mut self.window {
                Some(w) => {
                    let k = key.clone();
                    w.start(key, async move { format!("wrote {k}") });
                    Ok(Next::Pending)
                }
                None => {
                    self.log.lock().unwrap().push(format!("wrote {key}"));
                    Ok(Next::Done)
                }
            }
        }
        fn landed(&mut self, l: Landed<String, String>) -> Result<Next, String> {
            self.log.lock().unwrap().push(l.result.unwrap());
            Ok(Next::Done)
        }
    }

    async fn drive(windowed: bool) -> Vec<String> {
        let (tx, rx) = broadcast::channel(16);
        let log = Arc::new(Mutex::new(vec![]));
        let toy = Toy {
            queue: WorkQueue::with_backoff(Duration::from_millis(1), Duration::from_millis(4)),
            window: windowed.then(|| Window::new(2)),
            log: log.clone(),
            failed: false,
            panicked: false,
        };
        let inputs = Inputs::new().feed(Feed::new(rx, "toy"), |c| c);
        let task = tokio::spawn(run(toy, inputs, Pace::default()));
        for k in ["a", "boom", "fail", "b"] {
            tx.send(Change::Applied(Arc::new(k.to_string()))).unwrap();
        }
        while log.lock().unwrap().len() < 4 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A feed that ends ends the loop, with the resource named.
        drop(tx);
        let err = task.await.unwrap().unwrap_err();
        assert!(err.to_string().contains("toy"), "{err}");
        let mut got = log.lock().unwrap().clone();
        got.sort();
        got
    }

    #[tokio::test]
    async fn failures_and_panics_are_retried_inline_and_windowed() {
        let want = vec!["wrote a", "wrote b", "wrote boom", "wrote fail"];
        assert_eq!(drive(false).await, want);
        assert_eq!(drive(true).await, want);
    }
}
