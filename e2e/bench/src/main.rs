//! `stowage-bench` (run by `make bench`): starts the real control plane once, then runs each
//! workload against upstream kube-controller-manager and against stowage-controller, one after the
//! other on fresh objects, once with equal client rate limits and once with each one's defaults.
//! Prints a Markdown table per workload and writes JSON into `e2e/results/`.

mod agent;
mod apiserver;
mod controller;
mod fixtures;
mod floor;
mod procstat;
mod report;
mod takeover;
mod tracker;
mod window;
mod workload;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use clap::Parser;
use serde_json::json;

use crate::controller::{Impl, Limits, Setup, default_bin};
use crate::fixtures::Objects;
use crate::report::{Machine, Report, RunResult, round_name};
use crate::workload::{Env, Spec, Workload};

/// kube-controller-manager's `--kube-api-qps` / `--kube-api-burst` defaults.
const UPSTREAM_DEFAULTS: (f32, u32) = (20.0, 30);

/// Mode `lifted`: limits no workload here comes near. Not 0: client-go reads QPS 0 as "use the
/// default" (5), not as "unlimited".
const LIFTED: (f32, u32) = (100_000.0, 100_000);

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Sizes {
    /// The sizes: static 1,000 and 10,000; burst 10,000; 1,000 pods over 50 nodes; 500 expansions.
    Full,
    /// N = 200 everywhere (10 nodes): a quick check that everything works.
    Small,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Mode {
    /// The same --kube-api-qps/--kube-api-burst for both.
    Equal,
    /// Both limits lifted (--kube-api-qps=100000 --kube-api-burst=100000 for both).
    Lifted,
    /// Each implementation with its own defaults.
    Defaults,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Equal => "equal",
            Mode::Lifted => "lifted",
            Mode::Defaults => "defaults",
        }
    }
}

/// An implementation as named in `BENCH_IMPLS`; `floor` becomes one run per concurrency.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ImplArg {
    /// The apiserver's write floor: `stowage-bench floor`, no limit, no logic.
    Floor,
    Upstream,
    Stowage,
}

/// One run of a workload: its mode's name, the implementation, the limit flags passed (None =
/// its defaults) and the limits in effect.
#[derive(Debug, Clone, PartialEq)]
struct Planned {
    mode: &'static str,
    which: Impl,
    flags: Option<(f32, u32)>,
    effective: Limits,
}

/// The runs of one workload, in order: the floor sweep first (once: it has no client limit, so
/// no mode changes it), then every mode with the controllers in `impls` order.
fn plan(
    impls: &[ImplArg],
    modes: &[Mode],
    floor_concurrency: &[usize],
    equal: (f32, u32),
    stowage_defaults: Limits,
) -> Vec<Planned> {
    let mut out = Vec::new();
    if impls.contains(&ImplArg::Floor) {
        out.extend(floor_concurrency.iter().map(|&c| Planned {
            mode: "floor",
            which: Impl::Floor {
                concurrency: c.max(1),
            },
            flags: None,
            effective: Limits::None,
        }));
    }
    let fixed = |(qps, burst): (f32, u32)| Limits::Fixed { qps, burst };
    for &mode in modes {
        for &i in impls {
            let (which, flags, effective) = match (mode, i) {
                (_, ImplArg::Floor) => continue,
                (Mode::Equal, ImplArg::Upstream) => (Impl::Upstream, Some(equal), fixed(equal)),
                (Mode::Equal, ImplArg::Stowage) => (Impl::Stowage, Some(equal), fixed(equal)),
                (Mode::Lifted, ImplArg::Upstream) => (Impl::Upstream, Some(LIFTED), fixed(LIFTED)),
                (Mode::Lifted, ImplArg::Stowage) => (Impl::Stowage, Some(LIFTED), fixed(LIFTED)),
                (Mode::Defaults, ImplArg::Upstream) => (Impl::Upstream, None, fixed(UPSTREAM_DEFAULTS)),
                (Mode::Defaults, ImplArg::Stowage) => (Impl::Stowage, None, stowage_defaults),
            };
            out.push(Planned {
                mode: mode.name(),
                which,
                flags,
                effective,
            });
        }
    }
    out
}

