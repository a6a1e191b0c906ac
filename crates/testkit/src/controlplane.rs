//! The real control plane: upstream etcd and kube-apiserver (built by `make controlplane` from the
//! Kubernetes Go modules) on loopback ports, with a throw-away data dir, a CA and serving cert made
//! on the fly, a service-account signing key, RBAC, the default admission plugins, and an admin
//! token written into a kubeconfig. For a real cluster of more than one node the apiserver also
//! serves the nodes' network namespaces (`start_for_nodes`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use base64::Engine;
use kube::Client;

use crate::process::{free_port, spawn_tied, stop};

/// Where the upstream binaries are: `$STOWAGE_CONTROLPLANE_BIN`, else `e2e/bin` of this checkout.
pub fn bin_dir() -> PathBuf {
    std::env::var_os("STOWAGE_CONTROLPLANE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../e2e/bin"))
}

pub(crate) fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let p = bin_dir().join(name);
    if !p.is_file() {
        bail!("{} not found: run `make controlplane` first", p.display());
    }
    Ok(p)
}

/// The minor of a kube-apiserver binary (`--version` prints `Kubernetes v1.37.2`); 0 if unknown.
fn apiserver_minor(bin: &Path) -> u32 {
    let out = Command::new(bin).arg("--version").output();
    let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    text.ok()
        .and_then(|t| t.split('.').nth(1).and_then(|m| m.trim().parse().ok()))
        .unwrap_or(0)
}

/// The admin bearer token of every test control plane (loopback only, thrown away with it).
const ADMIN_TOKEN: &str = "stowage-admin-token";

/// Admin users a run can tell apart in the audit log (`replica-0` …): the takeover bench runs each
/// replica of a controller as one of them, so the apiserver's own record says which replica wrote
/// what, and when. Only their writes are audited, so other runs' audit logs stay empty.
pub const REPLICA_USERS: usize = 4;

pub fn replica_user(i: usize) -> String {
    format!("replica-{i}")
}

fn replica_token(i: usize) -> String {
    format!("stowage-replica-{i}-token")
}

/// The apiserver's Service range; its first address is the `kubernetes` Service's
/// (`crate::realnode::SERVICE_IP`, checked by a test).
pub const SERVICE_RANGE: &str = "10.0.0.0/24";

pub struct ControlPlane {
    dir: PathBuf,
    /// Kept so the directory lives as long as we do; `None` for a caller-chosen directory.
    _tmp: Option<tempfile::TempDir>,
    port: u16,
    etcd: Mutex<Option<Child>>,
    apiserver: Mutex<Option<Child>>,
    apiserver_cmd: Vec<String>,
    etcd_cmd: Vec<String>,
    /// The address nodes and pods reach the apiserver at.
    node_host: &'static str,
}

