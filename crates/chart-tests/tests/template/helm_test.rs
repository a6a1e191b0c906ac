//! The `helm test` hooks: the checker pod, its rights, and the consumer of a claim of the class.

use stowage_chart_tests::{Helm, document, kinds_and_names};

use crate::{assert_has, doc, list_entry, render};

/// The annotations of a rendered document, as `key: value` lines.
fn annotations(doc: &str) -> Vec<&str> {
    doc.lines()
        .skip_while(|l| *l != "  annotations:")
        .skip(1)
        .take_while(|l| l.starts_with("    "))
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .collect()
}

/// The value of the environment variable `name` in a rendered pod.
fn env(doc: &str, name: &str) -> String {
    let entry = list_entry(doc, "env", name).unwrap_or_else(|| panic!("no env {name}:\n{doc}"));
    entry[0]
        .strip_prefix("value: ")
        .unwrap()
        .trim_matches('"')
        .to_string()
}

#[tokio::test]
async fn helm_test_checks_readyz_and_a_claim_of_the_class() {
    let helm = Helm::new(None);
    let m = render(&helm, &["--set", "storageClass.create=true"])
        .await
        .unwrap();
    let mut test_objects: Vec<String> = kinds_and_names(&m)
        .into_iter()
        .filter(|k| k.ends_with("/st-stowage-test"))
        .collect();
    test_objects.sort();
    // One name for every hook: `helm test --logs` asks for a pod of each hook's name.
    assert_eq!(
        test_objects,
        [
            "Pod/st-stowage-test",
            "Role/st-stowage-test",
            "RoleBinding/st-stowage-test",
            "ServiceAccount/st-stowage-test",
            "StatefulSet/st-stowage-test",
        ]
    );
    for o in &test_objects {
        let (kind, name) = o.split_once('/').unwrap();
        let a = annotations(doc(&m, kind, name));
        assert!(a.contains(&"helm.sh/hook: test"), "{o}: {a:?}");
        // Everything but the checker is deleted after the run, passed or failed; the checker
        // stays for its log and prints it into helm's output when it fails.
        let policy = if kind == "Pod" {
            "helm.sh/hook-delete-policy: before-hook-creation"
        } else {
            "helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded"
        };
        assert!(a.contains(&policy), "{o}: {a:?}");
        assert_eq!(
            a.contains(&"helm.sh/hook-output-log-policy: hook-failed"),
            kind == "Pod",
            "{o}: {a:?}"
        );
    }
    // The RBAC and the consumer exist before the checker starts.
    let weight = |kind| {
        annotations(doc(&m, kind, "st-stowage-test"))
            .iter()
            .find_map(|a| a.strip_prefix("helm.sh/hook-weight: "))
            .map(|w| w.trim_matches('"').parse::<i32>().unwrap())
            .unwrap()
    };
    assert!(weight("RoleBinding") < weight("StatefulSet"));
    assert!(weight("StatefulSet") < weight("Pod"));

    // The consumer: one pod with a claim of the chart's class, the claim deleted with it.
    let sts = doc(&m, "StatefulSet", "st-stowage-test");
    assert_has(
        sts,
        "test StatefulSet",
        &[
            "replicas: 1",
            "whenDeleted: Delete",
            r#"storageClassName: "loop""#,
            r#"storage: "16Mi""#,
            "fsGroup: 65532",
            &format!("image: localhost/stowage:{}", env!("CARGO_PKG_VERSION")),
            r#"command: ["grep", "-qx", "written by helm test", "/data/helm-test"]"#,
        ],
    );
    // The checker: reads only the test's objects and the controller's metrics port.
    let role = doc(&m, "Role", "st-stowage-test");
    assert_has(
        role,
        "test Role",
        &[
            // The secure port (the default): the https scheme's proxy name.
            r#"resourceNames: ["https:st-stowage-controller-metrics:metrics"]"#,
            r#"resourceNames: ["data-st-stowage-test-0"]"#,
            r#"resourceNames: ["st-stowage-test-0"]"#,
            r#"resourceNames: ["st-stowage-test"]"#,
        ],
    );
    let verbs: Vec<&str> = role
        .lines()
        .filter(|l| l.contains("verbs:"))
        .map(str::trim)
        .collect();
    assert_eq!(
        verbs,
        [
            r#"verbs: ["get"]"#,
            r#"verbs: ["get"]"#,
            r#"verbs: ["get"]"#,
            r#"verbs: ["get"]"#,
            r#"verbs: ["list"]"#
        ],
        "read-only: {role}"
    );
    let pod = doc(&m, "Pod", "st-stowage-test");
    assert_eq!(env(pod, "SERVICE"), "st-stowage-controller-metrics");
    assert_eq!(env(pod, "CLAIM"), "data-st-stowage-test-0");
    assert_eq!(env(pod, "CLASS"), "loop");
    assert_eq!(env(pod, "TIMEOUT"), "180");
    assert_has(
        pod,
        "test Pod",
        &[
            r#"image: "docker.io/curlimages/curl:8.17.0""#,
            "restartPolicy: Never",
            "serviceAccountName: st-stowage-test",
            "automountServiceAccountToken: false",
            "expirationSeconds: 600",
            // The apiserver's certificate is checked against the cluster's CA.
            "name: kube-root-ca.crt",
            r#"curl -sS --fail-with-body --cacert "$secrets/ca.crt""#,
            "services/$PROXY/proxy/readyz",
        ],
    );
    assert!(!pod.contains("hostNetwork"), "{pod}");

    // Another class, the image the real node imports, host networking with the apiserver's
    // address, a shorter wait.
    let m = render(
        &helm,
        &[
            "--set",
            "tests.storageClassName=fast,tests.timeoutSeconds=30,tests.hostNetwork=true",
            "--set",
            "tests.image.repository=localhost/curl,tests.image.tag=stowage,tests.image.pullPolicy=Never",
            "--set",
            "apiServer.host=127.0.0.1,apiServer.port=6443",
        ],
    )
    .await
    .unwrap();
    let sts = doc(&m, "StatefulSet", "st-stowage-test");
    assert_has(sts, "test StatefulSet", &[r#"storageClassName: "fast""#]);
    let pod = doc(&m, "Pod", "st-stowage-test");
    assert_eq!(env(pod, "CLASS"), "fast");
    assert_eq!(env(pod, "TIMEOUT"), "30");
    assert_has(
        pod,
        "test Pod",
        &[
            "\n  hostNetwork: true\n",
            "\n  dnsPolicy: ClusterFirstWithHostNet\n",
        ],
    );
    assert_eq!(env(pod, "KUBERNETES_SERVICE_HOST"), "127.0.0.1");
    assert_eq!(env(pod, "KUBERNETES_SERVICE_PORT"), "6443");
    assert_has(
        pod,
        "test Pod",
        &[r#"image: "localhost/curl:stowage""#, "imagePullPolicy: Never"],
    );

    // No class to test (the default): no consumer, no rights on claims; /readyz is still
    // checked. Without the metrics Service there is nothing to ask /readyz through.
    let m = render(&helm, &["--set", "metrics.service.enabled=false"])
        .await
        .unwrap();
    assert!(document(&m, "StatefulSet", "st-stowage-test").is_none());
    let pod = doc(&m, "Pod", "st-stowage-test");
    assert_eq!(env(pod, "CLAIM"), "");
    assert_eq!(env(pod, "SERVICE"), "");
    let role = doc(&m, "Role", "st-stowage-test");
    assert!(role.trim_end().ends_with("rules:"), "no rules needed: {role}");

    // No kubelet runs pods in standalone mode; tests.enabled=false drops them too.
    for set in ["agent.mode=standalone", "tests.enabled=false"] {
        let m = render(&helm, &["--set", set, "--set", "storageClass.create=true"])
            .await
            .unwrap();
        let left: Vec<String> = kinds_and_names(&m)
            .into_iter()
            .filter(|k| k.contains("-test"))
            .collect();
        assert!(left.is_empty(), "{set}: {left:?}");
    }
}