#[derive(Debug, Parser)]
#[command(about = "Side-by-side benchmark of stowage-controller and upstream kube-controller-manager.")]
struct Args {
    /// Without a subcommand: the benchmark.
    #[command(subcommand)]
    command: Option<Command>,
    /// Workloads to run: static, burst, attach, expand, agent (it needs root for loop devices and
    /// mounts, and has no upstream counterpart), takeover (two replicas of each side, run last).
    #[arg(
        long,
        env = "BENCH_WORKLOADS",
        value_delimiter = ',',
        default_value = "static,burst,attach,expand,agent,takeover"
    )]
    workloads: Vec<String>,
    /// Implementations to run, in this order (the floor first whatever its place: floor, upstream,
    /// stowage).
    #[arg(
        long,
        env = "BENCH_IMPLS",
        value_delimiter = ',',
        default_value = "floor,upstream,stowage"
    )]
    impls: Vec<ImplArg>,
    /// Objects the floor writer keeps in flight: one floor row per value; the best is the floor.
    #[arg(
        long,
        env = "BENCH_FLOOR_CONCURRENCY",
        value_delimiter = ',',
        default_value = "16,64,256"
    )]
    floor_concurrency: Vec<usize>,
    /// Rate-limit modes to run: equal (BENCH_QPS/BENCH_BURST for both), lifted (100000/100000 for
    /// both), defaults (each its own).
    #[arg(
        long,
        env = "BENCH_MODES",
        value_delimiter = ',',
        default_value = "equal,defaults"
    )]
    modes: Vec<Mode>,
    /// Rounds of each workload: its whole plan (the floor sweep, then the controllers) runs this
    /// many times in turn, and the report adds each round's bars against upstream and their
    /// medians, so how far one run's ratio moves on this machine shows in one invocation.
    #[arg(long, env = "BENCH_ROUNDS", default_value_t = 1)]
    rounds: usize,
    /// Size preset; the options below override single sizes.
    #[arg(long, env = "BENCH_SIZES", default_value = "full")]
    sizes: Sizes,
    /// Pair counts of the static bind (the CPU scaling row compares the smallest and largest).
    #[arg(long, env = "BENCH_STATIC_SIZES", value_delimiter = ',')]
    static_sizes: Option<Vec<usize>>,
    /// Claim counts of the burst (one workload per value, e.g. the scale rows 10000,50000).
    #[arg(long, env = "BENCH_BURST_SIZE", value_delimiter = ',')]
    burst_size: Option<Vec<usize>>,
    #[arg(long, env = "BENCH_ATTACH_PODS")]
    attach_pods: Option<usize>,
    #[arg(long, env = "BENCH_ATTACH_NODES")]
    attach_nodes: Option<usize>,
    #[arg(long, env = "BENCH_EXPAND_SIZE")]
    expand_size: Option<usize>,
    /// --kube-api-qps of both in mode `equal`.
    #[arg(long, env = "BENCH_QPS", default_value_t = 50.0)]
    qps: f32,
    /// --kube-api-burst of both in mode `equal`.
    #[arg(long, env = "BENCH_BURST", default_value_t = 100)]
    burst: u32,
    /// Give up on a run when no object reached its target for this long.
    #[arg(long, env = "BENCH_STALL_TIMEOUT", default_value = "120s", value_parser = humantime::parse_duration)]
    stall_timeout: Duration,
    /// Give up on a run after this long.
    #[arg(long, env = "BENCH_RUN_TIMEOUT", default_value = "60m", value_parser = humantime::parse_duration)]
    run_timeout: Duration,
    /// Requests the bench keeps in flight while creating objects.
    #[arg(long, env = "BENCH_CONCURRENCY", default_value_t = 64)]
    concurrency: usize,
    /// Where the JSON (and controller logs) go.
    #[arg(long, env = "BENCH_OUT_DIR")]
    out_dir: Option<PathBuf>,
    #[arg(long, env = "BENCH_STOWAGE_BIN")]
    stowage_bin: Option<PathBuf>,
    /// Extra flags for stowage-controller in every run (e.g. `--attachdetach-max-in-flight=64`,
    /// to compare a setting side by side); space-separated.
    #[arg(long, env = "BENCH_STOWAGE_ARGS", default_value = "")]
    stowage_args: String,
    /// Extra flags for kube-controller-manager in every upstream run (e.g.
    /// `--kube-api-content-type=application/json`, to see what its protobuf transport is worth);
    /// space-separated.
    #[arg(long, env = "BENCH_UPSTREAM_ARGS", default_value = "")]
    upstream_args: String,
    #[arg(long, env = "BENCH_KCM_BIN")]
    kcm_bin: Option<PathBuf>,
    /// Bound pairs of workload `takeover`, one workload per value.
    #[arg(long, env = "BENCH_TAKEOVER_SIZES", value_delimiter = ',')]
    takeover_sizes: Option<Vec<usize>>,
    /// Pods with attachments among the takeover's pairs (spread over BENCH_ATTACH_NODES nodes).
    #[arg(long, env = "BENCH_TAKEOVER_PODS")]
    takeover_pods: Option<usize>,
    /// New claims of each takeover phase (the new pods are one per node).
    #[arg(long, env = "BENCH_TAKEOVER_NEW", default_value_t = 100)]
    takeover_new: usize,
    /// How the takeover's leader is stopped, one run per value and implementation.
    #[arg(
        long,
        env = "BENCH_TAKEOVER_STOPS",
        value_delimiter = ',',
        default_value = "kill,term"
    )]
    takeover_stops: Vec<takeover::Stop>,
    /// Volumes (and pods) of workload `agent`.
    #[arg(long, env = "BENCH_AGENT_VOLUMES", default_value_t = 200)]
    agent_volumes: usize,
    /// stowage-agent binary of workload `agent` (default target/release/stowage-agent).
    #[arg(long, env = "BENCH_AGENT_BIN")]
    agent_bin: Option<PathBuf>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// The floor writer (started by the benchmark for its floor rows): exactly the writes each
    /// object of a workload needs, no client limit, no decisions.
    Floor(floor::FloorArgs),
}

