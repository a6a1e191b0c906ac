//! The chart's ServiceMonitor and PodMonitor, as the apiserver stored them, turned into the
//! Prometheus scrape configs the Prometheus Operator would generate for them: Kubernetes service
//! discovery (role `endpoints` or `pod`), the target selection and target labels the operator
//! adds (namespace, service, pod, container, job, endpoint), then the monitor's own relabelings
//! and metricRelabelings.
//!
//! Debian's Prometheus is built without `kubernetes_sd_configs` (its packaging leaves Kubernetes
//! discovery out), so `discover` stands in for it: it lists the Endpoints, Services and Pods the
//! real apiserver holds, with Prometheus's token, and writes them as a `file_sd_configs` file with
//! the `__meta_kubernetes_*` labels Kubernetes discovery gives for the labels the relabelings
//! read. Everything after discovery (relabeling, scraping over TLS with the token, rules,
//! queries) is Prometheus's own.
//!
//! What it covers is what the chart sets: `selector.matchLabels`, `namespaceSelector.matchNames`,
//! `jobLabel`, and per endpoint `port` (by name), `path`, `scheme`, `interval`, `scrapeTimeout`,
//! `bearerTokenFile`, `tlsConfig.insecureSkipVerify`, `relabelings`, `metricRelabelings`. Any
//! other field fails the translation rather than being dropped, so the chart cannot grow a field
//! this test silently ignores.

use std::path::PathBuf;

use serde_json::{Value, json};

/// Where the discovery files go and the token Prometheus scrapes with.
pub struct Discovery {
    pub dir: PathBuf,
    /// The ServiceAccount token Prometheus runs with: the scrapes' bearer token.
    pub token_file: String,
}

/// What Kubernetes discovery of one scrape config would watch, and the file it is written to.
pub struct Sd {
    pub role: &'static str,
    pub namespaces: Vec<String>,
    pub file: PathBuf,
}

/// A scrape config per endpoint of `monitor` (a ServiceMonitor or PodMonitor as JSON), each with
/// the discovery it needs.
pub fn scrape_configs(monitor: &Value, d: &Discovery) -> Vec<(Value, Sd)> {
    let kind = monitor["kind"].as_str().unwrap();
    let (role, endpoints_key, meta) = match kind {
        "ServiceMonitor" => ("endpoints", "endpoints", "service"),
        "PodMonitor" => ("pod", "podMetricsEndpoints", "pod"),
        other => panic!("not a monitor: {other}"),
    };
    let ns = monitor["metadata"]["namespace"].as_str().unwrap();
    let name = monitor["metadata"]["name"].as_str().unwrap();
    let spec = &monitor["spec"];
    only(
        spec,
        &["jobLabel", "selector", "namespaceSelector", endpoints_key],
        kind,
    );
    only(&spec["selector"], &["matchLabels"], "selector");
    only(&spec["namespaceSelector"], &["matchNames"], "namespaceSelector");
    let namespaces = &spec["namespaceSelector"]["matchNames"];
    assert!(
        namespaces.is_array(),
        "{kind} {name}: namespaceSelector.matchNames"
    );

    let mut out = vec![];
    for (i, ep) in spec[endpoints_key].as_array().unwrap().iter().enumerate() {
        only(
            ep,
            &[
                "port",
                "path",
                "scheme",
                "interval",
                "scrapeTimeout",
                "bearerTokenFile",
                "tlsConfig",
                "relabelings",
                "metricRelabelings",
            ],
            "endpoint",
        );
        let port = ep["port"].as_str().expect("endpoint port by name");
        let mut relabel = vec![];
        // Only this monitor's objects: each matchLabels pair present with its value.
        for (k, v) in spec["selector"]["matchLabels"].as_object().unwrap() {
            let k = sanitize(k);
            relabel.push(json!({
                "action": "keep",
                "source_labels": [
                    format!("__meta_kubernetes_{meta}_label_{k}"),
                    format!("__meta_kubernetes_{meta}_labelpresent_{k}"),
                ],
                "regex": format!("({});true", v.as_str().unwrap()),
            }));
        }
        let (port_label, job_source) = match role {
            "endpoints" => {
                relabel.push(keep("__meta_kubernetes_endpoint_port_name", port));
                // The operator names the endpoint's backing object (pod or node).
                for (target_kind, label) in [("Node", "node"), ("Pod", "pod")] {
                    relabel.push(json!({
                        "source_labels": [
                            "__meta_kubernetes_endpoint_address_target_kind",
                            "__meta_kubernetes_endpoint_address_target_name",
                        ],
                        "separator": ";",
                        "regex": format!("{target_kind};(.*)"),
                        "target_label": label,
                        "replacement": "$1",
                    }));
                }
                relabel.push(copy("__meta_kubernetes_service_name", "service"));
                (
                    "__meta_kubernetes_endpoint_port_name",
                    "__meta_kubernetes_service_name",
                )
            }
            _ => {
                // Finished pods are not scraped.
                relabel.push(json!({
                    "action": "drop",
                    "source_labels": ["__meta_kubernetes_pod_phase"],
                    "regex": "(Failed|Succeeded)",
                }));
                relabel.push(keep("__meta_kubernetes_pod_container_port_name", port));
                ("__meta_kubernetes_pod_container_port_name", "")
            }
        };
        relabel.push(copy("__meta_kubernetes_namespace", "namespace"));
        relabel.push(copy("__meta_kubernetes_pod_name", "pod"));
        relabel.push(copy("__meta_kubernetes_pod_container_name", "container"));
        // job: the Service's name (ServiceMonitor) or <namespace>/<name> (PodMonitor), or the
        // value of the object's jobLabel label when it has one.
        match job_source {
            "" => relabel.push(json!({"target_label": "job", "replacement": format!("{ns}/{name}")})),
            src => relabel.push(copy(src, "job")),
        }
        if let Some(label) = spec["jobLabel"].as_str() {
            relabel.push(json!({
                "source_labels": [format!("__meta_kubernetes_{meta}_label_{}", sanitize(label))],
                "regex": "(.+)",
                "target_label": "job",
                "replacement": "$1",
            }));
        }
        relabel.push(json!({"source_labels": [port_label], "target_label": "endpoint"}));
        relabel.extend(rules(&ep["relabelings"]));

        let job = format!("{}/{ns}/{name}/{i}", lower_first(kind));
        let sd = Sd {
            role,
            namespaces: namespaces
                .as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_str().unwrap().to_string())
                .collect(),
            file: d.dir.join(format!("{}.json", sanitize(&job))),
        };
        let mut sc = json!({
            "job_name": job,
            "metrics_path": ep["path"].as_str().unwrap_or("/metrics"),
            "scheme": ep["scheme"].as_str().unwrap_or("http"),
            "file_sd_configs": [{"files": [sd.file], "refresh_interval": "5s"}],
            "relabel_configs": relabel,
            "metric_relabel_configs": rules(&ep["metricRelabelings"]),
        });
        if let Some(v) = ep["interval"].as_str() {
            sc["scrape_interval"] = json!(v);
        }
        if let Some(v) = ep["scrapeTimeout"].as_str() {
            sc["scrape_timeout"] = json!(v);
        }
        // The pod's token file stands for Prometheus's own token: here, the same ServiceAccount's.
        if ep["bearerTokenFile"].is_string() {
            sc["authorization"] = json!({"credentials_file": d.token_file});
        }
        if !ep["tlsConfig"].is_null() {
            only(&ep["tlsConfig"], &["insecureSkipVerify"], "tlsConfig");
            sc["tls_config"] = json!({
                "insecure_skip_verify": ep["tlsConfig"]["insecureSkipVerify"].as_bool().unwrap_or(false)
            });
        }
        out.push((sc, sd));
    }
    out
}