impl ControlPlane {
    /// Starts etcd and kube-apiserver in a fresh temporary directory and waits for `/readyz`.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_for_nodes(1)
    }

    /// `start`, for a real cluster of `nodes` nodes (`realnode::RealNode::start_cluster`).
    pub fn start_for_nodes(nodes: usize) -> anyhow::Result<Self> {
        let tmp = tempfile::Builder::new().prefix("stowage-cp-").tempdir()?;
        let dir = tmp.path().to_path_buf();
        Self::start_in_for_nodes(dir, Some(tmp), nodes)
    }

    /// Starts in `dir` (created if missing; its contents are replaced).
    pub fn start_in(dir: PathBuf, tmp: Option<tempfile::TempDir>) -> anyhow::Result<Self> {
        Self::start_in_for_nodes(dir, tmp, 1)
    }

    /// `start_in`, for a real cluster of `nodes` nodes. With more than one, the apiserver binds
    /// every address, not loopback only: the other nodes are in network namespaces of their own
    /// and reach it at `realnode::HOST_IP` (then in the serving certificate).
    pub fn start_in_for_nodes(
        dir: PathBuf,
        tmp: Option<tempfile::TempDir>,
        nodes: usize,
    ) -> anyhow::Result<Self> {
        let node_host = match nodes {
            0 | 1 => "127.0.0.1",
            _ => crate::realnode::HOST_IP,
        };
        std::fs::create_dir_all(&dir)?;
        let etcd_bin = binary("etcd")?;
        let apiserver_bin = binary("kube-apiserver")?;
        let (client_port, peer_port, port) = (free_port(), free_port(), free_port());

        let etcd_dir = dir.join("etcd");
        let _ = std::fs::remove_dir_all(&etcd_dir);
        let etcd_cmd = vec![
            etcd_bin.display().to_string(),
            "--name=default".into(),
            format!("--data-dir={}", etcd_dir.display()),
            format!("--listen-client-urls=http://127.0.0.1:{client_port}"),
            format!("--advertise-client-urls=http://127.0.0.1:{client_port}"),
            format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"),
            format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}"),
            format!("--initial-cluster=default=http://127.0.0.1:{peer_port}"),
            // Test data is thrown away; fsync would only make every write wait on the disk (a
            // killed etcd still finds its writes in the page cache when it starts again).
            "--unsafe-no-fsync".into(),
            "--log-level=warn".into(),
        ];
        let etcd = spawn_etcd(&etcd_cmd, &dir)?;

        write_pki(&dir, node_host)?;
        let mut tokens = format!("{ADMIN_TOKEN},admin,admin-uid,system:masters\n");
        for i in 0..crate::realnode::MAX_NODES {
            let uid = match i {
                0 => "node-uid".to_string(),
                _ => format!("node{}-uid", i + 1),
            };
            tokens.push_str(&format!(
                "{},system:node:{},{uid},system:nodes\n",
                crate::realnode::node_token(i),
                crate::realnode::node_name(i)
            ));
        }
        for i in 0..REPLICA_USERS {
            tokens.push_str(&format!(
                "{},{},{}-uid,system:masters\n",
                replica_token(i),
                replica_user(i),
                replica_user(i)
            ));
        }
        std::fs::write(dir.join("tokens.csv"), tokens)?;
        std::fs::write(dir.join("audit-policy.yaml"), audit_policy())?;
        let d = |f: &str| dir.join(f).display().to_string();
        let mut apiserver_cmd = vec![
            apiserver_bin.display().to_string(),
            format!("--etcd-servers=http://127.0.0.1:{client_port}"),
            match node_host {
                "127.0.0.1" => "--bind-address=127.0.0.1".into(),
                _ => "--bind-address=0.0.0.0".into(),
            },
            "--advertise-address=127.0.0.1".into(),
            format!("--secure-port={port}"),
            format!("--cert-dir={}", d("certs")),
            format!("--tls-cert-file={}", d("serving.crt")),
            format!("--tls-private-key-file={}", d("serving.key")),
            format!("--client-ca-file={}", d("ca.crt")),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", d("sa.pub")),
            format!("--service-account-signing-key-file={}", d("sa.key")),
            format!("--service-cluster-ip-range={SERVICE_RANGE}"),
            "--authorization-mode=Node,RBAC".into(),
            format!("--token-auth-file={}", d("tokens.csv")),
            format!("--audit-policy-file={}", d("audit-policy.yaml")),
            format!("--audit-log-path={}", d("audit.log")),
            "--audit-log-format=json".into(),
            "--allow-privileged=true".into(),
            // A real node is reached by its address: its name resolves nowhere here.
            "--kubelet-preferred-address-types=InternalIP,Hostname".into(),
            "--profiling=false".into(),
            "--v=0".into(),
        ];
        // From v1.37 the lease endpoint reconciler refuses a loopback advertise address. Nothing
        // here reads the endpoints of the `kubernetes` Service it would keep: the real nodes'
        // pods reach the apiserver at the address the chart is given (`apiServer.host`).
        if apiserver_minor(&apiserver_bin) >= 37 {
            apiserver_cmd.push("--endpoint-reconciler-type=none".into());
        }
        write_kubeconfig(&dir, port)?;
        let cp = Self {
            dir,
            _tmp: tmp,
            port,
            etcd: Mutex::new(Some(etcd)),
            apiserver: Mutex::new(None),
            apiserver_cmd,
            etcd_cmd,
            node_host,
        };
        if node_host != "127.0.0.1" {
            cp.firewall("-I")?;
        }
        cp.start_apiserver()?;
        Ok(cp)
    }

    /// Bound to every address for the nodes, the apiserver answers only on loopback, the nodes'
    /// veths (`stowrn*`) and node 1's pod bridge (`stowbr0`), not on this machine's other
    /// interfaces: its tokens are fixed. `op` is `-I` (insert, the accepts above the drop) or `-D`.
    fn firewall(&self, op: &str) -> anyhow::Result<()> {
        let port = self.port.to_string();
        let rules: [&[&str]; 4] = [
            &["-j", "DROP"],
            &["-i", "stowbr+", "-j", "ACCEPT"],
            &["-i", "stowrn+", "-j", "ACCEPT"],
            &["-i", "lo", "-j", "ACCEPT"],
        ];
        for rule in rules {
            let out = Command::new("iptables")
                .args([op, "INPUT", "-p", "tcp", "--dport", &port])
                .args(["-m", "comment", "--comment", "stowage test apiserver"])
                .args(rule)
                .output()
                .context("run iptables")?;
            if op == "-I" && !out.status.success() {
                bail!("iptables: {}", String::from_utf8_lossy(&out.stderr));
            }
        }
        Ok(())
    }

    fn start_apiserver(&self) -> anyhow::Result<()> {
        // Appended to, so a restarted apiserver's log follows its predecessor's.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("kube-apiserver.log"))
            .context("open kube-apiserver.log")?;
        let mut cmd = Command::new(&self.apiserver_cmd[0]);
        cmd.args(&self.apiserver_cmd[1..])
            .stdout(Stdio::null())
            .stderr(log);
        let child = spawn_tied(cmd).context("start kube-apiserver")?;
        *self.apiserver.lock().unwrap_or_else(|p| p.into_inner()) = Some(child);
        self.wait_ready(Duration::from_secs(180))
    }

    /// Stops kube-apiserver and starts it again on the same port and etcd (for restart tests).
    pub fn restart_apiserver(&self, down_for: Duration) -> anyhow::Result<()> {
        if let Some(mut c) = self.apiserver.lock().unwrap_or_else(|p| p.into_inner()).take() {
            stop(&mut c, Duration::from_secs(10));
        }
        std::thread::sleep(down_for);
        self.start_apiserver()
    }

    /// SIGKILLs etcd and starts it again on the same ports and the same data dir after `down_for`
    /// (the apiserver stays up and reconnects), then waits for the apiserver's `/readyz`, which
    /// includes etcd. What etcd had accepted is still there.
    pub fn restart_etcd(&self, down_for: Duration) -> anyhow::Result<()> {
        {
            let mut slot = self.etcd.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(mut c) = slot.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
            std::thread::sleep(down_for);
            *slot = Some(spawn_etcd(&self.etcd_cmd, &self.dir)?);
        }
        self.wait_ready(Duration::from_secs(180))
    }

    /// SIGKILLs kube-apiserver (no graceful shutdown) and starts it again after `down_for`.
    pub fn kill_and_restart_apiserver(&self, down_for: Duration) -> anyhow::Result<()> {
        if let Some(mut c) = self.apiserver.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        std::thread::sleep(down_for);
        self.start_apiserver()
    }

    /// Polls `/readyz` with a plain TLS client until it answers `ok`.
    fn wait_ready(&self, limit: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        let kubeconfig = self.kubeconfig();
        // Callers may be inside a runtime already (async tests), so poll on a runtime of our own
        // in a scoped thread.
        std::thread::scope(|s| s.spawn(|| self.poll_ready(&kubeconfig, deadline, limit)).join())
            .map_err(|_| anyhow::anyhow!("readiness poller panicked"))?
    }

    fn poll_ready(&self, kubeconfig: &Path, deadline: Instant, limit: Duration) -> anyhow::Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let client = client_for(kubeconfig).await?;
            loop {
                let req = http::Request::get("/readyz").body(Vec::new())?;
                match client.request_text(req).await {
                    Ok(body) if body.trim() == "ok" => return Ok(()),
                    _ if Instant::now() > deadline => {
                        bail!(
                            "kube-apiserver not ready within {limit:?}; last log lines:\n{}",
                            self.log_tail()
                        )
                    }
                    _ => {}
                }
                if let Some(c) = self.apiserver.lock().unwrap_or_else(|p| p.into_inner()).as_mut()
                    && let Ok(Some(status)) = c.try_wait()
                {
                    bail!(
                        "kube-apiserver exited ({status}); last log lines:\n{}",
                        self.log_tail()
                    );
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("kube-apiserver.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// The real kube-controller-manager (from `bin_dir()`) against this control plane, with only
    /// `controllers` on (its `--controllers` value), no leader election and no serving port, as
    /// the side-by-side tests run it as the oracle; `extra` flags follow. Killed when the guard
    /// drops, so a failing test leaves no controller writing into the next one's objects.
    pub fn start_kcm(&self, controllers: &str, extra: &[&str]) -> Kcm {
        self.start_kcm_as("kube-controller-manager", controllers, extra)
    }

    /// [`start_kcm`](Self::start_kcm) with `argv0` as the process's name. Its clients' user
    /// agents start with that name, and so does the field manager the apiserver records for its
    /// writes: k3s, which runs kube-controller-manager inside its own process, writes as `k3s`.
    pub fn start_kcm_as(&self, argv0: &str, controllers: &str, extra: &[&str]) -> Kcm {
        use std::os::unix::process::CommandExt;
        let child = std::process::Command::new(bin_dir().join("kube-controller-manager"))
            .arg0(argv0)
            .arg(format!("--kubeconfig={}", self.kubeconfig().display()))
            .args([
                "--leader-elect=false",
                "--use-service-account-credentials=false",
                "--secure-port=0",
            ])
            .arg(format!("--controllers={controllers}"))
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("kube-controller-manager does not start: {e}"));
        Kcm(child)
    }

    /// The admin kubeconfig (token auth, serving CA pinned).
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("kubeconfig")
    }

    /// A kubeconfig for admin user `replica_user(i)` (group `system:masters`), whose writes the
    /// audit log records.
    pub fn replica_kubeconfig(&self, i: usize) -> anyhow::Result<PathBuf> {
        anyhow::ensure!(
            i < REPLICA_USERS,
            "replica {i}: only {REPLICA_USERS} replica users"
        );
        let admin = std::fs::read_to_string(self.kubeconfig())?;
        let path = self.dir.join(format!("kubeconfig-{}", replica_user(i)));
        std::fs::write(&path, admin.replace(ADMIN_TOKEN, &replica_token(i)))?;
        Ok(path)
    }

    /// The apiserver's audit log: one JSON event per line, for the replica users' writes only.
    pub fn audit_log(&self) -> PathBuf {
        self.dir.join("audit.log")
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// The address the nodes of a real cluster and their pods reach the apiserver at (the
    /// chart's `apiServer.host`): loopback for one node, `realnode::HOST_IP` for more.
    pub fn node_host(&self) -> &str {
        self.node_host
    }

    pub fn node_url(&self) -> String {
        format!("https://{}:{}", self.node_host, self.port)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A kubeconfig for service account `namespace/name`, made cluster-admin by RBAC. Unlike the
    /// admin (system:masters, which API Priority and Fairness exempts), its requests are
    /// classified by FlowSchemas, as a controller's in a real cluster are.
    pub async fn service_account_kubeconfig(&self, namespace: &str, name: &str) -> anyhow::Result<PathBuf> {
        use k8s_openapi::api::authentication::v1::TokenRequest;
        use k8s_openapi::api::core::v1::ServiceAccount;
        use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
        use kube::api::{Api, PostParams};
        let client = self.client().await;
        let pp = PostParams::default();
        let sa: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
        sa.create(
            &pp,
            &serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?,
        )
        .await?;
        let binding: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("{namespace}-{name}-admin")},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        }))?;
        Api::<ClusterRoleBinding>::all(client)
            .create(&pp, &binding)
            .await?;
        let request: TokenRequest = serde_json::from_value(
            serde_json::json!({"spec": {"expirationSeconds": 86400, "audiences": []}}),
        )?;
        let granted: TokenRequest = sa.create_subresource("token", name, &pp, &request).await?;
        let token = granted
            .status
            .and_then(|s| s.token)
            .context("token request answered without a token")?;
        let admin = std::fs::read_to_string(self.kubeconfig())?;
        let path = self.dir.join(format!("kubeconfig-{namespace}-{name}"));
        std::fs::write(&path, admin.replace(ADMIN_TOKEN, &token))?;
        Ok(path)
    }

    /// A client for the admin kubeconfig, without client-side rate limits.
    pub async fn client(&self) -> Client {
        client_for(&self.kubeconfig())
            .await
            .expect("client for the test control plane")
    }

    /// Stops both processes; the data directory goes with the value.
    pub fn stop(&self) {
        for slot in [&self.apiserver, &self.etcd] {
            if let Some(mut c) = slot.lock().unwrap_or_else(|p| p.into_inner()).take() {
                stop(&mut c, Duration::from_secs(10));
            }
        }
        if self.node_host != "127.0.0.1" {
            let _ = self.firewall("-D");
        }
    }
}