impl Args {
    /// The sizes of workload `takeover`, if it was asked for.
    fn takeovers(&self) -> Vec<takeover::Sizes> {
        if !self.workloads.iter().any(|w| w.trim() == "takeover") {
            return Vec::new();
        }
        let small = self.sizes == Sizes::Small;
        let pairs = self
            .takeover_sizes
            .clone()
            .unwrap_or_else(|| if small { vec![200] } else { vec![10_000, 50_000] });
        let nodes = self.attach_nodes.unwrap_or(if small { 10 } else { 50 }).max(1);
        pairs
            .into_iter()
            .map(|n| takeover::Sizes {
                pairs: n,
                pods: self
                    .takeover_pods
                    .unwrap_or(if small { 100 } else { 1_000 })
                    .min(n),
                nodes,
                new_claims: self.takeover_new,
            })
            .collect()
    }

    fn workloads(&self) -> anyhow::Result<Vec<Workload>> {
        let small = self.sizes == Sizes::Small;
        let pick = |v: Option<usize>, full: usize| v.unwrap_or(if small { 200 } else { full });
        let mut out = Vec::new();
        for w in &self.workloads {
            match w.trim() {
                "static" => {
                    let sizes = self
                        .static_sizes
                        .clone()
                        .unwrap_or_else(|| if small { vec![200] } else { vec![1_000, 10_000] });
                    out.extend(sizes.into_iter().map(|n| Workload::Static { n }));
                }
                "burst" => {
                    let sizes = self
                        .burst_size
                        .clone()
                        .unwrap_or_else(|| vec![pick(None, 10_000)]);
                    out.extend(sizes.into_iter().map(|n| Workload::Burst { n }));
                }
                "attach" => out.push(Workload::Attach {
                    pods: pick(self.attach_pods, 1_000),
                    nodes: self.attach_nodes.unwrap_or(if small { 10 } else { 50 }),
                }),
                "expand" => out.push(Workload::Expand {
                    n: pick(self.expand_size, 500),
                }),
                // Run on their own after the side-by-side workloads (see `agent.rs`, `takeover.rs`).
                "agent" | "takeover" => {}
                other => bail!(
                    "unknown workload {other:?} (known: static, burst, attach, expand, agent, takeover)"
                ),
            }
        }
        Ok(out)
    }
}

