//! What the chart tests share: where the chart is, running helm (built from its Go module by
//! `e2e/scripts/helm.sh`) and kubectl, and `kubectl auth can-i` as a service account.

use std::path::{Path, PathBuf};

use tokio::process::Command;

/// The root of this checkout.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn chart_dir() -> PathBuf {
    repo_root().join("charts/stowage")
}

/// kubectl of the test control plane (`make controlplane` builds it beside kube-apiserver).
pub fn kubectl_bin() -> PathBuf {
    std::env::var_os("STOWAGE_CONTROLPLANE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("e2e/bin"))
        .join("kubectl")
}

/// Runs a command; stdout when it exits 0, else an error naming the command and its stderr.
async fn output(mut cmd: Command, what: &str) -> Result<String, String> {
    let out = cmd
        .output()
        .await
        .map_err(|e| format!("cannot run {what}: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!(
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            stdout
        ))
    }
}

/// helm with its own config, cache and data dirs (a test must not read or write the user's
/// repositories), talking to the cluster of `kubeconfig` when one is given.
pub struct Helm {
    home: tempfile::TempDir,
    kubeconfig: Option<PathBuf>,
}

impl Helm {
    pub fn new(kubeconfig: Option<&Path>) -> Self {
        Self {
            home: tempfile::Builder::new()
                .prefix("stowage-helm-")
                .tempdir()
                .expect("temporary helm home"),
            kubeconfig: kubeconfig.map(Path::to_path_buf),
        }
    }

    /// `helm <args>`: its stdout, or its stderr as the error.
    pub async fn run(&self, args: &[&str]) -> Result<String, String> {
        let mut cmd = Command::new(repo_root().join("e2e/scripts/helm.sh"));
        let h = self.home.path();
        cmd.args(args)
            .env("HELM_CONFIG_HOME", h.join("config"))
            .env("HELM_CACHE_HOME", h.join("cache"))
            .env("HELM_DATA_HOME", h.join("data"));
        if let Some(kc) = &self.kubeconfig {
            cmd.env("KUBECONFIG", kc);
        }
        output(cmd, &format!("helm {}", args.join(" "))).await
    }

    /// A server-side dry run of `helm install <release> <chart> -n <namespace>` with `extra`
    /// arguments: the apiserver validates and admits every object (and the chart's lookups read
    /// the cluster), nothing is stored. Its output (the NOTES), or why it was refused.
    pub async fn try_install(
        &self,
        release: &str,
        chart: &str,
        namespace: &str,
        extra: &[&str],
    ) -> Result<String, String> {
        let mut args = vec![
            "install",
            release,
            chart,
            "--namespace",
            namespace,
            "--dry-run=server",
        ];
        args.extend_from_slice(extra);
        self.run(&args).await
    }

    /// Writes a values file into helm's temporary home and returns its path.
    pub fn values(&self, name: &str, yaml: &str) -> PathBuf {
        let p = self.home.path().join(name);
        std::fs::write(&p, yaml).expect("write values file");
        p
    }
}

/// `kubectl auth can-i <question> --as=system:serviceaccount:<ns>:<sa>`, where `question` is
/// kubectl's own words, e.g. `patch nodes --subresource=status` or `get leases/name -n ns`.
pub async fn can_i(kubeconfig: &Path, (ns, sa): (&str, &str), question: &str) -> bool {
    let mut cmd = Command::new(kubectl_bin());
    cmd.env("KUBECONFIG", kubeconfig)
        .args(["auth", "can-i"])
        .args(question.split_whitespace())
        .arg(format!("--as=system:serviceaccount:{ns}:{sa}"));
    let out = cmd.output().await.expect("run kubectl auth can-i");
    // "yes" (exit 0) or "no" (exit 1); anything else is a broken question, not a "no".
    let answer = String::from_utf8_lossy(&out.stdout).trim().to_string();
    match answer.as_str() {
        "yes" => true,
        "no" => false,
        _ => panic!(
            "kubectl auth can-i {question}: unexpected answer {answer:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// The documents of a rendered manifest, without empty ones.
pub fn documents(manifest: &str) -> Vec<&str> {
    manifest
        .split("\n---")
        .map(str::trim)
        .filter(|d| d.lines().any(|l| l.starts_with("kind: ")))
        .collect()
}

/// The rendered document of `kind` named `name`, if any. The chart's templates put `kind` at
/// the top level and `metadata.name` first among the two-space-indented names.
pub fn document<'a>(manifest: &'a str, kind: &str, name: &str) -> Option<&'a str> {
    documents(manifest)
        .into_iter()
        .find(|d| kind_and_name(d) == (kind, name))
}

fn kind_and_name(doc: &str) -> (&str, &str) {
    let kind = doc.lines().find_map(|l| l.strip_prefix("kind: ")).unwrap_or("?");
    let name = doc
        .lines()
        .find_map(|l| l.strip_prefix("  name: "))
        .unwrap_or("?");
    (kind.trim(), name.trim())
}

/// Every `kind/name` of a rendered manifest.
pub fn kinds_and_names(manifest: &str) -> Vec<String> {
    documents(manifest)
        .into_iter()
        .map(|d| {
            let (kind, name) = kind_and_name(d);
            format!("{kind}/{name}")
        })
        .collect()
}
