//! `helm lint` and `helm template` of charts/stowage, with the defaults and with every optional
//! feature on, plus the values the chart must refuse. No cluster needed.

use std::collections::BTreeSet;

use stowage_chart_tests::{Helm, chart_dir, document, kinds_and_names};

/// Every optional feature switched on (the install test turns most of these on in its upgrade).
/// `registerNode` needs the kubelet-less mode, so this is the standalone agent; the default csi
/// agent is checked with the same host network and apiserver values in its own test.
const ALL_ON: &str = r#"
storageClass: {create: true, default: true, reclaimPolicy: Retain, volumeBindingMode: Immediate, parameters: {extra: "1"}}
metrics: {podAnnotations: true, serviceMonitor: {enabled: true, scrapeTimeout: 10s, labels: {release: prom}}}
agent: {mode: standalone, registerNode: true, hostNetwork: true, extraArgs: ["--metrics-bind-address=0.0.0.0:9091"], podAnnotations: {team: storage}}
controller: {hostNetwork: true, extraArgs: ["--binder-max-in-flight=32"], controllers: ["*", "-expand"], nodeSelector: {role: infra}, tolerations: [{operator: Exists}]}
apiServer: {host: 192.0.2.10, port: 6443}
kubeApi: {qps: 20, burst: 40}
imagePullSecrets: [{name: regcred}]
"#;

/// The entry named `name` of the first list `section` (e.g. `volumeMounts`, `volumes`) of a
/// rendered document: its lines after `- name: <name>`, trimmed, without comments. `None` when
/// the section has no such entry.
fn list_entry(doc: &str, section: &str, name: &str) -> Option<Vec<String>> {
    let indent = |l: &str| l.len() - l.trim_start().len();
    let significant = |l: &&str| !l.trim().is_empty() && !l.trim_start().starts_with('#');
    let mut lines = doc.lines().skip_while(|l| l.trim() != format!("{section}:"));
    let section_indent = indent(lines.next()?);
    let mut lines = lines.filter(significant);
    while let Some(l) = lines.next() {
        if indent(l) <= section_indent {
            return None;
        }
        if l.trim() == format!("- name: {name}") {
            let entry_indent = indent(l);
            return Some(
                lines
                    .take_while(|l| indent(l) > entry_indent)
                    .map(|l| l.trim().to_string())
                    .collect(),
            );
        }
    }
    None
}

/// Asserts the entry `name` of `section` in `doc` is exactly `want`.
#[track_caller]
fn assert_entry(doc: &str, section: &str, name: &str, want: &[&str]) {
    let got = list_entry(doc, section, name);
    assert_eq!(
        got.as_deref(),
        Some(&want.iter().map(|w| w.to_string()).collect::<Vec<_>>()[..]),
        "{section} entry {name}:\n{doc}"
    );
}

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
        // Two replicas by default: a drain takes one at a time.
        "PodDisruptionBudget/st-stowage-controller",
        // `helm test` hooks (helm template renders them; helm install does not create them).
        // No StorageClass by default, so no claim and consumer: /readyz only.
        "ServiceAccount/st-stowage-test",
        "Role/st-stowage-test",
        "RoleBinding/st-stowage-test",
        "Pod/st-stowage-test",
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
            "- --kube-api-burst=100",
            "- --kube-api-max-qps=2000",
            "- --log-format=text",
            "- --v=2",
            "priorityClassName: system-cluster-critical",
            "revisionHistoryLimit: 10",
            "topologyKey: kubernetes.io/hostname",
            "topologyKey: topology.kubernetes.io/zone",
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
    // No fixed rate by default: the controller's adaptive limiter applies.
    assert!(!d.contains("--kube-api-qps"), "{d}");
    // Spreading is soft (a one-node cluster runs every replica) and is all the scheduling
    // preference the defaults add.
    assert_eq!(d.matches("whenUnsatisfiable: ScheduleAnyway").count(), 2, "{d}");
    assert!(!d.contains("affinity:"), "{d}");
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
    // The default mode, csi: checked in detail by default_agent_is_the_csi_node_plugin; the
    // CSIDriver by csi_driver_suits_the_kubelet.
    assert_has(a, "agent DaemonSet", &["- --kubelet-dir=/var/lib/kubelet"]);
    assert!(!a.contains("--register-node"), "{a}");
    // losetup needs the host's loop devices, in both modes.
    assert_entry(a, "volumeMounts", "dev", &["mountPath: /dev"]);
    assert_entry(
        a,
        "volumes",
        "dev",
        &["hostPath:", "path: /dev", "type: Directory"],
    );
    assert_entry(
        a,
        "volumeMounts",
        "images",
        &["mountPath: /var/lib/stowage/images"],
    );
    // Both pods use the pod network and the in-cluster apiserver address by default.
    for (what, pod) in [("controller Deployment", d), ("agent DaemonSet", a)] {
        for unwanted in ["hostNetwork", "dnsPolicy", "KUBERNETES_SERVICE_"] {
            assert!(!pod.contains(unwanted), "{what} has {unwanted:?}:\n{pod}");
        }
    }
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
    assert!(!a.contains("--kubelet-dir"), "{a}");
    for (what, pod) in [("controller Deployment", d), ("agent DaemonSet", a)] {
        assert_host_network_and_apiserver(pod, what, "192.0.2.10", "6443");
    }
}

