//! `stowage-bench` (run by `make bench`): starts the real control plane once, then runs each
//! workload against upstream kube-controller-manager and against stowage-controller, one after the
//! other on fresh objects, once with equal client rate limits and once with each one's defaults.
//! Prints a Markdown table per workload and writes JSON into `e2e/results/`.

mod agent;
mod apiserver;
mod controller;
mod objects;
mod procstat;
mod report;
mod tracker;
mod workload;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use clap::Parser;
use serde_json::json;

use crate::controller::{Impl, Setup, default_bin};
use crate::objects::Objects;
use crate::report::{Machine, Report, RunResult};
use crate::workload::{Env, Spec, Workload};

/// kube-controller-manager's `--kube-api-qps` / `--kube-api-burst` defaults.
const UPSTREAM_DEFAULTS: (f32, u32) = (20.0, 30);

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
    /// Each implementation with its own defaults.
    Defaults,
}

#[derive(Debug, Parser)]
#[command(about = "Side-by-side benchmark of stowage-controller and upstream kube-controller-manager.")]
struct Args {
    /// Workloads to run: static, burst, attach, expand, agent (not in the default list: it needs
    /// root for loop devices and mounts, and has no upstream counterpart).
    #[arg(
        long,
        env = "BENCH_WORKLOADS",
        value_delimiter = ',',
        default_value = "static,burst,attach,expand,agent"
    )]
    workloads: Vec<String>,
    /// Implementations to run, in this order.
    #[arg(
        long,
        env = "BENCH_IMPLS",
        value_delimiter = ',',
        default_value = "upstream,stowage"
    )]
    impls: Vec<Impl>,
    /// Rate-limit modes to run.
    #[arg(
        long,
        env = "BENCH_MODES",
        value_delimiter = ',',
        default_value = "equal,defaults"
    )]
    modes: Vec<Mode>,
    /// Size preset; the options below override single sizes.
    #[arg(long, env = "BENCH_SIZES", default_value = "full")]
    sizes: Sizes,
    /// Pair counts of the static bind (the CPU scaling row compares the smallest and largest).
    #[arg(long, env = "BENCH_STATIC_SIZES", value_delimiter = ',')]
    static_sizes: Option<Vec<usize>>,
    #[arg(long, env = "BENCH_BURST_SIZE")]
    burst_size: Option<usize>,
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
    #[arg(long, env = "BENCH_KCM_BIN")]
    kcm_bin: Option<PathBuf>,
    /// Volumes (and pods) of workload `agent`.
    #[arg(long, env = "BENCH_AGENT_VOLUMES", default_value_t = 200)]
    agent_volumes: usize,
    /// stowage-agent binary of workload `agent` (default target/release/stowage-agent).
    #[arg(long, env = "BENCH_AGENT_BIN")]
    agent_bin: Option<PathBuf>,
}

impl Args {
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
                "burst" => out.push(Workload::Burst {
                    n: pick(self.burst_size, 10_000),
                }),
                "attach" => out.push(Workload::Attach {
                    pods: pick(self.attach_pods, 1_000),
                    nodes: self.attach_nodes.unwrap_or(if small { 10 } else { 50 }),
                }),
                "expand" => out.push(Workload::Expand {
                    n: pick(self.expand_size, 500),
                }),
                // Run on its own after the side-by-side workloads (see `agent.rs`).
                "agent" => {}
                other => bail!("unknown workload {other:?} (known: static, burst, attach, expand, agent)"),
            }
        }
        Ok(out)
    }
}

#[tokio::main]
async fn main() {
    if let Err(e) = run(Args::parse()).await {
        eprintln!("stowage-bench: {e:#}");
        std::process::exit(1);
    }
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
    if !workloads.is_empty() {
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
    let sdef = controller::stowage_client_defaults("stowage-controller");

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
            kcm_bin,
            stowage_bin,
            kubeconfig: cp.kubeconfig(),
            log_dir: log_dir.clone(),
            image_dir,
        },
        stall: args.stall_timeout,
        timeout: args.run_timeout,
    };

    let mut results: Vec<RunResult> = Vec::new();
    // Runs whose flags are identical (stowage's defaults may equal the `equal` limits) are run once.
    let mut by_config: HashMap<(String, Impl, u32, u32), RunResult> = HashMap::new();
    for w in &workloads {
        for mode in &args.modes {
            for &which in &args.impls {
                let (mode_name, limits, effective) = match (mode, which) {
                    (Mode::Equal, _) => ("equal", Some((args.qps, args.burst)), (args.qps, args.burst)),
                    (Mode::Defaults, Impl::Upstream) => ("defaults", None, UPSTREAM_DEFAULTS),
                    (Mode::Defaults, Impl::Stowage) => ("defaults", None, sdef),
                };
                let key = (w.name(), which, effective.0.to_bits(), effective.1);
                if let Some(prev) = by_config.get(&key) {
                    let mut r = prev.clone();
                    r.note = Some(format!(
                        "same flags as mode {} ({}/{}); that run's numbers",
                        prev.mode, effective.0, effective.1
                    ));
                    r.mode = mode_name.into();
                    results.push(r);
                    continue;
                }
                eprintln!("stowage-bench: {} / {mode_name} / {}", w.name(), which.name());
                let spec = Spec {
                    workload: w,
                    which,
                    mode: mode_name,
                    limits,
                    effective,
                };
                let r = workload::run_one(&env, &spec).await?;
                eprintln!(
                    "stowage-bench: {} / {mode_name} / {}: {}",
                    w.name(),
                    which.name(),
                    outcome(&r, "")
                );
                by_config.insert(key, r.clone());
                results.push(r);
            }
        }
    }

    let mut described: Vec<(String, String)> = workloads.iter().map(|w| (w.name(), w.describe())).collect();
    if let Some(n) = agent_n {
        eprintln!("stowage-bench: {} / stowage-agent", agent::name(n));
        let r = agent::run(&env, n, &agent_bin).await?;
        let rss = format!(", peak RSS {:.0} MiB", r.peak_rss_mib);
        eprintln!("stowage-bench: {}: {}", r.workload, outcome(&r, &rss));
        described.push((r.workload.clone(), agent::describe(n)));
        results.push(r);
    }

    let report = Report {
        started_unix: stamp,
        machine,
        settings: json!({
            "equal_qps": args.qps, "equal_burst": args.burst,
            "upstream_defaults": UPSTREAM_DEFAULTS, "stowage_defaults": sdef,
            "concurrency": args.concurrency, "stall_timeout_s": args.stall_timeout.as_secs(),
        }),
        workloads: described,
        results,
    };
    let md = report.markdown();
    println!("{md}");
    let json_path = out_dir.join(format!("bench-{stamp}.json"));
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)?)?;
    std::fs::write(out_dir.join(format!("bench-{stamp}.md")), &md)?;
    eprintln!("stowage-bench: wrote {}", json_path.display());
    drop(env);
    cp.stop();
    Ok(())
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
