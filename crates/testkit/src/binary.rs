//! Running a stowage binary as a real process in a test, with its metrics port.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::process::{free_port, spawn_tied};
use crate::scrape::{Metrics, http_get, parse};

/// The binary `name` of package `package`, next to `bin` (cargo builds every package's binaries
/// for a workspace test run; a lone `cargo test -p <one package>` builds it here).
pub fn sibling(bin: &Path, package: &str, name: &str) -> std::path::PathBuf {
    let path = bin.with_file_name(name);
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let ok = Command::new(cargo)
            .args(["build", "-p", package, "--bin", name])
            .status();
        assert!(ok.map(|s| s.success()).unwrap_or(false), "cannot build {name}");
    }
    path
}

pub struct Running {
    pub child: Child,
    pub metrics_addr: SocketAddr,
    pub log: std::path::PathBuf,
}

impl Running {
    /// Starts `bin` with `args` plus `--metrics-bind-address` on a free loopback port; output goes
    /// to `<log_dir>/<label>.log`.
    pub fn start(bin: &Path, args: &[String], log_dir: &Path, label: &str) -> std::io::Result<Self> {
        let metrics_addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let log = log_dir.join(format!("{label}.log"));
        let out = std::fs::File::create(&log)?;
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .arg(format!("--metrics-bind-address={metrics_addr}"))
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdout(out.try_clone()?)
            .stderr(out)
            .stdin(Stdio::null());
        Ok(Self {
            child: spawn_tied(cmd)?,
            metrics_addr,
            log,
        })
    }

    /// Scrapes and strictly parses `/metrics`.
    pub fn metrics(&self) -> Result<Metrics, String> {
        let (code, body) = http_get(self.metrics_addr, "/metrics").map_err(|e| e.to_string())?;
        if code != 200 {
            return Err(format!("/metrics answered {code}"));
        }
        parse(&body)
    }

    pub fn get(&self, path: &str) -> Result<(u16, String), String> {
        http_get(self.metrics_addr, path).map_err(|e| e.to_string())
    }

    pub fn sigterm(&self) {
        crate::process::signal(&self.child, libc::SIGTERM);
    }

    pub fn sigkill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGKILLs the process and everything it started (see [`crate::process::kill_tree`]).
    pub fn sigkill_tree(&mut self) {
        crate::process::kill_tree(self.child.id());
        let _ = self.child.wait();
    }

    /// Waits for exit (bounded), returning the exit code.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let deadline = std::time::Instant::now() + limit;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        crate::process::stop(&mut self.child, Duration::from_secs(5));
    }
}
