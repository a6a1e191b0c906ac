//! Events for people, sent by one background task per component through a bounded queue.
//!
//! Callers never wait for the apiserver: an event is queued (or, when the queue is full, dropped
//! and counted), as client-go's broadcaster does with its 1,000-event queue. A burst of bad
//! objects therefore costs a bounded amount of memory instead of one parked task per event.
//!
//! Repeats are folded into a series, as client-go's events.k8s.io recorder does: an event equal
//! to one sent before (same regarding object, type, reason, action, note and reporting
//! controller) within [`SERIES_WINDOW`] of that one's last occurrence updates the first Event
//! object's `series` (count, lastObservedTime) with a PATCH instead of creating another object.
//! The first repeat is written at once; later ones at most once per [`SERIES_WRITE_INTERVAL`]
//! (a flush writes what was counted meanwhile), as client-go defers series updates too.
//! The note is part of the key (kube-runtime's recorder leaves it out and keeps the first note,
//! so a changed explanation would never show). What the sender remembers is bounded
//! ([`FOLD_CAPACITY`] keys, least recently seen evicted first), so memory stays bounded however
//! many objects misbehave.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use crate::errors::{ERROR, SUCCESS};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event as K8sEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use prometheus::{IntCounterVec, Opts};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Events a component may have waiting; beyond this new ones are dropped (and counted).
pub const QUEUE_CAPACITY: usize = 1000;

/// A repeat this long after the previous occurrence starts a new Event object instead of
/// extending the series (client-go's and kube-runtime's 6 minutes).
pub const SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);

/// Distinct events whose Event object the sender remembers for folding.
pub const FOLD_CAPACITY: usize = 4096;

/// A series is written at most this often per event (the first repeat at once, so the series
/// shows); repeats in between are counted and written by the next flush. A storm of one event
/// therefore costs one PATCH per interval, not one write per occurrence.
pub const SERIES_WRITE_INTERVAL: Duration = Duration::from_secs(10);

/// `stowage_events_total{component, type, operation, result}`, process-wide; `metrics::registry`
/// exposes it.
pub(crate) static EVENTS_TOTAL: LazyLock<IntCounterVec> = LazyLock::new(|| {
    IntCounterVec::new(
        Opts::new(
            "stowage_events_total",
            "Kubernetes Events by operation (create: a new Event object; series: a repeat counted in an existing Event's series; queue: dropped because the queue was full) and result (success, error).",
        ),
        &["component", "type", "operation", "result"],
    )
    .expect("static metric definition")
});

/// The `operation` label of `stowage_events_total`: a new Event object, a repeat written into an
/// existing Event's series, or the hand-off to the sender (only fails: queue full, dropped).
const OP_CREATE: &str = "create";
const OP_SERIES: &str = "series";
const OP_QUEUE: &str = "queue";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    Normal,
    Warning,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

struct Pending {
    on: ObjectReference,
    type_: EventType,
    reason: String,
    action: String,
    note: String,
}

/// What makes two events the same occurrence (client-go's isomorphic-event key). The reporting
/// controller is the sender's own, so it is implied.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct FoldKey {
    regarding: String,
    type_: EventType,
    reason: String,
    action: String,
    note: String,
}

impl FoldKey {
    fn of(p: &Pending) -> Self {
        let r = &p.on;
        // The UID tells a re-created object with the same name apart; without one, the name.
        let regarding = format!(
            "{}/{}/{}/{}/{}",
            r.api_version.as_deref().unwrap_or(""),
            r.kind.as_deref().unwrap_or(""),
            r.namespace.as_deref().unwrap_or(""),
            r.name.as_deref().unwrap_or(""),
            r.uid.as_deref().unwrap_or("")
        );
        Self {
            regarding,
            type_: p.type_,
            reason: p.reason.clone(),
            action: p.action.clone(),
            note: p.note.clone(),
        }
    }
}

/// The Event object an earlier occurrence created, and its series so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seen {
    namespace: String,
    name: String,
    /// Occurrences so far (1 = no series yet).
    count: i32,
    /// The count the Event object shows.
    written: i32,
    /// The last occurrence (monotonic, for the window; wall clock, for lastObservedTime).
    last: Instant,
    observed: Timestamp,
    last_write: Instant,
}

