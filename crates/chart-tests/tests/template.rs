//! `helm lint` and `helm template` of charts/stowage, with the defaults and with every optional
//! feature on, plus the values the chart must refuse. No cluster needed.

use stowage_chart_tests::{Helm, chart_dir, document, kinds_and_names};

/// Every optional feature switched on (the install test turns most of these on in its upgrade).
const ALL_ON: &str = r#"
storageClass: {create: true, default: true, reclaimPolicy: Retain, volumeBindingMode: Immediate, parameters: {extra: "1"}}
metrics: {podAnnotations: true, serviceMonitor: {enabled: true, scrapeTimeout: 10s, labels: {release: prom}}}
agent: {registerNode: true, extraArgs: ["--metrics-bind-address=0.0.0.0:9091"], podAnnotations: {team: storage}}
controller: {extraArgs: ["--binder-max-in-flight=32"], controllers: ["*", "-expand"], nodeSelector: {role: infra}, tolerations: [{operator: Exists}]}
kubeApi: {qps: 20, burst: 40}
imagePullSecrets: [{name: regcred}]
"#;

async fn render(helm: &Helm, extra: &[&str]) -> Result<String, String> {
    let chart = chart_dir();
    let mut args = vec![
        "template",
        "st",
        chart.to_str().unwrap(),
        "--namespace",
        "stowage-system",
    ];
    args.extend_from_slice(extra);
    helm.run(&args).await
}

fn doc<'a>(manifest: &'a str, kind: &str, name: &str) -> &'a str {
    document(manifest, kind, name).unwrap_or_else(|| {
        panic!(
            "no {kind}/{name} in the manifest; it has {:?}",
            kinds_and_names(manifest)
        )
    })
}

/// Asserts that `doc` (described as `what` in the failure) contains every one of `needles`.
#[track_caller]
fn assert_has(doc: &str, what: &str, needles: &[&str]) {
    for needle in needles {
        assert!(doc.contains(needle), "{what} lacks {needle:?}:\n{doc}");
    }
}

#[tokio::test]
async fn lint_is_clean_with_defaults_and_every_option() {
    let helm = Helm::new(None);
    let chart = chart_dir();
    let chart = chart.to_str().unwrap();
    helm.run(&["lint", "--strict", chart]).await.unwrap();
    let all_on = helm.values("all-on.yaml", ALL_ON);
    let out = helm
        .run(&["lint", "--strict", chart, "-f", all_on.to_str().unwrap()])
        .await
        .unwrap();
    assert!(out.contains("0 chart(s) failed"), "{out}");
}