/// Writes `sd`'s targets as Kubernetes discovery would find them now; `list(resource, ns)` is
/// the `items` of a list from the apiserver.
pub fn discover(sd: &Sd, list: impl Fn(&str, &str) -> Vec<Value>) {
    let mut groups = vec![];
    for ns in &sd.namespaces {
        let pods = list("pods", ns);
        match sd.role {
            "endpoints" => {
                let services = list("services", ns);
                for e in list("endpoints", ns) {
                    let name = e["metadata"]["name"].as_str().unwrap();
                    let mut common = serde_json::Map::new();
                    common.insert("__meta_kubernetes_namespace".into(), json!(ns));
                    common.insert("__meta_kubernetes_endpoints_name".into(), json!(name));
                    if let Some(svc) = services.iter().find(|s| s["metadata"]["name"] == name) {
                        common.insert("__meta_kubernetes_service_name".into(), json!(name));
                        labels_of(&mut common, "service", &svc["metadata"]["labels"]);
                    }
                    for subset in e["subsets"].as_array().into_iter().flatten() {
                        let addresses = [("addresses", "true"), ("notReadyAddresses", "false")];
                        for (key, ready) in addresses {
                            for a in subset[key].as_array().into_iter().flatten() {
                                for port in subset["ports"].as_array().into_iter().flatten() {
                                    let mut l = common.clone();
                                    let number = port["port"].as_u64().unwrap();
                                    l.insert(
                                        "__address__".into(),
                                        json!(format!("{}:{number}", a["ip"].as_str().unwrap())),
                                    );
                                    l.insert("__meta_kubernetes_endpoint_ready".into(), json!(ready));
                                    l.insert(
                                        "__meta_kubernetes_endpoint_port_name".into(),
                                        port["name"].clone(),
                                    );
                                    let target = &a["targetRef"];
                                    if let Some(kind) = target["kind"].as_str() {
                                        l.insert(
                                            "__meta_kubernetes_endpoint_address_target_kind".into(),
                                            json!(kind),
                                        );
                                        l.insert(
                                            "__meta_kubernetes_endpoint_address_target_name".into(),
                                            target["name"].clone(),
                                        );
                                    }
                                    let pod = pods.iter().find(|p| {
                                        target["kind"] == "Pod" && p["metadata"]["name"] == target["name"]
                                    });
                                    if let Some(pod) = pod {
                                        pod_labels(&mut l, pod);
                                        // The container that has the port, as discovery names it.
                                        for c in pod["spec"]["containers"].as_array().unwrap() {
                                            let has = c["ports"]
                                                .as_array()
                                                .into_iter()
                                                .flatten()
                                                .any(|p| p["containerPort"].as_u64() == Some(number));
                                            if has {
                                                l.insert(
                                                    "__meta_kubernetes_pod_container_name".into(),
                                                    c["name"].clone(),
                                                );
                                            }
                                        }
                                    }
                                    groups.push(json!({"targets": [l["__address__"].clone()], "labels": l}));
                                }
                            }
                        }
                    }
                }
            }
            _ => {
                for pod in &pods {
                    let Some(ip) = pod["status"]["podIP"].as_str() else {
                        continue;
                    };
                    for c in pod["spec"]["containers"].as_array().unwrap() {
                        for port in c["ports"].as_array().into_iter().flatten() {
                            let mut l = serde_json::Map::new();
                            l.insert("__meta_kubernetes_namespace".into(), json!(ns));
                            pod_labels(&mut l, pod);
                            let number = port["containerPort"].as_u64().unwrap();
                            l.insert("__address__".into(), json!(format!("{ip}:{number}")));
                            l.insert("__meta_kubernetes_pod_container_name".into(), c["name"].clone());
                            l.insert(
                                "__meta_kubernetes_pod_container_port_name".into(),
                                json!(port["name"].as_str().unwrap_or("")),
                            );
                            l.insert(
                                "__meta_kubernetes_pod_container_port_number".into(),
                                json!(number.to_string()),
                            );
                            groups.push(json!({"targets": [l["__address__"].clone()], "labels": l}));
                        }
                    }
                }
            }
        }
    }
    // Replaced at once: Prometheus never reads half a file.
    let tmp = sd.file.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_string(&groups).unwrap()).unwrap();
    std::fs::rename(&tmp, &sd.file).unwrap();
}

