//! SSH to a node, and its kubelet as a unit that `systemctl` starts and stops: what upstream's
//! disruptive storage tests ask of a node (`test/e2e/storage/utils`: `KubeletCommand` runs
//! `sudo systemctl stop|start kubelet` over SSH, `systemctl show kubelet --property ActiveState`
//! reads its state, and the tests grep the node's `mount` and list `/var/lib/kubelet`).
//!
//! Each node runs Debian's OpenSSH server in its own namespaces, on its node IP, port 22, for
//! root with one key of the cluster's. Every session runs in the node's mount namespace with a
//! `PATH` whose `systemctl` knows one unit, the kubelet this rig runs: it hands `start`, `stop`
//! and `restart` to `RealNode::serve_units` (a thread of the process that owns the node) through
//! request files, and `show`/`is-active`/`status` read the state file that thread keeps. `sudo`
//! runs its command as is (sessions are root already). Nothing of it is in the product.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};

use super::{RealNode, run, wait_for};

/// The user the tests log in as (`KUBE_SSH_USER`).
pub const USER: &str = "root";

/// The cluster's SSH key pair; the private key is what the tests are given (`KUBE_SSH_KEY_PATH`).
pub struct ClusterKey {
    pub private: PathBuf,
    public: String,
}

impl ClusterKey {
    /// A new ed25519 key pair in `dir` (replacing one that is there).
    pub fn create(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let private = dir.join("id_ed25519");
        let _ = std::fs::remove_file(&private);
        let _ = std::fs::remove_file(private.with_extension("pub"));
        keygen(&private, "stowage-test-cluster")?;
        let public = std::fs::read_to_string(private.with_extension("pub"))?;
        Ok(Self { private, public })
    }
}

fn keygen(path: &Path, comment: &str) -> anyhow::Result<()> {
    run(Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"])
        .arg(path))?;
    Ok(())
}

/// `systemctl` for the one unit a node has: the kubelet the rig runs. `@CTL@` is the node's
/// control dir.
const SYSTEMCTL: &str = r#"#!/bin/sh
# systemctl on a test node: one unit, the kubelet, which the test rig runs (not systemd).
ctl='@CTL@'
verb=$1
[ $# -gt 0 ] && shift
unit=
for a in "$@"; do
  case $a in kubelet|kubelet.service) unit=kubelet ;; esac
done
if [ "$unit" != kubelet ]; then
  echo "systemctl: this test node has one unit, kubelet" >&2
  exit 5
fi
state=$(cat "$ctl/state" 2>/dev/null || echo inactive)
case $verb in
  show)
    case " $* " in
      *" --value "*) echo "$state" ;;
      *) echo "ActiveState=$state" ;;
    esac ;;
  is-active)
    echo "$state"
    [ "$state" = active ] ;;
  status)
    echo "* kubelet.service - kubelet (run by the test rig)"
    echo "     Active: $state"
    [ "$state" = active ] ;;
  start|stop|restart)
    req="$ctl/$$-$(date +%s%N)"
    echo "$verb" >"$req.tmp" && mv "$req.tmp" "$req.req"
    i=0
    while [ ! -f "$req.done" ]; do
      i=$((i + 1))
      if [ "$i" -gt 1200 ]; then
        echo "systemctl: the rig did not $verb the kubelet within 120s" >&2
        exit 1
      fi
      sleep 0.1
    done
    rc=$(cat "$req.done")
    rm -f "$req.done"
    exit "$rc" ;;
  *)
    echo "systemctl: $verb is not served on this test node" >&2
    exit 1 ;;
esac
"#;

/// `sudo` for sessions that are root already: runs its command (the tests probe it with
/// `sudo --version`, and prefix their commands with it when it answers).
const SUDO: &str = r#"#!/bin/sh
# sudo on a test node, whose SSH sessions are root already.
case $1 in
  --version|-V) echo "Sudo version (test node: sessions are root)"; exit 0 ;;
esac
exec "$@"
"#;

