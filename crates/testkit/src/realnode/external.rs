//! The loop driver as a third-party CSI driver, `ext.loop.stowage.dev`, beside a real cluster: its
//! node plugin on every node (`stowage-agent --csi-only --csi-driver-name`, registered with the
//! kubelet), its controller plugin on a socket of its own, and the upstream external-provisioner
//! and external-attacher driving it. All run as processes of the nodes (node 1's in the host's
//! namespaces), stopped with them. stowage serves nothing of this driver in-process, so the
//! storage controllers (stowage's or kube-controller-manager's) only do what they do for any CSI
//! driver. The CSIDriver object (`attachRequired: true`) is the caller's to create.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::bail;

use super::RealNode;
use crate::process::free_port;

/// The second name the loop driver is served under.
pub const DRIVER: &str = "ext.loop.stowage.dev";

/// The binaries it runs: `stowage-agent` and the two sidecars (`make sidecars`).
pub struct Binaries {
    pub agent: PathBuf,
    pub provisioner: PathBuf,
    pub attacher: PathBuf,
}

impl Binaries {
    /// `stowage-agent` from `bin_dir` (the workspace's `target/<profile>`), the sidecars from
    /// `e2e/sidecars/*/bin` of this repository.
    pub fn find(bin_dir: &Path) -> anyhow::Result<Self> {
        let sidecars = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../e2e/sidecars");
        let b = Self {
            agent: bin_dir.join("stowage-agent"),
            provisioner: sidecars.join("provisioner/bin/csi-provisioner"),
            attacher: sidecars.join("attacher/bin/csi-attacher"),
        };
        for p in [&b.agent, &b.provisioner, &b.attacher] {
            if !p.is_file() {
                bail!(
                    "{} is missing: cargo build --workspace --bins; make sidecars",
                    p.display()
                );
            }
        }
        Ok(b)
    }
}

/// Starts the driver's plugins and sidecars beside `nodes` (the first runs the controller side),
/// over the image store `images`, the sidecars reaching the apiserver through `kubeconfig`.
pub fn start(nodes: &[RealNode], kubeconfig: &Path, images: &Path, bins: &Binaries) -> anyhow::Result<()> {
    let Some(first) = nodes.first() else {
        bail!("no node to run {DRIVER} beside");
    };
    for node in nodes {
        let sock = node.kubelet_dir.join("plugins").join(DRIVER).join("csi.sock");
        let mut plugin = node.command(&bins.agent);
        plugin
            .args([
                "--csi-only",
                "--csi-driver-name",
                DRIVER,
                "--node-name",
                &node.name,
            ])
            .arg(format!("--kubelet-dir={}", node.kubelet_dir.display()))
            .arg(format!("--csi-endpoint=unix://{}", sock.display()))
            .arg(format!("--root-dir={}", node.dir().join("ext-node").display()))
            .arg(format!("--image-dir={}", images.display()));
        node.spawn("ext-node-plugin", plugin)?;
    }
    let ctrl_sock = first.dir().join("ext-controller/csi.sock");
    let mut ctrl = Command::new(&bins.agent);
    ctrl.args(["--csi-only", "--csi-controller", "--csi-driver-name", DRIVER])
        .args(["--node-name", "ext-controller"])
        .arg(format!("--csi-endpoint=unix://{}", ctrl_sock.display()))
        .arg(format!(
            "--root-dir={}",
            first.dir().join("ext-controller").display()
        ))
        .arg(format!("--image-dir={}", images.display()));
    first.spawn("ext-controller-plugin", ctrl)?;
    for (name, bin) in [
        ("csi-provisioner", &bins.provisioner),
        ("csi-attacher", &bins.attacher),
    ] {
        let mut c = Command::new(bin);
        c.arg(format!("--csi-address={}", ctrl_sock.display()))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(["--leader-election=false", "--v=4", "--timeout=60s"])
            .arg(format!("--http-endpoint=127.0.0.1:{}", free_port()));
        first.spawn(name, c)?;
    }
    Ok(())
}
