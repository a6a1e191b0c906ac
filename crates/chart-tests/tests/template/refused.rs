//! Values the chart refuses, each with the reason it gives, beside the valid neighbours that
//! render.

use std::collections::BTreeSet;

use stowage_chart_tests::{Helm, chart_dir, kinds_and_names};

use crate::{assert_has, doc, render};

#[tokio::test]
async fn bad_values_are_refused_with_a_reason() {
    let helm = Helm::new(None);
    let cases = [
        (
            vec!["--set", "imageStore.type=pvc"],
            "imageStore.existingClaim is required",
        ),
        (
            vec!["--set", "imageStore.type=nfs"],
            "imageStore.type must be hostPath or pvc",
        ),
        (
            vec![
                "--set",
                "storageClass.create=true,storageClass.fsType=xfs,imageStore.mode=shared",
            ],
            "storageClass.fsType xfs needs imageStore.mode local",
        ),
        (
            vec!["--set", "imageStore.mode=nfs"],
            r#"imageStore.mode must be local or shared, not "nfs""#,
        ),
        (
            vec!["--set", "controller.leaderElection.enabled=false"],
            "needs controller.leaderElection.enabled",
        ),
        (
            vec!["--set", "serviceAccount.create=false"],
            "serviceAccount.controllerName is required",
        ),
        (
            vec![
                "--set",
                "imageStore.mode=shared,imageStore.fixPermissions.image.repository=busybox",
            ],
            "imageStore.fixPermissions.image.tag is required",
        ),
        (
            vec!["--set", "agent.mode=kubeletless"],
            r#"agent.mode must be csi (beside a kubelet) or standalone (nodes without a kubelet), not "kubeletless""#,
        ),
        (
            vec!["--set", "agent.mode="],
            "agent.mode must be csi (beside a kubelet) or standalone",
        ),
        (
            // registerNode in the default (csi) mode.
            vec!["--set", "agent.registerNode=true"],
            "agent.registerNode is for nodes without a kubelet: it needs agent.mode=standalone",
        ),
        (
            vec!["--set", "agent.mode=csi,agent.registerNode=true"],
            "agent.registerNode is for nodes without a kubelet: it needs agent.mode=standalone",
        ),
        (
            vec!["--set", "apiServer.host=10.0.0.1"],
            "apiServer.host and apiServer.port go together",
        ),
        (
            vec!["--set", "apiServer.port=6443"],
            "apiServer.host and apiServer.port go together",
        ),
        // values.schema.json: a misspelled key, at the top or nested, is refused, not ignored.
        (
            vec!["--set", "tests.timeoutSecond=60"],
            "additional properties 'timeoutSecond' not allowed",
        ),
        (
            vec!["--set", "tests.image.pullPolicy=Sometimes"],
            "value must be one of 'Always', 'IfNotPresent', 'Never'",
        ),
        (
            vec!["--set", "controller.replica=3"],
            "additional properties 'replica' not allowed",
        ),
        (
            vec!["--set", "kubeAPI.qps=5"],
            "additional properties 'kubeAPI' not allowed",
        ),
        (
            vec!["--set", "logFormat=xml"],
            "value must be one of 'text', 'json'",
        ),
        (vec!["--set", "controller.replicas=0"], "minimum"),
        // A controller name stowage-controller would refuse at start is refused at install.
        (
            vec![
                "--set",
                "controller.controllers={*,-persistentvolume-binder-controler}",
            ],
            "at '/controller/controllers/1': value must be one of '*', 'binder'",
        ),
    ];
    for (args, why) in cases {
        let e = render(&helm, &args).await.unwrap_err();
        assert!(e.contains(why), "{args:?}: {e}");
    }
    // One replica: no PodDisruptionBudget (it could only block drains).
    let one = render(
        &helm,
        &[
            "--set",
            "controller.replicas=1,controller.leaderElection.enabled=false",
        ],
    )
    .await
    .unwrap();
    assert!(
        !kinds_and_names(&one)
            .iter()
            .any(|k| k.starts_with("PodDisruptionBudget/")),
        "no PDB for one replica"
    );
    // The valid neighbours of those cases render.
    render(&helm, &["--set", "agent.mode=standalone,agent.registerNode=true"])
        .await
        .unwrap();
    render(&helm, &["--set", "apiServer.host=10.0.0.1,apiServer.port=6443"])
        .await
        .unwrap();
    render(
        &helm,
        &["--set", "imageStore.type=pvc,imageStore.existingClaim=images"],
    )
    .await
    .unwrap();
    render(
        &helm,
        &[
            "--set",
            "controller.leaderElection.enabled=false,controller.replicas=1",
        ],
    )
    .await
    .unwrap();
    let m = render(
        &helm,
        &[
            "--set",
            "imageStore.mode=shared,imageStore.fixPermissions.image.repository=busybox,imageStore.fixPermissions.image.tag=1.37,image.repository=registry.example/stowage,image.tag=v9",
        ],
    )
    .await
    .unwrap();
    let d = doc(&m, "Deployment", "st-stowage-controller");
    assert_has(
        d,
        "controller Deployment",
        &[r#"image: "busybox:1.37""#, "image: registry.example/stowage:v9"],
    );
}

/// values.schema.json accepts exactly the `controller.controllers` entries stowage-controller
/// accepts: `*`, and each of its names and kube-controller-manager's, alone or negated.
#[test]
fn the_schema_knows_the_controllers_names() {
    let schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(chart_dir().join("values.schema.json")).unwrap())
            .unwrap();
    let listed: BTreeSet<String> =
        schema["properties"]["controller"]["properties"]["controllers"]["items"]["enum"]
            .as_array()
            .expect("an enum of controller names")
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
    let names = stowage_controller::CONTROLLERS
        .iter()
        .map(|(n, _)| *n)
        .chain(stowage_controller::KCM_ALIASES.iter().map(|(k, _)| *k));
    let accepted: BTreeSet<String> = names
        .flat_map(|n| [n.to_string(), format!("-{n}")])
        .chain(["*".to_string()])
        .collect();
    assert_eq!(listed, accepted);
    for entry in &accepted {
        assert!(
            stowage_controller::resolve_controllers(std::slice::from_ref(entry)).is_ok(),
            "{entry}"
        );
    }
}

/// `helm lint --strict` fails on a misspelled value, whether it comes from a values file or
/// `--set`, at the top level or nested: values.schema.json sets `additionalProperties: false`
/// throughout, so a typo is an error in CI rather than a setting silently ignored.
#[tokio::test]
async fn lint_fails_on_a_misspelled_value() {
    let helm = Helm::new(None);
    let chart = chart_dir();
    let chart = chart.to_str().unwrap();
    let typo = helm.values("typo.yaml", "controller:\n  replica: 3\n");
    let e = helm
        .run(&["lint", "--strict", chart, "-f", typo.to_str().unwrap()])
        .await
        .unwrap_err();
    assert!(e.contains("additional properties 'replica' not allowed"), "{e}");
    assert!(e.contains("1 chart(s) failed"), "{e}");
    let e = helm
        .run(&["lint", "--strict", chart, "--set", "logFormt=json"])
        .await
        .unwrap_err();
    assert!(e.contains("additional properties 'logFormt' not allowed"), "{e}");
    // The same keys spelled right lint clean.
    let right = helm.values("right.yaml", "controller:\n  replicas: 3\n");
    helm.run(&[
        "lint",
        "--strict",
        chart,
        "-f",
        right.to_str().unwrap(),
        "--set",
        "logFormat=json",
    ])
    .await
    .unwrap();
}
