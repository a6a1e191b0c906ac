//! The namespaces of a real node. One kernel plays every node.
//!
//! Every node has a PID namespace of its own, whose init (tini) lives in the node's mount
//! namespace, with a /proc of that PID namespace there. Upstream's storage e2e tests reach "the
//! host" of a node from a privileged pod through `nsenter --mount=/rootfs/proc/1/ns/mnt` (the
//! node's root file system at /rootfs, so /rootfs/proc is the /proc containerd sees): PID 1 there
//! must be a process of the node's mount namespace that such a pod may enter. This machine's own
//! PID 1 refuses that. The init is tied to the test process, so the namespaces, and every process
//! in them, end with it.
//!
//! Node 1 (`realnode`) keeps the host's network namespace, and its mount namespace is its init's:
//! a copy of the host's, made with propagation unchanged, so the host's shared mounts (the kubelet
//! root, bound and made shared before the copy) stay peers and the kubelet's and pods' mounts
//! there show on the host as before. Only /proc differs, and what the node mounts elsewhere (the
//! local-PV tests' tmpfs and bind mounts) stays on the node, as on a separate machine.
//!
//! Node 2 and further (`realnode2`) also have network and mount namespaces of their own. The agent
//! DaemonSet's hostNetwork pods run on each node, so each node needs its own ports: node 2's
//! containerd and kubelet run in a network namespace joined to the host by a veth pair with
//! private test addresses and no default route (nothing leaves this machine). The chart has one
//! `agent.kubeletDir` for all nodes, so node 2's kubelet root must sit at node 1's path: in a
//! mount namespace of its own, node 2's kubelet dir is bound over that path and made rshared there
//! (after the namespace was made private, so it is no peer of the host's mounts), and the agent's
//! Bidirectional mounts reach node 2's kubelet and pods, not node 1's. The paths the kubelet,
//! containerd and the CNI plugins hard-code get private dirs in that namespace too.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::run;
use crate::process::spawn_tied;

/// The host's address on every other node's veth: the apiserver's address for those nodes and
/// for the pods of all nodes (node 1 is in the host's network namespace, where it is local too).
pub const HOST_IP: &str = "10.250.0.1";

/// Host paths each node must have its own of: the kubelet's container log links (hard-coded),
/// containerd's pod network namespaces, shim sockets and runc state (hard-coded in 1.6), the CNI
/// plugins' IPAM and result store, and the chart's default `agent.rootDir` (the agent's CSI stage
/// records, which are per node). The kubelet root (`/var/lib/kubelet`, with the device-plugin
/// socket it hard-codes) is node 2's own dir, bound there by `create`.
const PRIVATE: &[&str] = &[
    "/var/log/containers",
    "/run/netns",
    "/run/containerd",
    "/var/lib/cni",
    "/var/lib/stowage",
];

/// Host mounts node 2's mount namespace keeps (besides `/` and the ones holding its own files).
/// Its copies of the rest (other tests' volumes and network namespaces, node 1's kubelet mounts)
/// would keep those file systems and namespaces alive for as long as the namespace lives.
const KEEP: &[&str] = &["/proc", "/sys", "/dev", "/etc"];

pub(crate) struct Isolation {
    /// Node 2 and further: the network namespace and its veth pair; `None` on node 1.
    net: Option<Net>,
    /// Node 2 and further: the persistent private mount namespace (a bind mount of its nsfs
    /// file); `None` on node 1, whose mount namespace is its init's.
    mntns: Option<PathBuf>,
    dir: PathBuf,
    /// `unshare --pid --fork --kill-child tini …` and tini's PID (PID 1 of the node's PID
    /// namespace), once started.
    init: Mutex<Option<(Child, u32)>>,
}

struct Net {
    name: String,
    /// The veth pair's ends: on the host, and in `name`.
    veth: String,
    node_veth: String,
    ip: String,
}

impl Isolation {
    /// Node 1's namespaces, with its files in `dir`; nothing is created until `create_peer`.
    pub fn host_peer(dir: &Path) -> Self {
        Self {
            net: None,
            mntns: None,
            dir: dir.to_path_buf(),
            init: Mutex::new(None),
        }
    }

    /// The names of node `index` (0-based, so 1 is `realnode2`) with its files in `dir`; nothing
    /// is created until `create`.
    pub fn own(index: usize, dir: &Path) -> Self {
        let n = index + 1;
        Self {
            net: Some(Net {
                name: format!("stowage-realnode{n}"),
                veth: format!("stowrn{n}h"),
                node_veth: format!("stowrn{n}n"),
                ip: format!("10.250.0.{n}"),
            }),
            mntns: Some(dir.join("mntns")),
            dir: dir.to_path_buf(),
            init: Mutex::new(None),
        }
    }