fn main() {
    let mut args = Args::parse();
    let r = match args.command.take() {
        // The floor writer runs on one thread, as stowage-controller does: the yardstick is the
        // cheapest client this stack makes, so no controller beats it by its runtime alone.
        Some(Command::Floor(f)) => {
            runtime(tokio::runtime::Builder::new_current_thread()).and_then(|rt| rt.block_on(floor::run(f)))
        }
        // The driver blocks in place (process stops, the control plane's start): many threads.
        None => runtime(tokio::runtime::Builder::new_multi_thread()).and_then(|rt| rt.block_on(run(args))),
    };
    if let Err(e) = r {
        eprintln!("stowage-bench: {e:#}");
        std::process::exit(1);
    }
}

fn runtime(mut builder: tokio::runtime::Builder) -> anyhow::Result<tokio::runtime::Runtime> {
    builder.enable_all().build().context("start the tokio runtime")
}

async fn run(args: Args) -> anyhow::Result<()> {
    let workloads = args.workloads()?;
    let out_dir = args.out_dir.clone().unwrap_or_else(|| default_bin("e2e/results"));
    std::fs::create_dir_all(&out_dir).with_context(|| format!("create {}", out_dir.display()))?;
    let out_dir = std::fs::canonicalize(&out_dir)?;
    let stamp = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let log_dir = out_dir.join(format!("logs-{stamp}"));
    std::fs::create_dir_all(&log_dir).with_context(|| format!("create {}", log_dir.display()))?;
    let stowage_bin = args
        .stowage_bin
        .clone()
        .unwrap_or_else(|| default_bin("target/release/stowage-controller"));
    let kcm_bin = args
        .kcm_bin
        .clone()
        .unwrap_or_else(|| stowage_testkit::controlplane::bin_dir().join("kube-controller-manager"));
    let agent_n = args
        .workloads
        .iter()
        .any(|w| w.trim() == "agent")
        .then_some(args.agent_volumes);
    let agent_bin = args
        .agent_bin
        .clone()
        .unwrap_or_else(|| default_bin("target/release/stowage-agent"));
    let mut bins = Vec::new();
    if agent_n.is_some() {
        bins.push((&agent_bin, "cargo build --release"));
    }
    let takeovers = args.takeovers();
    if !workloads.is_empty() || !takeovers.is_empty() {
        bins.extend([
            (&stowage_bin, "cargo build --release"),
            (&kcm_bin, "make controlplane"),
        ]);
    }
    for (b, what) in bins {
        if !b.is_file() {
            bail!("{} not found: run `{what}` first", b.display());
        }
    }
    let machine = Machine::probe();
    // stowage-controller's own client defaults.
    let sdef = controller::stowage_controller_defaults();

    eprintln!("stowage-bench: starting etcd + kube-apiserver");
    let cp = tokio::task::block_in_place(stowage_testkit::ControlPlane::start)?;
    eprintln!(
        "stowage-bench: control plane at {} (logs in {})",
        cp.url(),
        log_dir.display()
    );
    let image_dir = tempfile_dir(&log_dir)?;
    let env = Env {
        objects: Objects {
            client: cp.client().await,
            concurrency: args.concurrency.max(1),
            own_writes: Arc::default(),
        },
        setup: Setup {
            bench_bin: std::env::current_exe().context("path of this binary")?,
            kcm_bin,
            stowage_bin,
            stowage_args: args.stowage_args.split_whitespace().map(String::from).collect(),
            upstream_args: args.upstream_args.split_whitespace().map(String::from).collect(),
            kubeconfig: cp.kubeconfig(),
            log_dir: log_dir.clone(),
            image_dir,
        },
        stall: args.stall_timeout,
        timeout: args.run_timeout,
    };

    let rounds = args.rounds.max(1);
    let mut report = Report {
        started_unix: stamp,
        machine,
        settings: json!({
            "equal_qps": args.qps, "equal_burst": args.burst, "lifted": LIFTED,
            "upstream_defaults": UPSTREAM_DEFAULTS, "stowage_defaults": sdef.to_string(),
            "floor_concurrency": args.floor_concurrency,
            "concurrency": args.concurrency, "stall_timeout_s": args.stall_timeout.as_secs(),
            "rounds": rounds,
            "stowage_args": args.stowage_args, "upstream_args": args.upstream_args,
        }),
        workloads: workloads
            .iter()
            .flat_map(|w| (1..=rounds).map(move |k| (round_name(&w.name(), k, rounds), w.describe())))
            .collect(),
        results: Vec::new(),
        takeovers: Vec::new(),
    };
    // Runs whose flags are identical (stowage's defaults may equal the `equal` limits) are run once.
    let mut by_config: HashMap<(String, Impl, String), RunResult> = HashMap::new();
    let runs = plan(
        &args.impls,
        &args.modes,
        &args.floor_concurrency,
        (args.qps, args.burst),
        sdef,
    );
    for (w, k) in workloads.iter().flat_map(|w| (1..=rounds).map(move |k| (w, k))) {
        let name = round_name(&w.name(), k, rounds);
        for p in &runs {
            let (mode_name, which) = (p.mode, p.which);
            let key = (name.clone(), which, p.effective.to_string());
            if let Some(prev) = by_config.get(&key) {
                let mut r = prev.clone();
                r.note = Some(format!(
                    "same limits as mode {} ({}); that run's numbers",
                    prev.mode, p.effective
                ));
                r.mode = mode_name.into();
                report.results.push(r);
                continue;
            }
            eprintln!("stowage-bench: {name} / {mode_name} / {}", which.name());
            let spec = Spec {
                workload: w,
                which,
                mode: mode_name,
                limits: p.flags,
                effective: p.effective,
            };
            let mut r = workload::run_one(&env, &spec).await?;
            r.workload = name.clone();
            eprintln!(
                "stowage-bench: {name} / {mode_name} / {}: {}",
                which.name(),
                outcome(&r, "")
            );
            by_config.insert(key, r.clone());
            report.results.push(r);
            // Saved after every run, so a matrix cut short still leaves what it measured.
            save(&report, &out_dir, stamp)?;
        }
    }

    if let Some(n) = agent_n {
        eprintln!("stowage-bench: {} / stowage-agent", agent::name(n));
        let r = agent::run(&env, n, &agent_bin).await?;
        let rss = format!(", peak RSS {:.0} MiB", r.peak_rss_mib);
        eprintln!("stowage-bench: {}: {}", r.workload, outcome(&r, &rss));
        report.workloads.push((r.workload.clone(), agent::describe(n)));
        report.results.push(r);
    }

    let sides: Vec<Impl> = args
        .impls
        .iter()
        .filter_map(|i| match i {
            ImplArg::Upstream => Some(Impl::Upstream),
            ImplArg::Stowage => Some(Impl::Stowage),
            ImplArg::Floor => None,
        })
        .collect();
    for t in &takeovers {
        eprintln!("stowage-bench: {} / {:?}", takeover::name(t), args.takeover_stops);
        report.workloads.push((takeover::name(t), takeover::describe(t)));
        let rows = takeover::run(&cp, &env.objects, &env.setup, *t, &sides, &args.takeover_stops).await?;
        report.takeovers.extend(rows);
        save(&report, &out_dir, stamp)?;
    }

    let md = save(&report, &out_dir, stamp)?;
    println!("{md}");
    eprintln!(
        "stowage-bench: wrote {}",
        out_dir.join(format!("bench-{stamp}.json")).display()
    );
    drop(env);
    cp.stop();
    Ok(())
}

