//! A measured window of one process (a controller, the agent): the CPU, memory and apiserver
//! requests between its opening and its end, and the wait for the objects' progress that ends it.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::apiserver::Requests;
use crate::fixtures::Objects;
use crate::procstat;
use crate::report::RunResult;
use crate::tracker::{Tracker, percentile_ms};
use crate::workload::Env;

/// Everything a measured window needs to know when it ends (shared with the agent workload).
pub struct WindowStart {
    pub start: Instant,
    /// CPU of the measured process at the start.
    pub cpu0: f64,
    pub writes0: Requests,
}

/// What a measured window ended with, read as soon as its objects were done.
pub struct WindowEnd {
    opened: WindowStart,
    cpu: f64,
    rss: u64,
    delta: Requests,
}

impl WindowStart {
    /// Reads process `pid`'s CPU and peak RSS, then the apiserver's writes since the start.
    pub async fn close(self, client: &kube::Client, pid: u32) -> anyhow::Result<WindowEnd> {
        let cpu = procstat::cpu_seconds(pid).unwrap_or(0.0);
        let rss = procstat::peak_rss_bytes(pid).unwrap_or(0);
        // Trailing writes (an event after the last status) still belong to the run.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let delta = Requests::scrape(client).await?.since(&self.writes0);
        Ok(WindowEnd {
            opened: self,
            cpu,
            rss,
            delta,
        })
    }
}

impl WindowEnd {
    /// `base` with the window's numbers: `tracker`'s latencies and progress (stop whatever feeds
    /// it first), the process's CPU and RSS, and the writes other than the bench's own.
    pub fn result(
        self,
        base: RunResult,
        o: &Objects,
        tracker: &Tracker,
        failure: Option<String>,
    ) -> RunResult {
        let (lat, last) = tracker.latencies();
        let (done, total) = tracker.progress();
        let wall = last.map_or(0.0, |l| {
            l.saturating_duration_since(self.opened.start).as_secs_f64()
        });
        let writes = (self.delta.controller_writes() - o.own_writes.load(Ordering::Relaxed) as f64).max(0.0);
        RunResult {
            done,
            converged: failure.is_none() && done == total,
            note: failure,
            wall_s: wall,
            throughput_per_s: if wall > 0.0 { done as f64 / wall } else { 0.0 },
            p50_ms: percentile_ms(&lat, 50.0),
            p99_ms: percentile_ms(&lat, 99.0),
            max_ms: percentile_ms(&lat, 100.0),
            cpu_s: self.cpu - self.opened.cpu0,
            cpu_total_s: self.cpu,
            peak_rss_mib: self.rss as f64 / 1024.0 / 1024.0,
            writes,
            writes_per_object: if done > 0 { writes / done as f64 } else { 0.0 },
            conflicts: self.delta.conflicts(),
            throttled: self.delta.throttled(),
            writes_by_resource: self.delta.writes,
            reads_by_resource: self.delta.reads,
            request_seconds_by_resource: self.delta.seconds,
            ..base
        }
    }
}

/// The process a wait watches besides the objects' progress (a controller, the agent).
pub trait Watched {
    /// Why the process can make no more progress (it exited, ...), if so.
    fn failure(&mut self) -> Option<String>;
    /// Its resource use so far, for the progress line.
    fn usage(&self) -> String;
}

/// Polls `progress` until done == total; prints a progress line every 2 s. Returns why it gave
/// up, if it did: no progress for the stall timeout, the overall timeout, or a dead process.
pub async fn wait_for(
    env: &Env,
    label: &str,
    phase: &str,
    progress: impl Fn() -> (usize, usize),
    process: &mut impl Watched,
    since: Instant,
) -> Option<String> {
    let mut last_done = usize::MAX;
    let mut last_change = Instant::now();
    let mut last_print = Instant::now();
    loop {
        let (done, total) = progress();
        if done >= total {
            return None;
        }
        let now = Instant::now();
        if done != last_done {
            last_done = done;
            last_change = now;
        }
        if now.duration_since(last_change) > env.stall {
            return Some(format!("{phase}: stalled at {done}/{total} for {:?}", env.stall));
        }
        if now.duration_since(since) > env.timeout {
            return Some(format!(
                "{phase}: {done}/{total} after the {:?} timeout",
                env.timeout
            ));
        }
        if let Some(why) = process.failure() {
            return Some(format!("{phase}: {why}"));
        }
        if now.duration_since(last_print) >= Duration::from_secs(2) {
            last_print = now;
            eprintln!(
                "  {label}: {phase} {done}/{total} after {:.1} s ({})",
                now.duration_since(since).as_secs_f64(),
                process.usage()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
