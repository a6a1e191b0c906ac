//! The system under test: the real control plane, the image store, 2–3 stowage-controller replicas
//! with leader election and the kubelet-less agents, all real processes. A supervisor restarts any
//! that died, after a short back-off, as a Deployment or DaemonSet would.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::Api;
use stowage_testkit::binary::Running;

use crate::report::Record;

pub const LEASE: &str = "stowage-controller";
pub const LEASE_NS: &str = "default";
/// The controller's identity: a service account, so API Priority and Fairness classifies its
/// requests (the admin's group system:masters is exempt).
pub const CONTROLLER_SA: (&str, &str) = ("kube-system", "stowage-controller");

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Controller,
    Agent,
}

impl Role {
    pub fn label(self) -> &'static str {
        match self {
            Role::Controller => "controller",
            Role::Agent => "agent",
        }
    }
}

struct Slot {
    name: String,
    role: Role,
    bin: PathBuf,
    args: Vec<String>,
    running: Option<Running>,
    starts: u32,
    /// Not restarted while held (a node that is "shut down").
    held: bool,
    restart_at: Option<Instant>,
    /// The last exit was a kill of ours (else it is reported).
    killed: bool,
}

pub struct Procs {
    slots: Mutex<Vec<Slot>>,
    log_dir: PathBuf,
    record: Arc<Record>,
}

impl Procs {
    pub fn new(log_dir: PathBuf, record: Arc<Record>) -> Arc<Self> {
        Arc::new(Self {
            slots: Mutex::new(Vec::new()),
            log_dir,
            record,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn add(&self, name: &str, role: Role, bin: PathBuf, args: Vec<String>) -> anyhow::Result<()> {
        let mut slot = Slot {
            name: name.into(),
            role,
            bin,
            args,
            running: None,
            starts: 0,
            held: false,
            restart_at: None,
            killed: false,
        };
        self.start(&mut slot)?;
        self.lock().push(slot);
        Ok(())
    }

    fn start(&self, slot: &mut Slot) -> anyhow::Result<()> {
        slot.starts += 1;
        // One log file per start, so a restarted process never overwrites its predecessor's.
        let label = format!("{}.{}", slot.name, slot.starts);
        let r = Running::start(&slot.bin, &slot.args, &self.log_dir, &label)
            .with_context(|| format!("start {}", slot.name))?;
        self.record.log(
            "process-start",
            serde_json::json!({"name": slot.name, "pid": r.child.id(), "log": format!("{label}.log"), "metrics": r.metrics_addr.to_string()}),
        );
        slot.running = Some(r);
        slot.restart_at = None;
        slot.killed = false;
        Ok(())
    }

    /// SIGKILLs `name`; the supervisor starts it again after `restart_after` (unless held).
    pub fn kill(&self, name: &str, restart_after: Duration) -> bool {
        let mut slots = self.lock();
        let Some(slot) = slots.iter_mut().find(|s| s.name == name) else {
            return false;
        };
        let Some(mut r) = slot.running.take() else {
            return false;
        };
        let pid = r.child.id();
        // The whole tree, as a container runtime kills a container: a mount the process started
        // must not complete after it died.
        r.sigkill_tree();
        slot.killed = true;
        slot.restart_at = Some(Instant::now() + restart_after);
        self.record.log(
            "process-killed",
            serde_json::json!({"name": name, "pid": pid, "signal": "SIGKILL"}),
        );
        drop(r);
        true
    }

    pub fn hold(&self, name: &str, held: bool) {
        if let Some(s) = self.lock().iter_mut().find(|s| s.name == name) {
            s.held = held;
            if !held && s.restart_at.is_none() {
                s.restart_at = Some(Instant::now());
            }
        }
    }

    pub fn is_up(&self, name: &str) -> bool {
        self.lock().iter().any(|s| s.name == name && s.running.is_some())
    }

    /// One supervisor pass: reap what exited, start what is due.
    pub fn supervise(&self) {
        let mut slots = self.lock();
        for slot in slots.iter_mut() {
            if let Some(r) = slot.running.as_mut()
                && let Ok(Some(status)) = r.child.try_wait()
            {
                // Nothing stops a controller or an agent but our kills: an exit is a crash.
                self.record.violation(
                    &format!("exit:{}:{}", slot.name, slot.starts),
                    "process exited on its own",
                    format!(
                        "{} {} exited with {status} (log {}.{}.log)",
                        slot.role.label(),
                        slot.name,
                        slot.name,
                        slot.starts
                    ),
                );
                slot.running = None;
                slot.restart_at = Some(Instant::now() + Duration::from_secs(2));
            }
            if slot.running.is_none() && !slot.held && slot.restart_at.is_none_or(|t| Instant::now() >= t) {
                let role = slot.role;
                match self.start(slot) {
                    Ok(()) => self.record.restart(role.label()),
                    Err(e) => {
                        self.record.note("restart-failed", &format!("{e:#}"));
                        slot.restart_at = Some(Instant::now() + Duration::from_secs(2));
                    }
                }
            }
        }
    }

    pub fn all_up(&self) -> bool {
        self.lock().iter().all(|s| s.running.is_some())
    }

    pub fn names(&self, role: Role) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|s| s.role == role)
            .map(|s| s.name.clone())
            .collect()
    }

    /// SIGTERM to all, then wait (as a rollout would).
    pub fn stop_all(&self) {
        let mut slots = self.lock();
        for s in slots.iter_mut() {
            s.held = true;
            s.running.take();
        }
    }
}

/// The holder of the controller's Lease, if any.
pub async fn leader(client: &Client) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), LEASE_NS);
    leases
        .get(LEASE)
        .await
        .ok()
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
        .filter(|h| !h.is_empty())
}

/// Where the stowage binaries are: `$STOWAGE_SOAK_BIN_DIR`, else next to this executable (a
/// test's executable is one level down, in `deps/`). Missing ones are built.
pub fn binaries() -> (PathBuf, PathBuf) {
    let dir = std::env::var_os("STOWAGE_SOAK_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let exe = std::env::current_exe().expect("current executable");
            let mut d = exe.parent().map(Path::to_path_buf).unwrap_or_default();
            if d.ends_with("deps") {
                d.pop();
            }
            d
        });
    let anchor = dir.join("stowage-soak");
    (
        stowage_testkit::binary::sibling(&anchor, "stowage-controller", "stowage-controller"),
        stowage_testkit::binary::sibling(&anchor, "stowage-agent", "stowage-agent"),
    )
}

/// Node name → its agent's root dir.
pub type Roots = BTreeMap<String, PathBuf>;