/// `pod` runs in the host's network namespace with cluster DNS, and its container reaches the
/// apiserver at `host`:`port`.
#[track_caller]
fn assert_host_network_and_apiserver(pod: &str, what: &str, host: &str, port: &str) {
    assert_has(
        pod,
        what,
        &[
            "\n      hostNetwork: true\n",
            "\n      dnsPolicy: ClusterFirstWithHostNet\n",
        ],
    );
    assert_entry(
        pod,
        "env",
        "KUBERNETES_SERVICE_HOST",
        &[&format!("value: \"{host}\"")],
    );
    assert_entry(
        pod,
        "env",
        "KUBERNETES_SERVICE_PORT",
        &[&format!("value: \"{port}\"")],
    );
}

#[tokio::test]
async fn default_agent_is_the_csi_node_plugin() {
    let helm = Helm::new(None);
    for m in [
        render(&helm, &[]).await.unwrap(),
        render(&helm, &["--set", "agent.mode=csi"]).await.unwrap(),
    ] {
        let a = doc(&m, "DaemonSet", "st-stowage-agent");
        assert_has(
            a,
            "agent DaemonSet",
            &[
                "- --kubelet-dir=/var/lib/kubelet",
                "- --root-dir=/var/lib/stowage",
                "privileged: true",
            ],
        );
        // The kubelet keeps the Node; the agent's own volume manager does not run.
        assert!(!a.contains("--register-node"), "{a}");
        // The kubelet's root dir at its own path: the CSI sockets, and the stage and publish
        // mounts the kubelet asks for, which must reach the host.
        assert_entry(
            a,
            "volumeMounts",
            "kubelet-dir",
            &["mountPath: /var/lib/kubelet", "mountPropagation: Bidirectional"],
        );
        assert_entry(
            a,
            "volumes",
            "kubelet-dir",
            &["hostPath:", "path: /var/lib/kubelet", "type: Directory"],
        );
        // The agent's root dir only holds CSI stage records: no propagation.
        assert_entry(a, "volumeMounts", "root-dir", &["mountPath: /var/lib/stowage"]);
        assert_entry(
            a,
            "volumes",
            "root-dir",
            &["hostPath:", "path: /var/lib/stowage", "type: DirectoryOrCreate"],
        );
        assert_eq!(a.matches("mountPropagation:").count(), 1, "{a}");
    }

    // Another kubelet root dir moves the flag, the mount and the volume together.
    let m = render(&helm, &["--set", "agent.kubeletDir=/data/kubelet"])
        .await
        .unwrap();
    let a = doc(&m, "DaemonSet", "st-stowage-agent");
    assert_has(a, "agent DaemonSet", &["- --kubelet-dir=/data/kubelet"]);
    assert_entry(
        a,
        "volumeMounts",
        "kubelet-dir",
        &["mountPath: /data/kubelet", "mountPropagation: Bidirectional"],
    );
    assert_entry(
        a,
        "volumes",
        "kubelet-dir",
        &["hostPath:", "path: /data/kubelet", "type: Directory"],
    );
    assert!(!a.contains("/var/lib/kubelet"), "{a}");
}

