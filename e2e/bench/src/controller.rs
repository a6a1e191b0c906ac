//! Starting and stopping the two implementations as real processes.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use stowage_common::api::ratelimit::Limit;
use stowage_testkit::process::{free_port, spawn_tied, stop};

use crate::procstat;
use crate::window::Watched;

/// What runs against a workload: one of the two controllers, or the floor writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Impl {
    /// `stowage-bench floor` with this many objects in flight.
    Floor {
        concurrency: usize,
    },
    Upstream,
    Stowage,
}

impl Impl {
    pub fn name(self) -> String {
        match self {
            Impl::Floor { concurrency } => format!("floor@{concurrency}"),
            Impl::Upstream => "upstream".into(),
            Impl::Stowage => "stowage".into(),
        }
    }
}

/// The client-side rate limit a run has.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Limits {
    /// A token bucket: steady QPS, burst.
    Fixed { qps: f32, burst: u32 },
    /// No client-side limit (the floor writer).
    None,
    /// stowage's adaptive limiter: follows the apiserver's 429s up to this ceiling.
    Adaptive { max_qps: f32 },
}

impl std::fmt::Display for Limits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Limits::Fixed { qps, burst } => write!(f, "{qps}/{burst}"),
            Limits::None => f.write_str("none"),
            Limits::Adaptive { max_qps } => write!(f, "adaptive ≤{max_qps}"),
        }
    }
}

/// Binaries and the shared settings of every run.
pub struct Setup {
    /// This binary: the floor runs as `<bench_bin> floor ...`.
    pub bench_bin: PathBuf,
    pub kcm_bin: PathBuf,
    pub stowage_bin: PathBuf,
    /// Extra flags of every stowage-controller run (`--stowage-args`).
    pub stowage_args: Vec<String>,
    /// Extra flags of every kube-controller-manager run (`--upstream-args`).
    pub upstream_args: Vec<String>,
    pub kubeconfig: PathBuf,
    pub log_dir: PathBuf,
    pub image_dir: PathBuf,
}

pub struct Controller {
    child: Child,
    pub pid: u32,
    pub log: PathBuf,
    pub started: Instant,
    controllers: String,
    /// stowage-controller's /metrics (None for the other implementations).
    metrics: Option<SocketAddr>,
}

impl Controller {
    /// Starts `which` with only `controllers` enabled (for the floor: the workload it writes for)
    /// on the objects of run `run` (also their namespace); `limits` = None leaves the client rate
    /// limits at the implementation's own defaults.
    pub fn start(
        setup: &Setup,
        which: Impl,
        controllers: &str,
        run: &str,
        limits: Option<(f32, u32)>,
        label: &str,
    ) -> anyhow::Result<Self> {
        let log = setup.log_dir.join(format!("{label}.log"));
        let out = std::fs::File::create(&log).with_context(|| format!("create {}", log.display()))?;
        let kubeconfig = format!("--kubeconfig={}", setup.kubeconfig.display());
        let metrics: Option<SocketAddr> =
            matches!(which, Impl::Stowage).then(|| SocketAddr::from(([127, 0, 0, 1], free_port())));
        let mut cmd = match which {
            Impl::Floor { concurrency } => {
                let mut c = Command::new(&setup.bench_bin);
                c.args(["floor", kubeconfig.as_str()])
                    .arg(format!("--workload={controllers}"))
                    .arg(format!("--namespace={run}"))
                    .arg(format!("--run={run}"))
                    .arg(format!("--concurrency={concurrency}"));
                c
            }
            Impl::Upstream => {
                let mut c = Command::new(&setup.kcm_bin);
                c.args([
                    kubeconfig.as_str(),
                    "--leader-elect=false",
                    "--use-service-account-credentials=false",
                    // No serving endpoint: nothing scrapes it, and it would need authn/authz wiring.
                    "--secure-port=0",
                ])
                .arg(format!("--controllers={controllers}"))
                .args(&setup.upstream_args);
                c
            }
            Impl::Stowage => {
                let mut c = Command::new(&setup.stowage_bin);
                c.args([kubeconfig.as_str(), "--leader-elect=false"])
                    .arg(format!("--controllers={controllers}"))
                    .arg(format!("--image-dir={}", setup.image_dir.display()))
                    .args(metrics.map(|a| format!("--metrics-bind-address={a}")))
                    .args(&setup.stowage_args);
                // The operator's default log level, whatever the bench itself runs with.
                c.env_remove("RUST_LOG");
                c
            }
        };
        if let Some((qps, burst)) = limits {
            cmd.arg(format!("--kube-api-qps={qps}"))
                .arg(format!("--kube-api-burst={burst}"));
        }
        cmd.stdin(Stdio::null()).stdout(out.try_clone()?).stderr(out);
        let started = Instant::now();
        let child = spawn_tied(cmd).with_context(|| format!("start {}", which.name()))?;
        Ok(Self {
            pid: child.id(),
            child,
            log,
            started,
            controllers: controllers.to_string(),
            metrics,
        })
    }

