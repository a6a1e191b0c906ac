//! Safety paths of the executor: a detach never goes ahead while the node still advertises the
//! volume, and an attachment someone else already created is adopted, not fought over. (The
//! JoinSet below holds informer tasks, not writes.)

use std::sync::Arc;

use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::storage::v1::{VolumeAttachmentSource, VolumeAttachmentSpec};
use kube::api::ObjectMeta;
use kube::runtime::watcher;
use stowage_common::store::informer::{Informer, as_decoded};

use crate::world::*;

/// The user the restricted controller runs as (impersonated by the admin client).
const USER: &str = "stowage-attachdetach-test";
/// The role granting node status writes, revoked mid-test.
const NODE_STATUS: &str = "attachdetach-test-node-status";

impl World {
    /// A client that acts as `USER`, so the apiserver's RBAC decides what it may do.
    async fn as_user(&self) -> Client {
        let kc = kube::config::Kubeconfig::read_from(self._cp.kubeconfig()).unwrap();
        let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap();
        cfg.auth_info.impersonate = Some(USER.into());
        Client::try_from(cfg).unwrap()
    }

    /// A cluster role and its binding to `USER`.
    async fn grant(&self, name: &str, rules: serde_json::Value) {
        let role: ClusterRole = serde_json::from_value(json!({
            "metadata": { "name": name }, "rules": rules,
        }))
        .unwrap();
        let binding: ClusterRoleBinding = serde_json::from_value(json!({
            "metadata": { "name": name },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name },
            "subjects": [{ "apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER }],
        }))
        .unwrap();
        Api::<ClusterRole>::all(self.client.clone())
            .create(&PostParams::default(), &role)
            .await
            .unwrap();
        Api::<ClusterRoleBinding>::all(self.client.clone())
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
    }

    /// Everything the controller needs except writing node status.
    async fn grant_controller_rights(&self) {
        let read = json!(["get", "list", "watch"]);
        self.grant(
            "attachdetach-test-base",
            json!([
                { "apiGroups": [""], "resources": ["pods", "persistentvolumeclaims", "nodes"], "verbs": read },
                { "apiGroups": [""], "resources": ["persistentvolumes"], "verbs": ["get", "list", "watch", "patch", "update"] },
                { "apiGroups": ["storage.k8s.io"], "resources": ["volumeattachments"], "verbs": ["*"] },
                { "apiGroups": ["storage.k8s.io"], "resources": ["csidrivers", "storageclasses"], "verbs": read },
                { "apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch", "update"] },
            ]),
        )
        .await;
    }

    async fn grant_node_status(&self) {
        self.grant(
            NODE_STATUS,
            json!([{ "apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch", "update"] }]),
        )
        .await;
    }

    /// Takes node status writes away and waits until the apiserver refuses them to `as_user`.
    async fn revoke_node_status(&self, user: &Client, node: &str) {
        let dp = DeleteParams::default();
        Api::<ClusterRoleBinding>::all(self.client.clone())
            .delete(NODE_STATUS, &dp)
            .await
            .unwrap();
        Api::<ClusterRole>::all(self.client.clone())
            .delete(NODE_STATUS, &dp)
            .await
            .unwrap();
        let nodes: Api<Node> = Api::all(user.clone());
        eventually(LIMIT, || {
            let nodes = nodes.clone();
            async move {
                // An empty merge patch: changes nothing while it is still allowed.
                match nodes
                    .patch_status(node, &PatchParams::default(), &Patch::Merge(json!({})))
                    .await
                {
                    Err(kube::Error::Api(s)) if s.code == 403 => Ok(()),
                    other => Err(format!("node status write still allowed: {other:?}")),
                }
            }
        })
        .await;
    }
}

/// Upstream never detaches a volume the node may still list in `status.volumesAttached`: the
/// kubelet would go on using a device that is gone. When the status patch fails, the detaches of
/// that node are held back, counted, and retried; they go ahead once the patch succeeds.
#[tokio::test]
async fn a_detach_is_held_back_while_the_node_status_cannot_be_written() {
    let w = World::with_one_volume().await;
    w.grant_controller_rights().await;
    w.grant_node_status().await;
    let user = w.as_user().await;
    let c = Controller::start(&user, Config::default());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop3").await;
    let attached = vec![(unique_volume_name(DRIVER, "vol-1"), "/dev/loop3".to_string())];
    w.wait_node_attached("node-a", attached.clone()).await;

    w.revoke_node_status(&user, "node-a").await;
    w.delete_pod("app").await;
    eventually(LIMIT, || async {
        let held = c.metric_with(
            "stowage_attachdetach_reconcile_errors_total",
            &[("operation", "detach"), ("error", "node_status_not_updated")],
        );
        let refused = c.metric_with(
            "stowage_attachdetach_reconcile_errors_total",
            &[("operation", "node_status"), ("error", "forbidden")],
        );
        (held >= 1.0 && refused >= 1.0)
            .then_some(())
            .ok_or_else(|| format!("held-back detaches {held}, refused status writes {refused}"))
    })
    .await;
    let name = attachment_name("vol-1", DRIVER, "node-a");
    let va = w.vas().get(&name).await.unwrap();
    assert!(
        va.metadata.deletion_timestamp.is_none(),
        "the VolumeAttachment was not deleted while the node still advertised the volume"
    );
    w.wait_node_attached("node-a", attached).await;

    // Once the node can be told, the detach goes ahead.
    w.grant_node_status().await;
    w.wait_no_va("vol-1", "node-a").await;
    w.wait_node_attached("node-a", vec![]).await;
}

