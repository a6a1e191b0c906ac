//! `stowage-devcluster`: starts the real control plane for the demo and benchmarks and keeps it
//! running until SIGINT/SIGTERM, then removes its data.

use std::path::PathBuf;

use clap::Parser;

#[derive(Parser)]
#[command(about = "Run etcd + kube-apiserver on loopback until interrupted.")]
struct Args {
    /// Directory for data, logs and the kubeconfig (emptied first).
    #[arg(long)]
    dir: PathBuf,
}

fn main() {
    let args = Args::parse();
    let cp = match stowage_testkit::ControlPlane::start_in(args.dir, None) {
        Ok(cp) => cp,
        Err(e) => {
            eprintln!("stowage-devcluster: {e:#}");
            std::process::exit(1);
        }
    };
    println!(
        "control plane ready at {} (kubeconfig {})",
        cp.url(),
        cp.kubeconfig().display()
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(stowage_common::shutdown::signalled());
    cp.stop();
    let _ = std::fs::remove_dir_all(cp.dir().join("etcd"));
}
