//! The write window of a controller with one decision task: decisions are made in one place, on
//! one cache, and the API writes of each decision run as a task of their own, at most `max` at a
//! time, one per key.
//!
//! The window only takes new work while it has room, so a burst of objects waits in the work
//! queue as keys instead of as thousands of parked tasks holding snapshots (hundreds of MiB at
//! tens of thousands of claims), and every decision is made on the freshest cache. Keys that change while their
//! writes run are marked dirty and synced again when those land. Dropping the window aborts its
//! tasks, so a controller that loses leadership stops writing at once.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::hash::Hash;

use tokio::task::{Id, JoinSet};

/// What came back from one key's writes.
pub struct Landed<K, D> {
    pub key: K,
    /// The task's result; `None` if it panicked (a bug, logged here; the caller retries).
    pub result: Option<D>,
    /// The key changed while its writes ran: sync it again now.
    pub dirty: bool,
}

pub struct Window<K, D> {
    tasks: JoinSet<D>,
    keys: HashMap<Id, K>,
    running: HashSet<K>,
    dirty: HashSet<K>,
    max: usize,
}

impl<K: Clone + Eq + Hash + std::fmt::Debug, D: Send + 'static> Window<K, D> {
    /// At least one write runs, whatever `max` says.
    pub fn new(max: usize) -> Self {
        Self {
            tasks: JoinSet::new(),
            keys: HashMap::new(),
            running: HashSet::new(),
            dirty: HashSet::new(),
            max: max.max(1),
        }
    }

    /// Whether new work may start.
    pub fn has_room(&self) -> bool {
        self.running.len() < self.max
    }

    pub fn len(&self) -> usize {
        self.running.len()
    }

    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    pub fn is_running(&self, key: &K) -> bool {
        self.running.contains(key)
    }

    /// Remembers that `key` must be synced again once the writes it waits for land (its own, or
    /// another key's it depends on).
    pub fn mark_dirty(&mut self, key: K) {
        self.dirty.insert(key);
    }

    /// Whether `key` was marked dirty; clears the mark.
    pub fn take_dirty(&mut self, key: &K) -> bool {
        self.dirty.remove(key)
    }

    /// Marks `key` dirty if its writes are running; returns whether it did (then the caller must
    /// not start more work for it).
    pub fn defer_if_running(&mut self, key: &K) -> bool {
        if self.running.contains(key) {
            self.dirty.insert(key.clone());
            true
        } else {
            false
        }
    }

    /// Starts `writes` for `key`. The caller checks `has_room` and `is_running` first; a second
    /// start for a running key would let two tasks race on one object.
    pub fn start(&mut self, key: K, writes: impl Future<Output = D> + Send + 'static) {
        debug_assert!(!self.running.contains(&key), "{key:?} started twice");
        let id = self.tasks.spawn(writes).id();
        self.keys.insert(id, key.clone());
        self.running.insert(key);
    }

    /// The next key whose writes finished. Pending while nothing runs; cancel-safe, for use in
    /// `select!`.
    pub async fn next(&mut self) -> Landed<K, D> {
        loop {
            let Some(joined) = self.tasks.join_next_with_id().await else {
                return std::future::pending().await;
            };
            let (id, result) = match joined {
                Ok((id, d)) => (id, Some(d)),
                Err(e) => {
                    tracing::error!(error = %e, "write task failed; the key is retried");
                    (e.id(), None)
                }
            };
            // Every task was spawned by `start`, which recorded its id.
            let Some(key) = self.keys.remove(&id) else {
                continue;
            };
            self.running.remove(&key);
            let dirty = self.dirty.remove(&key);
            return Landed { key, result, dirty };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lands_each_key_once_with_its_dirty_mark() {
        let mut w: Window<&str, u32> = Window::new(2);
        assert!(w.has_room());
        w.start("a", async { 1 });
        assert!(w.defer_if_running(&"a"));
        assert!(!w.defer_if_running(&"b"));
        w.start("b", async { 2 });
        assert!(!w.has_room());
        let mut got = vec![];
        for _ in 0..2 {
            let l = w.next().await;
            got.push((l.key, l.result, l.dirty));
        }
        got.sort();
        assert_eq!(got, vec![("a", Some(1), true), ("b", Some(2), false)]);
        assert!(w.is_empty() && w.has_room());
    }

    #[tokio::test]
    async fn a_panicking_task_frees_its_key() {
        let mut w: Window<&str, u32> = Window::new(1);
        w.start("p", async { panic!("boom") });
        let l = w.next().await;
        assert_eq!((l.key, l.result), ("p", None));
        assert!(!w.is_running(&"p") && w.has_room());
    }

    #[tokio::test]
    async fn zero_means_one() {
        let w: Window<&str, ()> = Window::new(0);
        assert!(w.has_room());
    }
}