/// What to do with one occurrence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// A new Event object.
    Create,
    /// Count it in the series of the Event object `seen` names; write the series now, or leave
    /// it to the next flush.
    Series { count: i32, write_now: bool },
}

/// The folding decision: a repeat within the window extends the series; anything else (never
/// seen, or the last occurrence too long ago) is a new object. The first repeat is written at
/// once, later ones at most once per [`SERIES_WRITE_INTERVAL`].
pub(crate) fn decide(seen: Option<&Seen>, now: Instant) -> Step {
    match seen {
        Some(s) if now.saturating_duration_since(s.last) <= SERIES_WINDOW && s.count < i32::MAX => {
            Step::Series {
                count: s.count + 1,
                write_now: s.written <= 1
                    || now.saturating_duration_since(s.last_write) >= SERIES_WRITE_INTERVAL,
            }
        }
        _ => Step::Create,
    }
}

/// A bounded memory: a map plus its recency order; inserting beyond the capacity forgets the
/// least recently put key (for folds: its next occurrence just starts a new object; for the
/// repeat gate: its next event is sent at once).
pub(crate) struct Bounded<K, V> {
    map: HashMap<K, (V, u64)>,
    order: BTreeMap<u64, K>,
    tick: u64,
    cap: usize,
}

/// What the sender remembers of the Event objects it created.
pub(crate) type Folds = Bounded<FoldKey, Seen>;

impl<K: Clone + Eq + std::hash::Hash, V> Bounded<K, V> {
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            map: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
            cap: cap.max(1),
        }
    }

    pub(crate) fn get<Q>(&self, k: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
        Q: Eq + std::hash::Hash + ?Sized,
    {
        self.map.get(k).map(|(s, _)| s)
    }

    /// Changes an entry without making it more recent.
    fn get_mut(&mut self, k: &K) -> Option<&mut V> {
        self.map.get_mut(k).map(|(s, _)| s)
    }

    fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.map.iter().map(|(k, (v, _))| (k, v))
    }

    pub(crate) fn put(&mut self, k: K, v: V) {
        self.tick += 1;
        if let Some((_, old)) = self.map.remove(&k) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, k.clone());
        self.map.insert(k, (v, self.tick));
        while self.map.len() > self.cap {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            self.map.remove(&oldest);
        }
    }

    pub(crate) fn forget<Q>(&mut self, k: &Q)
    where
        K: std::borrow::Borrow<Q>,
        Q: Eq + std::hash::Hash + ?Sized,
    {
        if let Some((_, t)) = self.map.remove(k) {
            self.order.remove(&t);
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

impl Folds {
    /// Keys whose series has occurrences the Event object does not show yet.
    pub(crate) fn unwritten(&self) -> Vec<FoldKey> {
        self.iter()
            .filter(|(_, s)| s.count > s.written)
            .map(|(k, _)| k.clone())
            .collect()
    }
}

/// Whether an event about a subject is said again: the one place where controllers' repeats are
/// held back (before the recorder folds what is sent into series).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repeat {
    /// Every time; it becomes the subject's last event all the same.
    Always,
    /// Once per change of reason or note: a condition that persists is reported once, however
    /// often it is decided again.
    OnChange,
    /// A new reason or note at once; the same one again after a gap that doubles from `first`
    /// to `max` while it stays (a failure that persists is heard of less and less often).
    Backoff { first: Duration, max: Duration },
    /// At most once per period, whatever the note (a finding reported about many objects).
    Every(Duration),
}

/// A pod as the object an event is about.
pub fn pod_reference(
    namespace: &str,
    name: &str,
    uid: Option<&str>,
) -> k8s_openapi::api::core::v1::ObjectReference {
    k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        uid: uid.map(Into::into),
        ..Default::default()
    }
}

/// What the gate keys a controller's repeats on: an object, by its kind and its key or UID, and,
/// where one object has several conditions reported independently, which one (`about`). Every
/// subject is built here, so the subjects of all controllers read alike and cannot collide by
/// accident of formatting.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Subject(String);

impl Subject {
    /// The object of kind `kind` (`pod`, `claim`, `volume`, …) known by `id`.
    pub fn new(kind: &str, id: &str) -> Self {
        Self(format!("{kind} {id}"))
    }

    /// One of the object's conditions (a volume of a pod, an operation, a reason).
    pub fn about(mut self, part: &str) -> Self {
        self.0.push(' ');
        self.0.push_str(part);
        self
    }
}

