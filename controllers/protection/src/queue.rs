//! A work queue owned by one task: each key is queued at most once, and a key whose sync failed
//! comes back after an exponentially growing delay (per key, reset by a success), so one object
//! that keeps conflicting neither spins nor holds back the others.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::hash::Hash;
use std::time::Duration;

use tokio::time::Instant;

/// First retry delay; doubles per consecutive failure up to `MAX_DELAY`.
const BASE_DELAY: Duration = Duration::from_millis(10);
const MAX_DELAY: Duration = Duration::from_secs(120);

#[derive(Debug)]
pub struct WorkQueue<K: Clone + Eq + Hash + Ord> {
    ready: VecDeque<K>,
    /// Where each queued key is: `None` in `ready`, `Some(at)` in `later`.
    queued: HashMap<K, Option<Instant>>,
    later: BTreeSet<(Instant, K)>,
    failures: HashMap<K, u32>,
}

impl<K: Clone + Eq + Hash + Ord> Default for WorkQueue<K> {
    fn default() -> Self {
        Self {
            ready: VecDeque::new(),
            queued: HashMap::new(),
            later: BTreeSet::new(),
            failures: HashMap::new(),
        }
    }
}

impl<K: Clone + Eq + Hash + Ord> WorkQueue<K> {
    /// Queues `key` to run now; a key waiting for a retry is brought forward.
    pub fn add(&mut self, key: K) {
        match self.queued.get(&key) {
            Some(None) => {}
            Some(Some(at)) => {
                self.later.remove(&(*at, key.clone()));
                self.queued.insert(key.clone(), None);
                self.ready.push_back(key);
            }
            None => {
                self.queued.insert(key.clone(), None);
                self.ready.push_back(key);
            }
        }
    }

    /// Queues `key` for `at`, unless it is already queued to run sooner.
    pub fn add_at(&mut self, key: K, at: Instant) {
        match self.queued.get(&key) {
            Some(None) => {}
            Some(Some(old)) if *old <= at => {}
            Some(Some(old)) => {
                self.later.remove(&(*old, key.clone()));
                self.queued.insert(key.clone(), Some(at));
                self.later.insert((at, key));
            }
            None => {
                self.queued.insert(key.clone(), Some(at));
                self.later.insert((at, key));
            }
        }
    }

    /// Records a failure of `key` and queues it after its backoff; returns the delay.
    pub fn retry(&mut self, key: K, now: Instant) -> Duration {
        let n = self.failures.entry(key.clone()).or_default();
        let delay = BASE_DELAY.saturating_mul(1u32 << (*n).min(24)).min(MAX_DELAY);
        *n = n.saturating_add(1);
        self.add_at(key, now + delay);
        delay
    }

    /// Forgets the failures of `key` (its sync succeeded, or the object is gone).
    pub fn forget(&mut self, key: &K) {
        self.failures.remove(key);
    }

    /// Takes the next key that is due at `now`.
    pub fn pop(&mut self, now: Instant) -> Option<K> {
        while let Some((at, _)) = self.later.first() {
            if *at > now {
                break;
            }
            let (_, key) = self.later.pop_first().expect("first exists");
            self.queued.insert(key.clone(), None);
            self.ready.push_back(key);
        }
        let key = self.ready.pop_front()?;
        self.queued.remove(&key);
        Some(key)
    }

    /// When the earliest delayed key falls due.
    pub fn next_due(&self) -> Option<Instant> {
        self.later.first().map(|(at, _)| *at)
    }

    /// Keys waiting, ready or delayed.
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
    use proptest::prelude::*;

    #[test]
    fn dedup_backoff_and_forget() {
        let t0 = Instant::now();
        let mut q = WorkQueue::default();
        q.add("a");
        q.add("a");
        q.add("b");
        assert_eq!(q.len(), 2);
        assert_eq!(q.pop(t0), Some("a"));
        let d1 = q.retry("a", t0);
        assert_eq!(d1, BASE_DELAY);
        assert_eq!(q.pop(t0), Some("b"));
        assert_eq!(q.pop(t0), None, "a waits for its backoff");
        assert_eq!(q.pop(t0 + d1), Some("a"));
        let d2 = q.retry("a", t0);
        assert_eq!(d2, 2 * BASE_DELAY);
        q.forget(&"a");
        q.add("a"); // brought forward
        assert_eq!(q.pop(t0), Some("a"));
        assert!(q.is_empty());
        assert_eq!(q.retry("a", t0), BASE_DELAY, "forget resets the backoff");
    }

    #[test]
    fn backoff_is_capped() {
        let t0 = Instant::now();
        let mut q = WorkQueue::default();
        let mut last = Duration::ZERO;
        for _ in 0..40 {
            last = q.retry(1, t0);
            q.pop(t0 + MAX_DELAY);
        }
        assert_eq!(last, MAX_DELAY);
    }

    proptest! {
        /// Whatever happens, every queued key is in exactly one place, and a key popped was due.
        #[test]
        fn consistent(ops in proptest::collection::vec((0u8..4, 0u8..6, 0u64..40), 0..300)) {
            let t0 = Instant::now();
            let mut now = t0;
            let mut q = WorkQueue::default();
            for (op, key, ms) in ops {
                now += Duration::from_millis(ms);
                match op {
                    0 => q.add(key),
                    1 => { q.retry(key, now); }
                    2 => q.add_at(key, now + Duration::from_millis(ms * 3)),
                    _ => {
                        if let Some(k) = q.pop(now) {
                            prop_assert!(!q.queued.contains_key(&k));
                        }
                    }
                }
                let mut seen = std::collections::HashSet::new();
                for k in &q.ready { prop_assert!(seen.insert(*k)); prop_assert_eq!(q.queued.get(k), Some(&None)); }
                for (at, k) in &q.later { prop_assert!(seen.insert(*k)); prop_assert_eq!(q.queued.get(k), Some(&Some(*at))); }
                prop_assert_eq!(seen.len(), q.len());
            }
        }
    }
}
