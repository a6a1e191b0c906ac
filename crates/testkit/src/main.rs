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
    /// Also run a real node: kube-controller-manager (storage controllers off), kube-scheduler,
    /// containerd and a kubelet, with these OCI archives imported.
    #[arg(long)]
    real_node: bool,
    /// OCI image archives to import into the real node's containerd.
    #[arg(long = "image")]
    images: Vec<PathBuf>,
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
    let node = if args.real_node {
        match stowage_testkit::realnode::RealNode::start(&cp, &args.images) {
            Ok(n) => {
                println!(
                    "node {} ready (kubelet root {}, node IP {})",
                    stowage_testkit::realnode::NODE_NAME,
                    n.kubelet_dir.display(),
                    n.node_ip
                );
                Some(n)
            }
            Err(e) => {
                eprintln!("stowage-devcluster: real node: {e:#}");
                cp.stop();
                std::process::exit(1);
            }
        }
    } else {
        None
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(stowage_common::shutdown::signalled());
    drop(node);
    cp.stop();
    let _ = std::fs::remove_dir_all(cp.dir().join("etcd"));
}
