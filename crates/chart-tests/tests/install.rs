//! A real `helm install`, `helm upgrade` and `helm uninstall` of charts/stowage into the test
//! kit's kube-apiserver, which validates every object. No kubelet or scheduler runs, so no pod
//! starts; the test checks the objects, and the service accounts' rights with
//! `kubectl auth can-i`. Timeouts are bounds, not speeds. (Over 600 lines: one story whose steps
//! build on each other on one control plane, install then upgrade then uninstall, and the few
//! helpers only it uses.)

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Container, Namespace, PodSpec, Probe, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::api::storage::v1::{CSIDriver, StorageClass};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube::{Client, Resource};
use serde_json::json;
use stowage_chart_tests::{Helm, can_i, chart_dir};
use stowage_testkit::{ControlPlane, eventually, unique};

const BOUND: Duration = Duration::from_secs(60);
const RELEASE: &str = "st";
const CONTROLLER: &str = "st-stowage-controller";
const AGENT: &str = "st-stowage-agent";

const INSTALL_VALUES: &str = r#"
storageClass: {create: true, reclaimPolicy: Retain, volumeBindingMode: Immediate}
"#;

/// Changed on upgrade: more replicas, another QPS, the standalone agent with --register-node
/// (and its extra rights), host networking and an explicit apiserver address for both pods,
/// scrape annotations, ServiceMonitors, the class made the default.
const UPGRADE_VALUES: &str = r#"
storageClass: {create: true, default: true, reclaimPolicy: Retain, volumeBindingMode: Immediate}
controller: {replicas: 3, hostNetwork: true, extraArgs: ["--binder-max-in-flight=32"]}
kubeApi: {qps: 20}
agent: {mode: standalone, registerNode: true, hostNetwork: true}
apiServer: {host: 192.0.2.10, port: 6443}
metrics: {podAnnotations: true, serviceMonitor: {enabled: true}}
"#;

// kube-controller-manager's names of the controllers stowage replaces (cmd/kube-controller-manager/names).
const BINDER: &str = "persistentvolume-binder-controller";
const PV_PROTECTION: &str = "persistentvolume-protection-controller";
const PVC_PROTECTION: &str = "persistentvolumeclaim-protection-controller";
const ATTACH_DETACH: &str = "persistentvolume-attach-detach-controller";
const EXPANDER: &str = "persistentvolume-expander-controller";

/// kubeadm's `--controllers` value: KCM's default plus the two controllers a join needs.
const KUBEADM_CONTROLLERS: &str = "*,bootstrapsigner,tokencleaner";

/// The controllers the NOTES' whole flag for kubeadm (`--controllers=<kubeadm's value>,-a,-b`)
/// turns off. The NOTES never print a bare `--controllers=*,-…` (it would drop kubeadm's opt-in
/// controllers, and no new node could join).
fn kcm_flag(out: &str) -> Vec<&str> {
    assert!(
        !out.lines().any(|l| l.trim().starts_with("--controllers=*,-")),
        "NOTES print a --controllers value without the distribution's own:\n{out}"
    );
    let prefix = format!("--controllers={KUBEADM_CONTROLLERS}");
    let value = out
        .lines()
        .find_map(|l| l.trim().strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("no {prefix} line in the NOTES:\n{out}"));
    value
        .split(',')
        .filter(|c| !c.is_empty())
        .map(|c| {
            c.strip_prefix('-')
                .unwrap_or_else(|| panic!("{c} in {value} is not turned off"))
        })
        .collect()
}

fn service_monitor() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(
        "monitoring.coreos.com",
        "v1",
        "ServiceMonitor",
    ))
}

/// The smallest ServiceMonitor CRD that lets the apiserver store one (the Prometheus Operator's
/// full schema is not needed to test that the chart's object is accepted).
async fn install_service_monitor_crd(client: &Client) {
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": "servicemonitors.monitoring.coreos.com" },
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": { "plural": "servicemonitors", "singular": "servicemonitor",
                       "kind": "ServiceMonitor", "listKind": "ServiceMonitorList" },
            "versions": [{ "name": "v1", "served": true, "storage": true,
                "schema": { "openAPIV3Schema": { "type": "object",
                    "x-kubernetes-preserve-unknown-fields": true } } }]
        }
    }))
    .unwrap();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.create(&PostParams::default(), &crd).await.unwrap();
    eventually(BOUND, || {
        let api = api.clone();
        async move {
            let crd = api
                .get("servicemonitors.monitoring.coreos.com")
                .await
                .map_err(|e| e.to_string())?;
            let established = crd
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            if established {
                Ok(())
            } else {
                Err("CRD not Established yet".into())
            }
        }
    })
    .await;
}