    /// The node's network namespace (`ip netns exec <it>`); `None` on node 1.
    pub fn netns(&self) -> Option<&str> {
        self.net.as_ref().map(|n| n.name.as_str())
    }

    /// The node's address in its own network namespace; `None` on node 1.
    pub fn ip(&self) -> Option<&str> {
        self.net.as_ref().map(|n| n.ip.as_str())
    }

    /// `program` run in the node's namespaces: its mount and network ones, and its PID one once
    /// that exists (`nsenter` then forks it there and waits for it).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let init = self.init.lock().unwrap_or_else(|p| p.into_inner());
        let pid = init.as_ref().map(|(_, pid)| *pid);
        let mount = match (&self.mntns, pid) {
            (Some(file), _) => Some(file.display().to_string()),
            (None, Some(pid)) => Some(format!("/proc/{pid}/ns/mnt")),
            (None, None) => None,
        };
        if mount.is_none() && self.net.is_none() {
            // Node 1 before its init started: the host's namespaces.
            return Command::new(program);
        }
        let mut cmd = Command::new("nsenter");
        if let Some(mount) = mount {
            cmd.arg(format!("--mount={mount}"));
        }
        if let Some(net) = &self.net {
            cmd.arg(format!("--net=/run/netns/{}", net.name));
        }
        if let Some(pid) = pid {
            cmd.arg(format!("--pid=/proc/{pid}/ns/pid"));
        }
        cmd.arg("--").arg(program);
        cmd
    }

    /// Starts the node's PID namespace: tini as its PID 1 (it reaps the shims and other orphans
    /// the namespace's processes leave), and a /proc of that namespace in the node's mount
    /// namespace. Node 2's init joins the namespaces `create` made; node 1's makes its mount
    /// namespace, a copy of the host's whose shared mounts stay peers, with only /proc made
    /// private there before the new one is mounted (`--mount-proc`), so the host keeps its own.
    fn start_init(&self) -> anyhow::Result<()> {
        let mut cmd = self.command("unshare");
        if self.mntns.is_none() {
            cmd.args(["--mount", "--propagation", "unchanged", "--mount-proc"]);
        }
        cmd.args([
            "--pid",
            "--fork",
            "--kill-child",
            "tini",
            "-s",
            "--",
            "sleep",
            "infinity",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        // nsenter without --pid execs unshare in place (and node 1 runs unshare itself): this
        // child is unshare, and its one child is tini.
        let child = spawn_tied(cmd).context("start the node's PID namespace")?;
        let deadline = Instant::now() + Duration::from_secs(10);
        let tini = loop {
            if let Some(pid) = children_of(child.id()).into_iter().next() {
                break pid;
            }
            if Instant::now() > deadline {
                anyhow::bail!("tini did not start in the node's PID namespace");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        *self.init.lock().unwrap_or_else(|p| p.into_inner()) = Some((child, tini as u32));
        if self.mntns.is_some() {
            run(self.command("mount").args(["-t", "proc", "proc", "/proc"]))?;
        }
        Ok(())
    }

    /// Ends the PID namespace: SIGKILL to its init ends every process still in it.
    fn stop_init(&self) {
        if let Some((mut child, tini)) = self.init.lock().unwrap_or_else(|p| p.into_inner()).take() {
            // SAFETY: plain kill syscalls on processes this node started.
            unsafe {
                libc::kill(tini as i32, libc::SIGKILL);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Creates node 1's PID and mount namespaces. The mounts it must share with the host are
    /// made shared before this (the kubelet root); the rest of its mounts stay its own.
    pub fn create_peer(&self) -> anyhow::Result<()> {
        self.stop_init();
        self.start_init()
    }

    /// Creates node 2's network and mount namespaces, then its PID one; `kubelet_backing` is bound at `kubelet_path` in the mount one.
    pub fn create(&self, kubelet_path: &Path, kubelet_backing: &Path) -> anyhow::Result<()> {
        // What a killed run left (real clusters are exclusive on a machine).
        self.remove(&[]);
        let (Some(net), Some(mntns)) = (&self.net, &self.mntns) else {
            anyhow::bail!("create is for a node in namespaces of its own; node 1 has create_peer");
        };
        let (ns, host, node) = (&net.name, &net.veth, &net.node_veth);
        let ip = |args: &[&str]| run(Command::new("ip").args(args));
        ip(&["netns", "add", ns])?;
        ip(&["link", "add", host, "type", "veth", "peer", "name", node])?;
        ip(&["link", "set", node, "netns", ns])?;
        // /32 addresses and a route each way: every further node can have its own veth with
        // the same host address.
        ip(&["addr", "add", &format!("{HOST_IP}/32"), "dev", host])?;
        ip(&["link", "set", host, "up"])?;
        ip(&[
            "route",
            "add",
            &format!("{}/32", net.ip),
            "dev",
            host,
            "src",
            HOST_IP,
        ])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
        ip(&["-n", ns, "addr", "add", &format!("{}/32", net.ip), "dev", node])?;
        ip(&["-n", ns, "link", "set", node, "up"])?;
        ip(&[
            "-n",
            ns,
            "route",
            "add",
            &format!("{HOST_IP}/32"),
            "dev",
            node,
            "src",
            &net.ip,
        ])?;

        std::fs::File::create(mntns)?;
        run(Command::new("unshare")
            .arg(format!("--mount={}", mntns.display()))
            .args(["--propagation", "private", "true"]))?;
        let drop: Vec<String> = mount_points(&self.mount_table()?)
            .into_iter()
            .filter(|p| {
                p != "/" && !KEEP.iter().any(|k| Path::new(p).starts_with(k)) && !self.dir.starts_with(p)
            })
            .collect();
        if !drop.is_empty() {
            // Children of a mount already detached fail; nothing to do for them.
            let _ = self
                .command("umount")
                .arg("-l")
                .args(&drop)
                .stderr(Stdio::null())
                .status();
        }
        for path in PRIVATE {
            let own = self
                .dir
                .join("private")
                .join(path.trim_start_matches('/').replace('/', "_"));
            std::fs::create_dir_all(&own)?;
            std::fs::create_dir_all(path)?;
            run(self.command("mount").arg("--bind").arg(&own).arg(path))?;
        }
        std::fs::create_dir_all(kubelet_backing)?;
        run(self
            .command("mount")
            .arg("--bind")
            .arg(kubelet_backing)
            .arg(kubelet_path))?;
        run(self.command("mount").arg("--make-rshared").arg(kubelet_path))?;
        self.start_init()
    }

    /// The mount table as the node's processes see it.
    pub fn mount_table(&self) -> anyhow::Result<String> {
        run(self.command("cat").arg("/proc/self/mountinfo"))
    }

    /// Unmounts what the node mounted under `under` (deepest first), then ends its PID
    /// namespace and releases node 2's mount namespace, network namespace and veth pair;
    /// idempotent. Its processes must be
    /// gone, or the namespaces outlive this.
    pub fn remove(&self, under: &[&Path]) {
        if let Ok(table) = self.mount_table() {
            let mut points: Vec<String> = mount_points(&table)
                .into_iter()
                .filter(|p| under.iter().any(|u| Path::new(p).starts_with(u)))
                .collect();
            points.sort_by_key(|p| std::cmp::Reverse(Path::new(p).components().count()));
            if !points.is_empty() {
                let _ = self
                    .command("umount")
                    .arg("-l")
                    .args(&points)
                    .stderr(Stdio::null())
                    .status();
            }
        }
        self.stop_init();
        let quiet = |cmd: &mut Command| {
            let _ = cmd.stdout(Stdio::null()).stderr(Stdio::null()).status();
        };
        if let Some(mntns) = &self.mntns {
            quiet(Command::new("umount").arg("-l").arg(mntns));
            let _ = std::fs::remove_file(mntns);
        }
        let Some(net) = &self.net else {
            // Node 1: its mount namespace went with its init; the host keeps the rest.
            return;
        };
        quiet(Command::new("ip").args(["netns", "delete", &net.name]));
        quiet(Command::new("ip").args(["link", "delete", &net.veth]));
        // `ip netns add` binds /run/netns on itself; once no namespace is left there, undone.
        let empty = std::fs::read_dir("/run/netns").is_ok_and(|mut rd| rd.next().is_none());
        if empty && is_mount_point("/run/netns") {
            quiet(Command::new("umount").arg("/run/netns"));
        }
        let _ = std::fs::remove_dir_all(self.dir.join("private"));
    }
}

/// The direct children of `pid` (from `/proc/<pid>/task/*/children`).
pub(crate) fn children_of(pid: u32) -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return vec![];
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect()
}

fn is_mount_point(path: &str) -> bool {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    mount_points(&table).iter().any(|p| p == path)
}

/// The mount points of a mountinfo table, in its order (parents before what is mounted on them).
fn mount_points(table: &str) -> Vec<String> {
    table
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| {
            p.replace("\\040", " ")
                .replace("\\011", "\t")
                .replace("\\134", "\\")
        })
        .collect()
}
