//! The log stream as an operator's pipeline sees it: everything on stderr (stdout stays empty),
//! no colour codes when stderr is not a terminal, and with `--log-format=json` one JSON object
//! per line. The controller is pointed at an apiserver that does not answer, so it logs its
//! retries (at `--v=4`, debug) and then gives up with a one-line error.

use std::process::{Command, Stdio};

const KUBECONFIG: &str = r#"apiVersion: v1
kind: Config
clusters:
- name: nowhere
  cluster:
    server: https://127.0.0.1:1
    insecure-skip-tls-verify: true
users:
- name: u
  user:
    token: not-a-token
contexts:
- name: c
  context:
    cluster: nowhere
    user: u
current-context: c
"#;

/// Runs the controller to its exit (about 10 s: the reachability check's limit).
fn run(format: &str) -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    let kc = dir.path().join("kubeconfig");
    std::fs::write(&kc, KUBECONFIG).unwrap();
    let port = stowage_testkit::process::free_port();
    let out = Command::new(env!("CARGO_BIN_EXE_stowage-controller"))
        .args([
            format!("--kubeconfig={}", kc.display()),
            format!("--metrics-bind-address=127.0.0.1:{port}"),
            format!("--log-format={format}"),
            "--v=4".into(),
        ])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("controller runs");
    assert!(!out.status.success(), "an unreachable apiserver is an error");
    (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn text_logs_go_to_stderr_without_colour() {
    let (stdout, stderr) = run("text");
    assert_eq!(stdout, "", "nothing on stdout");
    assert!(
        stderr.contains("apiserver not answering yet"),
        "--v=4 shows the debug retries: {stderr}"
    );
    assert!(stderr.contains("DEBUG"), "level shown in text lines: {stderr}");
    assert!(
        !stderr.contains('\u{1b}'),
        "no escape codes off a terminal: {stderr:?}"
    );
    assert!(
        stderr.contains("is not reachable"),
        "the final error says why: {stderr}"
    );
}

#[test]
fn json_logs_are_one_object_per_line() {
    let (stdout, stderr) = run("json");
    assert_eq!(stdout, "");
    let mut logged = 0;
    for line in stderr.lines().filter(|l| !l.starts_with("stowage-controller:")) {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        assert!(v["timestamp"].is_string(), "{line}");
        assert!(v["level"].is_string(), "{line}");
        assert!(v["fields"]["message"].is_string(), "{line}");
        logged += 1;
    }
    assert!(logged > 0, "some log lines: {stderr}");
    assert!(
        stderr.contains("\"level\":\"DEBUG\""),
        "--v=4 means debug: {stderr}"
    );
}
