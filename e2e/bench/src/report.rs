//! Results: one record per (workload, mode, implementation), a Markdown table per workload with
//! the stowage/upstream ratio, and the CPU scaling check of the binder issue.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::controller::Limits;

#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    pub workload: String,
    pub mode: String,
    pub implementation: String,
    /// Client-side limits in effect (the implementation's defaults in mode `defaults`), e.g.
    /// `50/100`, `none`, `adaptive ≤2000`.
    pub limits: String,
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
    /// Writes answered 429 by API Priority and Fairness (and retried by the client).
    pub throttled: f64,
    pub writes_by_resource: BTreeMap<String, f64>,
    /// Read requests in the window (the bench's own watches and reads included), by resource.
    pub reads_by_resource: BTreeMap<String, f64>,
    /// Seconds the apiserver spent on requests in the window (watches excluded), by resource
    /// and verb.
    pub request_seconds_by_resource: BTreeMap<String, f64>,
    pub controller_log: String,
    /// The controller's own account of where the time went (stowage's attach rows).
    pub profile: Option<String>,
}

impl RunResult {
    /// A run with nothing measured yet (what a run whose warm-up failed reports).
    pub fn unmeasured(
        workload: String,
        mode: &str,
        implementation: &str,
        limits: Limits,
        objects: usize,
    ) -> Self {
        Self {
            workload,
            mode: mode.into(),
            implementation: implementation.into(),
            limits: limits.to_string(),
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
            throttled: 0.0,
            writes_by_resource: Default::default(),
            reads_by_resource: Default::default(),
            request_seconds_by_resource: Default::default(),
            controller_log: String::new(),
            profile: None,
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
    /// Workload `takeover`: its own shape (two replicas, intervals from the lease).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub takeovers: Vec<crate::takeover::TakeoverResult>,
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

const HEADER: &str = "| mode | implementation | QPS/burst | done | wall s | objects/s | % of floor | p50 ms | p99 ms | CPU s | peak RSS MiB | writes/object | 409s | 429s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";

/// Prefix of the floor rows' implementation name (`floor@<concurrency>`).
pub const FLOOR: &str = "floor@";

/// The workload's floor: the best throughput of its floor rows that converged (one per
/// concurrency of the sweep), and which row that was.
pub fn best_floor<'a>(rows: impl IntoIterator<Item = &'a RunResult>) -> Option<&'a RunResult> {
    rows.into_iter()
        .filter(|r| r.implementation.starts_with(FLOOR) && r.converged && r.throughput_per_s > 0.0)
        .max_by(|a, b| a.throughput_per_s.total_cmp(&b.throughput_per_s))
}

/// Throughput as a percentage of the floor's.
pub fn percent_of_floor(throughput: f64, floor: Option<f64>) -> Option<f64> {
    floor.and_then(|f| ratio(throughput, f)).map(|r| r * 100.0)
}

/// The bars against upstream in one table (stowage against upstream, and the best floor
/// row against upstream on the same bars), from the lifted rows, else the first mode that has
/// both controllers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bars<'a> {
    pub mode: &'a str,
    pub floor: &'a str,
    /// Stowage's objects/s over upstream's.
    pub throughput: Option<f64>,
    /// % of floor of stowage and of upstream.
    pub stowage_pct: Option<f64>,
    pub upstream_pct: Option<f64>,
    /// p99 over upstream's p50: stowage's, the floor row's.
    pub stowage_p99: Option<f64>,
    pub floor_p99: Option<f64>,
    /// CPU over upstream's: stowage's, the floor row's.
    pub stowage_cpu: Option<f64>,
    pub floor_cpu: Option<f64>,
}

