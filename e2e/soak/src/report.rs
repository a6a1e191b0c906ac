//! What a run reports: counters per operation, fault and invariant, the violations and leaks
//! found, an append-only event timeline, and the bundle a failing run leaves behind.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    /// Seconds since the run started.
    pub at: f64,
    pub what: String,
    pub detail: String,
}

#[derive(Default, Debug, Serialize, Clone)]
pub struct Counters {
    pub operations: BTreeMap<String, u64>,
    pub faults: BTreeMap<String, u64>,
    pub checks: BTreeMap<String, u64>,
    pub restarts: BTreeMap<String, u64>,
    pub violations: Vec<Finding>,
    pub leaks: Vec<Finding>,
    /// Things that went wrong in the soak's own driving (an API call that failed during a fault):
    /// reported, not counted as violations.
    pub notes: BTreeMap<String, u64>,
    /// What the API squeezes did to the controller's requests, from the apiserver's own APF
    /// metrics: requests dispatched and rejected (429) in the squeezed level, milliseconds queued.
    pub squeeze: BTreeMap<String, u64>,
    /// `spec.leaseTransitions` of the controller's Lease at the end: handovers to another replica.
    pub lease_transitions: u64,
}

/// The shared record of a run: counters and the JSON-lines timeline (`timeline.jsonl`).
pub struct Record {
    pub start: Instant,
    counters: Mutex<Counters>,
    timeline: Mutex<Option<std::fs::File>>,
    pub timeline_path: PathBuf,
    seen: Mutex<std::collections::HashSet<String>>,
}

impl Record {
    pub fn new(dir: &Path) -> std::io::Result<Self> {
        let timeline_path = dir.join("timeline.jsonl");
        Ok(Self {
            start: Instant::now(),
            counters: Mutex::new(Counters::default()),
            timeline: Mutex::new(Some(std::fs::File::create(&timeline_path)?)),
            timeline_path,
            seen: Mutex::new(Default::default()),
        })
    }

    pub fn elapsed(&self) -> f64 {
        (self.start.elapsed().as_millis() as f64) / 1000.0
    }

