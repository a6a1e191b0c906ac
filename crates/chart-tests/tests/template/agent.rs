//! The agent's two modes: the CSI node plugin beside a kubelet (the default) and the standalone,
//! kubelet-less node; and the CSIDriver object the kubelet reads.

use stowage_chart_tests::{Helm, document};

use crate::{assert_entry, assert_has, doc, list_entry, render};

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
        // The kubelet's or the root dir's, and the image store's HostToContainer.
        assert_eq!(a.matches("mountPropagation:").count(), 2, "{a}");
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
                "- --image-store-mode=local",
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
        // The kubelet's or the root dir's, and the image store's HostToContainer.
        assert_eq!(a.matches("mountPropagation:").count(), 2, "{a}");

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
                "storageCapacity: true",
            ],
            "{set}:\n{c}"
        );
    }
    // Shared mode: no node has more room than another.
    let m = render(&helm, &["--set", "imageStore.mode=shared"]).await.unwrap();
    let c = doc(&m, "CSIDriver", "loop.stowage.dev");
    assert!(c.contains("storageCapacity: false"), "{c}");
    let m = render(&helm, &["--set", "csiDriver.create=false"]).await.unwrap();
    assert!(document(&m, "CSIDriver", "loop.stowage.dev").is_none());
}

/// Where the agents run by default: every node in local mode (each makes its own store); in
/// shared mode no NoSchedule-tainted node (a control-plane node without the shared mount would
/// fail its hostPath check and hold the rollout for ever), though never evicted by a NoExecute
/// taint; a list of the user's replaces either.
#[tokio::test]
async fn the_agents_tolerations_follow_the_store_and_yield_to_the_users() {
    let helm = Helm::new(None);
    let m = render(&helm, &[]).await.unwrap();
    let a = doc(&m, "DaemonSet", "st-stowage-agent");
    assert!(a.contains("tolerations:\n        - operator: Exists"), "{a}");
    let m = render(&helm, &["--set", "imageStore.mode=shared"]).await.unwrap();
    let a = doc(&m, "DaemonSet", "st-stowage-agent");
    assert!(
        a.contains("tolerations:\n        - effect: NoExecute\n          operator: Exists"),
        "shared mode: never evicted, never placed on a NoSchedule node:\n{a}"
    );
    assert_eq!(a.matches("operator: Exists").count(), 1, "{a}");
    let m = render(
        &helm,
        &[
            "--set",
            "agent.tolerations[0].key=node-role.kubernetes.io/control-plane",
            "--set",
            "agent.tolerations[0].operator=Exists",
            "--set",
            "agent.tolerations[0].effect=NoSchedule",
        ],
    )
    .await
    .unwrap();
    let a = doc(&m, "DaemonSet", "st-stowage-agent");
    assert!(a.contains("key: node-role.kubernetes.io/control-plane"), "{a}");
    assert_eq!(
        a.matches("operator: Exists").count(),
        1,
        "the user's list only:\n{a}"
    );
    let m = render(&helm, &["--set-json", "agent.tolerations=[]"])
        .await
        .unwrap();
    let a = doc(&m, "DaemonSet", "st-stowage-agent");
    assert!(!a.contains("tolerations:"), "an empty list is none:\n{a}");
}
