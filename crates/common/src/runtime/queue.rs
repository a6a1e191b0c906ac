//! A de-duplicating work queue with per-key exponential backoff, owned by one task (no locks),
//! shared by every controller. A key is at most once in the queue; a failed key comes back after
//! base × 2^failures, capped, and a success forgets its failures (client-go's per-item limiter has
//! the same shape), so one object that keeps conflicting neither spins nor holds back the others.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::Hash;
use std::sync::LazyLock;
use std::time::Duration;

use prometheus::{GaugeVec, IntGaugeVec};
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts};
use tokio::time::Instant;

/// The work-queue families, process-wide (several controllers' queues share them by `name`);
/// `register_metrics` exposes them.
struct Families {
    depth: IntGaugeVec,
    adds: IntCounterVec,
    retries: IntCounterVec,
    queue_duration: HistogramVec,
    work_duration: HistogramVec,
    unfinished: GaugeVec,
    longest: GaugeVec,
}

/// client-go's buckets: 10 ns to 10 s, each ten times the last.
fn buckets() -> Vec<f64> {
    prometheus::exponential_buckets(1e-8, 10.0, 10).expect("static buckets")
}

static FAMILIES: LazyLock<Families> = LazyLock::new(|| {
    let name = ["name"];
    Families {
        depth: IntGaugeVec::new(Opts::new("workqueue_depth", "Current depth of the work queue."), &name)
            .expect("static metric definition"),
        adds: IntCounterVec::new(
            Opts::new("workqueue_adds_total", "Keys added to the work queue (a key already queued is not counted)."),
            &name,
        )
        .expect("static metric definition"),
        retries: IntCounterVec::new(
            Opts::new("workqueue_retries_total", "Keys queued again after a failed sync."),
            &name,
        )
        .expect("static metric definition"),
        queue_duration: HistogramVec::new(
            HistogramOpts::new(
                "workqueue_queue_duration_seconds",
                "How long a key waits in the queue, from ready to handed to a worker.",
            )
            .buckets(buckets()),
            &name,
        )
        .expect("static metric definition"),
        work_duration: HistogramVec::new(
            HistogramOpts::new(
                "workqueue_work_duration_seconds",
                "How long processing a key takes, from handed out to success or retry.",
            )
            .buckets(buckets()),
            &name,
        )
        .expect("static metric definition"),
        unfinished: GaugeVec::new(
            Opts::new(
                "workqueue_unfinished_work_seconds",
                "Seconds of work in progress not yet observed by work_duration; a large value that keeps growing means a stuck worker.",
            ),
            &name,
        )
        .expect("static metric definition"),
        longest: GaugeVec::new(
            Opts::new(
                "workqueue_longest_running_processor_seconds",
                "How long the longest-running key in progress has been processed.",
            ),
            &name,
        )
        .expect("static metric definition"),
    }
});

/// Registers the `workqueue_*` families, in the binaries whose controllers use [`WorkQueue`]
/// (not the agent, whose loops do not: it would export families that never get a series).
pub fn register_metrics(registry: &crate::observe::metrics::Registry) {
    FAMILIES.register(registry);
}

impl Families {
    fn register(&self, registry: &crate::observe::metrics::Registry) {
        use crate::observe::metrics::register;
        register(registry, self.depth.clone());
        register(registry, self.adds.clone());
        register(registry, self.retries.clone());
        register(registry, self.queue_duration.clone());
        register(registry, self.work_duration.clone());
        register(registry, self.unfinished.clone());
        register(registry, self.longest.clone());
    }
}

/// One queue's series.
struct Series {
    depth: prometheus::IntGauge,
    adds: prometheus::IntCounter,
    retries: prometheus::IntCounter,
    queue_duration: prometheus::Histogram,
    work_duration: prometheus::Histogram,
    unfinished: prometheus::Gauge,
    longest: prometheus::Gauge,
}

