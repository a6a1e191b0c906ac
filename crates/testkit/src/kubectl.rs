//! kubectl of the test control plane (`make controlplane` builds it beside kube-apiserver), run
//! blocking, for tests that act as a user would.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::controlplane::bin_dir;

/// The kubectl binary of the test control plane.
pub fn bin() -> PathBuf {
    bin_dir().join("kubectl")
}

/// `kubectl --kubeconfig=<kubeconfig> <args>`: stdout when it exits 0, else an error naming
/// the command and its stderr.
pub fn run(kubeconfig: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(bin())
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args(args)
        .output()
        .map_err(|e| format!("cannot run kubectl: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "kubectl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}