impl RealNode {
    /// Starts the node's SSH server (see the module doc) for `key`; `serve_units` must run for
    /// `systemctl` to act.
    pub fn serve_ssh(&self, key: &ClusterKey) -> anyhow::Result<()> {
        let dir = self.dir.join("ssh");
        let bin = dir.join("bin");
        let ctl = self.unit_dir();
        std::fs::create_dir_all(&bin)?;
        std::fs::create_dir_all(&ctl)?;
        let host_key = dir.join("host_ed25519");
        if !host_key.exists() {
            keygen(&host_key, &self.name)?;
        }
        std::fs::write(dir.join("authorized_keys"), &key.public)?;
        let ctl_text = ctl.display().to_string();
        write_exec(&bin.join("systemctl"), &SYSTEMCTL.replace("@CTL@", &ctl_text))?;
        write_exec(&bin.join("sudo"), SUDO)?;
        // Every session: the node's tools first, then the command as sshd was asked for it.
        write_exec(
            &dir.join("session"),
            &format!(
                "#!/bin/sh\nPATH={}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nexport PATH\ncd /\nif [ -n \"$SSH_ORIGINAL_COMMAND\" ]; then exec /bin/sh -c \"$SSH_ORIGINAL_COMMAND\"; fi\nexec /bin/sh -i\n",
                bin.display()
            ),
        )?;
        let config = dir.join("sshd_config");
        std::fs::write(
            &config,
            format!(
                "ListenAddress {ip}:22
HostKey {host_key}
AuthorizedKeysFile {keys}
PidFile {pid}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
AllowUsers {USER}
ForceCommand {session}
",
                ip = self.node_ip,
                host_key = host_key.display(),
                keys = dir.join("authorized_keys").display(),
                pid = dir.join("sshd.pid").display(),
                session = dir.join("session").display(),
            ),
        )?;
        // The privilege-separation dir sshd insists on (made by the service unit on a host).
        run(self.command("mkdir").args(["-p", "/run/sshd"]))?;
        let mut sshd = self.command("/usr/sbin/sshd");
        sshd.args(["-D", "-e", "-f"]).arg(&config);
        self.spawn("sshd", sshd)?;
        let addr: std::net::SocketAddr = format!("{}:22", self.node_ip).parse().context("the node IP")?;
        wait_for(Duration::from_secs(20), "sshd listening", || {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
        })
        .with_context(|| format!("sshd log:\n{}", self.log_tail("sshd")))?;
        self.set_unit_state();
        Ok(())
    }

    fn unit_dir(&self) -> PathBuf {
        self.dir.join("ssh").join("units")
    }

    fn set_unit_state(&self) {
        write_state(&self.unit_dir(), self);
    }

    /// Carries out the `systemctl start|stop|restart kubelet` the node's SSH sessions ask for,
    /// until `stop` is set; run it on a thread of the process that owns the node.
    pub fn serve_units(&self, stop: &AtomicBool) {
        serve(&self.unit_dir(), self, stop, &self.name);
    }
}

/// A unit `systemctl` acts on: the node's kubelet, here.
pub trait Unit: Sync {
    fn active(&self) -> bool;
    fn stop_unit(&self);
    fn start_unit(&self) -> anyhow::Result<()>;
}

impl Unit for RealNode {
    fn active(&self) -> bool {
        self.kubelet_running()
    }
    fn stop_unit(&self) {
        self.stop_kubelet();
    }
    fn start_unit(&self) -> anyhow::Result<()> {
        // A kubelet that ended by itself is still on the node's list.
        self.stop_kubelet();
        self.start_kubelet_again()
    }
}

fn write_state(dir: &Path, unit: &dyn Unit) {
    let state = if unit.active() { "active" } else { "inactive" };
    let _ = std::fs::write(dir.join("state"), state);
}

/// Answers the request files `systemctl` leaves in `dir` (`<id>.req` holding the verb) with
/// `<id>.done` (the exit code), keeping `dir/state` current, until `stop` is set.
fn serve(dir: &Path, unit: &dyn Unit, stop: &AtomicBool, name: &str) {
    write_state(dir, unit);
    while !stop.load(Ordering::Relaxed) {
        let mut requests: Vec<PathBuf> = std::fs::read_dir(dir)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "req"))
                    .collect()
            })
            .unwrap_or_default();
        requests.sort();
        for req in requests {
            let verb = std::fs::read_to_string(&req).unwrap_or_default();
            let verb = verb.trim();
            let rc = match act(unit, verb) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("{name}: systemctl {verb} kubelet: {e:#}");
                    1
                }
            };
            write_state(dir, unit);
            let _ = std::fs::remove_file(&req);
            let _ = std::fs::write(req.with_extension("done"), rc.to_string());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One verb, as systemd does it: stopping a stopped unit and starting a running one change
