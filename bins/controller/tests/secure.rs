//! The secure port on the real apiserver, as a scraper meets it: HTTPS, a bearer token checked
//! with a TokenReview, the path authorized with a SubjectAccessReview against RBAC, probes open.

use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::Api;
use kube::api::PostParams;
use serde_json::json;
use stowage_testkit::binary::Running;
use stowage_testkit::{ControlPlane, eventually};

/// `curl`'s status code for `path` on the secure port, with `token` if any (`-k`: the
/// certificate is self-signed, as kube-controller-manager's is).
fn status(port: u16, path: &str, token: Option<&str>) -> String {
    let mut cmd = Command::new("curl");
    cmd.args(["-sk", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10"]);
    if let Some(t) = token {
        cmd.args(["-H", &format!("Authorization: Bearer {t}")]);
    }
    cmd.arg(format!("https://127.0.0.1:{port}{path}"));
    let out = cmd.output().expect("curl runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn token(client: &kube::Client, sa: &str) -> String {
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
    sas.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": sa}})).unwrap(),
    )
    .await
    .unwrap();
    let req = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: None,
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    sas.create_token_request(sa, &PostParams::default(), &req)
        .await
        .unwrap()
        .status
        .and_then(|s| s.token)
        .expect("a token")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_on_the_secure_port_need_a_token_that_rbac_lets_read_them() {
    let cp = tokio::task::spawn_blocking(ControlPlane::start)
        .await
        .unwrap()
        .unwrap();
    let client = cp.client().await;
    let images = tempfile::tempdir().unwrap();

    // What a Prometheus that scrapes kube-controller-manager is given.
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": "metrics-reader"},
        "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    }))
    .unwrap();
    Api::<ClusterRole>::all(client.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "metrics-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "metrics-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "scraper", "namespace": "default"}]
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let scraper = token(&client, "scraper").await;
    let nobody = token(&client, "nobody").await;

    let port = stowage_testkit::process::free_port();
    let controller = Running::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_stowage-controller")),
        &[
            format!("--kubeconfig={}", cp.kubeconfig().display()),
            "--controllers=binder".into(),
            "--leader-elect=false".into(),
            format!("--secure-port={port}"),
            "--bind-address=127.0.0.1".into(),
            format!("--image-dir={}", images.path().display()),
        ],
        cp.dir(),
        "stowage-secure",
    )
    .unwrap();

    eventually(Duration::from_secs(60), || async {
        match status(port, "/healthz", None).as_str() {
            "200" => Ok(()),
            other => Err(format!("/healthz answered {other:?}\n{}", controller.log_text())),
        }
    })
    .await;
    assert_eq!(status(port, "/readyz", None), "200", "probes need no token");
    assert_eq!(status(port, "/metrics", None), "401", "no token");
    assert_eq!(
        status(port, "/metrics", Some("not-a-token")),
        "401",
        "a token the apiserver does not know"
    );
    assert_eq!(
        status(port, "/metrics", Some(&nobody)),
        "403",
        "a user RBAC does not let read /metrics"
    );
    assert_eq!(
        status(port, "/metrics", Some(&scraper)),
        "200",
        "the scraper's token"
    );
    let body = Command::new("curl")
        .args(["-sk", "-H", &format!("Authorization: Bearer {scraper}")])
        .arg(format!("https://127.0.0.1:{port}/metrics"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&body.stdout);
    assert!(
        text.contains("stowage_build_info"),
        "the metrics themselves: {}",
        &text[..text.len().min(300)]
    );
}