    fn with<R>(&self, f: impl FnOnce(&mut Counters) -> R) -> R {
        f(&mut self.counters.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// One line of the timeline: `{"t": seconds, "type": .., ...fields}`.
    pub fn log(&self, kind: &str, fields: serde_json::Value) {
        let mut line = serde_json::json!({"t": self.elapsed(), "type": kind});
        if let (Some(obj), serde_json::Value::Object(more)) = (line.as_object_mut(), fields) {
            obj.extend(more);
        }
        if let Some(f) = self.timeline.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            let _ = writeln!(f, "{line}");
        }
    }

    pub fn op(&self, kind: &str, detail: serde_json::Value) {
        self.with(|c| *c.operations.entry(kind.into()).or_default() += 1);
        self.log("op", serde_json::json!({"op": kind, "detail": detail}));
    }

    /// How many operations of `kind` were done so far.
    pub fn operations(&self, kind: &str) -> u64 {
        self.with(|c| c.operations.get(kind).copied().unwrap_or(0))
    }

    pub fn fault(&self, kind: &str, detail: serde_json::Value) {
        self.with(|c| *c.faults.entry(kind.into()).or_default() += 1);
        self.log("fault", serde_json::json!({"fault": kind, "detail": detail}));
    }

    pub fn restart(&self, what: &str) {
        self.with(|c| *c.restarts.entry(what.into()).or_default() += 1);
    }

    pub fn checks(&self, invariant: &str, n: u64) {
        if n > 0 {
            self.with(|c| *c.checks.entry(invariant.into()).or_default() += n);
        }
    }

    pub fn note(&self, what: &str, detail: &str) {
        self.with(|c| *c.notes.entry(what.into()).or_default() += 1);
        self.log("note", serde_json::json!({"what": what, "detail": detail}));
    }

    /// Records a violation once per `key` (an ongoing state is one violation, not one per look).
    pub fn violation(&self, key: &str, what: &str, detail: String) {
        if !self
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(format!("v:{key}"))
        {
            return;
        }
        eprintln!("soak: VIOLATION {what}: {detail}");
        self.log("violation", serde_json::json!({"what": what, "detail": detail}));
        let at = self.elapsed();
        self.with(|c| {
            c.violations.push(Finding {
                at,
                what: what.into(),
                detail,
            })
        });
    }

    pub fn leak(&self, what: &str, detail: String) {
        eprintln!("soak: LEAK {what}: {detail}");
        self.log("leak", serde_json::json!({"what": what, "detail": detail}));
        let at = self.elapsed();
        self.with(|c| {
            c.leaks.push(Finding {
                at,
                what: what.into(),
                detail,
            })
        });
    }

    pub fn measured(&self, what: &str, n: u64) {
        self.with(|c| *c.squeeze.entry(what.into()).or_default() += n);
    }

    pub fn lease_transitions(&self, n: u64) {
        self.with(|c| c.lease_transitions = n);
    }

    pub fn snapshot(&self) -> Counters {
        self.with(|c| c.clone())
    }

    pub fn close_timeline(&self) {
        self.timeline.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

/// What `make soak` prints and the test asserts on.
#[derive(Debug, Serialize, Clone)]
pub struct Summary {
    pub seed: u64,
    pub churn_seconds: u64,
    pub total_seconds: f64,
    pub controllers: usize,
    pub agents: usize,
    #[serde(flatten)]
    pub counters: Counters,
    /// Where the bundle of a failing run is (none for a clean run unless asked for).
    pub bundle: Option<PathBuf>,
    /// Set when the run could not be carried out at all (set-up failed, a bound was hit).
    pub error: Option<String>,
}

impl Summary {
    pub fn passed(&self) -> bool {
        self.error.is_none() && self.counters.violations.is_empty() && self.counters.leaks.is_empty()
    }

    pub fn render(&self) -> String {
        let c = &self.counters;
        let mut s = String::new();
        let line = |s: &mut String, t: String| {
            s.push_str(&t);
            s.push('\n');
        };
        let map = |m: &BTreeMap<String, u64>| -> String {
            if m.is_empty() {
                return "none".into();
            }
            let total: u64 = m.values().sum();
            let parts: Vec<String> = m.iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!("{total} ({})", parts.join(", "))
        };
        line(&mut s, "== stowage soak summary ==".into());
        line(
            &mut s,
            format!(
                "seed {} (replay: make soak SEED={} DURATION={}s)",
                self.seed, self.seed, self.churn_seconds
            ),
        );
        line(
            &mut s,
            format!(
                "churn {} s, whole run {:.0} s; {} controller replicas (leader election), {} agents",
                self.churn_seconds, self.total_seconds, self.controllers, self.agents
            ),
        );
        line(&mut s, format!("operations:       {}", map(&c.operations)));
        line(&mut s, format!("faults injected:  {}", map(&c.faults)));
        line(&mut s, format!("process restarts: {}", map(&c.restarts)));
        line(
            &mut s,
            format!("leader handovers (Lease transitions): {}", c.lease_transitions),
        );
        line(&mut s, format!("invariant checks: {}", map(&c.checks)));
        if !c.squeeze.is_empty() {
            let parts: Vec<String> = c.squeeze.iter().map(|(k, v)| format!("{k}={v}")).collect();
            line(
                &mut s,
                format!(
                    "squeezed API level, controller and noisy neighbour (apiserver APF metrics): {}",
                    parts.join(", ")
                ),
            );
        }
        if !c.notes.is_empty() {
            line(&mut s, format!("notes (not failures): {}", map(&c.notes)));
        }
        line(&mut s, format!("violations: {}", c.violations.len()));
        for v in &c.violations {
            line(&mut s, format!("  [{:.1}s] {}: {}", v.at, v.what, v.detail));
        }
        line(&mut s, format!("leaks: {}", c.leaks.len()));
        for v in &c.leaks {
            line(&mut s, format!("  [{:.1}s] {}: {}", v.at, v.what, v.detail));
        }
        if let Some(e) = &self.error {
            line(&mut s, format!("error: {e}"));
        }
        if let Some(b) = &self.bundle {
            line(&mut s, format!("bundle: {}", b.display()));
        }
        line(
            &mut s,
            format!("result: {}", if self.passed() { "PASS" } else { "FAIL" }),
        );
        s
    }
}