pub fn bars<'a>(rows: &[&'a RunResult], floor: &'a RunResult) -> Option<Bars<'a>> {
    let pair = |mode: &str| {
        let find = |i: &str| {
            rows.iter()
                .copied()
                .find(|r| r.mode == mode && r.implementation == i && r.converged)
        };
        find("stowage").zip(find("upstream"))
    };
    let (s, u) = pair("lifted").or_else(|| rows.iter().find_map(|r| pair(&r.mode)))?;
    let p99_over_p50 = |r: &RunResult| r.p99_ms.zip(u.p50_ms).and_then(|(a, b)| ratio(a, b));
    let pct = |r: &RunResult| percent_of_floor(r.throughput_per_s, Some(floor.throughput_per_s));
    Some(Bars {
        mode: &s.mode,
        floor: &floor.implementation,
        throughput: ratio(s.throughput_per_s, u.throughput_per_s),
        stowage_pct: pct(s),
        upstream_pct: pct(u),
        stowage_p99: p99_over_p50(s),
        floor_p99: p99_over_p50(floor),
        stowage_cpu: ratio(s.cpu_s, u.cpu_s),
        floor_cpu: ratio(floor.cpu_s, u.cpu_s),
    })
}

/// The bars as one sentence under a workload's table, so a bar that even a writer with no logic
/// misses on this machine reads as such.
fn against_upstream(b: &Bars) -> String {
    format!(
        "Against {} upstream, stowage and {}: p99 over upstream's p50 {} and {}; CPU over \
         upstream's {} and {}.",
        b.mode,
        b.floor,
        opt(b.stowage_p99, 2),
        opt(b.floor_p99, 2),
        opt(b.stowage_cpu, 2),
        opt(b.floor_cpu, 2),
    )
}

/// `name` of round `k` of `rounds` (`BENCH_ROUNDS`): unchanged when there is one round.
pub fn round_name(name: &str, k: usize, rounds: usize) -> String {
    match rounds {
        0 | 1 => name.to_string(),
        _ => format!("{name} round {k}"),
    }
}

const ROUND: &str = " round ";

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

impl Report {
    /// A line naming the extra flags the controllers ran with (`BENCH_UPSTREAM_ARGS`,
    /// `BENCH_STOWAGE_ARGS`), so that tables read on their own do not pass for the defaults.
    fn extra_flags(&self) -> String {
        let flags = |key: &str| {
            self.settings
                .get(key)
                .and_then(|v| v.as_str())
                .map(str::trim)
                .filter(|f| !f.is_empty())
        };
        let parts: Vec<String> = [("upstream", "upstream_args"), ("stowage", "stowage_args")]
            .into_iter()
            .filter_map(|(who, key)| flags(key).map(|f| format!("{who} with `{f}`")))
            .collect();
        if parts.is_empty() {
            String::new()
        } else {
            format!("Extra flags in every run: {}.\n\n", parts.join("; "))
        }
    }

