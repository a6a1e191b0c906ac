//! What the chart renders with its defaults and with every option on, and `helm lint` of both.

use stowage_chart_tests::{Helm, chart_dir, document, kinds_and_names};

use crate::{assert_entry, assert_has, assert_host_network_and_apiserver, doc, render};

/// Every optional feature switched on (the install test turns most of these on in its upgrade).
/// `registerNode` needs the kubelet-less mode, so this is the standalone agent; the default csi
/// agent is checked with the same host network and apiserver values in its own test.
const ALL_ON: &str = r#"
storageClass: {create: true, default: true, reclaimPolicy: Retain, volumeBindingMode: Immediate, parameters: {extra: "1"}}
metrics: {podAnnotations: true, serviceMonitor: {enabled: true, scrapeTimeout: 10s, labels: {release: prom}}, readers: [{kind: ServiceAccount, name: prometheus, namespace: monitoring}]}
agent: {mode: standalone, registerNode: true, hostNetwork: true, extraArgs: ["--metrics-bind-address=0.0.0.0:9091"], podAnnotations: {team: storage}}
controller: {hostNetwork: true, extraArgs: ["--binder-max-in-flight=32"], controllers: ["*", "-expand"], nodeSelector: {role: infra}, tolerations: [{operator: Exists}]}
apiServer: {host: 192.0.2.10, port: 6443}
kubeApi: {qps: 20, burst: 40}
imagePullSecrets: [{name: regcred}]
"#;

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
        // The secure metrics port (the default): token and permission checks, and the role a
        // scraper is bound to.
        "ClusterRoleBinding/st-stowage-controller-auth-delegator",
        "ClusterRole/st-stowage-metrics-reader",
        "Role/st-stowage-controller-leader-election",
        "RoleBinding/st-stowage-controller-leader-election",
        // Local mode (the default): the agents publish their stores' capacity here.
        "Role/st-stowage-agent-capacity",
        "RoleBinding/st-stowage-agent-capacity",
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
            "- --image-store-mode=local",
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
        ],
    );
    // Local mode (the default): the nodes' agents make the images; the controller mounts no
    // store and needs no root init container.
    for unwanted in [
        "--image-dir",
        "image-store-permissions",
        "/var/lib/stowage/images",
    ] {
        assert!(
            !d.contains(unwanted),
            "controller Deployment has {unwanted:?}:\n{d}"
        );
    }
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
    assert_eq!(d.matches(&image).count(), 1, "{d}");
    assert_eq!(d.matches("imagePullPolicy: IfNotPresent").count(), 1, "{d}");

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
            "- --image-store-mode=local",
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
    // A store mounted after the pod started is seen: HostToContainer.
    assert_entry(
        a,
        "volumeMounts",
        "images",
        &[
            "mountPath: /var/lib/stowage/images",
            "mountPropagation: HostToContainer",
        ],
    );
    // Local: the node's own directory, made where missing.
    assert_entry(
        a,
        "volumes",
        "images",
        &[
            "hostPath:",
            "path: /var/lib/stowage/images",
            "type: DirectoryOrCreate",
        ],
    );
    // Local mode lets each node make and delete its volumes' images.
    let r = doc(&m, "ClusterRole", "st-stowage-agent");
    assert!(r.contains(r#"verbs: ["update", "delete"]"#), "{r}");

    // Shared mode: one store, mounted by the controller too (after its permissions are fixed),
    // and never created on a node that lacks the mount point.
    let shared = render(&Helm::new(None), &["--set", "imageStore.mode=shared"])
        .await
        .unwrap();
    let sd = doc(&shared, "Deployment", "st-stowage-controller");
    assert_has(
        sd,
        "controller Deployment (shared)",
        &[
            "- --image-store-mode=shared",
            "- --image-dir=/var/lib/stowage/images",
            "name: image-store-permissions",
        ],
    );
    // The controller's own mount sees a store mounted late (the init container's needs not).
    assert_eq!(sd.matches("mountPropagation: HostToContainer").count(), 1, "{sd}");
    let sa = doc(&shared, "DaemonSet", "st-stowage-agent");
    assert_has(sa, "agent DaemonSet (shared)", &["- --image-store-mode=shared"]);
    for pod in [sd, sa] {
        assert_entry(
            pod,
            "volumes",
            "images",
            &["hostPath:", "path: /var/lib/stowage/images", "type: Directory"],
        );
    }
    let sr = doc(&shared, "ClusterRole", "st-stowage-agent");
    assert!(
        !sr.contains(r#""delete""#),
        "shared mode: the agent deletes no volume\n{sr}"
    );
    // Both pods use the pod network and the in-cluster apiserver address by default.
    for (what, pod) in [("controller Deployment", d), ("agent DaemonSet", a)] {
        for unwanted in ["hostNetwork", "dnsPolicy", "KUBERNETES_SERVICE_"] {
            assert!(!pod.contains(unwanted), "{what} has {unwanted:?}:\n{pod}");
        }
    }
    // Without --register-node the agent may not create Nodes: its nodes rule only patches.
    let nodes_rule = r
        .split("resources: [\"nodes\"]")
        .nth(1)
        .and_then(|rest| rest.lines().nth(1))
        .unwrap_or_else(|| panic!("no nodes rule:\n{r}"));
    assert_eq!(nodes_rule.trim(), r#"verbs: ["patch"]"#, "{r}");
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
    assert_has(
        doc(&m, "ClusterRoleBinding", "st-stowage-metrics-reader"),
        "metrics readers",
        &[
            "name: st-stowage-metrics-reader",
            "kind: ServiceAccount",
            "name: prometheus",
            "namespace: monitoring",
        ],
    );

    let d = doc(&m, "Deployment", "st-stowage-controller");
    assert_has(
        d,
        "controller Deployment",
        &[
            r#"prometheus.io/port: "10257""#,
            "prometheus.io/scheme: https",
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
async fn the_secure_port_replaces_plain_metrics_everywhere_it_is_read() {
    let helm = Helm::new(None);
    let values = helm.values(
        "secure.yaml",
        r#"
controller:
  securePort: 10257
metrics:
  podAnnotations: true
  serviceMonitor:
    enabled: true
    jobLabel: app.kubernetes.io/component
    relabelings:
      - targetLabel: cluster
        replacement: prod
    metricRelabelings:
      - sourceLabels: [__name__]
        regex: go_.*
        action: drop
"#,
    );
    let m = render(&helm, &["-f", values.to_str().unwrap()]).await.unwrap();
    let d = doc(&m, "Deployment", "st-stowage-controller");
    assert_has(
        d,
        "controller Deployment",
        &[
            "- --secure-port=10257",
            "- --metrics-bind-address=0",
            "containerPort: 10257",
            "scheme: HTTPS",
            r#"prometheus.io/port: "10257""#,
            "prometheus.io/scheme: https",
        ],
    );
    assert!(!d.contains("0.0.0.0:8080"), "no plain metrics port: {d}");
    assert_has(
        doc(&m, "Service", "st-stowage-controller-metrics"),
        "controller metrics Service",
        &["port: 10257", "targetPort: metrics"],
    );
    let sm = doc(&m, "ServiceMonitor", "st-stowage-controller");
    assert_has(
        sm,
        "controller ServiceMonitor",
        &[
            "jobLabel: app.kubernetes.io/component",
            "scheme: https",
            "bearerTokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token",
            "insecureSkipVerify: true",
            "targetLabel: cluster",
            "action: drop",
        ],
    );
    // The agent keeps plain HTTP (it has no secure port) but takes the same relabelings.
    let agent_sm = doc(&m, "ServiceMonitor", "st-stowage-agent");
    assert!(!agent_sm.contains("scheme: https"), "{agent_sm}");
    assert_has(agent_sm, "agent ServiceMonitor", &["targetLabel: cluster"]);
    assert_has(
        doc(&m, "ClusterRoleBinding", "st-stowage-controller-auth-delegator"),
        "auth delegation",
        &["name: system:auth-delegator", "name: st-stowage-controller"],
    );
    assert_has(
        doc(&m, "ClusterRole", "st-stowage-metrics-reader"),
        "metrics reader",
        &[r#"nonResourceURLs: ["/metrics"]"#],
    );
    // helm test asks /readyz through the service proxy over TLS, and may only do that.
    assert!(
        m.contains(r#"resourceNames: ["https:st-stowage-controller-metrics:metrics"]"#),
        "{m}"
    );
    assert!(
        m.contains(r#"value: "https:st-stowage-controller-metrics:metrics""#),
        "{m}"
    );

    // The default is that port; 0 turns all of it off, for plain HTTP on metricsPort.
    let default = render(&helm, &[]).await.unwrap();
    assert_has(
        doc(&default, "Deployment", "st-stowage-controller"),
        "controller Deployment",
        &[
            "- --secure-port=10257",
            "- --metrics-bind-address=0",
            "scheme: HTTPS",
        ],
    );
    // No readers named: the role is there to bind, no binding is made.
    assert!(document(&default, "ClusterRoleBinding", "st-stowage-metrics-reader").is_none());
    let plain = render(&helm, &["--set", "controller.securePort=0"])
        .await
        .unwrap();
    assert_has(
        doc(&plain, "Deployment", "st-stowage-controller"),
        "controller Deployment",
        &["- --metrics-bind-address=0.0.0.0:8080", "containerPort: 8080"],
    );
    assert!(!plain.contains("scheme: HTTPS"), "{plain}");
    assert!(!plain.contains("metrics-reader"), "{plain}");
    assert!(!plain.contains("--secure-port"), "{plain}");
    assert!(!plain.contains("auth-delegator"), "{plain}");
    assert!(
        plain.contains(r#"resourceNames: ["st-stowage-controller-metrics:metrics"]"#),
        "{plain}"
    );
}

#[tokio::test]
async fn the_pod_monitor_scrapes_the_agents_with_their_node() {
    let helm = Helm::new(None);
    let values = helm.values(
        "podmonitor.yaml",
        r#"
metrics:
  serviceMonitor:
    enabled: true
  podMonitor:
    enabled: true
    interval: 15s
    scrapeTimeout: 5s
    labels: {release: prom}
    jobLabel: app.kubernetes.io/component
    relabelings:
      - targetLabel: cluster
        replacement: prod
    metricRelabelings:
      - sourceLabels: [__name__]
        regex: go_.*
        action: drop
"#,
    );
    let m = render(&helm, &["-f", values.to_str().unwrap()]).await.unwrap();
    let pm = doc(&m, "PodMonitor", "st-stowage-agent");
    assert_has(
        pm,
        "agent PodMonitor",
        &[
            "apiVersion: monitoring.coreos.com/v1",
            "release: prom",
            "jobLabel: app.kubernetes.io/component",
            "app.kubernetes.io/component: agent",
            r#"matchNames: ["stowage-system"]"#,
            "- port: metrics",
            "interval: 15s",
            "scrapeTimeout: 5s",
            "targetLabel: cluster",
            "action: drop",
        ],
    );
    // The node relabeling comes first, so a user's relabelings can read or override `node`.
    let node = pm
        .find("sourceLabels: [__meta_kubernetes_pod_node_name]")
        .expect(pm);
    let user = pm.find("targetLabel: cluster").unwrap();
    assert!(node < user, "{pm}");
    assert!(
        pm[node..].lines().nth(1).unwrap().contains("targetLabel: node"),
        "{pm}"
    );
    // A series' own `node` (renamed exported_node by Prometheus) is mapped back and the copy dropped.
    assert_has(
        pm,
        "agent PodMonitor",
        &[
            "sourceLabels: [exported_node]",
            "regex: exported_node",
            "action: labeldrop",
        ],
    );
    // The agents are the PodMonitor's: the ServiceMonitor is the controller's only.
    assert!(
        document(&m, "ServiceMonitor", "st-stowage-agent").is_none(),
        "{m}"
    );
    doc(&m, "ServiceMonitor", "st-stowage-controller");

    // Off by default; on alone, it needs no ServiceMonitor and leaves the agent's Service alone.
    let plain = render(&helm, &[]).await.unwrap();
    assert!(!plain.contains("kind: PodMonitor"), "{plain}");
    let alone = render(&helm, &["--set", "metrics.podMonitor.enabled=true"])
        .await
        .unwrap();
    doc(&alone, "PodMonitor", "st-stowage-agent");
    assert!(!alone.contains("kind: ServiceMonitor"), "{alone}");
    doc(&alone, "Service", "st-stowage-agent-metrics");
}