impl Series {
    fn new(name: &str) -> Self {
        let f = &*FAMILIES;
        Self {
            depth: f.depth.with_label_values(&[name]),
            adds: f.adds.with_label_values(&[name]),
            retries: f.retries.with_label_values(&[name]),
            queue_duration: f.queue_duration.with_label_values(&[name]),
            work_duration: f.work_duration.with_label_values(&[name]),
            unfinished: f.unfinished.with_label_values(&[name]),
            longest: f.longest.with_label_values(&[name]),
        }
    }
}

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
    /// Metrics, when the queue has names: one series per name, `class` picks a key's; when each
    /// ready key became ready, and when each key being worked on was handed out.
    series: Vec<Series>,
    class: fn(&K) -> usize,
    /// Queued keys per series (the depth of each name).
    lens: Vec<usize>,
    ready_since: HashMap<K, Instant>,
    processing: HashMap<K, Instant>,
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
            series: Vec::new(),
            class: |_| 0,
            lens: Vec::new(),
            ready_since: HashMap::new(),
            processing: HashMap::new(),
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

    /// The same queue, exporting the work-queue metrics under `name`.
    pub fn named(self, name: &str) -> Self {
        self.named_by(&[name], |_| 0)
    }

    /// The same queue, exporting each key's work-queue metrics under `names[class(key)]`: one
    /// queue whose keys are reported as several named queues (kube-controller-manager runs a
    /// queue per kind where stowage runs one). Each key counts under exactly one name, so the
    /// series of all names add up to the queue.
    pub fn named_by(mut self, names: &[&str], class: fn(&K) -> usize) -> Self {
        self.series = names.iter().map(|n| Series::new(n)).collect();
        self.lens = vec![0; names.len()];
        self.class = class;
        self
    }

    /// The series `key` is counted in.
    fn series_of(&self, key: &K) -> Option<&Series> {
        self.series.get((self.class)(key))
    }

    fn mark_queued(&mut self, key: &K) -> bool {
        let new = self.queued.insert(key.clone());
        if new && let Some(n) = self.lens.get_mut((self.class)(key)) {
            *n += 1;
        }
        new
    }

    fn unmark_queued(&mut self, key: &K) {
        if self.queued.remove(key)
            && let Some(n) = self.lens.get_mut((self.class)(key))
        {
            *n = n.saturating_sub(1);
        }
    }

    /// Queues `key` now (a delayed key is brought forward).
    pub fn add(&mut self, key: K) {
        if let Some(at) = self.due.remove(&key) {
            self.delayed.remove(&(at, key.clone()));
            self.unmark_queued(&key);
        }
        if self.mark_queued(&key) {
            self.became_ready(&key, Instant::now());
            self.ready.push_back(key);
        }
    }

    fn became_ready(&mut self, key: &K, now: Instant) {
        if let Some(s) = self.series_of(key) {
            s.adds.inc();
            self.ready_since.insert(key.clone(), now);
        }
    }

    /// Work on `key` ended (it succeeded or is being retried).
    fn finished(&mut self, key: &K, now: Instant) {
        let start = self.processing.remove(key);
        if let (Some(s), Some(start)) = (self.series_of(key), start) {
            s.work_duration
                .observe(now.saturating_duration_since(start).as_secs_f64());
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
        self.mark_queued(&key);
        self.due.insert(key.clone(), at);
        self.delayed.insert((at, key));
    }

    /// Queues `key` after its next backoff step.
    pub fn retry(&mut self, key: K, now: Instant) -> Duration {
        let n = self.failures.entry(key.clone()).or_insert(0);
        *n = n.saturating_add(1);
        let delay = crate::runtime::backoff::exponential(self.base, self.cap, *n);
        self.retry_at(key, now, now + delay);
        delay
    }

    /// Queues `key` after `delay`, a failure all the same (a policy with its own curve over
    /// `failures`).
    pub fn retry_after(&mut self, key: K, now: Instant, delay: Duration) {
        let n = self.failures.entry(key.clone()).or_insert(0);
        *n = n.saturating_add(1);
        self.retry_at(key, now, now + delay);
    }

    /// Failures of `key` since its last success.
    pub fn failures(&self, key: &K) -> u32 {
        self.failures.get(key).copied().unwrap_or(0)
    }

    /// Whether `key` failed since its last success (it is backing off, or being retried).
    pub fn is_failing(&self, key: &K) -> bool {
        self.failures.contains_key(key)
    }

    /// Forgets `key`'s failures (its object is gone): a new object of that name starts afresh.
    pub fn forget(&mut self, key: &K) {
        self.failures.remove(key);
    }

    /// Queues `key` again at `at` after a failed sync (a caller with its own backoff).
    fn retry_at(&mut self, key: K, now: Instant, at: Instant) {
        self.finished(&key, now);
        if let Some(s) = self.series_of(&key) {
            s.retries.inc();
        }
        self.add_at(key, at);
    }

    /// Ends the work on `key` with success: its failures are forgotten (the key itself stays
    /// queued if it was queued again meanwhile).
    pub fn succeeded(&mut self, key: &K) {
        self.failures.remove(key);
        self.finished(key, Instant::now());
    }

    /// Sets the gauges that change with time alone (depth, work in progress); call it from the
    /// controller's loop.
    pub fn report(&self, now: Instant) {
        for (i, (s, len)) in self.series.iter().zip(&self.lens).enumerate() {
            s.depth.set(*len as i64);
            let ages = self
                .processing
                .iter()
                .filter(|(key, _)| (self.class)(key) == i)
                .map(|(_, t)| now.saturating_duration_since(*t).as_secs_f64());
            let (total, longest) = ages.fold((0.0, 0.0f64), |(sum, max), a| (sum + a, max.max(a)));
            s.unfinished.set(total);
            s.longest.set(longest);
        }
    }

    /// Moves due keys to ready and pops the first ready key.
    pub fn pop(&mut self, now: Instant) -> Option<K> {
        while let Some((at, _)) = self.delayed.first() {
            if *at > now {
                break;
            }
            let (at, key) = self.delayed.pop_first().expect("checked non-empty");
            self.due.remove(&key);
            self.became_ready(&key, at);
            self.ready.push_back(key);
        }
        let key = self.ready.pop_front()?;
        self.unmark_queued(&key);
        let class = (self.class)(&key);
        if let Some(s) = self.series.get(class) {
            if let Some(since) = self.ready_since.remove(&key) {
                s.queue_duration
                    .observe(now.saturating_duration_since(since).as_secs_f64());
            }
            s.depth.set(self.lens[class] as i64);
            self.processing.insert(key.clone(), now);
        }
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
        q.succeeded(&"a");
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

    #[test]
    fn a_named_queue_counts_adds_retries_and_work() {
        let t0 = Instant::now();
        let mut q = WorkQueue::default().named("test-queue-metrics");
        let f = &*FAMILIES;
        let adds = || f.adds.with_label_values(&["test-queue-metrics"]).get();
        let retries = || f.retries.with_label_values(&["test-queue-metrics"]).get();
        let work = || {
            f.work_duration
                .with_label_values(&["test-queue-metrics"])
                .get_sample_count()
        };
        q.add("a");
        q.add("a"); // already queued: not an add
        assert_eq!(adds(), 1);
        assert_eq!(q.pop(t0), Some("a"));
        q.report(t0 + Duration::from_secs(3));
        let longest = f.longest.with_label_values(&["test-queue-metrics"]).get();
        assert_eq!(longest, 3.0, "a key handed out 3 s ago is still in progress");
        q.retry("a", t0 + Duration::from_secs(3));
        assert_eq!((retries(), work()), (1, 1));
        let due = q.next_due().unwrap();
        assert_eq!(q.pop(due), Some("a"));
        assert_eq!(adds(), 2, "a retried key counts again when it becomes ready");
        q.succeeded(&"a");
        assert_eq!(work(), 2);
        q.report(due);
        assert_eq!(f.longest.with_label_values(&["test-queue-metrics"]).get(), 0.0);
        assert_eq!(f.depth.with_label_values(&["test-queue-metrics"]).get(), 0);
    }

    #[test]
    fn one_queue_reports_its_keys_under_two_names() {
        let t0 = Instant::now();
        let mut q = WorkQueue::default().named_by(&["test-split-even", "test-split-odd"], |k: &u32| {
            (*k % 2) as usize
        });
        let f = &*FAMILIES;
        let depth = |n: &str| f.depth.with_label_values(&[n]).get();
        let adds = |n: &str| f.adds.with_label_values(&[n]).get();
        q.add(2);
        q.add(4);
        q.add(3);
        q.report(t0);
        assert_eq!((depth("test-split-even"), depth("test-split-odd")), (2, 1));
        assert_eq!((adds("test-split-even"), adds("test-split-odd")), (2, 1));
        assert_eq!(q.pop(t0), Some(2));
        assert_eq!(
            depth("test-split-even"),
            1,
            "a pop lowers only its own name's depth"
        );
        q.retry(2, t0);
        assert_eq!(f.retries.with_label_values(&["test-split-even"]).get(), 1);
        assert_eq!(f.retries.with_label_values(&["test-split-odd"]).get(), 0);
        assert_eq!(q.pop(t0), Some(4));
        q.report(t0 + Duration::from_secs(2));
        assert_eq!(f.longest.with_label_values(&["test-split-even"]).get(), 2.0);
        assert_eq!(f.longest.with_label_values(&["test-split-odd"]).get(), 0.0);
        assert_eq!((depth("test-split-even"), depth("test-split-odd")), (1, 1));
    }

    proptest::proptest! {
        /// Whatever the operations, a key is popped at most once per time it was queued and
        /// `len` always equals the number of distinct queued keys.
        #[test]
        fn never_duplicates(ops in proptest::collection::vec((0u8..4, 0u8..5, 0u64..50), 0..200)) {
            let t0 = Instant::now();
            let mut q = WorkQueue::default().named_by(&["test-prop-a", "test-prop-b"], |k: &u8| usize::from(*k % 2));
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
                proptest::prop_assert_eq!(q.lens.iter().sum::<usize>(), q.len());
                let odd = seen.iter().filter(|k| **k % 2 == 1).count();
                proptest::prop_assert_eq!(q.lens[1], odd);
            }
        }
    }
}