/// Writes the report so far as `bench-<stamp>.json` and `.md` into `out_dir`; returns the Markdown.
fn save(report: &Report, out_dir: &std::path::Path, stamp: u64) -> anyhow::Result<String> {
    let md = report.markdown();
    std::fs::write(
        out_dir.join(format!("bench-{stamp}.json")),
        serde_json::to_string_pretty(report)?,
    )?;
    std::fs::write(out_dir.join(format!("bench-{stamp}.md")), &md)?;
    Ok(md)
}

/// A finished run for the progress lines: done/objects, wall time and CPU, `extra`, its note.
fn outcome(r: &RunResult, extra: &str) -> String {
    format!(
        "{}/{} in {:.1} s, CPU {:.2} s{extra}{}",
        r.done,
        r.objects,
        r.wall_s,
        r.cpu_s,
        r.note.as_deref().map(|n| format!(" ({n})")).unwrap_or_default()
    )
}

/// The image directory stowage-controller is given (no workload here provisions loop images).
fn tempfile_dir(parent: &std::path::Path) -> anyhow::Result<PathBuf> {
    let d = parent.join("images");
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    #[test]
    fn modes_and_impls_parse_from_their_names() {
        assert_eq!(Mode::from_str("lifted", false), Ok(Mode::Lifted));
        assert_eq!(Mode::from_str("equal", false), Ok(Mode::Equal));
        assert_eq!(Mode::from_str("defaults", false), Ok(Mode::Defaults));
        assert!(Mode::from_str("unlimited", false).is_err());
        assert_eq!(ImplArg::from_str("floor", false), Ok(ImplArg::Floor));
        let a = Args::try_parse_from([
            "stowage-bench",
            "--modes=lifted,defaults",
            "--impls=floor,upstream,stowage",
            "--floor-concurrency=16,64",
        ])
        .unwrap();
        assert_eq!(a.modes, [Mode::Lifted, Mode::Defaults]);
        assert_eq!(a.impls, [ImplArg::Floor, ImplArg::Upstream, ImplArg::Stowage]);
        assert_eq!(a.floor_concurrency, [16, 64]);
    }

    #[test]
    fn scale_sizes_are_selectable() {
        let a = Args::try_parse_from([
            "stowage-bench",
            "--workloads=static,burst",
            "--static-sizes=10000,50000",
            "--burst-size=10000,50000",
        ])
        .unwrap();
        let names: Vec<String> = a.workloads().unwrap().iter().map(Workload::name).collect();
        assert_eq!(
            names,
            ["static-10000", "static-50000", "burst-10000", "burst-50000"]
        );
        let a = Args::try_parse_from(["stowage-bench", "--workloads=burst", "--sizes=small"]).unwrap();
        assert_eq!(a.workloads().unwrap(), [Workload::Burst { n: 200 }]);
    }

    #[test]
    fn floor_subcommand_parses() {
        let a = Args::try_parse_from([
            "stowage-bench",
            "floor",
            "--workload=burst",
            "--kubeconfig=/k",
            "--namespace=b1",
            "--run=b1",
            "--concurrency=256",
        ])
        .unwrap();
        let Some(Command::Floor(f)) = a.command else {
            panic!("no floor subcommand: {a:?}");
        };
        assert_eq!(f.workload, floor::FloorWorkload::Burst);
        assert_eq!(f.concurrency, 256);
    }

    #[test]
    fn plan_runs_the_floor_sweep_once_then_each_mode() {
        let sdef = Limits::Adaptive { max_qps: 2000.0 };
        let p = plan(
            &[ImplArg::Upstream, ImplArg::Floor, ImplArg::Stowage],
            &[Mode::Lifted, Mode::Defaults],
            &[16, 64, 256],
            (50.0, 100),
            sdef,
        );
        let names: Vec<(String, String)> = p.iter().map(|r| (r.mode.to_string(), r.which.name())).collect();
        let want = [
            ("floor", "floor@16"),
            ("floor", "floor@64"),
            ("floor", "floor@256"),
            ("lifted", "upstream"),
            ("lifted", "stowage"),
            ("defaults", "upstream"),
            ("defaults", "stowage"),
        ];
        assert_eq!(names, want.map(|(m, i)| (m.to_string(), i.to_string())).to_vec());
        // The floor has no limit; lifted passes the same large limits to both (never 0, which
        // client-go reads as its default of 5 QPS); defaults passes none.
        assert!(
            p[..3]
                .iter()
                .all(|r| r.flags.is_none() && r.effective == Limits::None)
        );
        for r in &p[3..5] {
            assert_eq!(r.flags, Some((100_000.0, 100_000)));
        }
        assert_eq!(p[5].effective, Limits::Fixed { qps: 20.0, burst: 30 });
        assert_eq!((p[6].flags, p[6].effective), (None, sdef));
    }

    #[test]
    fn no_floor_rows_unless_asked() {
        let p = plan(
            &[ImplArg::Upstream, ImplArg::Stowage],
            &[Mode::Equal],
            &[16],
            (50.0, 100),
            Limits::Fixed {
                qps: 50.0,
                burst: 100,
            },
        );
        assert_eq!(p.len(), 2);
        assert!(p.iter().all(|r| r.flags == Some((50.0, 100))));
    }
}
