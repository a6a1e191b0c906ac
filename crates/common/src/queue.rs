//! A de-duplicating work queue with per-key exponential backoff, owned by one task (no locks),
//! shared by every controller. A key is at most once in the queue; a failed key comes back after
//! base × 2^failures, capped, and a success forgets its failures (client-go's per-item limiter has
//! the same shape), so one object that keeps conflicting neither spins nor holds back the others.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::Hash;
use std::time::Duration;

use tokio::time::Instant;

const BASE: Duration = Duration::from_millis(5);
const CAP: Duration = Duration::from_secs(60);

pub struct WorkQueue<K: Clone + Eq + Hash + Ord> {
    ready: VecDeque<K>,
    /// Every key in `ready` or `delayed`.
    queued: HashSet<K>,
    delayed: BTreeSet<(Instant, K)>,
    due: HashMap<K, Instant>,
    failures: HashMap<K, u32>,
    base: Duration,
    cap: Duration,
}

impl<K: Clone + Eq + Hash + Ord> Default for WorkQueue<K> {
    fn default() -> Self {
        Self {
            ready: VecDeque::new(),
            queued: HashSet::new(),
            delayed: BTreeSet::new(),
            due: HashMap::new(),
            failures: HashMap::new(),
            base: BASE,
            cap: CAP,
        }
    }
}

impl<K: Clone + Eq + Hash + Ord> WorkQueue<K> {
    /// A queue whose retries start at `base` and double up to `cap`.
    pub fn with_backoff(base: Duration, cap: Duration) -> Self {
        Self {
            base,
            cap,
            ..Self::default()
        }
    }

    /// Queues `key` now (a delayed key is brought forward).
    pub fn add(&mut self, key: K) {
        if let Some(at) = self.due.remove(&key) {
            self.delayed.remove(&(at, key.clone()));
            self.queued.remove(&key);
        }
        if self.queued.insert(key.clone()) {
            self.ready.push_back(key);
        }
    }

    /// Queues `key` at `at` unless it is already queued sooner.
    pub fn add_at(&mut self, key: K, at: Instant) {
        if self.queued.contains(&key) {
            match self.due.get(&key) {
                Some(old) if *old > at => {
                    self.delayed.remove(&(*old, key.clone()));
                }
                _ => return,
            }
        }
        self.queued.insert(key.clone());
        self.due.insert(key.clone(), at);
        self.delayed.insert((at, key));
    }

    /// Queues `key` after its next backoff step.
    pub fn retry(&mut self, key: K, now: Instant) -> Duration {
        let n = self.failures.entry(key.clone()).or_insert(0);
        let delay = self.base.saturating_mul(1u32 << (*n).min(20)).min(self.cap);
        *n = n.saturating_add(1);
        self.add_at(key, now + delay);
        delay
    }

    /// Forgets the failures of `key` (after a success).
    pub fn forget(&mut self, key: &K) {
        self.failures.remove(key);
    }

    /// Moves due keys to ready and pops the first ready key.
    pub fn pop(&mut self, now: Instant) -> Option<K> {
        while let Some((at, _)) = self.delayed.first() {
            if *at > now {
                break;
            }
            let (_, key) = self.delayed.pop_first().expect("checked non-empty");
            self.due.remove(&key);
            self.ready.push_back(key);
        }
        let key = self.ready.pop_front()?;
        self.queued.remove(&key);
        Some(key)
    }

    /// When the next delayed key falls due (if nothing is ready).
    pub fn next_due(&self) -> Option<Instant> {
        self.delayed.first().map(|(at, _)| *at)
    }

    pub fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    pub fn len(&self) -> usize {
        self.queued.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dedups_and_backs_off() {
        let t0 = Instant::now();
        let mut q = WorkQueue::default();
        q.add("a");
        q.add("a");
        q.add("b");
        assert_eq!(q.len(), 2);
        assert_eq!(q.pop(t0), Some("a"));
        let d1 = q.retry("a", t0);
        let d2 = q.retry("a", t0); // already queued sooner: stays at d1
        assert_eq!(q.next_due(), Some(t0 + d1));
        assert!(d2 > d1);
        assert_eq!(q.pop(t0), Some("b"));
        assert_eq!(q.pop(t0), None, "a is not due yet");
        assert_eq!(q.pop(t0 + d1), Some("a"));
        q.forget(&"a");
        assert_eq!(q.retry("a", t0), BASE);
    }

    #[test]
    fn add_brings_a_delayed_key_forward() {
        let t0 = Instant::now();
        let mut q = WorkQueue::default();
        q.add_at("a", t0 + Duration::from_secs(10));
        q.add("a");
        assert_eq!(q.pop(t0), Some("a"));
        assert!(q.is_empty());
        assert_eq!(q.next_due(), None);
    }

    proptest::proptest! {
        /// Whatever the operations, a key is popped at most once per time it was queued and
        /// `len` always equals the number of distinct queued keys.
        #[test]
        fn never_duplicates(ops in proptest::collection::vec((0u8..4, 0u8..5, 0u64..50), 0..200)) {
            let t0 = Instant::now();
            let mut q = WorkQueue::default();
            let mut now = t0;
            for (op, key, ms) in ops {
                now += Duration::from_millis(ms);
                match op {
                    0 => q.add(key),
                    1 => { q.retry(key, now); }
                    2 => q.add_at(key, now + Duration::from_millis(ms)),
                    _ => { let _ = q.pop(now); }
                }
                let mut seen = std::collections::HashSet::new();
                for k in q.ready.iter() { proptest::prop_assert!(seen.insert(*k)); }
                for (_, k) in q.delayed.iter() { proptest::prop_assert!(seen.insert(*k)); }
                proptest::prop_assert_eq!(seen.len(), q.len());
            }
        }
    }
}