/// A label that keeps a VolumeAttachment out of the controller's informer, standing for a watch
/// that has not delivered it yet.
const HIDDEN: &str = "test.stowage.dev/hidden";

/// The controller on its own informers, of which the VolumeAttachment one does not see objects
/// labelled `HIDDEN`.
fn start_with_hidden_attachments(client: &Client) -> Controller {
    let registry = Registry::new();
    let mut tasks = JoinSet::new();
    let cfg = watcher::Config::default;
    let cluster = Arc::new(Informers {
        pvs: Informer::spawn(client.clone(), cfg(), as_decoded, &mut tasks),
        pvcs: Informer::spawn(client.clone(), cfg(), as_decoded, &mut tasks),
        pods: Informer::spawn(client.clone(), cfg(), as_decoded, &mut tasks),
        nodes: Informer::spawn(client.clone(), cfg(), as_decoded, &mut tasks),
        attachments: Informer::spawn(
            client.clone(),
            cfg().labels(&format!("!{HIDDEN}")),
            as_decoded,
            &mut tasks,
        ),
        classes: Informer::spawn(client.clone(), cfg(), as_decoded, &mut tasks),
        csi_drivers: Informer::spawn(client.clone(), cfg(), as_decoded, &mut tasks),
        capacities: None,
        client: client.clone(),
        registry: registry.clone(),
    });
    Controller::run_on(cluster, registry, tasks, Config::default())
}

/// A VolumeAttachment of the right name already exists when the controller creates it (a
/// previous leader made it, and this one's watch has not delivered it): the create answers 409
/// AlreadyExists and the controller follows that object instead of failing and retrying forever.
#[tokio::test]
async fn an_attachment_that_already_exists_is_adopted() {
    let w = World::with_one_volume().await;
    let name = attachment_name("vol-1", DRIVER, "node-a");
    let existing = w
        .vas()
        .create(
            &PostParams::default(),
            &VolumeAttachment {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    labels: Some([(HIDDEN.to_string(), "true".to_string())].into()),
                    ..Default::default()
                },
                spec: VolumeAttachmentSpec {
                    attacher: DRIVER.into(),
                    node_name: "node-a".into(),
                    source: VolumeAttachmentSource {
                        persistent_volume_name: Some("vol-1".into()),
                        inline_volume_spec: None,
                    },
                },
                status: None,
            },
        )
        .await
        .unwrap();
    let c = start_with_hidden_attachments(&w.client);
    w.pod("app", "vol-1", "node-a").await;

    // The create was answered with 409 and taken as done, not as a failure.
    eventually(LIMIT, || async {
        let ok = c.metric_with(
            "stowage_attachdetach_operations_total",
            &[("operation", "attach"), ("result", "success")],
        );
        (ok >= 1.0)
            .then_some(())
            .ok_or_else(|| "no attach counted as done yet".to_string())
    })
    .await;
    assert_eq!(
        c.metric_with(
            "stowage_attachdetach_operations_total",
            &[("operation", "attach"), ("result", "error")],
        ),
        0.0,
        "an existing attachment is not a failed attach"
    );
    let va = w.vas().get(&name).await.unwrap();
    assert_eq!(va.uid(), existing.uid(), "the existing object was kept");

    // The watch catches up; the controller follows the adopted object to node status.
    w.vas()
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { HIDDEN: null } } })),
        )
        .await
        .unwrap();
    w.mark_attached("vol-1", "node-a", "/dev/loop4").await;
    w.wait_node_attached(
        "node-a",
        vec![(unique_volume_name(DRIVER, "vol-1"), "/dev/loop4".into())],
    )
    .await;
    assert_eq!(
        c.metric_with(
            "stowage_attachdetach_operations_total",
            &[("operation", "attach"), ("result", "error")],
        ),
        0.0
    );
}

/// Entries of `status.volumesAttached` the controller does not manage (a plugin it does not have)
/// survive every status write it makes: one the node had before the controller started and does
/// not list in `volumesInUse`, and one another writer adds while the controller runs. Before,
/// the first write replaced the list and both were gone.
#[tokio::test]
async fn entries_of_other_plugins_survive_every_node_status_write() {
    let w = World::with_one_volume().await;
    let legacy = (
        "kubernetes.io/aws-ebs/aws://us-east-1a/vol-old".to_string(),
        "/dev/xvdf".to_string(),
    );
    let flex = ("flexvolume-example.com/nfs/share".to_string(), String::new());
    let entry = |(name, path): &(String, String)| json!({ "name": name, "devicePath": path });
    w.node_status("node-a", json!({ "volumesAttached": [entry(&legacy)] }))
        .await;
    let _c = Controller::start(&w.client, Config::default());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop3").await;
    let ours = (unique_volume_name(DRIVER, "vol-1"), "/dev/loop3".to_string());
    let mut want = vec![legacy.clone(), ours.clone()];
    want.sort();
    w.wait_node_attached("node-a", want).await;
    // Another writer adds an entry of its own while the controller runs.
    w.node_status(
        "node-a",
        json!({ "volumesAttached": [entry(&legacy), entry(&ours), entry(&flex)] }),
    )
    .await;
    w.delete_pod("app").await;
    w.wait_no_va("vol-1", "node-a").await;
    let mut want = vec![legacy, flex];
    want.sort();
    w.wait_node_attached("node-a", want).await;
}
