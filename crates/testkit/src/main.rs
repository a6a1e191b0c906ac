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
    /// With --real-node: how many nodes (`realnode`, `realnode2`); the second runs in network and
    /// mount namespaces of its own, and nodes and pods reach the apiserver at the host's veth
    /// address.
    #[arg(long, default_value_t = 1, requires = "real_node")]
    nodes: usize,
    /// With --real-node: kube-controller-manager's `--controllers`; `*` keeps its own storage
    /// controllers (for runs compared with stowage's). Default: without the five stowage replaces.
    #[arg(long, requires = "real_node")]
    kcm_controllers: Option<String>,
    /// With --real-node: also run the loop driver as the third-party driver ext.loop.stowage.dev
    /// over this image store: its node plugin on every node, its controller plugin and the
    /// upstream external-provisioner and external-attacher (`make sidecars`) beside node 1.
    #[arg(long, requires = "real_node")]
    external_driver_images: Option<PathBuf>,
    /// With --real-node: the image store path, made a shared mount on every node as on a real
    /// host (`RealNode::image_store`), before stowage is installed.
    #[arg(long, requires = "real_node")]
    image_store: Option<PathBuf>,
    /// With --image-store: every node but the first gets a directory of its own there (local
    /// mode: nodes share no store); without it all nodes see the one directory (shared mode).
    #[arg(long, requires = "image_store")]
    own_image_stores: bool,
    /// With --real-node: every node serves SSH on its node IP for root with a key made in
    /// `<dir>/ssh`, and `systemctl start|stop|restart kubelet` there acts on its kubelet (what
    /// upstream's disruptive storage tests ask of a node; `realnode::ssh`).
    #[arg(long, requires = "real_node")]
    ssh: bool,
}

fn main() {
    let args = Args::parse();
    let cp = match stowage_testkit::ControlPlane::start_in_for_nodes(args.dir, None, args.nodes) {
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
    let cluster = if args.real_node {
        let kcm = args
            .kcm_controllers
            .as_deref()
            .unwrap_or(stowage_testkit::realnode::KCM_CONTROLLERS);
        let started =
            stowage_testkit::realnode::RealNode::start_cluster_with_kcm(&cp, &args.images, args.nodes, kcm)
                .and_then(|c| {
                    if let Some(store) = &args.image_store {
                        for n in c.nodes() {
                            let dir = n.image_store(store, args.own_image_stores)?;
                            println!("node {} image store {}", n.name, dir.display());
                        }
                    }
                    if args.ssh {
                        use stowage_testkit::realnode::ssh;
                        let key = ssh::ClusterKey::create(&cp.dir().join("ssh"))?;
                        for n in c.nodes() {
                            n.serve_ssh(&key)?;
                        }
                        println!(
                            "nodes serve SSH on their node IPs, port 22, user {}, key {}",
                            ssh::USER,
                            key.private.display()
                        );
                    }
                    if let Some(images) = &args.external_driver_images {
                        use stowage_testkit::realnode::external;
                        // stowage-agent is built beside this binary.
                        let exe = std::env::current_exe()?;
                        let bins =
                            external::Binaries::find(exe.parent().unwrap_or(std::path::Path::new(".")))?;
                        external::start(c.nodes(), &cp.kubeconfig(), images, &bins)?;
                        println!("{} served beside the nodes", external::DRIVER);
                    }
                    Ok(c)
                });
        match started {
            Ok(c) => {
                for n in c.nodes() {
                    let netns = n.netns().map(|ns| format!(", netns {ns}")).unwrap_or_default();
                    println!(
                        "node {} ready (kubelet root {}, node IP {}{netns})",
                        n.name,
                        n.kubelet_dir.display(),
                        n.node_ip
                    );
                }
                println!("nodes and pods reach the apiserver at {}", cp.node_url());
                Some(c)
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
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        // The nodes' kubelets as units their SSH sessions' `systemctl` starts and stops.
        if args.ssh {
            for n in cluster.iter().flat_map(|c| c.nodes()) {
                let stop = &stop;
                s.spawn(move || n.serve_units(stop));
            }
        }
        rt.block_on(stowage_common::runtime::shutdown::signalled());
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    drop(cluster);
    cp.stop();
    let _ = std::fs::remove_dir_all(cp.dir().join("etcd"));
}