/// A pod's discovery labels (name, node, phase, IP, its labels).
fn pod_labels(l: &mut serde_json::Map<String, Value>, pod: &Value) {
    l.insert(
        "__meta_kubernetes_pod_name".into(),
        pod["metadata"]["name"].clone(),
    );
    for (label, field) in [
        ("node_name", &pod["spec"]["nodeName"]),
        ("phase", &pod["status"]["phase"]),
        ("ip", &pod["status"]["podIP"]),
    ] {
        if let Some(v) = field.as_str() {
            l.insert(format!("__meta_kubernetes_pod_{label}"), json!(v));
        }
    }
    labels_of(l, "pod", &pod["metadata"]["labels"]);
}

/// An object's labels as discovery gives them: `_label_<name>` and `_labelpresent_<name>`.
fn labels_of(l: &mut serde_json::Map<String, Value>, meta: &str, labels: &Value) {
    for (k, v) in labels.as_object().into_iter().flatten() {
        let k = sanitize(k);
        l.insert(format!("__meta_kubernetes_{meta}_label_{k}"), v.clone());
        l.insert(
            format!("__meta_kubernetes_{meta}_labelpresent_{k}"),
            json!("true"),
        );
    }
}

/// Relabelings in the operator's spelling (camelCase fields, any-case action) as Prometheus's.
fn rules(list: &Value) -> Vec<Value> {
    let Some(list) = list.as_array() else {
        return vec![];
    };
    list.iter()
        .map(|r| {
            let mut out = serde_json::Map::new();
            for (k, v) in r.as_object().unwrap() {
                let key = match k.as_str() {
                    "sourceLabels" => "source_labels",
                    "targetLabel" => "target_label",
                    "separator" | "regex" | "modulus" | "replacement" => k.as_str(),
                    "action" => {
                        out.insert("action".into(), json!(v.as_str().unwrap().to_lowercase()));
                        continue;
                    }
                    other => panic!("relabeling field {other} not translated: {r}"),
                };
                out.insert(key.into(), v.clone());
            }
            Value::Object(out)
        })
        .collect()
}

fn keep(label: &str, value: &str) -> Value {
    json!({"action": "keep", "source_labels": [label], "regex": value})
}

fn copy(from: &str, to: &str) -> Value {
    json!({"source_labels": [from], "target_label": to})
}

/// A Kubernetes label name as service discovery spells it in a meta label.
fn sanitize(label: &str) -> String {
    label
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

fn lower_first(s: &str) -> String {
    let mut c = s.chars();
    c.next()
        .map(|f| f.to_lowercase().chain(c).collect())
        .unwrap_or_default()
}

/// Fails on any field of `v` outside `known`: the translation would otherwise drop it.
#[track_caller]
fn only(v: &Value, known: &[&str], what: &str) {
    if let Some(o) = v.as_object() {
        for k in o.keys() {
            assert!(
                known.contains(&k.as_str()),
                "{what} field {k} is not translated: {v}"
            );
        }
    }
}