/// A kube-controller-manager process started by [`ControlPlane::start_kcm`]; killed (by its own
/// pid) and reaped when dropped.
pub struct Kcm(std::process::Child);

impl Kcm {
    /// Whether it still runs (it exits on a bad flag or a lost apiserver).
    pub fn running(&mut self) -> bool {
        self.0.try_wait().is_ok_and(|status| status.is_none())
    }
}

impl Drop for Kcm {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn client_for(kubeconfig: &Path) -> anyhow::Result<Client> {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    stowage_common::api::client::build(config, stowage_common::api::ratelimit::Limit::Unlimited)
}

/// Starts etcd from its saved command line; its log is appended to, so a restart keeps the earlier
/// lines.
fn spawn_etcd(cmd_line: &[String], dir: &Path) -> anyhow::Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("etcd.log"))
        .context("open etcd.log")?;
    let mut cmd = Command::new(&cmd_line[0]);
    cmd.args(&cmd_line[1..]).stdout(Stdio::null()).stderr(log);
    spawn_tied(cmd).context("start etcd")
}

pub(crate) fn log_file(dir: &Path, name: &str) -> anyhow::Result<std::fs::File> {
    std::fs::File::create(dir.join(name)).with_context(|| format!("create {name}"))
}

/// A CA, a serving certificate for 127.0.0.1/localhost (and `node_host`, and the `kubernetes`
/// Service's IP and names) signed by it, and a service-account key.
fn write_pki(dir: &Path, node_host: &str) -> anyhow::Result<()> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "stowage-test-ca");
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);

    let key = KeyPair::generate()?;
    // In-cluster clients dial the `kubernetes` Service by its cluster IP or its names.
    let names = [
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ];
    let mut params = CertificateParams::new(names.map(String::from).to_vec())?;
    params
        .subject_alt_names
        .push(SanType::IpAddress(std::net::IpAddr::from([127, 0, 0, 1])));
    params
        .subject_alt_names
        .push(SanType::IpAddress(crate::realnode::SERVICE_IP.parse()?));
    if node_host != "127.0.0.1" {
        params
            .subject_alt_names
            .push(SanType::IpAddress(node_host.parse()?));
    }
    params
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    let cert = params.signed_by(&key, &issuer)?;

    std::fs::write(dir.join("ca.crt"), ca_cert.pem())?;
    std::fs::write(dir.join("serving.crt"), cert.pem())?;
    std::fs::write(dir.join("serving.key"), key.serialize_pem())?;
    let sa = KeyPair::generate()?;
    std::fs::write(dir.join("sa.key"), sa.serialize_pem())?;
    std::fs::write(dir.join("sa.pub"), sa.public_key_pem())?;
    Ok(())
}