/// nothing.
fn act(unit: &dyn Unit, verb: &str) -> anyhow::Result<()> {
    match verb {
        "stop" => unit.stop_unit(),
        "start" if unit.active() => {}
        "start" => unit.start_unit()?,
        "restart" => {
            unit.stop_unit();
            unit.start_unit()?;
        }
        other => bail!("unknown verb {other:?}"),
    }
    Ok(())
}

fn write_exec(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::process::Command;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::*;

    /// A unit that only counts.
    #[derive(Default)]
    struct Fake {
        running: AtomicBool,
        starts: AtomicUsize,
    }

    impl Unit for Fake {
        fn active(&self) -> bool {
            self.running.load(Ordering::SeqCst)
        }
        fn stop_unit(&self) {
            self.running.store(false, Ordering::SeqCst);
        }
        fn start_unit(&self) -> anyhow::Result<()> {
            self.starts.fetch_add(1, Ordering::SeqCst);
            self.running.store(true, Ordering::SeqCst);
            Ok(())
        }
    }

    /// The shim as the tests run it, through `sh`: (exit code, stdout).
    fn systemctl(dir: &Path, args: &[&str]) -> (i32, String) {
        let out = Command::new("sh")
            .arg(dir.join("systemctl"))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        )
    }

    #[test]
    fn systemctl_starts_stops_and_reports_the_kubelet_through_the_rig() {
        let tmp = tempfile::tempdir().unwrap();
        let ctl = tmp.path().join("units");
        std::fs::create_dir_all(&ctl).unwrap();
        let shim = SYSTEMCTL.replace("@CTL@", &ctl.display().to_string());
        write_exec(&tmp.path().join("systemctl"), &shim).unwrap();
        let unit = Fake::default();
        unit.running.store(true, Ordering::SeqCst);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| serve(&ctl, &unit, &stop, "node"));
            // What KubeletCommand and getKubeletRunning send.
            let show = ["show", "kubelet", "--property", "ActiveState", "--value"];
            let dir = tmp.path();
            // serve writes the state first; a read before that says inactive.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while systemctl(dir, &show).1 != "active" {
                assert!(std::time::Instant::now() < deadline, "no state written");
                std::thread::sleep(Duration::from_millis(50));
            }
            assert_eq!(systemctl(dir, &["stop", "kubelet"]), (0, String::new()));
            assert!(!unit.active());
            assert_eq!(systemctl(dir, &show), (0, "inactive".into()));
            assert_eq!(systemctl(dir, &["is-active", "kubelet"]).0, 1);
            assert_eq!(systemctl(dir, &["start", "kubelet.service"]).0, 0);
            assert!(unit.active());
            assert_eq!(
                systemctl(dir, &["show", "kubelet", "--property", "ActiveState"]).1,
                "ActiveState=active"
            );
            // Starting a running unit is a no-op, as systemd's; restart stops and starts.
            assert_eq!(systemctl(dir, &["start", "kubelet"]).0, 0);
            assert_eq!(unit.starts.load(Ordering::SeqCst), 1);
            assert_eq!(systemctl(dir, &["restart", "kubelet"]).0, 0);
            assert_eq!(unit.starts.load(Ordering::SeqCst), 2);
            // Any other unit or verb is refused, not faked.
            assert_eq!(systemctl(dir, &["stop", "containerd"]).0, 5);
            assert_eq!(systemctl(dir, &["reload", "kubelet"]).0, 1);
            stop.store(true, Ordering::SeqCst);
        });
        assert!(
            std::fs::read_dir(&ctl)
                .unwrap()
                .flatten()
                .all(|e| e.file_name() == "state"),
            "every request answered and collected"
        );
    }

    #[test]
    fn sudo_answers_its_version_probe_and_runs_the_command() {
        let tmp = tempfile::tempdir().unwrap();
        let sudo = tmp.path().join("sudo");
        write_exec(&sudo, SUDO).unwrap();
        let out = Command::new("sh").arg(&sudo).arg("--version").output().unwrap();
        assert!(out.status.success());
        assert!(!String::from_utf8_lossy(&out.stderr).contains("command not found"));
        let out = Command::new("sh")
            .arg(&sudo)
            .args(["sh", "-c", "echo $0-ran", "it"])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "it-ran");
    }
}
