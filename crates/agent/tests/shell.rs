//! The agent binary starts against the real apiserver and serves its endpoints.

use std::time::Duration;

use stowage_testkit::binary::Running;
use stowage_testkit::{eventually, shared, unique};

#[tokio::test]
async fn agent_serves_parseable_metrics_and_health() {
    let logs = std::env::temp_dir().join("stowage-test-logs");
    std::fs::create_dir_all(&logs).unwrap();
    let root = std::env::temp_dir().join(unique("stowage-agent-root"));
    let args = vec![
        format!("--kubeconfig={}", shared().kubeconfig().display()),
        format!("--node-name={}", unique("node")),
        format!("--root-dir={}", root.display()),
    ];
    let r = Running::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_stowage-agent")),
        &args,
        &logs,
        "agent-shell",
    )
    .unwrap();
    eventually(Duration::from_secs(60), || async {
        match r.get("/readyz") {
            Ok((200, _)) => Ok(()),
            other => Err(format!("readyz: {other:?}")),
        }
    })
    .await;
    let m = r.metrics().unwrap();
    assert_eq!(m.value("stowage_build_info"), Some(1.0));
    assert_eq!(r.get("/healthz").unwrap().0, 200);
    let _ = std::fs::remove_dir_all(root);
}