#[tokio::test]
async fn standalone_agent_renders_the_kubelet_less_node() {
    let helm = Helm::new(None);
    for (set, register) in [
        ("agent.mode=standalone", false),
        ("agent.mode=standalone,agent.registerNode=true", true),
    ] {
        let m = render(&helm, &["--set", set]).await.unwrap();
        let a = doc(&m, "DaemonSet", "st-stowage-agent");
        assert_has(
            a,
            "agent DaemonSet",
            &[
                "- --node-name=$(NODE_NAME)",
                "- --root-dir=/var/lib/stowage",
                "- --image-dir=/var/lib/stowage/images",
                "- --metrics-bind-address=0.0.0.0:8081",
                "- --kube-api-burst=100",
                "privileged: true",
            ],
        );
        // No qps by default: the agent's own fixed default applies.
        assert!(!a.contains("--kube-api-qps"), "{set}:\n{a}");
        assert_eq!(a.contains("- --register-node"), register, "{set}:\n{a}");
        // No kubelet: no --kubelet-dir and no kubelet dir volume.
        assert!(!a.contains("kubelet-dir"), "{set}:\n{a}");
        assert!(list_entry(a, "volumes", "kubelet-dir").is_none(), "{a}");
        // The agent mounts devices and pod volumes under its root dir itself.
        assert_entry(
            a,
            "volumeMounts",
            "root-dir",
            &["mountPath: /var/lib/stowage", "mountPropagation: Bidirectional"],
        );
        assert_entry(
            a,
            "volumes",
            "root-dir",
            &["hostPath:", "path: /var/lib/stowage", "type: DirectoryOrCreate"],
        );
        assert_entry(a, "volumeMounts", "dev", &["mountPath: /dev"]);
        assert_eq!(a.matches("mountPropagation:").count(), 1, "{a}");

        // The standalone agent watches its Node (volumesAttached) and reads it before a first
        // mount; --register-node, and only it, brings Node creation and kube-node-lease rights.
        let r = doc(&m, "ClusterRole", "st-stowage-agent");
        let verbs = if register {
            r#"verbs: ["get", "list", "watch", "create", "patch"]"#
        } else {
            r#"verbs: ["get", "list", "watch", "patch"]"#
        };
        assert!(r.contains(verbs), "{set}: {verbs}\n{r}");
        assert_eq!(
            document(&m, "Role", "st-stowage-agent-node-lease").is_some(),
            register,
            "{set}"
        );
    }
}

#[tokio::test]
async fn host_network_and_apiserver_reach_both_pods() {
    let helm = Helm::new(None);
    let m = render(
        &helm,
        &[
            "--set",
            "agent.hostNetwork=true,controller.hostNetwork=true",
            "--set",
            "apiServer.host=10.20.30.40,apiServer.port=6443",
        ],
    )
    .await
    .unwrap();
    let d = doc(&m, "Deployment", "st-stowage-controller");
    let a = doc(&m, "DaemonSet", "st-stowage-agent");
    assert_host_network_and_apiserver(d, "controller Deployment", "10.20.30.40", "6443");
    assert_host_network_and_apiserver(a, "agent DaemonSet", "10.20.30.40", "6443");
    // The values still sit beside the Downward API variables (csi mode here).
    assert_has(
        a,
        "agent DaemonSet",
        &["fieldPath: spec.nodeName", "- --kubelet-dir=/var/lib/kubelet"],
    );
    assert_has(d, "controller Deployment", &["fieldPath: metadata.name"]);

    // Each workload's switch is its own; the apiserver address is a string either way.
    let m = render(
        &helm,
        &[
            "--set",
            "agent.hostNetwork=true",
            "--set-string",
            "apiServer.host=apiserver.example,apiServer.port=443",
        ],
    )
    .await
    .unwrap();
    let d = doc(&m, "Deployment", "st-stowage-controller");
    let a = doc(&m, "DaemonSet", "st-stowage-agent");
    assert!(!d.contains("hostNetwork") && !d.contains("dnsPolicy"), "{d}");
    assert_has(a, "agent DaemonSet", &["hostNetwork: true"]);
    for pod in [d, a] {
        assert_entry(
            pod,
            "env",
            "KUBERNETES_SERVICE_HOST",
            &[r#"value: "apiserver.example""#],
        );
        assert_entry(pod, "env", "KUBERNETES_SERVICE_PORT", &[r#"value: "443""#]);
    }
}

#[tokio::test]
async fn csi_driver_suits_the_kubelet() {
    let helm = Helm::new(None);
    for set in ["agent.mode=csi", "agent.mode=standalone"] {
        let m = render(&helm, &["--set", set]).await.unwrap();
        let c = doc(&m, "CSIDriver", "loop.stowage.dev");
        let spec: Vec<&str> = c
            .lines()
            .skip_while(|l| *l != "spec:")
            .skip(1)
            .map(str::trim)
            .filter(|l| !l.starts_with('#'))
            .collect();
        assert_eq!(
            spec,
            [
                "attachRequired: true",
                "podInfoOnMount: false",
                "fsGroupPolicy: File",
                "volumeLifecycleModes:",
                "- Persistent",
                "requiresRepublish: false",
                "storageCapacity: false",
            ],
            "{set}:\n{c}"
        );
    }
    let m = render(&helm, &["--set", "csiDriver.create=false"]).await.unwrap();
    assert!(document(&m, "CSIDriver", "loop.stowage.dev").is_none());
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
            r#"resourceNames: ["st-stowage-controller-metrics:metrics"]"#,
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
            "services/$SERVICE:metrics/proxy/readyz",
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