    /// Where stowage's attaches spent their time, from its own metrics: the decision (pod event
    /// → create request sent), the create request, and how many full passes and attach steps
    /// decided them. None for other implementations or when nothing was attached.
    pub fn attach_profile(&self) -> Option<String> {
        let (_, body) = stowage_testkit::scrape::http_get(self.metrics?, "/metrics").ok()?;
        let m = stowage_testkit::scrape::parse(&body).ok()?;
        let mean_ms = |name: &str, labels: &[(&str, &str)]| {
            let n = m.sum_where(&format!("{name}_count"), labels);
            (n > 0.0).then(|| 1000.0 * m.sum_where(&format!("{name}_sum"), labels) / n)
        };
        let decided = m.sum("stowage_attachdetach_attach_decision_seconds_count");
        if decided == 0.0 {
            return None;
        }
        let fmt = |v: Option<f64>| v.map_or("–".into(), |v| format!("{v:.2} ms"));
        Some(format!(
            "{decided:.0} attaches: decision (pod event → create sent) mean {}; create request mean {}; \
             {:.0} full passes (decide mean {}), {:.0} attach steps",
            fmt(mean_ms("stowage_attachdetach_attach_decision_seconds", &[])),
            fmt(mean_ms(
                "stowage_attachdetach_operation_duration_seconds",
                &[("operation", "attach")]
            )),
            m.sum("stowage_attachdetach_reconcile_total"),
            fmt(mean_ms("stowage_attachdetach_reconcile_duration_seconds", &[])),
            m.sum("stowage_attachdetach_attach_steps_total"),
        ))
    }

    /// SIGTERM, a grace period, SIGKILL; the process is gone when this returns.
    pub fn stop(self) {
        drop(self);
    }
}

impl Watched for Controller {
    /// Why the process is no longer usable for this run, if it is not.
    fn failure(&mut self) -> Option<String> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return Some(format!("controller exited ({st}); see {}", self.log.display()));
        }
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        // stowage-controller logs this and idles when a selected controller is not built in yet.
        text.contains("controller not available in this build").then(|| {
            format!(
                "this stowage-controller build has no `{}` controller (its log says `controller not available in this build`)",
                self.controllers
            )
        })
    }

    fn usage(&self) -> String {
        format!(
            "controller CPU {:.1} s",
            procstat::cpu_seconds(self.pid).unwrap_or(0.0)
        )
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        tokio::task::block_in_place(|| stop(&mut self.child, Duration::from_secs(10)));
    }
}

impl From<Limit> for Limits {
    fn from(l: Limit) -> Self {
        match l {
            Limit::Unlimited => Limits::None,
            Limit::Static { qps, burst } => Limits::Fixed { qps, burst },
            // Its ceiling rate (the adaptive part may be a rate or a window of requests in
            // flight; the ceiling is what the flags set).
            adaptive @ Limit::Adaptive(_) => Limits::Adaptive {
                max_qps: adaptive.nominal_qps(),
            },
        }
    }
}

/// The client limit stowage-controller runs with when given no limit flags (the adaptive
/// limiter), read from its own flag definitions so it cannot drift.
pub fn stowage_controller_defaults() -> Limits {
    use clap::Parser;
    stowage_controller::Args::parse_from(["stowage-controller"])
        .limit()
        .into()
}

/// The same for stowage-agent (a fixed bucket when --kube-api-qps is not given).
pub fn stowage_agent_defaults() -> Limits {
    use clap::Parser;
    #[derive(Parser)]
    struct Defaults {
        #[command(flatten)]
        api: stowage_common::api::client::ApiArgs,
    }
    let d = Defaults::parse_from(["stowage-agent"]);
    d.api
        .limit_or(Limit::Static {
            qps: stowage_common::api::client::AGENT_QPS,
            burst: d.api.kube_api_burst,
        })
        .into()
}

pub fn default_bin(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(rel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_read_from_the_binaries_flags() {
        // Without --kube-api-qps the controller adapts up to --kube-api-max-qps (2000); the agent
        // keeps a fixed bucket.
        assert_eq!(
            stowage_controller_defaults(),
            Limits::Adaptive { max_qps: 2000.0 }
        );
        assert_eq!(stowage_controller_defaults().to_string(), "adaptive ≤2000");
        assert!(matches!(stowage_agent_defaults(), Limits::Fixed { .. }));
        assert_eq!(Limits::from(Limit::Unlimited).to_string(), "none");
        assert_eq!(
            Limits::from(Limit::Static {
                qps: 100_000.0,
                burst: 100_000
            })
            .to_string(),
            "100000/100000"
        );
    }
}