/// Audits the replica users' writes (metadata only, when answered) and nothing else.
fn audit_policy() -> String {
    let users: Vec<String> = (0..REPLICA_USERS)
        .map(|i| format!("\"{}\"", replica_user(i)))
        .collect();
    format!(
        "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [\"RequestReceived\"]\nrules:\n\
         - level: Metadata\n  users: [{}]\n  verbs: [\"create\", \"update\", \"patch\", \"delete\", \"deletecollection\"]\n\
         - level: None\n",
        users.join(", ")
    )
}

fn write_kubeconfig(dir: &Path, port: u16) -> anyhow::Result<()> {
    let ca = std::fs::read_to_string(dir.join("ca.crt"))?;
    let ca_b64 = base64::engine::general_purpose::STANDARD.encode(ca.as_bytes());
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: stowage-test\n  cluster:\n    server: https://127.0.0.1:{port}\n    certificate-authority-data: {ca_b64}\nusers:\n- name: admin\n  user:\n    token: {ADMIN_TOKEN}\ncontexts:\n- name: stowage-test\n  context:\n    cluster: stowage-test\n    user: admin\ncurrent-context: stowage-test\n"
    );
    std::fs::write(dir.join("kubeconfig"), kubeconfig)?;
    Ok(())
}

/// The control plane shared by every test in this test binary: the one named by
/// `$STOWAGE_TEST_KUBECONFIG` if set (no processes of ours), else one started on first use and
/// torn down when the process exits.
pub fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        if let Some(kc) = std::env::var_os("STOWAGE_TEST_KUBECONFIG") {
            return Shared {
                kubeconfig: PathBuf::from(kc),
                cp: None,
            };
        }
        let cp =
            ControlPlane::start().unwrap_or_else(|e| panic!("cannot start the test control plane: {e:#}"));
        register_exit_cleanup(cp.dir.clone());
        Shared {
            kubeconfig: cp.kubeconfig(),
            cp: Some(cp),
        }
    })
}

