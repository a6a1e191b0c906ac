//! Which operations run and which wait out a backoff, like upstream's nestedpendingoperations:
//! an operation is keyed by (volume, pod); a key with no pod stands for the whole volume and
//! conflicts with every operation on that volume, so device-level steps are serialised per volume
//! while unmounts of different pods may overlap. Pure: time is an argument.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use stowage_common::runtime::backoff;
use tokio::time::Instant;

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpKey {
    pub volume: String,
    pub pod: Option<String>,
}

impl OpKey {
    pub fn volume(v: &str) -> Self {
        Self {
            volume: v.into(),
            pod: None,
        }
    }
    pub fn pod(v: &str, pod: &str) -> Self {
        Self {
            volume: v.into(),
            pod: Some(pod.into()),
        }
    }
    pub fn conflicts(&self, other: &OpKey) -> bool {
        self.volume == other.volume && (self.pod.is_none() || other.pod.is_none() || self.pod == other.pod)
    }
}

/// The failures of one kind of operation on a key, and when it may run again.
#[derive(Debug, Clone)]
struct Backoff {
    kind: &'static str,
    failures: backoff::Backoff,
    until: Instant,
}

#[derive(Debug, Default)]
pub struct Tracker {
    running: BTreeSet<OpKey>,
    backoff: BTreeMap<OpKey, Backoff>,
}

impl Tracker {
    /// May `kind` start on `key` now? Not while a conflicting operation runs, nor while the same
    /// kind of operation on the same key waits out its backoff (a different kind may go: the
    /// world changed, so the old failure says little about it).
    pub fn can_start(&self, key: &OpKey, kind: &'static str, now: Instant) -> bool {
        if self.running.iter().any(|r| r.conflicts(key)) {
            return false;
        }
        match self.backoff.get(key) {
            Some(b) => b.kind != kind || now >= b.until,
            None => true,
        }
    }

    pub fn start(&mut self, key: OpKey) {
        self.running.insert(key);
    }

    pub fn is_running(&self, key: &OpKey) -> bool {
        self.running.contains(key)
    }

    /// Records the end of an operation; a failure doubles the wait of the same kind.
    pub fn finish(&mut self, key: &OpKey, kind: &'static str, ok: bool, now: Instant) {
        self.running.remove(key);
        if ok {
            self.backoff.remove(key);
            return;
        }
        // A failure of another kind starts over: the world changed.
        let mut failures = match self.backoff.get(key) {
            Some(b) if b.kind == kind => b.failures,
            _ => backoff::Backoff::new(),
        };
        let delay = failures.failed();
        self.backoff.insert(
            key.clone(),
            Backoff {
                kind,
                failures,
                until: now + delay,
            },
        );
    }

    /// The current wait of a key, if it is backing off.
    pub fn delay(&self, key: &OpKey) -> Option<Duration> {
        self.backoff.get(key).and_then(|b| b.failures.current())
    }

    /// When the earliest backoff ends (so the loop can wake for it).
    pub fn next_expiry(&self, now: Instant) -> Option<Instant> {
        self.backoff.values().map(|b| b.until).filter(|u| *u > now).min()
    }

    /// Forgets backoffs of keys nothing asks for any more (bounded memory).
    pub fn retain(&mut self, mut wanted: impl FnMut(&OpKey) -> bool) {
        self.backoff.retain(|k, _| wanted(k));
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap_and_resets_on_success_or_new_kind() {
        let mut t = Tracker::default();
        let k = OpKey::volume("v");
        let mut now = Instant::now();
        let mut seen = vec![];
        for _ in 0..12 {
            assert!(t.can_start(&k, "mount", now));
            t.start(k.clone());
            assert!(!t.can_start(&k, "mount", now), "one operation per key at a time");
            t.finish(&k, "mount", false, now);
            assert!(!t.can_start(&k, "mount", now));
            seen.push(t.delay(&k).unwrap());
            now += t.delay(&k).unwrap();
        }
        assert_eq!(seen[0], Duration::from_millis(500));
        assert_eq!(seen[1], Duration::from_secs(1));
        assert_eq!(*seen.last().unwrap(), backoff::MAX);
        assert!(seen.windows(2).all(|w| w[1] >= w[0]));
        t.finish(&k, "mount", false, now);
        assert!(t.can_start(&k, "unmount", now), "another kind is not held back");
        t.finish(&k, "unmount", false, now);
        assert_eq!(t.delay(&k), Some(backoff::INITIAL));
        t.finish(&k, "unmount", true, now);
        assert_eq!(t.delay(&k), None);
    }

    #[test]
    fn volume_keys_conflict_with_pod_keys_of_the_same_volume_only() {
        let mut t = Tracker::default();
        let now = Instant::now();
        t.start(OpKey::pod("v", "a"));
        assert!(t.can_start(&OpKey::pod("v", "b"), "x", now));
        assert!(!t.can_start(&OpKey::pod("v", "a"), "x", now));
        assert!(!t.can_start(&OpKey::volume("v"), "x", now));
        assert!(t.can_start(&OpKey::volume("w"), "x", now));
    }
}