#[tokio::test]
async fn defaults_render_the_core_objects_only() {
    let helm = Helm::new(None);
    let m = render(&helm, &[]).await.unwrap();
    let mut got = kinds_and_names(&m);
    got.sort();
    let mut want = vec![
        "ServiceAccount/st-stowage-controller",
        "ServiceAccount/st-stowage-agent",
        "ClusterRole/st-stowage-controller",
        "ClusterRole/st-stowage-agent",
        "ClusterRoleBinding/st-stowage-controller",
        "ClusterRoleBinding/st-stowage-agent",
        "Role/st-stowage-controller-leader-election",
        "RoleBinding/st-stowage-controller-leader-election",
        "Service/st-stowage-controller-metrics",
        "Service/st-stowage-agent-metrics",
        "Deployment/st-stowage-controller",
        "DaemonSet/st-stowage-agent",
        "CSIDriver/loop.stowage.dev",
    ];
    want.sort();
    assert_eq!(got, want);

    let d = doc(&m, "Deployment", "st-stowage-controller");
    assert_has(
        d,
        "controller Deployment",
        &[
            "replicas: 2",
            "- --leader-elect=true",
            "- --leader-elect-resource-namespace=stowage-system",
            "- --image-dir=/var/lib/stowage/images",
            "- --kube-api-qps=50",
            "- --kube-api-burst=100",
            "path: /healthz",
            "path: /readyz",
            "runAsNonRoot: true",
            "readOnlyRootFilesystem: true",
            "- ALL",
            "type: RuntimeDefault",
            "allowPrivilegeEscalation: false",
            "mountPath: /var/lib/stowage/images",
            "name: image-store-permissions",
        ],
    );
    assert!(!d.contains("prometheus.io/scrape"), "{d}");
    // The image `make image` builds, for the controller and its init container alike (so an
    // imported image is all a node needs); tests/image.rs checks it against the archive.
    let image = format!("image: localhost/stowage:{}", env!("CARGO_PKG_VERSION"));
    assert_eq!(d.matches(&image).count(), 2, "{d}");
    assert_eq!(d.matches("imagePullPolicy: IfNotPresent").count(), 2, "{d}");

    let a = doc(&m, "DaemonSet", "st-stowage-agent");
    assert_has(
        a,
        "agent DaemonSet",
        &[
            "privileged: true",
            "mountPropagation: Bidirectional",
            "path: /dev",
            "fieldPath: spec.nodeName",
            "- --node-name=$(NODE_NAME)",
            "- --root-dir=/var/lib/stowage",
            "- --image-dir=/var/lib/stowage/images",
            "path: /healthz",
            // The image's user is the controller's non-root one; losetup and mount need root.
            "runAsUser: 0",
            &image,
            "imagePullPolicy: IfNotPresent",
        ],
    );
    assert!(!a.contains("--register-node"), "{a}");

    let c = doc(&m, "CSIDriver", "loop.stowage.dev");
    assert!(
        c.contains("attachRequired: true") && c.contains("podInfoOnMount: false"),
        "{c}"
    );
    // Without --register-node the agent may not create Nodes.
    let r = doc(&m, "ClusterRole", "st-stowage-agent");
    assert!(
        r.contains(r#"verbs: ["patch"]"#) && !r.contains(r#""create", "patch""#),
        "{r}"
    );
}

#[tokio::test]
async fn every_option_on_renders() {
    let helm = Helm::new(None);
    let all_on = helm.values("all-on.yaml", ALL_ON);
    let m = render(&helm, &["-f", all_on.to_str().unwrap()]).await.unwrap();

    for name in ["st-stowage-controller", "st-stowage-agent"] {
        let sm = doc(&m, "ServiceMonitor", name);
        assert!(sm.contains("apiVersion: monitoring.coreos.com/v1"), "{sm}");
        assert!(
            sm.contains("release: prom") && sm.contains("scrapeTimeout: 10s"),
            "{sm}"
        );
    }
    let sc = doc(&m, "StorageClass", "loop");
    assert_has(
        sc,
        "StorageClass",
        &[
            "provisioner: loop.stowage.dev",
            "allowVolumeExpansion: true",
            "reclaimPolicy: Retain",
            "volumeBindingMode: Immediate",
            r#"storageclass.kubernetes.io/is-default-class: "true""#,
            r#"extra: "1""#,
        ],
    );
    doc(&m, "Role", "st-stowage-agent-node-lease");
    doc(&m, "RoleBinding", "st-stowage-agent-node-lease");

    let d = doc(&m, "Deployment", "st-stowage-controller");
    assert_has(
        d,
        "controller Deployment",
        &[
            r#"prometheus.io/port: "8080""#,
            "- --controllers=*,-expand",
            r#"- "--binder-max-in-flight=32""#,
            "- --kube-api-qps=20",
            "role: infra",
            "- name: regcred",
        ],
    );
    let a = doc(&m, "DaemonSet", "st-stowage-agent");
    assert_has(
        a,
        "agent DaemonSet",
        &[
            "- --register-node",
            r#"prometheus.io/port: "8081""#,
            "team: storage",
            "- --kube-api-burst=40",
        ],
    );
}

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
    ];
    for (args, why) in cases {
        let e = render(&helm, &args).await.unwrap_err();
        assert!(e.contains(why), "{args:?}: {e}");
    }
    // The valid neighbours of those cases render.
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
