//! `stowage-soak`: one seeded soak run; prints the summary and exits 1 on any violation or leak.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

#[derive(Parser)]
#[command(about = "Chaos soak of stowage on the real control plane: churn, faults, invariants, leaks.")]
struct Args {
    /// How long the workload and the faults run (humantime: 3m, 30m).
    #[arg(long, default_value = "3m", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Seed of every random decision; the summary prints it to replay a run. Random when absent.
    #[arg(long)]
    seed: Option<u64>,
    /// stowage-controller replicas (leader election).
    #[arg(long, default_value_t = 3)]
    controllers: usize,
    /// Kubelet-less agents (one node each).
    #[arg(long, default_value_t = 2)]
    agents: usize,
    /// Where a failing run's bundle (logs, object dumps, timeline) is written.
    #[arg(long, default_value = "e2e/results")]
    results: PathBuf,
    /// Write the bundle for a passing run too.
    #[arg(long)]
    keep: bool,
}

fn main() {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64 % 1_000_000)
            .unwrap_or(1)
    });
    let mut opts = stowage_soak::Options::profile(seed, args.duration, args.results);
    opts.controllers = args.controllers.clamp(1, 26);
    opts.agents = args.agents.clamp(2, 26);
    opts.keep = args.keep;
    eprintln!(
        "soak: seed {seed}, churn {:?}, {} controllers, {} agents",
        opts.duration, opts.controllers, opts.agents
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let summary = rt.block_on(stowage_soak::run(opts));
    print!("{}", summary.render());
    // Nothing of ours may outlive the summary (blocked API calls of killed processes).
    rt.shutdown_timeout(Duration::from_secs(5));
    std::process::exit(if summary.passed() { 0 } else { 1 });
}