impl std::fmt::Display for Subject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What the gate remembers of a subject's last event.
#[derive(Debug, Clone)]
pub(crate) struct Said {
    reason: String,
    note: String,
    /// When the same event may be said again (`Backoff`, `Every`).
    next: Instant,
    gap: Duration,
}

/// Subjects the gate remembers; beyond this the least recently said is forgotten.
const GATE_CAPACITY: usize = 16_384;

/// The gate's decision for one event: whether it is said now, and what to remember if so.
pub(crate) fn gate(
    last: Option<&Said>,
    repeat: Repeat,
    reason: &str,
    note: &str,
    now: Instant,
) -> Option<Said> {
    let same = last.is_some_and(|l| l.reason == reason && l.note == note);
    let (say, gap) = match repeat {
        Repeat::Always => (true, Duration::ZERO),
        Repeat::OnChange => (!same, Duration::ZERO),
        Repeat::Backoff { first, max } => match last {
            Some(l) if same => (now >= l.next, (l.gap * 2).clamp(first, max)),
            _ => (true, first),
        },
        Repeat::Every(period) => (last.is_none_or(|l| now >= l.next), period),
    };
    say.then(|| Said {
        reason: reason.to_string(),
        note: note.to_string(),
        next: now + gap,
        gap,
    })
}

/// One event a controller has to say.
#[derive(Debug, Clone)]
pub struct Occurrence<'a> {
    pub warning: bool,
    pub reason: &'a str,
    pub action: &'a str,
    pub note: String,
}

/// The apiserver refuses notes longer than this many bytes.
const NOTE_LIMIT: usize = 1024;

/// A note a controller composes from a list that may grow (pods, volumes): kept under 1,000
/// bytes, cut on a character boundary and marked " …", so the recorder's own cut at the
/// apiserver's limit never lands in the middle of it unmarked.
pub fn bounded_note(mut note: String) -> String {
    if note.len() > 1000 {
        note.truncate(truncate(&note, 990).len());
        note.push_str(" …");
    }
    note
}

/// `s` cut to at most `max` bytes, on a character boundary.
fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Aborts the sender when the last handle goes, so a stopped controller (lost leadership)
/// sends nothing more.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[derive(Clone)]
pub struct Events {
    tx: mpsc::Sender<Pending>,
    component: Arc<str>,
    /// The last event said about each subject (`report`), shared by every clone.
    said: Arc<std::sync::Mutex<Bounded<Subject, Said>>>,
    _sender: Arc<AbortOnDrop>,
}

/// The sender task's state.
struct Sender {
    client: Client,
    controller: String,
    instance: String,
    folds: Folds,
}

impl Sender {
    fn api(&self, ns: &str) -> Api<K8sEvent> {
        Api::namespaced(self.client.clone(), ns)
    }