/// The object of kind `ar` named `name` exists (in `ns` when namespaced).
async fn exists(client: &Client, ar: &ApiResource, ns: Option<&str>, name: &str) -> bool {
    let api: Api<DynamicObject> = match ns {
        Some(ns) => Api::namespaced_with(client.clone(), ns, ar),
        None => Api::all_with(client.clone(), ar),
    };
    api.get_opt(name)
        .await
        .unwrap_or_else(|e| panic!("get {} {name}: {e}", ar.kind))
        .is_some()
}

fn erase<K: Resource<DynamicType = ()>>() -> ApiResource {
    ApiResource::erase::<K>(&())
}

fn only_container(spec: Option<&PodSpec>) -> &Container {
    let spec = spec.expect("pod template spec");
    assert_eq!(spec.containers.len(), 1, "one container");
    &spec.containers[0]
}

fn args(c: &Container) -> Vec<String> {
    c.args.clone().unwrap_or_default()
}

/// The propagation of `c`'s mount at `path` (`Some(None)`: mounted without one).
fn propagation(c: &Container, path: &str) -> Option<Option<String>> {
    c.volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == path)
        .map(|m| m.mount_propagation.clone())
}

/// The value of `c`'s plain environment variable `name`.
fn env_value(c: &Container, name: &str) -> Option<String> {
    c.env
        .iter()
        .flatten()
        .find(|e| e.name == name)
        .and_then(|e| e.value.clone())
}

/// Both ways a pod reaches the apiserver after the upgrade: the host's network with cluster DNS,
/// and the explicit address.
fn assert_host_network_and_apiserver(what: &str, spec: Option<&PodSpec>) {
    let pod = spec.expect("pod template spec");
    assert_eq!(pod.host_network, Some(true), "{what}");
    assert_eq!(
        pod.dns_policy.as_deref(),
        Some("ClusterFirstWithHostNet"),
        "{what}"
    );
    let c = only_container(spec);
    assert_eq!(
        env_value(c, "KUBERNETES_SERVICE_HOST").as_deref(),
        Some("192.0.2.10"),
        "{what}"
    );
    assert_eq!(
        env_value(c, "KUBERNETES_SERVICE_PORT").as_deref(),
        Some("6443"),
        "{what}"
    );
}

/// Runs `(question, expected)` through `kubectl auth can-i` as `sa` and reports every mismatch.
async fn assert_rights(kubeconfig: &Path, ns: &str, sa: &str, cases: &[(&str, bool)]) {
    let mut wrong = Vec::new();
    for (question, want) in cases {
        let got = can_i(kubeconfig, (ns, sa), question).await;
        if got != *want {
            wrong.push(format!("{sa}: can-i {question}: got {got}, want {want}"));
        }
    }
    assert!(wrong.is_empty(), "least privilege broken:\n{}", wrong.join("\n"));
}