pub struct Shared {
    kubeconfig: PathBuf,
    cp: Option<ControlPlane>,
}

impl Shared {
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    pub async fn client(&self) -> Client {
        client_for(&self.kubeconfig)
            .await
            .expect("client for the shared control plane")
    }

    /// The processes, when this test binary started them.
    pub fn control_plane(&self) -> Option<&ControlPlane> {
        self.cp.as_ref()
    }
}

static CLEANUP_DIR: OnceLock<PathBuf> = OnceLock::new();

/// Statics are never dropped, so the shared data dir is removed by an exit hook (the children
/// themselves die with the process through PDEATHSIG).
fn register_exit_cleanup(dir: PathBuf) {
    extern "C" fn cleanup() {
        if let Some(d) = CLEANUP_DIR.get() {
            let _ = std::fs::remove_dir_all(d);
        }
    }
    if CLEANUP_DIR.set(dir).is_ok() {
        // SAFETY: registers a plain extern "C" function.
        unsafe {
            libc::atexit(cleanup);
        }
    }
}

/// Parses `anyhow` into test panics with context.
pub fn must<T>(r: anyhow::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn missing_binaries_say_what_to_run() {
        let e = super::binary("no-such-binary").unwrap_err().to_string();
        assert!(e.contains("make controlplane"), "{e}");
    }

    /// The DNAT and the serving certificate name the `kubernetes` Service by the address the
    /// apiserver gives it: the first of its range.
    #[test]
    fn the_service_ip_is_the_first_of_the_range() {
        let (net, _) = super::SERVICE_RANGE.split_once('/').unwrap();
        let net: std::net::Ipv4Addr = net.parse().unwrap();
        let first = std::net::Ipv4Addr::from(u32::from(net) + 1);
        assert_eq!(first.to_string(), crate::realnode::SERVICE_IP);
    }
}
