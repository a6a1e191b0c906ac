//! Results: one record per (workload, mode, implementation), a Markdown table per workload with
//! the stowage/upstream ratio, and the CPU scaling check of the binder issue.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    pub workload: String,
    pub mode: String,
    pub implementation: String,
    /// Client-side limits in effect (the implementation's defaults in mode `defaults`).
    pub qps: f32,
    pub burst: u32,
    pub objects: usize,
    pub done: usize,
    pub converged: bool,
    /// Why a run did not converge, or that its numbers were reused from an identical run.
    pub note: Option<String>,
    /// Window start → last object in its target state.
    pub wall_s: f64,
    pub throughput_per_s: f64,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub max_ms: Option<f64>,
    /// CPU (user + system) of the controller process inside the window.
    pub cpu_s: f64,
    /// CPU of the controller process over its whole life up to convergence.
    pub cpu_total_s: f64,
    pub peak_rss_mib: f64,
    /// Write requests the apiserver served in the window, minus its own background writes and the
    /// bench's own.
    pub writes: f64,
    pub writes_per_object: f64,
    pub conflicts: f64,
    pub writes_by_resource: BTreeMap<String, f64>,
    pub controller_log: String,
}

impl RunResult {
    /// A run with nothing measured yet (what a run whose warm-up failed reports).
    pub fn unmeasured(
        workload: String,
        mode: &str,
        implementation: &str,
        (qps, burst): (f32, u32),
        objects: usize,
    ) -> Self {
        Self {
            workload,
            mode: mode.into(),
            implementation: implementation.into(),
            qps,
            burst,
            objects,
            done: 0,
            converged: false,
            note: None,
            wall_s: 0.0,
            throughput_per_s: 0.0,
            p50_ms: None,
            p99_ms: None,
            max_ms: None,
            cpu_s: 0.0,
            cpu_total_s: 0.0,
            peak_rss_mib: 0.0,
            writes: 0.0,
            writes_per_object: 0.0,
            conflicts: 0.0,
            writes_by_resource: Default::default(),
            controller_log: String::new(),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub started_unix: u64,
    pub machine: Machine,
    pub settings: serde_json::Value,
    pub workloads: Vec<(String, String)>,
    pub results: Vec<RunResult>,
}

#[derive(Debug, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub mem_gib: f64,
    pub kernel: String,
    pub load_at_start: String,
}

impl Machine {
    pub fn probe() -> Self {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let mem_kib: f64 = read("/proc/meminfo")
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
            .unwrap_or(0.0);
        Self {
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            mem_gib: (mem_kib / 1024.0 / 1024.0 * 10.0).round() / 10.0,
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            load_at_start: read("/proc/loadavg")
                .split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" "),
        }
    }
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("–".into(), |v| format!("{v:.digits$}"))
}

fn ratio(s: f64, u: f64) -> Option<f64> {
    (u > 0.0 && s.is_finite() && u.is_finite()).then(|| s / u)
}

const HEADER: &str = "| mode | implementation | QPS/burst | done | wall s | objects/s | p50 ms | p99 ms | CPU s | peak RSS MiB | writes/object | 409s |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n";

impl Report {
    pub fn markdown(&self) -> String {
        let mut out = String::new();
        for (name, what) in &self.workloads {
            let rows: Vec<&RunResult> = self.results.iter().filter(|r| &r.workload == name).collect();
            if rows.is_empty() {
                continue;
            }
            let _ = write!(out, "### {name}\n\n{what}\n\n{HEADER}");
            let mut notes = Vec::new();
            let mut modes: Vec<&str> = rows.iter().map(|r| r.mode.as_str()).collect();
            modes.dedup();
            for mode in modes {
                let of = |i: &str| rows.iter().find(|r| r.mode == mode && r.implementation == i);
                for r in rows.iter().filter(|r| r.mode == mode) {
                    let _ = writeln!(
                        out,
                        "| {} | {} | {}/{} | {}/{}{} | {:.1} | {:.1} | {} | {} | {:.2} | {:.0} | {:.2} | {:.0} |",
                        r.mode,
                        r.implementation,
                        r.qps,
                        r.burst,
                        r.done,
                        r.objects,
                        if r.note.is_some() { " ¹" } else { "" },
                        r.wall_s,
                        r.throughput_per_s,
                        opt(r.p50_ms, 0),
                        opt(r.p99_ms, 0),
                        r.cpu_s,
                        r.peak_rss_mib,
                        r.writes_per_object,
                        r.conflicts
                    );
                    if let Some(n) = &r.note {
                        notes.push(format!("{} {}/{}: {n}", r.mode, r.implementation, r.workload));
                    }
                }
                if let (Some(s), Some(u)) = (of("stowage"), of("upstream"))
                    && s.converged
                    && u.converged
                {
                    let f = |v: Option<f64>| opt(v, 2);
                    let _ = writeln!(
                        out,
                        "| {mode} | **stowage/upstream** | | | {} | {} | {} | {} | {} | {} | {} | |",
                        f(ratio(s.wall_s, u.wall_s)),
                        f(ratio(s.throughput_per_s, u.throughput_per_s)),
                        f(s.p50_ms.zip(u.p50_ms).and_then(|(a, b)| ratio(a, b))),
                        f(s.p99_ms.zip(u.p99_ms).and_then(|(a, b)| ratio(a, b))),
                        f(ratio(s.cpu_s, u.cpu_s)),
                        f(ratio(s.peak_rss_mib, u.peak_rss_mib)),
                        f(ratio(s.writes_per_object, u.writes_per_object)),
                    );
                }
            }
            for n in notes {
                let _ = writeln!(out, "\n¹ {n}");
            }
            out.push('\n');
        }
        out.push_str(&self.scaling());
        out
    }

    /// Controller CPU of the largest static bind over the smallest: the binder issue asks for at
    /// most about 12× the CPU for 10× the volumes (an index, not a scan).
    fn scaling(&self) -> String {
        let statics: Vec<&RunResult> = self
            .results
            .iter()
            // Reused rows (same flags as another mode) would only repeat a line.
            .filter(|r| r.workload.starts_with("static-") && r.converged && r.note.is_none())
            .collect();
        let mut lines = Vec::new();
        let mut keys: Vec<(&str, &str)> = statics
            .iter()
            .map(|r| (r.mode.as_str(), r.implementation.as_str()))
            .collect();
        keys.sort();
        keys.dedup();
        for (mode, imp) in keys {
            let mut rs: Vec<&&RunResult> = statics
                .iter()
                .filter(|r| r.mode == mode && r.implementation == imp)
                .collect();
            rs.sort_by_key(|r| r.objects);
            let (Some(small), Some(big)) = (rs.first(), rs.last()) else {
                continue;
            };
            if big.objects <= small.objects {
                continue;
            }
            lines.push(format!(
                "| {mode} | {imp} | {} → {} ({:.0}×) | {:.2} → {:.2} | **{}×** |",
                small.objects,
                big.objects,
                big.objects as f64 / small.objects as f64,
                small.cpu_s,
                big.cpu_s,
                opt(ratio(big.cpu_s, small.cpu_s), 1)
            ));
        }
        if lines.is_empty() {
            return String::new();
        }
        format!(
            "### CPU scaling of the static bind\n\n| mode | implementation | pairs | CPU s | CPU ratio |\n|---|---|---|---|---|\n{}\n",
            lines.join("\n")
        )
    }
}
