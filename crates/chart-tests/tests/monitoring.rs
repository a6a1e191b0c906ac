//! The chart's alerts (PrometheusRule) and dashboard query only metrics the binaries export
//! (docs/metrics.md, itself checked against both binaries' registries), and the
//! rules pass `promtool check rules` and a `promtool test rules` case (promtool built from the
//! Prometheus module pinned in e2e/promtool, by e2e/scripts/build-promtool.sh).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use stowage_chart_tests::{Helm, chart_dir, document, repo_root as repo};

/// Every metric family docs/metrics.md lists for either binary (the rows the registry check
/// holds to what the binaries register).
fn documented() -> BTreeSet<String> {
    ["stowage-controller", "stowage-agent"]
        .into_iter()
        .flat_map(|b| stowage_testkit::metricsdoc::documented(b).into_keys())
        .collect()
}

/// Metric names in PromQL text: identifiers of the families stowage exports, with a
/// histogram's `_bucket`/`_count`/`_sum` mapped to its family.
fn metric_names(promql: &str, documented: &BTreeSet<String>) -> BTreeSet<String> {
    const PREFIXES: &[&str] = &[
        "stowage_",
        "workqueue_",
        "rest_client_",
        "leader_election_",
        "pv_collector_",
        "attachdetach_controller_",
        "attach_detach_controller_",
        "process_",
    ];
    promql
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|t| PREFIXES.iter().any(|p| t.starts_with(p)))
        .map(|t| {
            ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| t.strip_suffix(s).filter(|b| documented.contains(*b)))
                .unwrap_or(t)
                .to_string()
        })
        .collect()
}

async fn render(helm: &Helm) -> String {
    let chart = chart_dir();
    let out = helm
        .run(&[
            "template",
            "st",
            chart.to_str().unwrap(),
            "--namespace",
            "stowage-system",
            "--set",
            "metrics.prometheusRule.enabled=true,metrics.dashboard.enabled=true",
        ])
        .await;
    out.expect("helm template with alerts and dashboard")
}

/// `expr:` values of the rendered PrometheusRule.
fn exprs(rule: &str) -> Vec<String> {
    rule.lines()
        .filter_map(|l| l.trim().strip_prefix("expr: "))
        .map(String::from)
        .collect()
}

#[tokio::test]
async fn alerts_and_dashboard_query_only_documented_metrics() {
    let helm = Helm::new(None);
    let m = render(&helm).await;
    let docs = documented();
    let rule = document(&m, "PrometheusRule", "st-stowage").expect("PrometheusRule rendered");
    let exprs = exprs(rule);
    assert!(exprs.len() >= 8, "alerts: {exprs:?}");
    let cm = document(&m, "ConfigMap", "st-stowage-dashboard").expect("dashboard ConfigMap");
    assert!(
        cm.contains("grafana_dashboard: \"1\""),
        "the sidecar's label: {cm}"
    );
    let json = std::fs::read_to_string(chart_dir().join("dashboards/stowage.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&json).expect("dashboard JSON");
    let queries: Vec<String> = dash["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(String::from))
        .collect();
    assert!(queries.len() >= 10, "dashboard queries: {queries:?}");
    for q in exprs.iter().chain(&queries) {
        let names = metric_names(q, &docs);
        assert!(!names.is_empty(), "a query reads no stowage metric: {q}");
        let unknown: Vec<_> = names.iter().filter(|n| !docs.contains(*n)).collect();
        assert!(
            unknown.is_empty(),
            "{unknown:?} in `{q}` are not in docs/metrics.md"
        );
    }
    // The panels the issue asks for.
    for needle in [
        "stowage_binder_claim_bind_latency_seconds_count",
        "workqueue_depth",
        "rest_client_rate_limiter_duration_seconds_bucket",
        "stowage_attachdetach_attach_duration_seconds_bucket",
    ] {
        assert!(
            queries.iter().any(|q| q.contains(needle)),
            "no panel reads {needle}"
        );
    }
}

fn promtool() -> PathBuf {
    let bin = repo().join("e2e/promtool/bin/promtool");
    assert!(
        bin.is_file(),
        "{} is missing: run `make test` (or e2e/scripts/build-promtool.sh) first",
        bin.display()
    );
    bin
}

#[tokio::test]
async fn alert_rules_pass_promtool() {
    let helm = Helm::new(None);
    let m = render(&helm).await;
    let rule = document(&m, "PrometheusRule", "st-stowage").expect("PrometheusRule rendered");
    // A rule file is the PrometheusRule's spec: its `groups:` block, de-indented.
    let spec: Vec<&str> = rule.lines().skip_while(|l| l.trim() != "spec:").skip(1).collect();
    let rules: String = spec
        .iter()
        .map(|l| format!("{}\n", l.strip_prefix("  ").unwrap_or(l)))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rules.yaml");
    std::fs::write(&file, &rules).unwrap();
    let out = Command::new(promtool())
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool check rules:\n{}{}\n{rules}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Behaviour tests: a forced detach fires StowageDetachForced with its reason; a node without
    // the image store's marker fires StowageImageStoreNotReady.
    let test = format!(
        r#"rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'stowage_attachdetach_forced_detaches_total{{namespace="stowage-system",reason="timeout"}}'
        values: '0 0 1 1 1'
    alert_rule_test:
      - eval_time: 3m
        alertname: StowageDetachForced
        exp_alerts:
          - exp_labels: {{severity: warning, reason: timeout}}
            exp_annotations:
              summary: Volumes were detached from a node that still used them (timeout)
              description: A forced detach skips the wait for the node to unmount; check the node and the pods' data.
              runbook_url: docs/operator-guide.md#troubleshooting-by-event-reason
      - eval_time: 1m
        alertname: StowageDetachForced
        exp_alerts: []
  # An agent whose node lost the image store's marker; the standby controller's 0 is no alert.
  - interval: 1m
    input_series:
      - series: 'stowage_agent_image_store_ready{{namespace="stowage-system",instance="node-a"}}'
        values: '1 0 0 0 0 0 0 0'
      - series: 'stowage_binder_image_store_ready{{namespace="stowage-system",instance="standby"}}'
        values: '0 0 0 0 0 0 0 0'
      - series: 'stowage_leader{{namespace="stowage-system",instance="standby"}}'
        values: '0 0 0 0 0 0 0 0'
    alert_rule_test:
      - eval_time: 7m
        alertname: StowageImageStoreNotReady
        exp_alerts:
          - exp_labels: {{severity: critical, namespace: stowage-system, instance: node-a}}
            exp_annotations:
              summary: The image store is not ready on node-a
              description: The marker /var/lib/stowage/images/.stowage-image-store is missing there; claims wait, deletions wait and nothing is attached until the store is mounted (or, on a new install, marked with stowage-controller init-image-store).
              runbook_url: docs/operator-guide.md#the-image-store-marker
"#,
        rules = file.display()
    );
    let test_file = dir.path().join("test.yaml");
    std::fs::write(&test_file, test).unwrap();
    let out = Command::new(promtool())
        .args(["test", "rules"])
        .arg(&test_file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool test rules:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
