//! Leader election, metrics and start-up errors of the real binary against the real apiserver.

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use stowage_testkit::binary::Running;
use stowage_testkit::{eventually, shared, unique};

const BIN: &str = env!("CARGO_BIN_EXE_stowage-controller");

fn logs() -> PathBuf {
    let d = std::env::temp_dir().join("stowage-test-logs");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A replica with its own identity on lease `lease`, running no controllers.
fn replica(lease: &str, id: &str, timings: [&str; 3]) -> Running {
    let args = vec![
        format!("--kubeconfig={}", shared().kubeconfig().display()),
        "--controllers=".into(),
        format!("--leader-elect-resource-name={lease}"),
        "--leader-elect-resource-namespace=default".into(),
        format!("--leader-elect-identity={id}"),
        format!("--leader-elect-lease-duration={}", timings[0]),
        format!("--leader-elect-renew-deadline={}", timings[1]),
        format!("--leader-elect-retry-period={}", timings[2]),
    ];
    Running::start(
        std::path::Path::new(BIN),
        &args,
        &logs(),
        &format!("{lease}-{id}"),
    )
    .unwrap()
}

fn leader_value(r: &Running) -> Result<f64, String> {
    r.metrics()?
        .value("stowage_leader")
        .ok_or_else(|| "no stowage_leader".to_string())
}

async fn holder(lease: &str) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(shared().client().await, "default");
    leases
        .get_opt(lease)
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
}

/// Waits until exactly one of the replicas reports leadership and the Lease names it.
async fn one_leader(lease: &str, replicas: &[(&str, &Running)]) -> String {
    eventually(Duration::from_secs(90), || async {
        let mut leaders = Vec::new();
        for (id, r) in replicas {
            if leader_value(r)? == 1.0 {
                leaders.push(id.to_string());
            }
        }
        let h = holder(lease).await;
        match leaders.as_slice() {
            [one] if h.as_deref() == Some(one) => Ok(one.clone()),
            _ => Err(format!("leaders by metric {leaders:?}, lease holder {h:?}")),
        }
    })
    .await
}

#[tokio::test]
async fn exactly_one_leader_and_sigkill_fails_over_after_expiry() {
    let lease = unique("le-kill");
    let t = ["4s", "3s", "1s"];
    let mut a = replica(&lease, "a", t);
    let mut b = replica(&lease, "b", t);
    let first = one_leader(&lease, &[("a", &a), ("b", &b)]).await;
    // Both stay up and keep agreeing across renewals (the Lease's renewTime moves twice).
    let leases: Api<Lease> = Api::namespaced(shared().client().await, "default");
    let renewed = || async {
        leases
            .get(&lease)
            .await
            .ok()
            .and_then(|l| l.spec)
            .and_then(|s| s.renew_time)
            .map(|t| t.0)
    };
    let seen = std::sync::Mutex::new(vec![renewed().await]);
    eventually(Duration::from_secs(30), || async {
        let now = renewed().await;
        let mut seen = seen.lock().unwrap();
        if seen.last() != Some(&now) {
            seen.push(now);
        }
        if seen.len() >= 3 {
            Ok(())
        } else {
            Err(format!("renewals seen: {seen:?}"))
        }
    })
    .await;
    assert_eq!(one_leader(&lease, &[("a", &a), ("b", &b)]).await, first);

    let (killed, survivor, survivor_id) = if first == "a" {
        (&mut a, &b, "b")
    } else {
        (&mut b, &a, "a")
    };
    killed.sigkill();
    // The survivor takes over once the killed holder's lease has gone unrenewed for a duration.
    let next = one_leader(&lease, &[(survivor_id, survivor)]).await;
    assert_eq!(next, survivor_id);
    let leases: Api<Lease> = Api::namespaced(shared().client().await, "default");
    let spec = leases.get(&lease).await.unwrap().spec.unwrap();
    assert_eq!(
        spec.lease_transitions,
        Some(1),
        "one hand-over from the first holder"
    );
}

#[tokio::test]
async fn sigterm_releases_the_lease_and_the_standby_takes_over_before_expiry() {
    let lease = unique("le-term");
    // A lease far longer than the test's bound: a takeover can only come from the release.
    let t = ["600s", "400s", "1s"];
    let mut rs = [("a", replica(&lease, "a", t)), ("b", replica(&lease, "b", t))];
    let first = one_leader(&lease, &[("a", &rs[0].1), ("b", &rs[1].1)]).await;
    let (li, si) = if first == "a" { (0, 1) } else { (1, 0) };
    rs[li].1.sigterm();
    let code = rs[li].1.wait_exit(Duration::from_secs(30));
    assert_eq!(code, Some(0), "clean exit on SIGTERM:\n{}", rs[li].1.log_text());
    assert!(
        rs[li].1.log_text().contains("released leadership"),
        "{}",
        rs[li].1.log_text()
    );
    let next = one_leader(&lease, &[(rs[si].0, &rs[si].1)]).await;
    assert_eq!(next, rs[si].0);
}

#[tokio::test]
async fn metrics_parse_as_prometheus_text_and_health_answers() {
    let lease = unique("le-metrics");
    let r = replica(&lease, "solo", ["15s", "10s", "2s"]);
    one_leader(&lease, &[("solo", &r)]).await;
    let m = r.metrics().unwrap();
    assert_eq!(m.value("stowage_leader"), Some(1.0));
    assert_eq!(m.value("stowage_build_info"), Some(1.0));
    assert!(
        m.value("process_resident_memory_bytes").unwrap_or(0.0) > 0.0,
        "process metrics"
    );
    assert_eq!(r.get("/healthz").unwrap(), (200, "ok".into()));
    assert_eq!(r.get("/readyz").unwrap(), (200, "ok".into()));
}

fn run_to_exit(args: &[&str]) -> (Option<i32>, String) {
    let out = std::process::Command::new(BIN)
        .args(args)
        .arg("--metrics-bind-address=127.0.0.1:0")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn missing_kubeconfig_is_one_clear_line_and_exit_1() {
    let (code, err) = run_to_exit(&["--kubeconfig=/nonexistent/kubeconfig"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("cannot read kubeconfig /nonexistent/kubeconfig"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        err.lines()
            .filter(|l| l.starts_with("stowage-controller:"))
            .count(),
        1,
        "{err}"
    );
}

#[test]
fn unreachable_apiserver_is_one_clear_line_and_exit_1() {
    let dir = tempfile_dir();
    let port = stowage_testkit::process::free_port();
    let kc = dir.join("kubeconfig");
    std::fs::write(
        &kc,
        format!("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:{port}\n    insecure-skip-tls-verify: true\nusers:\n- name: u\n  user:\n    token: x\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\ncurrent-context: c\n"),
    )
    .unwrap();
    let (code, err) = run_to_exit(&[&format!("--kubeconfig={}", kc.display())]);
    assert_eq!(code, Some(1));
    assert!(err.contains("is not reachable"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn unknown_controller_name_is_rejected() {
    let (code, err) = run_to_exit(&["--controllers=binder,bogus", "--kubeconfig=/dev/null"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("unknown controller \"bogus\""), "{err}");
}

fn tempfile_dir() -> PathBuf {
    let d = std::env::temp_dir().join(unique("stowage-kc"));
    std::fs::create_dir_all(&d).unwrap();
    d
}