    pub fn markdown(&self) -> String {
        let mut out = self.extra_flags();
        for (name, what) in &self.workloads {
            let rows: Vec<&RunResult> = self.results.iter().filter(|r| &r.workload == name).collect();
            if rows.is_empty() {
                continue;
            }
            let _ = write!(out, "### {name}\n\n{what}\n\n{HEADER}");
            let floor = best_floor(rows.iter().copied());
            let floor_tput = floor.map(|f| f.throughput_per_s);
            let mut notes = Vec::new();
            let mut profiles = Vec::new();
            let mut modes: Vec<&str> = rows.iter().map(|r| r.mode.as_str()).collect();
            modes.dedup();
            for mode in modes {
                let of = |i: &str| rows.iter().find(|r| r.mode == mode && r.implementation == i);
                for r in rows.iter().filter(|r| r.mode == mode) {
                    let _ = writeln!(
                        out,
                        "| {} | {} | {} | {}/{}{} | {:.1} | {:.1} | {} | {} | {} | {:.2} | {:.0} | {:.2} | {:.0} | {:.0} |",
                        r.mode,
                        r.implementation,
                        r.limits,
                        r.done,
                        r.objects,
                        if r.note.is_some() { " ¹" } else { "" },
                        r.wall_s,
                        r.throughput_per_s,
                        opt(
                            r.converged
                                .then(|| percent_of_floor(r.throughput_per_s, floor_tput))
                                .flatten(),
                            0
                        ),
                        opt(r.p50_ms, 0),
                        opt(r.p99_ms, 0),
                        r.cpu_s,
                        r.peak_rss_mib,
                        r.writes_per_object,
                        r.conflicts,
                        r.throttled
                    );
                    if let Some(n) = &r.note {
                        notes.push(format!("{} {}/{}: {n}", r.mode, r.implementation, r.workload));
                    }
                    if let Some(p) = &r.profile {
                        profiles.push(format!("{} {}: {p}", r.mode, r.implementation));
                    }
                }
                if let (Some(s), Some(u)) = (of("stowage"), of("upstream"))
                    && s.converged
                    && u.converged
                {
                    let f = |v: Option<f64>| opt(v, 2);
                    let _ = writeln!(
                        out,
                        "| {mode} | **stowage/upstream** | | | {} | {} | | {} | {} | {} | {} | {} | | |",
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
            if let Some(f) = floor {
                let _ = writeln!(
                    out,
                    "\nFloor: {} at {:.1} objects/s (the best floor row; % of floor divides by it).",
                    f.implementation, f.throughput_per_s
                );
                if let Some(b) = bars(&rows, f) {
                    let _ = writeln!(out, "\n{}", against_upstream(&b));
                }
            }
            for n in notes {
                let _ = writeln!(out, "\n¹ {n}");
            }
            if !profiles.is_empty() {
                let _ = writeln!(out, "\nProfile (the controller's own metrics):\n");
                for p in profiles {
                    let _ = writeln!(out, "- {p}");
                }
            }
            out.push('\n');
        }
        out.push_str(&self.rounds());
        out.push_str(&self.per_object());
        out.push_str(&self.scaling());
        for (name, what) in &self.workloads {
            let rows: Vec<_> = self
                .takeovers
                .iter()
                .filter(|r| &r.workload == name)
                .cloned()
                .collect();
            out.push_str(&crate::takeover::markdown(&rows, what));
        }
        out
    }

    /// For workloads run in rounds: each round's bars against upstream and the floor, and their
    /// medians, so one invocation shows how far a single run's ratio moves on this machine.
    fn rounds(&self) -> String {
        let mut bases: Vec<&str> = self
            .workloads
            .iter()
            .filter_map(|(name, _)| name.split_once(ROUND).map(|(base, _)| base))
            .collect();
        bases.dedup();
        let mut out = String::new();
        for base in bases {
            let mut table = Vec::new();
            for (name, _) in self
                .workloads
                .iter()
                .filter(|(n, _)| n.split_once(ROUND).is_some_and(|(b, _)| b == base))
            {
                let rows: Vec<&RunResult> = self.results.iter().filter(|r| &r.workload == name).collect();
                if let Some(b) = best_floor(rows.iter().copied()).and_then(|f| bars(&rows, f)) {
                    let round = name.rsplit(ROUND).next().unwrap_or_default().to_string();
                    table.push((round, b));
                }
            }
            if table.is_empty() {
                continue;
            }
            let _ = write!(
                out,
                "### {base}: the rounds\n\n| round | stowage/upstream objects/s | % of floor (upstream, stowage) | p99 over upstream's p50 (stowage, floor) | CPU over upstream's (stowage, floor) |\n|---|---|---|---|---|\n"
            );
            let pair = |a: Option<f64>, b: Option<f64>, d: usize| format!("{}, {}", opt(a, d), opt(b, d));
            for (round, b) in &table {
                let _ = writeln!(
                    out,
                    "| {round} | {} | {} | {} | {} |",
                    opt(b.throughput, 2),
                    pair(b.upstream_pct, b.stowage_pct, 0),
                    pair(b.stowage_p99, b.floor_p99, 2),
                    pair(b.stowage_cpu, b.floor_cpu, 2),
                );
            }
            let med = |f: fn(&Bars) -> Option<f64>| median(table.iter().filter_map(|(_, b)| f(b)).collect());
            let _ = writeln!(
                out,
                "| **median** | **{}** | {} | {} | {} |\n",
                opt(med(|b| b.throughput), 2),
                pair(med(|b| b.upstream_pct), med(|b| b.stowage_pct), 0),
                pair(med(|b| b.stowage_p99), med(|b| b.floor_p99), 2),
                pair(med(|b| b.stowage_cpu), med(|b| b.floor_cpu), 2),
            );
        }
        out
    }

    /// CPU and peak RSS per 1,000 objects of the bind workloads (static, burst), and the memory
    /// a binder adds per 10,000 more objects where two sizes of one workload ran.
    fn per_object(&self) -> String {
        let kind = |w: &str| w.split('-').next().unwrap_or("").to_string();
        let rows: Vec<&RunResult> = self
            .results
            .iter()
            .filter(|r| {
                matches!(kind(&r.workload).as_str(), "static" | "burst")
                    && r.converged
                    && r.done > 0
                    && r.note.is_none()
            })
            .collect();
        if rows.is_empty() {
            return String::new();
        }
        let mut out = String::from(
            "### Per object (bind workloads)\n\n| workload | mode | implementation | objects/s | % of floor | CPU s | CPU s per 1,000 | peak RSS MiB | peak RSS MiB per 1,000 |\n|---|---|---|---|---|---|---|---|---|\n",
        );
        for r in &rows {
            let floor = best_floor(self.results.iter().filter(|x| x.workload == r.workload))
                .map(|f| f.throughput_per_s);
            let k = r.done as f64 / 1000.0;
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.1} | {} | {:.2} | {:.3} | {:.0} | {:.1} |",
                r.workload,
                r.mode,
                r.implementation,
                r.throughput_per_s,
                opt(percent_of_floor(r.throughput_per_s, floor), 0),
                r.cpu_s,
                r.cpu_s / k,
                r.peak_rss_mib,
                r.peak_rss_mib / k
            );
        }
        let mut growth = Vec::new();
        let mut keys: Vec<(String, &str, &str)> = rows
            .iter()
            .map(|r| (kind(&r.workload), r.mode.as_str(), r.implementation.as_str()))
            .collect();
        keys.sort();
        keys.dedup();
        for (k, mode, imp) in keys {
            let mut rs: Vec<&&RunResult> = rows
                .iter()
                .filter(|r| kind(&r.workload) == k && r.mode == mode && r.implementation == imp)
                .collect();
            rs.sort_by_key(|r| r.done);
            if let (Some(a), Some(b)) = (rs.first(), rs.last())
                && let Some(per) = memory_per_10k(a.done, a.peak_rss_mib, b.done, b.peak_rss_mib)
            {
                growth.push(format!(
                    "| {k} | {mode} | {imp} | {} → {} | {:.0} → {:.0} | {per:.1} |",
                    a.done, b.done, a.peak_rss_mib, b.peak_rss_mib
                ));
            }
        }
        if !growth.is_empty() {
            out.push_str(
                "\nMemory per 10,000 more objects (peak RSS difference between the two sizes that ran):\n\n| workload | mode | implementation | objects | peak RSS MiB | MiB per 10,000 |\n|---|---|---|---|---|---|\n",
            );
            out.push_str(&growth.join("\n"));
            out.push('\n');
        }
        out.push('\n');
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

/// Peak RSS added per 10,000 objects between a run of `n0` objects and one of `n1` (> `n0`).
pub fn memory_per_10k(n0: usize, rss0: f64, n1: usize, rss1: f64) -> Option<f64> {
    (n1 > n0).then(|| (rss1 - rss0) / (n1 - n0) as f64 * 10_000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(workload: &str, mode: &str, imp: &str, done: usize, wall: f64, cpu: f64, rss: f64) -> RunResult {
        let limits = if imp.starts_with(FLOOR) {
            Limits::None
        } else {
            Limits::Fixed {
                qps: 100_000.0,
                burst: 100_000,
            }
        };
        RunResult {
            done,
            converged: true,
            wall_s: wall,
            throughput_per_s: done as f64 / wall,
            p50_ms: Some(100.0),
            p99_ms: Some(200.0),
            cpu_s: cpu,
            peak_rss_mib: rss,
            writes_per_object: 4.0,
            ..RunResult::unmeasured(workload.into(), mode, imp, limits, done)
        }
    }

    fn report(results: Vec<RunResult>, workloads: &[&str]) -> Report {
        Report {
            started_unix: 0,
            machine: Machine {
                cpus: 2,
                mem_gib: 1.0,
                kernel: String::new(),
                load_at_start: String::new(),
            },
            settings: serde_json::Value::Null,
            workloads: workloads
                .iter()
                .map(|w| (w.to_string(), format!("{w} caption")))
                .collect(),
            results,
            takeovers: Vec::new(),
        }
    }

    #[test]
    fn extra_flags_are_named_above_the_tables() {
        let rows = vec![row("attach-10x2", "lifted", "upstream", 10, 1.0, 0.1, 10.0)];
        let mut r = report(rows, &["attach-10x2"]);
        assert!(r.markdown().starts_with("### attach-10x2"), "{}", r.markdown());
        r.settings = serde_json::json!({
            "upstream_args": " --kube-api-content-type=application/json ",
            "stowage_args": "",
        });
        let md = r.markdown();
        assert!(
            md.starts_with(
                "Extra flags in every run: upstream with `--kube-api-content-type=application/json`.\n\n### attach-10x2"
            ),
            "{md}"
        );
        r.settings = serde_json::json!({"upstream_args": "--a", "stowage_args": "--b=1 --c"});
        assert!(
            r.markdown()
                .starts_with("Extra flags in every run: upstream with `--a`; stowage with `--b=1 --c`.")
        );
    }

    #[test]
    fn percent_of_floor_divides_by_the_best_converged_floor_row() {
        let mut slow = row("static-100", "floor", "floor@256", 100, 2.0, 0.1, 10.0);
        let fast = row("static-100", "floor", "floor@64", 100, 1.0, 0.1, 10.0);
        let mut stalled = row("static-100", "floor", "floor@16", 50, 0.1, 0.1, 10.0);
        stalled.converged = false;
        let ctrl = row("static-100", "lifted", "stowage", 100, 1.25, 0.1, 10.0);
        let rows = [slow.clone(), fast, stalled, ctrl];
        let best = best_floor(&rows).unwrap();
        assert_eq!(best.implementation, "floor@64");
        assert_eq!(percent_of_floor(80.0, Some(best.throughput_per_s)), Some(80.0));
        assert_eq!(percent_of_floor(80.0, None), None);
        assert_eq!(percent_of_floor(80.0, Some(0.0)), None);
        // Controllers are never the floor, however fast.
        slow.implementation = "stowage".into();
        assert!(best_floor(&[slow]).is_none());
    }

    #[test]
    fn table_has_a_floor_row_and_percent_of_floor() {
        let md = report(
            vec![
                row("burst-100", "floor", "floor@16", 100, 1.0, 0.05, 9.0),
                row("burst-100", "floor", "floor@64", 100, 0.5, 0.05, 9.0),
                row("burst-100", "lifted", "upstream", 100, 2.0, 1.0, 100.0),
                row("burst-100", "lifted", "stowage", 100, 0.625, 0.25, 25.0),
            ],
            &["burst-100"],
        )
        .markdown();
        let lines: Vec<&str> = md.lines().collect();
        let find = |prefix: &str| {
            *lines
                .iter()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("no row {prefix:?} in\n{md}"))
        };
        assert!(md.contains("| objects/s | % of floor |"), "{md}");
        assert!(
            find("| floor | floor@64 |")
                .starts_with("| floor | floor@64 | none | 100/100 | 0.5 | 200.0 | 100 |")
        );
        assert!(find("| floor | floor@16 |").contains("| 100.0 | 50 |"));
        assert!(find("| lifted | upstream |").contains("| 50.0 | 25 |"));
        assert!(find("| lifted | stowage |").contains("| 160.0 | 80 |"));
        assert!(find("| lifted | **stowage/upstream** |").contains("| 0.31 | 3.20 | |"));
        assert!(md.contains("Floor: floor@64 at 200.0 objects/s"), "{md}");
        // The bars against upstream, for stowage and for the best floor row.
        assert!(
            md.contains(
                "Against lifted upstream, stowage and floor@64: p99 over upstream's p50 2.00 and \
                 2.00; CPU over upstream's 0.25 and 0.05."
            ),
            "{md}"
        );
        // Per-object table: CPU and RSS per 1,000 objects.
        assert!(
            find("| burst-100 | lifted | stowage |").ends_with("| 160.0 | 80 | 0.25 | 2.500 | 25 | 250.0 |")
        );
    }

    #[test]
    fn no_floor_row_no_percentage() {
        let md = report(
            vec![row("attach-10x2", "equal", "stowage", 10, 1.0, 0.1, 5.0)],
            &["attach-10x2"],
        )
        .markdown();
        assert!(
            md.contains("| equal | stowage | 100000/100000 | 10/10 | 1.0 | 10.0 | – |"),
            "{md}"
        );
        assert!(!md.contains("Floor:"));
    }

    #[test]
    fn rounds_get_a_table_of_their_bars_and_medians() {
        assert_eq!(round_name("attach-10x2", 1, 1), "attach-10x2");
        assert_eq!(round_name("attach-10x2", 2, 3), "attach-10x2 round 2");
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
        let mut results = Vec::new();
        let names: Vec<String> = (1..=3).map(|k| round_name("attach-100x2", k, 3)).collect();
        // Stowage's wall time per round: 1.0, 0.5, 2.0 s against upstream's 1.0 s.
        for (name, wall) in names.iter().zip([1.0, 0.5, 2.0]) {
            let mut f = row(name, "floor", "floor@64", 100, 0.5, 0.1, 10.0);
            f.p99_ms = Some(400.0);
            results.push(f);
            results.push(row(name, "lifted", "upstream", 100, 1.0, 1.0, 100.0));
            results.push(row(name, "lifted", "stowage", 100, wall, 0.5, 30.0));
        }
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let md = report(results, &names).markdown();
        assert!(md.contains("### attach-100x2: the rounds"), "{md}");
        assert!(
            md.contains("| 1 | 1.00 | 50, 50 | 2.00, 4.00 | 0.50, 0.10 |"),
            "{md}"
        );
        assert!(
            md.contains("| 2 | 2.00 | 50, 100 | 2.00, 4.00 | 0.50, 0.10 |"),
            "{md}"
        );
        assert!(
            md.contains("| 3 | 0.50 | 50, 25 | 2.00, 4.00 | 0.50, 0.10 |"),
            "{md}"
        );
        assert!(
            md.contains("| **median** | **1.00** | 50, 50 | 2.00, 4.00 | 0.50, 0.10 |"),
            "{md}"
        );
        // One round: no such table.
        let md = report(
            vec![
                row("attach-100x2", "floor", "floor@64", 100, 0.5, 0.1, 10.0),
                row("attach-100x2", "lifted", "upstream", 100, 1.0, 1.0, 100.0),
                row("attach-100x2", "lifted", "stowage", 100, 1.0, 0.5, 30.0),
            ],
            &["attach-100x2"],
        )
        .markdown();
        assert!(!md.contains("the rounds"), "{md}");
    }

    #[test]
    fn memory_growth_between_two_sizes() {
        assert_eq!(memory_per_10k(2_000, 40.0, 10_000, 120.0), Some(100.0));
        assert_eq!(memory_per_10k(10_000, 120.0, 10_000, 120.0), None);
        let md = report(
            vec![
                row("static-2000", "lifted", "stowage", 2_000, 10.0, 1.0, 40.0),
                row("static-10000", "lifted", "stowage", 10_000, 50.0, 5.0, 120.0),
            ],
            &["static-2000", "static-10000"],
        )
        .markdown();
        assert!(
            md.contains("| static | lifted | stowage | 2000 → 10000 | 40 → 120 | 100.0 |"),
            "{md}"
        );
    }
}
