//! A controller's decision state kept current while its replica waits for the Lease: the second
//! half of a warm standby. The informers keep the stores full; this keeps what a controller
//! derives from them (the binder's volume index and unbound claims, attach/detach's desired and
//! actual state), so that a term decides its first key at once instead of first indexing every
//! object. At 50,000 pairs that indexing is seconds on the one thread that decides.
//!
//! A task of its own builds the state once the stores are full and takes in their changes, never
//! writing. A term takes the state (`Standby::take`) and gives nothing back: by its end the state
//! holds the term's reservations and the objects it wrote, so the task builds a fresh one from the
//! stores as soon as the term's state is dropped.

use std::future::Future;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

/// A controller's state while its replica waits: it takes in changes and writes nothing.
pub trait Follow: Send + 'static {
    /// Takes in changes until one fails (a feed's watch ended). Cancel-safe: dropped between two
    /// changes (a term asking for the state), it has taken in every change it returned for.
    fn follow(&mut self) -> impl Future<Output = anyhow::Result<()>> + Send;
}

/// The state one term took. Dropping it (the term ended) has the standby build a fresh one.
pub struct Term<P> {
    state: P,
    _ended: oneshot::Sender<()>,
}

impl<P> Term<P> {
    /// Runs the term on the state; the standby waits until this future is dropped or done.
    pub async fn lead<F: Future>(self, f: impl FnOnce(P) -> F) -> F::Output {
        let _ended = self._ended;
        f(self.state).await
    }
}

type Ask<P> = oneshot::Sender<Term<P>>;

/// The handle terms take the state from.
pub struct Standby<P> {
    asks: mpsc::UnboundedSender<Ask<P>>,
}

impl<P> Clone for Standby<P> {
    fn clone(&self) -> Self {
        Self {
            asks: self.asks.clone(),
        }
    }
}

/// How long a standby whose state failed to follow waits before it builds another.
const REBUILD_DELAY: Duration = Duration::from_secs(1);

impl<P: Follow> Standby<P> {
    /// Starts the task on `tasks`: `build` makes the state from full stores (it waits for them
    /// itself), `name` is the controller's, for the log.
    pub fn spawn<F, Fut>(tasks: &mut JoinSet<()>, name: &'static str, build: F) -> Self
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: Future<Output = P> + Send + 'static,
    {
        let (asks, rx) = mpsc::unbounded_channel();
        tasks.spawn(keep(name, build, rx));
        Self { asks }
    }

    /// The state as of now; waits while it is being built. `None` once the standby's task is
    /// gone (the caller then builds its own).
    pub async fn take(&self) -> Option<Term<P>> {
        let (tx, rx) = oneshot::channel();
        self.asks.send(tx).ok()?;
        rx.await.ok()
    }
}

async fn keep<P, F, Fut>(name: &'static str, build: F, mut asks: mpsc::UnboundedReceiver<Ask<P>>)
where
    P: Follow,
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = P> + Send + 'static,
{
    loop {
        let t0 = Instant::now();
        let mut state = build().await;
        tracing::info!(
            controller = name,
            built_ms = u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX),
            "standby: decision state ready"
        );
        let asked = tokio::select! {
            r = state.follow() => {
                let e = r.err().unwrap_or_else(|| anyhow::anyhow!("stopped following"));
                tracing::warn!(controller = name, error = %format!("{e:#}"), "standby: state lost its feeds; building it again");
                tokio::time::sleep(REBUILD_DELAY).await;
                None
            }
            ask = asks.recv() => match ask {
                Some(tx) => Some(tx),
                None => return,
            },
        };
        let Some(tx) = asked else { continue };
        let (ended, term_over) = oneshot::channel();
        // A term that went away before the answer drops it here: a fresh state is built for the
        // next one (the one it declined is left as it was, but this is rare and cheap enough).
        let _ = tx.send(Term { state, _ended: ended });
        let _ = term_over.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A state that sums the numbers fed to it; `built` says which build it came from.
    struct Sum {
        built: usize,
        total: u64,
        feed: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<u64>>>,
    }

    impl Follow for Sum {
        async fn follow(&mut self) -> anyhow::Result<()> {
            loop {
                let Some(n) = self.feed.lock().await.recv().await else {
                    anyhow::bail!("feed closed");
                };
                self.total += n;
            }
        }
    }

    fn standby() -> (
        Standby<Sum>,
        mpsc::UnboundedSender<u64>,
        Arc<AtomicUsize>,
        JoinSet<()>,
    ) {
        let (tx, rx) = mpsc::unbounded_channel();
        let feed = Arc::new(tokio::sync::Mutex::new(rx));
        let builds = Arc::new(AtomicUsize::new(0));
        let mut tasks = JoinSet::new();
        let counter = builds.clone();
        let s = Standby::spawn(&mut tasks, "test", move || {
            let built = counter.fetch_add(1, Ordering::SeqCst) + 1;
            let feed = feed.clone();
            async move {
                Sum {
                    built,
                    total: 0,
                    feed,
                }
            }
        });
        (s, tx, builds, tasks)
    }

    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_term_takes_the_state_with_every_change_taken_in() {
        let (s, feed, builds, _tasks) = standby();
        for n in [1, 2, 3] {
            feed.send(n).unwrap();
        }
        settle().await;
        let term = s.take().await.unwrap();
        let (built, total) = term.lead(|p| async move { (p.built, p.total) }).await;
        assert_eq!((built, total), (1, 6));
        // The term is over (its state dropped): the standby builds a fresh one.
        settle().await;
        assert_eq!(builds.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn the_next_term_waits_for_the_last_to_end_and_gets_a_fresh_state() {
        let (s, feed, builds, _tasks) = standby();
        feed.send(5).unwrap();
        settle().await;
        let first = s.take().await.unwrap();
        // While a term holds the state nothing is built and the next ask waits.
        let s2 = s.clone();
        let second = tokio::spawn(async move { s2.take().await.map(|t| t.state.built) });
        settle().await;
        assert!(!second.is_finished());
        assert_eq!(builds.load(Ordering::SeqCst), 1);
        drop(first);
        assert_eq!(second.await.unwrap(), Some(2));
    }

    #[tokio::test]
    async fn a_state_whose_feed_failed_is_built_again() {
        let (s, feed, builds, _tasks) = standby();
        drop(feed);
        // Follow fails at once; after the delay a new state is built (whose follow fails too).
        tokio::time::sleep(REBUILD_DELAY + REBUILD_DELAY / 2).await;
        assert!(builds.load(Ordering::SeqCst) >= 2);
        drop(s);
    }

    #[tokio::test]
    async fn without_its_task_take_says_none() {
        let (s, _feed, _builds, mut tasks) = standby();
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
        assert!(s.take().await.is_none());
    }
}