    async fn write_series(&self, seen: &Seen) -> Result<(), kube::Error> {
        let patch = serde_json::json!({
            "series": {"count": seen.count, "lastObservedTime": MicroTime(seen.observed)}
        });
        self.api(&seen.namespace)
            .patch(&seen.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
    }

    /// Creates, or folds into a series; returns the metric's operation and result.
    async fn send(&mut self, p: Pending) -> (&'static str, &'static str) {
        let key = FoldKey::of(&p);
        let now = Instant::now();
        if let Some(seen) = self.folds.get(&key).cloned()
            && let Step::Series { count, write_now } = decide(Some(&seen), now)
        {
            let mut next = Seen {
                count,
                last: now,
                observed: Timestamp::now(),
                ..seen
            };
            if !write_now {
                self.folds.put(key, next);
                return (OP_SERIES, SUCCESS);
            }
            match self.write_series(&next).await {
                Ok(()) => {
                    next.written = count;
                    next.last_write = now;
                    self.folds.put(key, next);
                    return (OP_SERIES, SUCCESS);
                }
                // Expired (events have a TTL) or deleted: start a new object below.
                Err(kube::Error::Api(s)) if s.code == 404 => self.folds.forget(&key),
                Err(e) => {
                    // Counted still; the next flush tries again.
                    tracing::warn!(reason = %p.reason, error = %e, "cannot update event series");
                    self.folds.put(key, next);
                    return (OP_SERIES, ERROR);
                }
            }
        }
        let ev = self.new_event(&p);
        let ns = ev.metadata.namespace.clone().unwrap_or_default();
        match self.api(&ns).create(&PostParams::default(), &ev).await {
            Ok(created) => {
                let seen = Seen {
                    namespace: ns,
                    name: created.metadata.name.unwrap_or_default(),
                    count: 1,
                    written: 1,
                    last: now,
                    observed: Timestamp::now(),
                    last_write: now,
                };
                self.folds.put(key, seen);
                (OP_CREATE, SUCCESS)
            }
            Err(e) => {
                tracing::warn!(reason = %p.reason, error = %e, "cannot record event");
                (OP_CREATE, ERROR)
            }
        }
    }

    /// Writes the series whose occurrences the Event objects do not show yet.
    async fn flush(&mut self) {
        for key in self.folds.unwritten() {
            let Some(seen) = self.folds.get(&key).cloned() else {
                continue;
            };
            match self.write_series(&seen).await {
                Ok(()) => {
                    if let Some(s) = self.folds.get_mut(&key) {
                        s.written = seen.count;
                        s.last_write = Instant::now();
                    }
                }
                Err(kube::Error::Api(s)) if s.code == 404 => self.folds.forget(&key),
                Err(e) => tracing::warn!(reason = %key.reason, error = %e, "cannot update event series"),
            }
        }
    }

    fn new_event(&self, p: &Pending) -> K8sEvent {
        let now = Timestamp::now();
        let ns = p.on.namespace.clone().unwrap_or_else(|| "default".into());
        let base = p.on.name.as_deref().unwrap_or(&self.controller);
        K8sEvent {
            metadata: ObjectMeta {
                namespace: Some(ns),
                name: Some(format!("{base}.{:x}", now.as_nanosecond())),
                ..Default::default()
            },
            event_time: Some(MicroTime(now)),
            action: Some(p.action.clone()),
            reason: Some(p.reason.clone()),
            note: Some(truncate(&p.note, NOTE_LIMIT).into()),
            regarding: Some(p.on.clone()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(p.type_.as_str().into()),
            ..Default::default()
        }
    }
}

impl Events {
    /// `controller` is the reporting component, e.g. `stowage-binder`. Spawns the sender on the
    /// current runtime.
    pub fn new(client: Client, controller: &str) -> Self {
        let mut sender = Sender {
            client,
            controller: controller.into(),
            instance: std::env::var("POD_NAME").unwrap_or_else(|_| controller.into()),
            folds: Folds::new(FOLD_CAPACITY),
        };
        let component: Arc<str> = controller.into();
        let (tx, mut rx) = mpsc::channel::<Pending>(QUEUE_CAPACITY);
        let label = component.clone();
        let task = tokio::spawn(async move {
            let mut flush = tokio::time::interval(SERIES_WRITE_INTERVAL);
            flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    p = rx.recv() => {
                        let Some(p) = p else { break };
                        let type_ = p.type_;
                        let (operation, result) = sender.send(p).await;
                        EVENTS_TOTAL
                            .with_label_values(&[&*label, type_.as_str(), operation, result])
                            .inc();
                    }
                    _ = flush.tick() => sender.flush().await,
                }
            }
        });
        Self {
            tx,
            component,
            said: Arc::new(std::sync::Mutex::new(Bounded::new(GATE_CAPACITY))),
            _sender: Arc::new(AbortOnDrop(task)),
        }
    }

    /// Says `e` about `on` unless `repeat` holds it back for `subject`; returns whether it was
    /// said, so a log line can follow the same rule.
    pub fn report(&self, subject: &Subject, repeat: Repeat, on: &ObjectReference, e: Occurrence<'_>) -> bool {
        {
            let mut said = self.said.lock().unwrap_or_else(|p| p.into_inner());
            match gate(said.get(subject), repeat, e.reason, &e.note, Instant::now()) {
                Some(s) => said.put(subject.clone(), s),
                None => return false,
            }
        }
        let type_ = if e.warning {
            EventType::Warning
        } else {
            EventType::Normal
        };
        self.queue(on, type_, e.reason, e.action, e.note);
        true
    }

    /// Forgets what was said about `subject` (it is gone, or its condition cleared): its next
    /// event is said at once.
    pub fn forget(&self, subject: &Subject) {
        self.said
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .forget(subject);
    }

    pub fn normal(&self, on: &ObjectReference, reason: &str, action: &str, note: String) {
        self.queue(on, EventType::Normal, reason, action, note);
    }

