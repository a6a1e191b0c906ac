//! Per-object timing: when each object's clock started and when a watch first saw it in its target
//! state. Watches, not polls, so the observed time is within a round trip of the write.

use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use futures::StreamExt;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use serde::de::DeserializeOwned;
use tokio::task::JoinHandle;

#[derive(Default)]
struct Inner {
    /// Keys whose latencies count.
    measured: HashSet<String>,
    /// Keys watched but not measured (the warm-up object).
    extra: HashSet<String>,
    start: HashMap<String, Instant>,
    /// Start of objects that have no start of their own (all created before the controller ran).
    default_start: Option<Instant>,
    done: HashMap<String, Instant>,
}

pub struct Tracker(Mutex<Inner>);

impl Tracker {
    pub fn new(
        measured: impl IntoIterator<Item = String>,
        extra: impl IntoIterator<Item = String>,
    ) -> Arc<Self> {
        Arc::new(Self(Mutex::new(Inner {
            measured: measured.into_iter().collect(),
            extra: extra.into_iter().collect(),
            ..Default::default()
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts `key`'s clock now (call before the request that creates or changes it is sent).
    pub fn start(&self, key: &str) {
        self.lock().start.insert(key.to_string(), Instant::now());
    }

    pub fn set_default_start(&self, t: Instant) {
        self.lock().default_start = Some(t);
    }

    /// A watch saw `key` in its target state; only the first sighting counts.
    pub fn observe(&self, key: &str) {
        let now = Instant::now();
        let mut g = self.lock();
        if (g.measured.contains(key) || g.extra.contains(key)) && !g.done.contains_key(key) {
            g.done.insert(key.to_string(), now);
        }
    }

    pub fn is_done(&self, key: &str) -> bool {
        self.lock().done.contains_key(key)
    }

    /// (measured keys done, measured keys in all).
    pub fn progress(&self) -> (usize, usize) {
        let g = self.lock();
        let done = g.done.keys().filter(|k| g.measured.contains(*k)).count();
        (done, g.measured.len())
    }

    /// Latencies of the measured keys that reached their target, and the last such moment.
    pub fn latencies(&self) -> (Vec<Duration>, Option<Instant>) {
        let g = self.lock();
        let mut out = Vec::with_capacity(g.done.len());
        let mut last: Option<Instant> = None;
        for (k, t) in g.done.iter().filter(|(k, _)| g.measured.contains(*k)) {
            let Some(s) = g.start.get(k).copied().or(g.default_start) else {
                continue;
            };
            out.push(t.saturating_duration_since(s));
            last = Some(last.map_or(*t, |l| l.max(*t)));
        }
        out.sort();
        (out, last)
    }
}

/// Watches `api` and reports to `tracker` every object for which `key_of` returns a key. Returns
/// once the initial list has been seen, so nothing that happens afterwards can be missed.
pub async fn watch<K, F>(
    api: Api<K>,
    config: watcher::Config,
    tracker: Arc<Tracker>,
    key_of: F,
) -> anyhow::Result<JoinHandle<()>>
where
    K: kube::Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    F: Fn(&K) -> Option<String> + Send + 'static,
{
    follow(api, config, move |o| {
        if let Some(k) = key_of(o) {
            tracker.observe(&k);
        }
    })
    .await
}

/// Watches `api`, calling `f` on every object seen (relists replay every object); returns once
/// the initial list is in.
pub async fn follow<K>(
    api: Api<K>,
    config: watcher::Config,
    mut f: impl FnMut(&K) + Send + 'static,
) -> anyhow::Result<JoinHandle<()>>
where
    K: kube::Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut tx = Some(tx);
        let mut stream = watcher(api, config).default_backoff().boxed();
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => f(&o),
                Ok(watcher::Event::InitDone) => {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(());
                    }
                }
                // Errors are retried by the backoff.
                _ => {}
            }
        }
    });
    // Generous: the takeover workload's first list holds 50,000 claims.
    match tokio::time::timeout(Duration::from_secs(300), rx).await {
        Ok(Ok(())) => Ok(task),
        _ => {
            task.abort();
            Err(anyhow!("watch did not finish its initial list within 300 s"))
        }
    }
}

/// Nearest-rank percentile of sorted durations, in milliseconds.
pub fn percentile_ms(sorted: &[Duration], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    let i = rank.clamp(1, sorted.len()) - 1;
    Some(sorted[i].as_secs_f64() * 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_sighting_counts_and_unknown_keys_are_ignored() {
        let t = Tracker::new(["a".to_string(), "b".to_string()], ["warm".to_string()]);
        t.set_default_start(Instant::now());
        t.observe("a");
        t.observe("nope");
        t.observe("warm");
        assert_eq!(t.progress(), (1, 2));
        assert!(t.is_done("warm"));
        let (lat, last) = t.latencies();
        assert_eq!(lat.len(), 1);
        assert!(last.is_some());
    }

    #[test]
    fn nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile_ms(&v, 50.0), Some(50.0));
        assert_eq!(percentile_ms(&v, 99.0), Some(99.0));
        assert_eq!(percentile_ms(&v[..1], 99.0), Some(1.0));
        assert_eq!(percentile_ms(&[], 50.0), None);
    }
}
