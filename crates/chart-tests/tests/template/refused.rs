//! Values the chart refuses, each with the reason it gives, beside the valid neighbours that
//! render.

use stowage_chart_tests::{Helm, kinds_and_names};

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
            vec!["--set", "controller.leaderElection.enabled=false"],
            "needs controller.leaderElection.enabled",
        ),
        (
            vec!["--set", "serviceAccount.create=false"],
            "serviceAccount.controllerName is required",
        ),
        (
            vec!["--set", "imageStore.fixPermissions.image.repository=busybox"],
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
            "imageStore.fixPermissions.image.repository=busybox,imageStore.fixPermissions.image.tag=1.37,image.repository=registry.example/stowage,image.tag=v9",
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
