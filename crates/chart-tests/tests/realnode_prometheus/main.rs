//! A real Prometheus (Debian's `prometheus` package, which `make deps` installs) monitors stowage
//! on a real node through the chart's own monitoring objects: the chart installed by helm with
//! the secure port, its ServiceMonitor (controller) and PodMonitor (agents) turned into the scrape
//! configs the Prometheus Operator would make of them (`translate.rs`; no operator runs here, and
//! as Debian builds Prometheus without Kubernetes discovery, the test lists what it would find),
//! its PrometheusRule's groups as the rule file, and every query of its Grafana dashboard asked
//! through Prometheus's HTTP API after a claim was bound, attached and mounted. Prometheus scrapes
//! the controller over HTTPS with the token of a ServiceAccount bound to the chart's
//! metrics-reader ClusterRole; the same target without a token is down (401), as is a direct
//! scrape without one, and a token without the binding is refused (403). A summary is printed.
//!
//! Needs root and the archives `make test` builds, like the other real-node scenarios.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use serde_json::{Value, json};
use stowage_chart_tests::chart_dir;
use support::{Kubectl, claim, install_mode, pod, poll, rollout, single_node};
use translate::Discovery;

#[allow(dead_code)]
#[path = "../realnode/support.rs"]
mod support;
mod translate;

/// The Prometheus Operator's CRDs, reduced to what lets the apiserver store the chart's objects
/// (the operator's schemas are not what is under test; the objects' use by Prometheus is).
const CRDS: &[(&str, &str, &str)] = &[
    ("servicemonitors", "servicemonitor", "ServiceMonitor"),
    ("podmonitors", "podmonitor", "PodMonitor"),
    ("prometheusrules", "prometheusrule", "PrometheusRule"),
];

/// Dashboard queries that may rightly be empty on a healthy install: each counts failures, and
/// its counter has no series until the first one. They must still be valid PromQL.
const FAILURE_COUNTERS: &[(&str, &str)] = &[
    ("_reconcile_errors_total", "failed syncs: none on a healthy run"),
    (
        "stowage_attachdetach_forced_detaches_total",
        "forced detaches: nothing was force-detached",
    ),
    (
        "stowage_agent_operation_errors_total",
        "failed agent operations: none failed",
    ),
];