#[tokio::test]
async fn helm_install_upgrade_uninstall_on_a_real_apiserver() {
    // A control plane of its own: the chart's CSIDriver and StorageClass are cluster-wide names.
    let cp = ControlPlane::start().expect("start the test control plane");
    let kc = cp.kubeconfig();
    let client = cp.client().await;
    let ns = unique("stowage-chart");
    let (namespace, _) = stowage_testkit::builders::namespace(&ns);
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .unwrap();

    let helm = Helm::new(Some(&kc));
    let chart = chart_dir();
    let chart = chart.to_str().unwrap();

    // NOTES print the kube-controller-manager --controllers value that turns off exactly what
    // this release runs, from controller.controllers in stowage's names or KCM's, negations
    // honoured. A server-side dry run renders them against this apiserver and stores nothing.
    for (controllers, off) in [
        (
            "{*}",
            &[BINDER, PV_PROTECTION, PVC_PROTECTION, ATTACH_DETACH, EXPANDER][..],
        ),
        (
            "{*,-expand,-persistentvolume-attach-detach-controller}",
            &[BINDER, PV_PROTECTION, PVC_PROTECTION],
        ),
        (
            "{binder,persistentvolumeclaim-protection-controller}",
            &[BINDER, PVC_PROTECTION],
        ),
    ] {
        let set = format!("controller.controllers={controllers}");
        let out = helm
            .try_install(RELEASE, chart, &ns, &["--set", &set])
            .await
            .unwrap();
        assert_eq!(kcm_flag(&out), off, "{set}:\n{out}");
    }
    // The chart's name tables repeat the controller's: for every name it accepts, alone and
    // negated, NOTES print exactly the flag the controller itself logs at start.
    let names = stowage_controller::CONTROLLERS
        .iter()
        .map(|(n, _)| *n)
        .chain(stowage_controller::KCM_ALIASES.iter().map(|(k, _)| *k));
    for spec in names.flat_map(|n| [vec![n.to_string()], vec!["*".into(), format!("-{n}")]]) {
        let set = format!("controller.controllers={{{}}}", spec.join(","));
        let out = helm
            .try_install(RELEASE, chart, &ns, &["--set", &set])
            .await
            .unwrap();
        let running = stowage_controller::resolve_controllers(&spec).unwrap();
        for want in [
            stowage_controller::kcm_negations(&running),
            stowage_controller::kcm_flag(KUBEADM_CONTROLLERS, &running),
        ] {
            assert!(
                out.lines().any(|l| l.trim() == want),
                "{set}: NOTES lack the controller's {want}:\n{out}"
            );
        }
    }
    // Told the value the distribution passes, the NOTES print the whole flag from it.
    let out = helm
        .try_install(
            RELEASE,
            chart,
            &ns,
            &[
                "--set",
                "controller.kubeControllerManagerControllers=*\\,tokencleaner",
            ],
        )
        .await
        .unwrap();
    let want = stowage_controller::kcm_flag(
        "*,tokencleaner",
        &stowage_controller::resolve_controllers(&["*".into()]).unwrap(),
    );
    assert!(out.lines().any(|l| l.trim() == want), "NOTES lack {want}:\n{out}");
    // An unknown name fails the install even when the schema is skipped.
    let e = helm
        .try_install(
            RELEASE,
            chart,
            &ns,
            &[
                "--skip-schema-validation",
                "--set",
                "controller.controllers={*,-persistentvolume-binder-controler}",
            ],
        )
        .await
        .unwrap_err();
    assert!(
        e.contains(r#"unknown controller "persistentvolume-binder-controler""#),
        "{e}"
    );

    let install = helm.values("install.yaml", INSTALL_VALUES);
    let out = helm
        .run(&[
            "install",
            RELEASE,
            chart,
            "--namespace",
            &ns,
            "-f",
            install.to_str().unwrap(),
        ])
        .await
        .unwrap();
    assert!(out.contains("STATUS: deployed"), "{out}");
    assert_eq!(
        kcm_flag(&out),
        [BINDER, PV_PROTECTION, PVC_PROTECTION, ATTACH_DETACH, EXPANDER],
        "{out}"
    );
    // The chart's default class is not created here: helm test would check /readyz only.
    assert!(out.contains(&format!("helm test {RELEASE} -n {ns}")), "{out}");

    // --- the objects, as the apiserver stored them
    let deploy = Api::<Deployment>::namespaced(client.clone(), &ns)
        .get(CONTROLLER)
        .await
        .unwrap();
    let spec = deploy.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(2));
    let pod = spec.template.spec.as_ref();
    assert_eq!(pod.unwrap().service_account_name.as_deref(), Some(CONTROLLER));
    let psc = pod.unwrap().security_context.as_ref().unwrap();
    assert_eq!(psc.run_as_non_root, Some(true));
    assert_eq!(
        psc.seccomp_profile.as_ref().map(|s| s.type_.as_str()),
        Some("RuntimeDefault")
    );
    let c = only_container(pod);
    let a = args(c);
    for want in [
        format!("--leader-elect-resource-namespace={ns}"),
        "--leader-elect=true".into(),
        "--image-store-mode=local".into(),
        "--kube-api-max-qps=2000".into(),
    ] {
        assert!(a.contains(&want), "controller args {a:?} lack {want}");
    }
    // No fixed rate by default: the controller's adaptive limiter applies.
    assert!(
        !a.iter().any(|x| x.starts_with("--kube-api-qps")),
        "controller args {a:?} set a fixed rate by default"
    );
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(
        sc.capabilities.as_ref().and_then(|c| c.drop.clone()),
        Some(vec!["ALL".to_string()])
    );
    let probe_path = |p: Option<&Probe>| p.and_then(|p| p.http_get.as_ref()).and_then(|h| h.path.clone());
    assert_eq!(probe_path(c.liveness_probe.as_ref()).as_deref(), Some("/healthz"));
    assert_eq!(probe_path(c.readiness_probe.as_ref()).as_deref(), Some("/readyz"));
    assert!(
        c.resources.as_ref().and_then(|r| r.requests.as_ref()).is_some(),
        "controller has resource requests"
    );
    // Local mode (the default): each node's agent makes its images; the controller has no store.
    assert!(
        !c.volume_mounts
            .iter()
            .flatten()
            .any(|m| m.mount_path == "/var/lib/stowage/images"),
        "controller mounts no image store in local mode"
    );

    let ds = Api::<DaemonSet>::namespaced(client.clone(), &ns)
        .get(AGENT)
        .await
        .unwrap();
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref();
    let c = only_container(pod);
    assert_eq!(c.security_context.as_ref().and_then(|s| s.privileged), Some(true));
    // The default csi mode: the kubelet's dir carries the mounts back to the host; the agent's
    // root dir only holds stage records.
    assert_eq!(
        propagation(c, "/var/lib/kubelet"),
        Some(Some("Bidirectional".into())),
        "kubelet dir mount"
    );
    assert_eq!(propagation(c, "/var/lib/stowage"), Some(None), "root dir mount");
    assert!(propagation(c, "/dev").is_some(), "/dev mount");
    let volumes = pod.and_then(|p| p.volumes.clone()).unwrap_or_default();
    let kubelet_dir = volumes
        .iter()
        .find(|v| v.name == "kubelet-dir")
        .and_then(|v| v.host_path.clone())
        .expect("kubelet dir hostPath volume");
    assert_eq!(kubelet_dir.path, "/var/lib/kubelet");
    assert_eq!(kubelet_dir.type_.as_deref(), Some("Directory"));
    assert_eq!(pod.unwrap().host_network, None);
    assert_eq!(env_value(c, "KUBERNETES_SERVICE_HOST"), None);
    let node_name = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .and_then(|e| e.value_from.as_ref())
        .and_then(|v| v.field_ref.as_ref())
        .map(|f| f.field_path.clone());
    assert_eq!(node_name.as_deref(), Some("spec.nodeName"));
    let a = args(c);
    assert!(a.contains(&"--node-name=$(NODE_NAME)".to_string()), "{a:?}");
    assert!(a.contains(&"--kubelet-dir=/var/lib/kubelet".to_string()), "{a:?}");
    assert!(!a.contains(&"--register-node".to_string()), "{a:?}");

    let driver = Api::<CSIDriver>::all(client.clone())
        .get("loop.stowage.dev")
        .await
        .unwrap();
    assert_eq!(driver.spec.attach_required, Some(true));
    assert_eq!(driver.spec.pod_info_on_mount, Some(false));
    assert_eq!(driver.spec.fs_group_policy.as_deref(), Some("File"));
    assert_eq!(
        driver.spec.volume_lifecycle_modes,
        Some(vec!["Persistent".to_string()])
    );
    assert_eq!(driver.spec.requires_republish, Some(false));
    // Local mode (the default): the agents publish their stores' capacity.
    assert_eq!(driver.spec.storage_capacity, Some(true));

    let class = Api::<StorageClass>::all(client.clone())
        .get("loop")
        .await
        .unwrap();
    assert_eq!(class.provisioner, "loop.stowage.dev");
    assert_eq!(class.allow_volume_expansion, Some(true));
    assert_eq!(class.reclaim_policy.as_deref(), Some("Retain"));
    assert_eq!(class.volume_binding_mode.as_deref(), Some("Immediate"));

    // --- least privilege, asked of the apiserver's RBAC authorizer
    let lease_ns = format!("-n {ns}");
    let controller_rights: Vec<(String, bool)> = vec![
        ("list persistentvolumes".into(), true),
        ("create persistentvolumes".into(), true),
        ("delete persistentvolumes".into(), true),
        ("update persistentvolumes --subresource=status".into(), true),
        ("update persistentvolumeclaims -n any".into(), true),
        (
            "update persistentvolumeclaims --subresource=status -n any".into(),
            true,
        ),
        ("list pods -n any".into(), true),
        ("create volumeattachments.storage.k8s.io".into(), true),
        ("patch nodes --subresource=status".into(), true),
        ("get nodes".into(), true),
        ("patch volumeattachments.storage.k8s.io".into(), true),
        ("create events.events.k8s.io -n any".into(), true),
        // A repeated Event is a patch of its series (kube-runtime's recorder).
        ("patch events.events.k8s.io -n any".into(), true),
        (format!("get leases/stowage-controller {lease_ns}"), true),
        (format!("update leases/stowage-controller {lease_ns}"), true),
        (format!("create leases {lease_ns}"), true),
        // Denied: what no controller does.
        ("get secrets -n any".into(), false),
        ("delete pods -n any".into(), false),
        ("create persistentvolumeclaims -n any".into(), false),
        ("delete persistentvolumeclaims -n any".into(), false),
        ("update nodes".into(), false),
        ("create storageclasses.storage.k8s.io".into(), false),
        (format!("update leases/someone-else {lease_ns}"), false),
        ("create leases -n kube-system".into(), false),
    ];
    let agent_rights_common: Vec<(String, bool)> = vec![
        ("list pods -n any".into(), true),
        ("watch persistentvolumes".into(), true),
        ("patch volumeattachments.storage.k8s.io".into(), true),
        (
            "patch volumeattachments.storage.k8s.io --subresource=status".into(),
            true,
        ),
        ("patch nodes".into(), true),
        ("patch nodes --subresource=status".into(), true),
        (
            "patch persistentvolumeclaims --subresource=status -n any".into(),
            true,
        ),
        ("create events.events.k8s.io -n any".into(), true),
        // A repeated Event is a patch of its series (kube-runtime's recorder).
        ("patch events.events.k8s.io -n any".into(), true),
        // Local mode (the default): the node deletes the volumes whose images it removed.
        ("delete persistentvolumes".into(), true),
        ("update persistentvolumes".into(), true),
        // Denied: the agent never creates attachments or volumes, or reads secrets.
        ("create volumeattachments.storage.k8s.io".into(), false),
        ("create persistentvolumes".into(), false),
        ("update persistentvolumeclaims -n any".into(), false),
        ("get secrets -n any".into(), false),
        ("delete nodes".into(), false),
    ];
    let check = |sa: &'static str, cases: Vec<(String, bool)>| {
        let kc = kc.clone();
        let ns = ns.clone();
        async move {
            let cases: Vec<(&str, bool)> = cases.iter().map(|(q, w)| (q.as_str(), *w)).collect();
            assert_rights(&kc, &ns, sa, &cases).await;
        }
    };
    check(CONTROLLER, controller_rights.clone()).await;
    let mut agent_before = agent_rights_common.clone();
    agent_before.extend([
        // Without --register-node: no Node creation, no kube-node-lease.
        ("create nodes".to_string(), false),
        // Beside a kubelet (csi mode) the kubelet checks volumesAttached: no Node reads.
        ("watch nodes".to_string(), false),
        ("create leases -n kube-node-lease".to_string(), false),
    ]);
    check(AGENT, agent_before).await;

    // --- upgrade with changed values
    install_service_monitor_crd(&client).await;
    let upgrade = helm.values("upgrade.yaml", UPGRADE_VALUES);
    let out = helm
        .run(&[
            "upgrade",
            RELEASE,
            chart,
            "--namespace",
            &ns,
            "-f",
            upgrade.to_str().unwrap(),
        ])
        .await
        .unwrap();
    assert!(out.contains("REVISION: 2"), "{out}");

    let deploy = Api::<Deployment>::namespaced(client.clone(), &ns)
        .get(CONTROLLER)
        .await
        .unwrap();
    let spec = deploy.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(3));
    let a = args(only_container(spec.template.spec.as_ref()));
    assert!(a.contains(&"--kube-api-qps=20".to_string()), "{a:?}");
    assert!(a.contains(&"--binder-max-in-flight=32".to_string()), "{a:?}");
    let annotations = spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.annotations.clone());
    assert_eq!(
        annotations
            .as_ref()
            .and_then(|a| a.get("prometheus.io/port"))
            .map(String::as_str),
        // The secure port, the chart's default.
        Some("10257")
    );
    assert_host_network_and_apiserver("controller", spec.template.spec.as_ref());
    let ds = Api::<DaemonSet>::namespaced(client.clone(), &ns)
        .get(AGENT)
        .await
        .unwrap();
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref();
    assert_host_network_and_apiserver("agent", pod);
    let c = only_container(pod);
    let a = args(c);
    assert!(a.contains(&"--register-node".to_string()), "{a:?}");
    // Standalone: no kubelet; the agent's own mounts under its root dir reach the host.
    assert!(!a.iter().any(|a| a.starts_with("--kubelet-dir")), "{a:?}");
    assert_eq!(propagation(c, "/var/lib/kubelet"), None, "no kubelet dir mount");
    assert_eq!(
        propagation(c, "/var/lib/stowage"),
        Some(Some("Bidirectional".into())),
        "root dir mount"
    );
    let class = Api::<StorageClass>::all(client.clone())
        .get("loop")
        .await
        .unwrap();
    assert_eq!(
        class
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("storageclass.kubernetes.io/is-default-class"))
            .map(String::as_str),
        Some("true")
    );
    let sm = service_monitor();
    for name in [CONTROLLER, AGENT] {
        assert!(
            exists(&client, &sm, Some(&ns), name).await,
            "ServiceMonitor {name}"
        );
    }
    check(CONTROLLER, controller_rights).await;
    let mut agent_after = agent_rights_common.clone();
    agent_after.extend([
        // --register-node: the agent keeps its Node and heartbeat Lease, and nothing more.
        ("create nodes".to_string(), true),
        ("get nodes --subresource=status".to_string(), true),
        // Standalone: it watches its Node for status.volumesAttached.
        ("watch nodes".to_string(), true),
        ("create leases -n kube-node-lease".to_string(), true),
        ("patch leases -n kube-node-lease".to_string(), true),
        ("delete leases -n kube-node-lease".to_string(), false),
        ("create leases -n kube-system".to_string(), false),
    ]);
    check(AGENT, agent_after).await;

    // --- uninstall removes everything the chart made
    let everything: Vec<(ApiResource, Option<&str>, String)> = vec![
        (erase::<Deployment>(), Some(&ns), CONTROLLER.into()),
        (erase::<DaemonSet>(), Some(&ns), AGENT.into()),
        (erase::<ServiceAccount>(), Some(&ns), CONTROLLER.into()),
        (erase::<ServiceAccount>(), Some(&ns), AGENT.into()),
        (erase::<ClusterRole>(), None, CONTROLLER.into()),
        (erase::<ClusterRole>(), None, AGENT.into()),
        (erase::<ClusterRoleBinding>(), None, CONTROLLER.into()),
        (erase::<ClusterRoleBinding>(), None, AGENT.into()),
        (
            erase::<Role>(),
            Some(&ns),
            format!("{CONTROLLER}-leader-election"),
        ),
        (
            erase::<RoleBinding>(),
            Some(&ns),
            format!("{CONTROLLER}-leader-election"),
        ),
        (
            erase::<Role>(),
            Some("kube-node-lease"),
            format!("{AGENT}-node-lease"),
        ),
        (
            erase::<RoleBinding>(),
            Some("kube-node-lease"),
            format!("{AGENT}-node-lease"),
        ),
        (erase::<Service>(), Some(&ns), format!("{CONTROLLER}-metrics")),
        (erase::<Service>(), Some(&ns), format!("{AGENT}-metrics")),
        (sm.clone(), Some(&ns), CONTROLLER.into()),
        (sm.clone(), Some(&ns), AGENT.into()),
        (erase::<CSIDriver>(), None, "loop.stowage.dev".into()),
        (erase::<StorageClass>(), None, "loop".into()),
    ];
    for (ar, ns, name) in &everything {
        assert!(
            exists(&client, ar, *ns, name).await,
            "{} {name} before uninstall",
            ar.kind
        );
    }
    let out = helm
        .run(&["uninstall", RELEASE, "--namespace", &ns, "--wait"])
        .await
        .unwrap();
    assert!(out.contains("uninstalled"), "{out}");
    for (ar, ns, name) in &everything {
        let (client, ar, name) = (client.clone(), ar.clone(), name.clone());
        let ns = ns.map(str::to_string);
        eventually(BOUND, || {
            let (client, ar, name, ns) = (client.clone(), ar.clone(), name.clone(), ns.clone());
            async move {
                if exists(&client, &ar, ns.as_deref(), &name).await {
                    Err(format!("{} {name} still there after uninstall", ar.kind))
                } else {
                    Ok(())
                }
            }
        })
        .await;
    }
    let list = helm
        .run(&["list", "--all", "--namespace", &ns, "-q"])
        .await
        .unwrap();
    assert!(list.trim().is_empty(), "releases left: {list}");
}