    pub fn warning(&self, on: &ObjectReference, reason: &str, action: &str, note: String) {
        self.queue(on, EventType::Warning, reason, action, note);
    }

    fn queue(&self, on: &ObjectReference, type_: EventType, reason: &str, action: &str, note: String) {
        let p = Pending {
            on: on.clone(),
            type_,
            reason: reason.into(),
            action: action.into(),
            note,
        };
        if self.tx.try_send(p).is_err() {
            tracing::warn!(reason, object = ?on.name, "event queue full, event dropped");
            EVENTS_TOTAL
                .with_label_values(&[&*self.component, type_.as_str(), OP_QUEUE, ERROR])
                .inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_says_what_each_repeat_rule_lets_through() {
        let t0 = Instant::now();
        let s = |d: u64| t0 + Duration::from_secs(d);
        let step = |last: &mut Option<Said>, r: Repeat, note: &str, at: Instant| {
            let said = gate(last.as_ref(), r, "Reason", note, at);
            let out = said.is_some();
            if let Some(x) = said {
                *last = Some(x);
            }
            out
        };
        // OnChange: once per text.
        let mut l = None;
        assert!(step(&mut l, Repeat::OnChange, "a", s(0)));
        assert!(!step(&mut l, Repeat::OnChange, "a", s(1000)));
        assert!(step(&mut l, Repeat::OnChange, "b", s(1000)));
        // Always records, so the text it said is the one OnChange compares with.
        assert!(step(&mut l, Repeat::Always, "a", s(1000)));
        assert!(!step(&mut l, Repeat::OnChange, "a", s(1001)));
        // Backoff: 10 s, then 20 s, capped at 30 s; a new text at once and from the first gap.
        let b = Repeat::Backoff {
            first: Duration::from_secs(10),
            max: Duration::from_secs(30),
        };
        let mut l = None;
        assert!(step(&mut l, b, "x", s(0)));
        assert!(!step(&mut l, b, "x", s(9)));
        assert!(step(&mut l, b, "x", s(10)));
        assert!(!step(&mut l, b, "x", s(29)));
        assert!(step(&mut l, b, "x", s(30)));
        assert!(step(&mut l, b, "x", s(60)));
        assert!(!step(&mut l, b, "x", s(89)));
        assert!(step(&mut l, b, "y", s(61)));
        assert!(!step(&mut l, b, "y", s(70)));
        assert!(step(&mut l, b, "y", s(71)));
        // Every: whatever the note, once per period.
        let e = Repeat::Every(Duration::from_secs(600));
        let mut l = None;
        assert!(step(&mut l, e, "one", s(0)));
        assert!(!step(&mut l, e, "two", s(599)));
        assert!(step(&mut l, e, "three", s(600)));
    }

    #[tokio::test]
    async fn a_full_queue_drops_and_counts_instead_of_growing() {
        // Nothing listens there: the sender's posts fail, which is fine for this test.
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let events = Events::new(Client::try_from(config).unwrap(), "test-full-queue");
        let dropped = || {
            EVENTS_TOTAL
                .with_label_values(&["test-full-queue", "Warning", OP_QUEUE, ERROR])
                .get()
        };
        let on = ObjectReference {
            name: Some("x".into()),
            ..Default::default()
        };
        // The current-thread runtime does not run the sender until this test yields, so the
        // queue fills deterministically.
        for i in 0..QUEUE_CAPACITY + 5 {
            events.warning(&on, "Test", "Testing", format!("note {i}"));
        }
        assert_eq!(dropped(), 5);
    }

    fn key(note: &str) -> FoldKey {
        FoldKey::of(&Pending {
            on: ObjectReference {
                kind: Some("PersistentVolumeClaim".into()),
                namespace: Some("app".into()),
                name: Some("c".into()),
                uid: Some("u1".into()),
                ..Default::default()
            },
            type_: EventType::Warning,
            reason: "ProvisioningFailed".into(),
            action: "Provisioning".into(),
            note: note.into(),
        })
    }

    fn seen(count: i32, last: Instant) -> Seen {
        Seen {
            namespace: "app".into(),
            name: "c.1".into(),
            count,
            written: count,
            last,
            observed: Timestamp::UNIX_EPOCH,
            last_write: last,
        }
    }

    #[test]
    fn bounded_notes_stay_under_a_thousand_bytes_and_say_they_were_cut() {
        assert_eq!(bounded_note("short".into()), "short");
        let cut = bounded_note("é".repeat(600));
        assert!(cut.len() <= 1000 && cut.ends_with(" …"), "{}", cut.len());
    }

    #[test]
    fn notes_are_cut_to_the_apiservers_byte_limit_on_a_character_boundary() {
        assert_eq!(truncate("short", NOTE_LIMIT), "short");
        let long = "é".repeat(600); // 1,200 bytes
        let cut = truncate(&long, NOTE_LIMIT);
        assert!(cut.len() <= NOTE_LIMIT && cut.len() >= NOTE_LIMIT - 1);
        assert!(cut.chars().all(|c| c == 'é'));
    }

    #[test]
    fn a_repeat_within_the_window_extends_the_series_else_a_new_object() {
        let t0 = Instant::now();
        let series = |st: Step| match st {
            Step::Series { count, .. } => Some(count),
            Step::Create => None,
        };
        assert_eq!(decide(None, t0), Step::Create);
        assert_eq!(
            series(decide(Some(&seen(1, t0)), t0 + Duration::from_secs(1))),
            Some(2)
        );
        assert_eq!(series(decide(Some(&seen(7, t0)), t0 + SERIES_WINDOW)), Some(8));
        assert_eq!(
            decide(Some(&seen(7, t0)), t0 + SERIES_WINDOW + Duration::from_millis(1)),
            Step::Create,
            "a quiet spell longer than the window starts over"
        );
        assert_eq!(decide(Some(&seen(i32::MAX, t0)), t0), Step::Create);
    }

    #[test]
    fn the_first_repeat_is_written_at_once_later_ones_at_most_once_per_interval() {
        let t0 = Instant::now();
        let write_now = |s: &Seen, at| matches!(decide(Some(s), at), Step::Series { write_now: true, .. });
        assert!(write_now(&seen(1, t0), t0), "the series shows at once");
        let mut s = seen(2, t0);
        assert!(
            !write_now(&s, t0 + Duration::from_secs(1)),
            "counted, written by the flush"
        );
        assert!(write_now(&s, t0 + SERIES_WRITE_INTERVAL));
        // Occurrences counted since the last write are what a flush writes.
        s.count = 5;
        let mut f = Folds::new(8);
        f.put(key("a"), s);
        f.put(key("b"), seen(3, t0));
        assert_eq!(f.unwritten(), vec![key("a")]);
    }

    #[test]
    fn the_key_tells_notes_objects_and_types_apart() {
        assert_eq!(key("a"), key("a"));
        assert_ne!(key("a"), key("b"), "a changed explanation is a new event");
        let mut other = key("a");
        other.type_ = EventType::Normal;
        assert_ne!(key("a"), other);
        let recreated = FoldKey::of(&Pending {
            on: ObjectReference {
                kind: Some("PersistentVolumeClaim".into()),
                namespace: Some("app".into()),
                name: Some("c".into()),
                uid: Some("u2".into()),
                ..Default::default()
            },
            type_: EventType::Warning,
            reason: "ProvisioningFailed".into(),
            action: "Provisioning".into(),
            note: "a".into(),
        });
        assert_ne!(
            key("a"),
            recreated,
            "a re-created object with the same name is another object"
        );
    }

    #[test]
    fn the_fold_memory_is_bounded_and_forgets_the_least_recently_seen() {
        let t0 = Instant::now();
        let mut f = Folds::new(3);
        for n in ["a", "b", "c"] {
            f.put(key(n), seen(1, t0));
        }
        // Touch "a": now "b" is the least recently seen.
        f.put(key("a"), seen(2, t0));
        f.put(key("d"), seen(1, t0));
        assert_eq!(f.len(), 3);
        assert!(f.get(&key("b")).is_none());
        assert_eq!(f.get(&key("a")).map(|s| s.count), Some(2));
        assert!(f.get(&key("c")).is_some() && f.get(&key("d")).is_some());
        for i in 0..10_000 {
            f.put(key(&i.to_string()), seen(1, t0));
        }
        assert_eq!(f.len(), 3, "memory stays bounded");
        assert_eq!(f.order.len(), 3);
        f.forget(&key("9999"));
        assert_eq!((f.len(), f.order.len()), (2, 2));
    }
}