/// Prometheus, stopped when the test ends whatever its outcome.
struct Prometheus {
    child: Child,
    url: String,
    log: std::path::PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    fn api(&self, path: &str, query: &[(&str, &str)]) -> Result<Value, String> {
        let mut cmd = Command::new("curl");
        cmd.args(["-sS", "--fail-with-body", "-G", &format!("{}{path}", self.url)]);
        for (k, v) in query {
            cmd.args(["--data-urlencode", &format!("{k}={v}")]);
        }
        let out = cmd.output().map_err(|e| e.to_string())?;
        let body = String::from_utf8_lossy(&out.stdout).to_string();
        if !out.status.success() {
            return Err(format!("{path}: {body}{}", String::from_utf8_lossy(&out.stderr)));
        }
        let v: Value = serde_json::from_str(&body).map_err(|e| format!("{path}: {e}: {body}"))?;
        match v["status"].as_str() {
            Some("success") => Ok(v["data"].clone()),
            _ => Err(format!("{path}: {body}")),
        }
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<_> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

/// The HTTP status of a GET of `url`, with `token` as bearer when given (TLS not verified: the
/// controller's certificate is self-signed).
fn status_of(url: &str, token: Option<&str>) -> String {
    let mut cmd = Command::new("curl");
    cmd.args(["-sk", "-o", "/dev/null", "-w", "%{http_code}", url]);
    if let Some(t) = token {
        cmd.args(["-H", &format!("Authorization: Bearer {t}")]);
    }
    String::from_utf8_lossy(&cmd.output().expect("run curl").stdout).to_string()
}

fn json_of(k: &Kubectl, args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.extend(["-o", "json"]);
    serde_json::from_str(&k.must(&a)).unwrap()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn prometheus_bin() -> String {
    let out = Command::new("sh")
        .args(["-c", "command -v prometheus"])
        .output()
        .unwrap();
    let bin = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        !bin.is_empty(),
        "prometheus is not on PATH: `make deps` installs Debian's package"
    );
    bin
}

/// Starts Prometheus on a free loopback port with `config`, its data in `dir`.
fn start_prometheus(dir: &Path, config: &Value) -> Prometheus {
    let config_file = dir.join("prometheus.yml");
    std::fs::write(&config_file, serde_json::to_string_pretty(config).unwrap()).unwrap();
    let port = free_port();
    let log = dir.join("prometheus.log");
    let child = Command::new(prometheus_bin())
        .arg(format!("--config.file={}", config_file.display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start prometheus");
    let mut p = Prometheus {
        child,
        url: format!("http://127.0.0.1:{port}"),
        log,
    };
    poll(|| {
        if let Some(status) = p.child.try_wait().unwrap() {
            panic!(
                "prometheus exited ({status}):\n{}\nconfig:\n{}",
                p.log_tail(),
                serde_json::to_string_pretty(config).unwrap()
            );
        }
        p.api("/api/v1/status/buildinfo", &[]).map(|_| ())
    });
    p
}

#[tokio::test(flavor = "multi_thread")]
async fn a_real_prometheus_scrapes_stowage_through_the_charts_monitoring() {
    let started = Instant::now();
    let (cp, images, _cleanup, node, k, helm) = single_node().await;

    // The monitoring kinds, then the chart with all of its monitoring on; scrapes every 5 s so
    // rates have two samples soon.
    for (plural, singular, kind) in CRDS {
        k.apply(&format!(
            r#"apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {{name: {plural}.monitoring.coreos.com}}
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {{plural: {plural}, singular: {singular}, kind: {kind}, listKind: {kind}List}}
  versions:
  - name: v1
    served: true
    storage: true
    schema: {{openAPIV3Schema: {{type: object, x-kubernetes-preserve-unknown-fields: true}}}}
"#
        ));
        k.must(&[
            "wait",
            "--for=condition=Established",
            &format!("crd/{plural}.monitoring.coreos.com"),
        ]);
    }
    // Local mode, the chart's default: the node's own store.
    install_mode(&helm, &k, &cp, &images, &node.kubelet_dir, "local", || {
        node.log_tail("kubelet")
    })
    .await;
    let monitoring = helm.values(
        "monitoring.yaml",
        // The secure port is the chart's default; the shared install turns it off, this puts it back.
        r#"controller: {securePort: 10257}
metrics:
  readers: [{kind: ServiceAccount, name: prometheus, namespace: monitoring}]
  serviceMonitor: {enabled: true, interval: 5s}
  podMonitor: {enabled: true, interval: 5s}
  prometheusRule: {enabled: true}
  dashboard: {enabled: true}
"#,
    );
    helm.run(&[
        "upgrade",
        "st",
        chart_dir().to_str().unwrap(),
        "-n",
        "stowage",
        "--reuse-values",
        "-f",
        monitoring.to_str().unwrap(),
    ])
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    for what in ["deployment/st-stowage-controller", "daemonset/st-stowage-agent"] {
        rollout(&k, what, || node.log_tail("kubelet"));
    }
    println!(
        "stowage installed with its monitoring after {:?}",
        started.elapsed()
    );
    // `helm test` reaches the controller's /readyz through the https service proxy.
    let out = helm
        .run(&["test", "st", "-n", "stowage", "--timeout", "5m", "--logs"])
        .await
        .unwrap_or_else(|e| panic!("helm test with the secure port: {e}"));
    let readyz = "ok: controller /readyz through Service st-stowage-controller-metrics answers ok";
    assert!(out.contains(readyz), "helm test output lacks {readyz:?}:\n{out}");

    // Prometheus's identity: discovery (endpoints, pods) here; the chart binds its metrics-reader
    // ClusterRole to it (metrics.readers above).
    k.apply(
        r#"apiVersion: v1
kind: Namespace
metadata: {name: monitoring}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: prometheus, namespace: monitoring}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: stranger, namespace: monitoring}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: prometheus-discovery}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: prometheus-discovery}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: prometheus-discovery}
subjects: [{kind: ServiceAccount, name: prometheus, namespace: monitoring}]
"#,
    );
    let token = |sa: &str| {
        k.must(&["create", "token", sa, "-n", "monitoring", "--duration=1h"])
            .trim()
            .to_string()
    };
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, token("prometheus")).unwrap();
    let d = Discovery {
        dir: dir.path().to_path_buf(),
        token_file: token_file.display().to_string(),
    };
    // Discovery's view of the apiserver: Prometheus's own token, so its discovery RBAC is tested.
    let prometheus_token = std::fs::read_to_string(&token_file).unwrap();
    let list = |resource: &str, ns: &str| -> Vec<Value> {
        let out = k.must(&[
            "--token",
            &prometheus_token,
            "get",
            resource,
            "-n",
            ns,
            "-o",
            "json",
        ]);
        let v: Value = serde_json::from_str(&out).unwrap();
        v["items"].as_array().cloned().unwrap_or_default()
    };

    // The chart's objects as the apiserver holds them.
    let monitors = json_of(&k, &["get", "servicemonitor,podmonitor", "-n", "stowage"]);
    let monitors = monitors["items"].as_array().unwrap();
    let names: Vec<String> = monitors
        .iter()
        .map(|m| {
            format!(
                "{}/{}",
                m["kind"].as_str().unwrap(),
                m["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect();
    // One ServiceMonitor (the controller) and one PodMonitor (the agents): no agent twice.
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        [
            "PodMonitor/st-stowage-agent",
            "ServiceMonitor/st-stowage-controller"
        ]
    );
    let (mut scrape, sds): (Vec<Value>, Vec<translate::Sd>) = monitors
        .iter()
        .flat_map(|m| translate::scrape_configs(m, &d))
        .unzip();
    let discover = || {
        for sd in &sds {
            translate::discover(sd, list);
        }
    };
    discover();
    let jobs: Vec<String> = scrape
        .iter()
        .map(|s| s["job_name"].as_str().unwrap().to_string())
        .collect();
    // The controller's target once more without a token: Prometheus must find it refused.
    let controller_job = scrape
        .iter()
        .find(|s| s["job_name"].as_str().unwrap().starts_with("serviceMonitor/"))
        .unwrap();
    assert_eq!(
        controller_job["scheme"], "https",
        "the controller is scraped over HTTPS"
    );
    let mut anonymous = controller_job.clone();
    anonymous.as_object_mut().unwrap().remove("authorization");
    anonymous["job_name"] = json!("anonymous");
    anonymous["relabel_configs"]
        .as_array_mut()
        .unwrap()
        .push(json!({"target_label": "job", "replacement": "anonymous"}));
    scrape.push(anonymous);

    let rule = json_of(&k, &["get", "prometheusrule", "-n", "stowage", "st-stowage"]);
    let rules_file = dir.path().join("rules.yml");
    std::fs::write(&rules_file, serde_json::to_string(&rule["spec"]).unwrap()).unwrap();
    let groups: Vec<&str> = rule["spec"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["name"].as_str().unwrap())
        .collect();
    let rule_count: usize = rule["spec"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["rules"].as_array().unwrap().len())
        .sum();

    let prom = start_prometheus(
        dir.path(),
        &json!({
            "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
            "rule_files": [rules_file.display().to_string()],
            "scrape_configs": scrape,
        }),
    );
    let with_log = |e: String| format!("{e}\nprometheus log:\n{}", prom.log_tail());

    // A claim used by a pod: the binder binds it, the attach/detach controller attaches it, the
    // kubelet mounts it through the agent; all of it shows in the metrics.
    k.apply(&claim("data", "loop", "ReadWriteOnce"));
    k.apply(&pod("user", "data"));
    k.wait_logs("user", "wrote");
    k.show("a claim bound, attached and mounted");

    // Every target of the chart's monitors up (the controller over HTTPS with the token), the
    // token-less one down with the controller's 401.
    let mut up = vec![];
    let mut refused = String::new();
    poll(|| {
        discover();
        let t = prom.api("/api/v1/targets", &[("state", "active")])?;
        let active = t["activeTargets"].as_array().cloned().unwrap_or_default();
        up.clear();
        for job in &jobs {
            let of_job: Vec<_> = active
                .iter()
                .filter(|t| t["scrapePool"] == job.as_str())
                .collect();
            if of_job.is_empty() {
                return Err(with_log(format!("no target of {job} yet: {t}")));
            }
            for t in &of_job {
                if t["health"] != "up" {
                    return Err(with_log(format!("{job} target not up: {t}")));
                }
            }
            up.push(format!(
                "{job}: {} up ({})",
                of_job.len(),
                of_job
                    .iter()
                    .map(|t| t["scrapeUrl"].as_str().unwrap())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        let anon: Vec<_> = active.iter().filter(|t| t["scrapePool"] == "anonymous").collect();
        match anon.first() {
            Some(t) if t["health"] == "down" && t["lastError"].as_str().unwrap_or("").contains("401") => {
                refused = format!(
                    "{} down: {}",
                    t["scrapeUrl"].as_str().unwrap(),
                    t["lastError"].as_str().unwrap()
                );
                Ok(())
            }
            other => Err(with_log(format!(
                "the token-less target is not down with 401 yet: {other:?}"
            ))),
        }
    });
    // The agents' targets carry their node.
    let agent_up = prom
        .api(
            "/api/v1/query",
            &[("query", r#"up{job="stowage/st-stowage-agent"}"#)],
        )
        .unwrap();
    let nodes: Vec<&str> = agent_up["result"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["metric"]["node"].as_str())
        .collect();
    assert_eq!(
        nodes,
        [stowage_testkit::realnode::NODE_NAME],
        "agent targets' node: {agent_up}"
    );

    // Straight at the secure port: no token 401, a token without the metrics-reader binding 403,
    // Prometheus's 200.
    let controller_url = prom.api("/api/v1/targets", &[("state", "active")]).unwrap()["activeTargets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["scrapePool"].as_str().unwrap().starts_with("serviceMonitor/"))
        .map(|t| t["scrapeUrl"].as_str().unwrap().to_string())
        .unwrap();
    let stranger = token("stranger");
    let direct = [
        ("no token", status_of(&controller_url, None), "401"),
        (
            "a token without the binding",
            status_of(&controller_url, Some(&stranger)),
            "403",
        ),
        (
            "Prometheus's token",
            status_of(&controller_url, Some(&prometheus_token)),
            "200",
        ),
    ];
    for (who, got, want) in &direct {
        assert_eq!(got, want, "GET {controller_url} with {who}");
    }

    // The chart's rule groups loaded, every rule evaluated without error.
    let mut loaded = vec![];
    poll(|| {
        let r = prom.api("/api/v1/rules", &[])?;
        let got = r["groups"].as_array().cloned().unwrap_or_default();
        loaded.clear();
        for g in &groups {
            let Some(group) = got.iter().find(|x| x["name"] == *g) else {
                return Err(with_log(format!("group {g} not loaded: {r}")));
            };
            let rules = group["rules"].as_array().unwrap();
            for rule in rules {
                if rule["health"] != "ok" || !rule["lastError"].as_str().unwrap_or("").is_empty() {
                    return Err(with_log(format!("rule not evaluated cleanly: {rule}")));
                }
            }
            loaded.push(format!("{g} ({} rules, all health ok)", rules.len()));
        }
        Ok(())
    });
    let loaded_rules: usize = loaded.len();
    assert_eq!(loaded_rules, groups.len());

    // The dashboard's namespace variable lists the release's namespace, and each of its queries,
    // with that namespace, returns data (failure counters excepted, each valid PromQL).
    let cm = json_of(&k, &["get", "configmap", "-n", "stowage", "st-stowage-dashboard"]);
    let dashboard: Value = cm["data"]
        .as_object()
        .unwrap()
        .values()
        .find_map(|v| serde_json::from_str(v.as_str()?).ok())
        .expect("dashboard JSON in the ConfigMap");
    let namespaces = prom
        .api(
            "/api/v1/label/namespace/values",
            &[("match[]", "stowage_build_info")],
        )
        .unwrap();
    assert!(
        namespaces.as_array().unwrap().contains(&json!("stowage")),
        "label_values(stowage_build_info, namespace): {namespaces}"
    );
    let queries: Vec<(String, String)> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or("").to_string();
            p["targets"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter_map(move |t| {
                    Some((
                        title.clone(),
                        t["expr"].as_str()?.replace("$namespace", "stowage"),
                    ))
                })
        })
        .collect();
    assert!(queries.len() >= 10, "dashboard queries: {queries:?}");
    let mut with_data = vec![];
    let mut empty_failures = vec![];
    for (title, q) in &queries {
        let exempt = FAILURE_COUNTERS.iter().find(|(m, _)| q.contains(m));
        poll(|| {
            let r = prom.api("/api/v1/query", &[("query", q)])?;
            let n = r["result"].as_array().map_or(0, |a| a.len());
            match (n, exempt) {
                (0, None) => Err(with_log(format!("{title}: `{q}` returns no data yet"))),
                (0, Some((_, why))) => {
                    empty_failures.push(format!("{title}: {why}"));
                    Ok(())
                }
                _ => {
                    with_data.push(format!("{title}: {n} series"));
                    Ok(())
                }
            }
        });
    }

    println!(
        "==> Prometheus {} on the chart's monitoring, after {:?}",
        prom.url,
        started.elapsed()
    );
    println!("targets up:");
    for t in &up {
        println!("  {t}");
    }
    println!("  agent targets' node label: {nodes:?}");
    println!("refused: token-less target {refused}");
    for (who, got, _) in &direct {
        println!("  direct GET /metrics with {who}: {got}");
    }
    println!("rule groups loaded ({rule_count} rules):");
    for g in &loaded {
        println!("  {g}");
    }
    println!(
        "dashboard queries with data: {}/{}",
        with_data.len(),
        queries.len()
    );
    for q in &with_data {
        println!("  {q}");
    }
    for q in &empty_failures {
        println!("  empty, as on a healthy run: {q}");
    }
}
