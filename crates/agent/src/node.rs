//! The Node side: the controller-managed attach/detach annotation, `status.volumesInUse` (written
//! as soon as it changes, and only then reported back to the volume manager, which mounts nothing
//! before its volume is listed), and with `--register-node` the Node object, its Ready condition
//! and its heartbeat Lease, as a kubelet keeps them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use crate::paths::unique_name;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, NodeCondition};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use tokio::sync::watch;

use crate::ctx::Ctx;

pub const CONTROLLER_MANAGED: &str = "volumes.kubernetes.io/controller-managed-attach-detach";
/// A kubelet's default node status update frequency and lease renew interval.
pub const HEARTBEAT: Duration = Duration::from_secs(10);
const LEASE_DURATION_SECONDS: i32 = 40;
const LEASE_NAMESPACE: &str = "kube-node-lease";

/// Creates the Node when asked to and it is missing, and sets the attach/detach annotation.
/// Retries until it succeeds (the agent is useless without its Node).
/// `topology`: local mode, where a kubelet would label its Node with the topology the node
/// plugin reports; without a kubelet the agent sets that label itself.
pub async fn prepare(client: &Client, node: &str, register: bool, topology: bool) {
    let api: Api<Node> = Api::all(client.clone());
    let mut delay = Duration::from_millis(500);
    loop {
        match prepare_once(&api, node, register, topology).await {
            Ok(()) => return,
            Err(e) => {
                tracing::warn!(node, error = %e, "cannot prepare the Node object, retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(10));
            }
        }
    }
}

async fn prepare_once(api: &Api<Node>, node: &str, register: bool, topology: bool) -> anyhow::Result<()> {
    if register && api.get_opt(node).await?.is_none() {
        let obj = Node {
            metadata: ObjectMeta {
                name: Some(node.into()),
                labels: Some(BTreeMap::from([
                    ("kubernetes.io/hostname".to_string(), node.to_string()),
                    ("kubernetes.io/os".to_string(), "linux".to_string()),
                ])),
                annotations: Some(BTreeMap::from([(
                    CONTROLLER_MANAGED.to_string(),
                    "true".to_string(),
                )])),
                ..Default::default()
            },
            ..Default::default()
        };
        match api.create(&PostParams::default(), &obj).await {
            Ok(_) => tracing::info!(node, "registered the Node"),
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    let mut patch = serde_json::json!({ "metadata": { "annotations": { CONTROLLER_MANAGED: "true" } } });
    if topology {
        patch["metadata"]["labels"] = serde_json::json!({ stowage_loopdriver::TOPOLOGY_KEY: node });
    }
    api.patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    if register {
        heartbeat(api, node).await?;
    }
    Ok(())
}

/// The Ready condition a kubelet posts; the transition time moves only when the status flips.
pub fn ready_condition(current: Option<&NodeCondition>, now: Timestamp) -> NodeCondition {
    let since = current
        .filter(|c| c.status == "True")
        .and_then(|c| c.last_transition_time.clone());
    NodeCondition {
        type_: "Ready".into(),
        status: "True".into(),
        reason: Some("KubeletReady".into()),
        message: Some("stowage-agent is posting ready status".into()),
        last_heartbeat_time: Some(Time(now)),
        last_transition_time: Some(since.unwrap_or(Time(now))),
    }
}

async fn heartbeat(api: &Api<Node>, node: &str) -> anyhow::Result<()> {
    let current = api.get_status(node).await?;
    let now = Timestamp::now();
    let cur_ready = current
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"));
    let cond = ready_condition(cur_ready, now);
    // Strategic merge keys conditions by type: other conditions stay as they are.
    let patch = serde_json::json!({ "status": { "conditions": [cond] } });
    api.patch_status(node, &PatchParams::default(), &Patch::Strategic(&patch))
        .await?;
    renew_lease(api.clone().into(), node, current.metadata.uid.as_deref()).await
}

async fn renew_lease(client: Client, node: &str, node_uid: Option<&str>) -> anyhow::Result<()> {
    let api: Api<Lease> = Api::namespaced(client, LEASE_NAMESPACE);
    let now = MicroTime(Timestamp::now());
    match api.get_opt(node).await? {
        Some(_) => {
            let patch = serde_json::json!({ "spec": {
                "holderIdentity": node,
                "leaseDurationSeconds": LEASE_DURATION_SECONDS,
                "renewTime": now,
            }});
            api.patch(node, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
        }
        None => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(node.into()),
                    namespace: Some(LEASE_NAMESPACE.into()),
                    // Owned by the Node, so the lease goes when the Node does.
                    owner_references: node_uid.map(|uid| {
                        vec![OwnerReference {
                            api_version: "v1".into(),
                            kind: "Node".into(),
                            name: node.into(),
                            uid: uid.into(),
                            ..Default::default()
                        }]
                    }),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(node.into()),
                    lease_duration_seconds: Some(LEASE_DURATION_SECONDS),
                    renew_time: Some(now),
                    ..Default::default()
                }),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}

/// The node's `volumesInUse` with this driver's entries replaced by `ours`; other drivers'
/// entries (a kubelet's) are kept as they are.
pub fn merge_in_use(current: &[String], ours: &BTreeSet<String>) -> Vec<String> {
    let prefix = unique_name("");
    let mut out: BTreeSet<String> = current
        .iter()
        .filter(|v| !v.starts_with(&prefix))
        .cloned()
        .collect();
    out.extend(ours.iter().cloned());
    out.into_iter().collect()
}

/// Writes our part of `volumesInUse`, guarded by the resourceVersion read, so an entry someone
/// else wrote in between is never dropped (a conflict is retried by the caller).
async fn write_in_use(api: &Api<Node>, node: &str, ours: &BTreeSet<String>) -> kube::Result<Node> {
    let current = api.get_status(node).await?;
    let list = merge_in_use(
        current
            .status
            .as_ref()
            .and_then(|s| s.volumes_in_use.as_deref())
            .unwrap_or_default(),
        ours,
    );
    let patch = serde_json::json!({
        "metadata": { "resourceVersion": current.metadata.resource_version },
        "status": { "volumesInUse": if list.is_empty() { None } else { Some(list) } },
    });
    api.patch_status(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
}

/// Keeps `volumesInUse` equal to what the volume manager asks for, and the heartbeat fresh.
pub async fn run(
    ctx: Arc<Ctx>,
    register: bool,
    mut in_use: watch::Receiver<Option<BTreeSet<String>>>,
    reported: watch::Sender<BTreeSet<String>>,
    mut stop: watch::Receiver<bool>,
) {
    // Nothing is mounted before the Node lists the volume, so waiting here for the Node (made
    // by a kubelet, or by us with --register-node) holds back exactly what must wait.
    tokio::select! {
        _ = prepare(&ctx.client, &ctx.node, register, ctx.store_mode.is_local()) => {}
        _ = stop.changed() => return,
    }
    let api: Api<Node> = Api::all(ctx.client.clone());
    let mut written: Option<BTreeSet<String>> = None;
    let mut next_beat = tokio::time::Instant::now() + HEARTBEAT;
    let mut retry = false;
    loop {
        let want = in_use.borrow_and_update().clone();
        if let Some(want) = want
            && written.as_ref() != Some(&want)
        {
            match write_in_use(&api, &ctx.node, &want).await {
                Ok(_) => {
                    tracing::debug!(volumes = want.len(), "volumesInUse updated");
                    reported.send_replace(want.clone());
                    written = Some(want);
                    retry = false;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot update volumesInUse, retrying");
                    retry = true;
                }
            }
        }
        if register && tokio::time::Instant::now() >= next_beat {
            next_beat = tokio::time::Instant::now() + HEARTBEAT;
            if let Err(e) = heartbeat(&api, &ctx.node).await {
                tracing::warn!(error = %e, "node heartbeat failed");
            }
        }
        let wake = if retry {
            tokio::time::Instant::now() + Duration::from_secs(1)
        } else {
            next_beat
        };
        tokio::select! {
            r = in_use.changed() => if r.is_err() { break },
            _ = tokio::time::sleep_until(wake) => {}
            _ = stop.changed() => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transition_time_moves_only_on_a_flip() {
        let t0 = Timestamp::UNIX_EPOCH;
        let t1 = Timestamp::from_second(100).unwrap();
        let first = ready_condition(None, t0);
        assert_eq!(first.last_transition_time, Some(Time(t0)));
        let again = ready_condition(Some(&first), t1);
        assert_eq!(again.last_transition_time, Some(Time(t0)));
        assert_eq!(again.last_heartbeat_time, Some(Time(t1)));
        let mut not_ready = first.clone();
        not_ready.status = "False".into();
        assert_eq!(
            ready_condition(Some(&not_ready), t1).last_transition_time,
            Some(Time(t1))
        );
    }
}

#[cfg(test)]
mod merge_tests {
    use super::*;

    #[test]
    fn other_drivers_entries_survive_and_ours_are_replaced() {
        let current = vec![
            "kubernetes.io/csi/other.example.com^v1".to_string(),
            unique_name("old"),
        ];
        let ours: BTreeSet<String> = [unique_name("new")].into();
        assert_eq!(
            merge_in_use(&current, &ours),
            vec![
                "kubernetes.io/csi/loop.stowage.dev^new".to_string(),
                "kubernetes.io/csi/other.example.com^v1".to_string()
            ]
        );
        assert_eq!(
            merge_in_use(&current, &BTreeSet::new()),
            vec!["kubernetes.io/csi/other.example.com^v1".to_string()]
        );
    }
}
