//! What the kubelet-less cluster tests share: the agent binary beside the controller's, and
//! kubectl against the test control plane.

use std::path::{Path, PathBuf};
use std::time::Duration;

use stowage_testkit::eventually;

pub const LIMIT: Duration = Duration::from_secs(120);

/// The agent binary, next to this package's binary.
pub fn agent_bin() -> PathBuf {
    stowage_testkit::binary::sibling(
        Path::new(env!("CARGO_BIN_EXE_stowage-controller")),
        "stowage-agent",
        "stowage-agent",
    )
}

pub struct Kubectl(pub PathBuf);

impl Kubectl {
    pub fn run(&self, args: &[&str]) -> Result<String, String> {
        stowage_testkit::kubectl::run(&self.0, args)
    }

    pub fn must(&self, args: &[&str]) -> String {
        self.run(args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Waits until `kubectl args` prints exactly `want` (trimmed).
    pub async fn until(&self, args: &[&str], want: &str) {
        eventually(LIMIT, || async {
            let got = self.run(args)?;
            match got.trim() == want {
                true => Ok(()),
                false => Err(format!(
                    "kubectl {} printed {got:?}, want {want:?}",
                    args.join(" ")
                )),
            }
        })
        .await
    }
}
