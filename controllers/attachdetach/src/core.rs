//! The reconciler: one pure pass over desired and actual state that decides detaches, node
//! status updates and attaches, in that order (a pod moving between nodes frees its
//! single-node volume before anything tries to attach it elsewhere).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;

use crate::Config;
use crate::actual::{Actual, Op, PairState};
pub use crate::desired::Kind;
use crate::desired::{Desired, DesiredVolume, PodRef, VolumeSpec};
use crate::read::{LOOP_DRIVER, LOOP_SINGLE_NODE_RULE, NodeInfo, attachment_name};
use crate::translate::is_managed_name;

pub type Nodes = BTreeMap<String, NodeInfo>;

/// Why a detach went ahead although the node still listed the volume as in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ForceReason {
    /// Node not Ready for longer than --max-wait-for-unmount.
    Timeout,
    /// The node carries the out-of-service taint.
    OutOfService,
    /// The Node object is gone and --max-wait-for-unmount has passed (a gone node is unhealthy;
    /// its last `volumesInUse` still counts until then).
    NodeDeleted,
}

impl ForceReason {
    pub fn label(self) -> &'static str {
        match self {
            ForceReason::Timeout => "timeout",
            ForceReason::OutOfService => "out-of-service",
            ForceReason::NodeDeleted => "node-deleted",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Start the unmount countdown of a detach (upstream's detachRequestedTime).
    MarkDetachRequested { volume: String, node: String },
    /// The volume is wanted again: forget the countdown.
    CancelDetachRequest { volume: String, node: String },
    /// Detach wanted but the node still uses the volume.
    WaitForUnmount {
        volume: String,
        node: String,
        waited: Duration,
    },
    /// Delete the VolumeAttachment `va_name`. `forced` is set when the node still listed the
    /// volume as in use (or is gone).
    Detach {
        volume: String,
        node: String,
        va_name: String,
        forced: Option<ForceReason>,
        waited: Duration,
    },
    /// Replace the node's `status.volumesAttached` (unique name, device path), sorted by name.
    /// Entries the controller does not manage are carried over as the node had them; `guard` is
    /// then the resourceVersion they were read at, so a write never drops one added since.
    UpdateNodeStatus {
        node: String,
        volumes: Vec<(String, String)>,
        guard: Option<String>,
    },
    /// Attach: create the VolumeAttachment (naming the PV, or with the inline spec), or for
    /// iSCSI/FC mark the volume attached (their plugins' attach does nothing).
    Attach {
        volume: String,
        node: String,
        va_name: String,
        pv_name: String,
        driver: String,
        kind: Kind,
    },
    /// The built-in driver's attachment on a node that is gone (or out of service) is being
    /// deleted, and no agent is left there to drop its finalizer: the controller releases it.
    ReleaseAttachment {
        volume: String,
        node: String,
        va_name: String,
        resource_version: Option<String>,
    },
    /// A single-node volume is held by another node: tell the waiting pods.
    MultiAttachError {
        volume: String,
        node: String,
        notes: Vec<(PodRef, String)>,
    },
}

/// One reconciler pass. `now` is the caller's clock, so the pass is a pure function of its inputs.
pub fn reconcile(
    desired: &Desired,
    actual: &Actual,
    nodes: &Nodes,
    now: Instant,
    config: &Config,
) -> Vec<Action> {
    let mut actions = Vec::new();
    // Detaches decided in this pass: no longer reported in node status.
    let mut detaching: BTreeSet<(&str, &str)> = BTreeSet::new();

    // Phase 0: loop attachments of dead nodes whose detach was issued. Their attacher (the agent
    // of that node) is gone, so its finalizer would hold the VolumeAttachment, and with it the
    // volume, forever. Released once the node is out of service, or gone and either no longer
    // using the volume or past the unmount timeout (the same rule that let the detach go ahead).
    for ((volume, node), a) in actual.iter() {
        let Some(va) = a.va.as_ref().filter(|v| v.deleting && v.loop_finalizer) else {
            continue;
        };
        if a.driver != LOOP_DRIVER || a.op.is_some() || a.backing_off(now) {
            continue;
        }
        let waited = a.detach_requested.map(|t| now.saturating_duration_since(t));
        if waited.is_none() {
            actions.push(Action::MarkDetachRequested {
                volume: volume.clone(),
                node: node.clone(),
            });
        }
        let timed_out = !config.disable_force_detach_on_timeout
            && waited.is_some_and(|w| w >= config.max_wait_for_unmount);
        let release = match nodes.get(node) {
            Some(n) if n.out_of_service => true,
            Some(n) if n.deleted => !n.in_use.contains(volume) || timed_out,
            Some(_) => false,
            None => timed_out,
        };
        if release {
            actions.push(Action::ReleaseAttachment {
                volume: volume.clone(),
                node: node.clone(),
                va_name: va.name.clone(),
                resource_version: va.resource_version.clone(),
            });
        }
    }

    // Phase 1: detaches.
    for ((volume, node), a) in actual.iter() {
        if desired.get(volume, node).is_some() || !a.exists() {
            continue;
        }
        if a.op.is_some() || a.deleting() || a.backing_off(now) {
            continue;
        }
        let waited = match a.detach_requested {
            Some(t) => now.saturating_duration_since(t),
            None => {
                actions.push(Action::MarkDetachRequested {
                    volume: volume.clone(),
                    node: node.clone(),
                });
                Duration::ZERO
            }
        };
        // A node never seen (an attachment from before a restart whose Node is gone) is
        // assumed to use the volume, as upstream assumes "mounted until proven otherwise".
        let timed_out = !config.disable_force_detach_on_timeout && waited >= config.max_wait_for_unmount;
        let forced = match nodes.get(node) {
            Some(n) if !n.in_use.contains(volume) => None,
            Some(n) if n.out_of_service => Some(ForceReason::OutOfService),
            None if timed_out => Some(ForceReason::NodeDeleted),
            Some(n) if n.deleted && timed_out => Some(ForceReason::NodeDeleted),
            Some(n) if !n.ready && timed_out => Some(ForceReason::Timeout),
            _ => {
                actions.push(Action::WaitForUnmount {
                    volume: volume.clone(),
                    node: node.clone(),
                    waited,
                });
                continue;
            }
        };
        let va_name = match &a.va {
            Some(va) => va.name.clone(),
            None => attachment_name(&a.handle, &a.driver, node),
        };
        detaching.insert((volume, node));
        actions.push(Action::Detach {
            volume: volume.clone(),
            node: node.clone(),
            va_name,
            forced,
            waited,
        });
    }

    // Phase 2: node status. Before a detach the node must stop advertising the volume, so the
    // update carries the detaches of this pass already (the executor patches before deleting).
    let mut reports: BTreeMap<&str, BTreeMap<&str, &str>> = BTreeMap::new();
    for ((volume, node), a) in actual.iter() {
        if detaching.contains(&(volume.as_str(), node.as_str())) {
            continue;
        }
        if let Some(path) = a.report() {
            reports.entry(node).or_default().insert(volume, path);
        }
    }
    for (name, info) in nodes {
        let want = reports.remove(name.as_str()).unwrap_or_default();
        // A gone Node has no status to write.
        if info.deleted {
            continue;
        }
        // Leave nodes alone that the controller has nothing to do with.
        if !info.managed && want.is_empty() && !detaching.iter().any(|(_, n)| n == name) {
            continue;
        }
        // Entries of plugins this controller does not have stay as they are: upstream cannot
        // detach them either, so it keeps them listed.
        let mut want = want;
        let mut foreign = false;
        for (v, p) in &info.volumes_attached {
            if !is_managed_name(v) {
                want.insert(v.as_str(), p.as_str());
                foreign = true;
            }
        }
        let same = want.len() == info.volumes_attached.len()
            && want
                .iter()
                .all(|(v, p)| info.volumes_attached.get(*v).map(String::as_str) == Some(*p));
        if !same {
            actions.push(Action::UpdateNodeStatus {
                node: name.clone(),
                volumes: want
                    .into_iter()
                    .map(|(v, p)| (v.to_string(), p.to_string()))
                    .collect(),
                guard: foreign.then(|| info.resource_version.clone()).flatten(),
            });
        }
    }

    // Phase 3: attaches.
    actions.extend(attaches(desired, actual, nodes, now, desired.iter()));
    actions
}

/// Phase 3 alone, for the volumes in `volumes`: what a full pass would decide to attach for
/// them, and nothing else. Attach decisions of a volume read only that volume's desired and
/// actual entries (and the nodes'), never the pass's other phases, so a pod event can be
/// answered at once without scanning every attachment; detaches, node status and releases
/// wait for the next full pass.
pub fn reconcile_attaches(
    desired: &Desired,
    actual: &Actual,
    nodes: &Nodes,
    now: Instant,
    volumes: &BTreeSet<String>,
) -> Vec<Action> {
    attaches(
        desired,
        actual,
        nodes,
        now,
        volumes.iter().flat_map(|v| desired.wanting(v)),
    )
}

/// Attaches (and multi-attach refusals) for the desired entries `wants`. Per volume, nodes come
/// in name order, so two nodes wanting one single-node volume at once resolve the same way
/// whether the whole desired state or one volume is walked.
fn attaches<'a>(
    desired: &Desired,
    actual: &Actual,
    nodes: &Nodes,
    now: Instant,
    wants: impl Iterator<Item = (&'a String, &'a DesiredVolume)>,
) -> Vec<Action> {
    let mut actions = Vec::new();
    // Single-node volumes handed to a node in this pass.
    let mut claimed: BTreeMap<&str, &str> = BTreeMap::new();
    for (node, want) in wants {
        let volume = want.spec.name.as_str();
        if !nodes.get(node).is_some_and(NodeInfo::accepts_attach) {
            continue;
        }
        if let Some(a) = actual.get(volume, node) {
            if a.exists() {
                if a.detach_requested.is_some() {
                    actions.push(Action::CancelDetachRequest {
                        volume: volume.to_string(),
                        node: node.clone(),
                    });
                }
                // Attached, attaching, or being deleted (re-created once it is gone).
                continue;
            }
            if a.op.is_some() || a.backing_off(now) {
                continue;
            }
        }
        if !want.spec.multi_attach {
            let held = actual.other_nodes(volume, node).next().is_some()
                || claimed.get(volume).is_some_and(|n| *n != node.as_str());
            if held {
                if !want.multi_attach_reported {
                    actions.push(Action::MultiAttachError {
                        volume: volume.to_string(),
                        node: node.clone(),
                        notes: want
                            .pods
                            .values()
                            .map(|p| {
                                (
                                    p.clone(),
                                    multi_attach_note(desired, actual, volume, node, &want.spec, p),
                                )
                            })
                            .collect(),
                    });
                }
                continue;
            }
            claimed.insert(volume, node);
        }
        actions.push(Action::Attach {
            volume: volume.to_string(),
            node: node.clone(),
            va_name: attachment_name(&want.spec.handle, &want.spec.driver, node),
            pv_name: want.spec.pv_name.clone(),
            driver: want.spec.driver.clone(),
            kind: want.spec.kind.clone(),
        });
    }
    actions
}

/// The event text for `waiting`, in upstream's words (users and runbooks grep for them):
/// "Multi-Attach error for volume "<pv>" Volume is already used by pod(s) a, b". Only pods on
/// the nodes the volume is attached to count (those are what holds it); their names only from
/// the waiting pod's own namespace, a count for the rest, so no names leak across namespaces.
fn multi_attach_note(
    desired: &Desired,
    actual: &Actual,
    volume: &str,
    node: &str,
    spec: &VolumeSpec,
    waiting: &PodRef,
) -> String {
    let attached: BTreeSet<&str> = actual.other_nodes(volume, node).collect();
    let holders = attached.iter().flat_map(|n| desired.pods_on(volume, n));
    let note = multi_attach_text(holders, &spec.pv_name, waiting);
    if spec.driver == LOOP_DRIVER {
        format!("{note} ({LOOP_SINGLE_NODE_RULE})")
    } else {
        note
    }
}

fn multi_attach_text<'a>(
    holders: impl Iterator<Item = &'a PodRef>,
    pv_name: &str,
    waiting: &PodRef,
) -> String {
    let mut same: Vec<&str> = Vec::new();
    let mut others = 0usize;
    for p in holders {
        if p.namespace == waiting.namespace {
            same.push(&p.name);
        } else {
            others += 1;
        }
    }
    same.sort_unstable();
    same.dedup();
    let head = format!("Multi-Attach error for volume \"{pv_name}\"");
    match (same.is_empty(), others) {
        (true, 0) => format!(
            "{head} Volume is already exclusively attached to one node and can't be attached to another"
        ),
        (false, 0) => format!("{head} Volume is already used by pod(s) {}", same.join(", ")),
        (true, n) => format!("{head} Volume is already used by {n} pod(s) in different namespaces"),
        (false, n) => format!(
            "{head} Volume is already used by pod(s) {} and {n} pod(s) in different namespaces",
            same.join(", ")
        ),
    }
}

/// Whether an attachment entry going from `before` to `after` leaves every decision of a full
/// pass (and `next_deadline`) as it was, given that its (volume, node) is `wanted` in the desired
/// state before and after. It is what lets the create's result and its watch event skip the
/// full pass during an attach burst: the entry stays present for the multi-attach guard, is not
/// being deleted (release, detach), has nothing new to report in node status, and carries no
/// countdown or retry. Anything else marks the pass due.
pub fn pass_unaffected(before: &PairState, after: &PairState, wanted: bool) -> bool {
    let calm =
        |a: &PairState| a.exists() && !a.deleting() && a.detach_requested.is_none() && a.retry_at.is_none();
    wanted && calm(before) && calm(after) && before.report() == after.report()
}

/// When the next pass is due without any new event: the earliest unmount deadline or retry
/// still ahead of `now` (one already passed has had its pass).
pub fn next_deadline(actual: &Actual, config: &Config, now: Instant) -> Option<Instant> {
    actual
        .iter()
        .filter_map(|(_, a)| {
            let unmount = (!config.disable_force_detach_on_timeout && a.op != Some(Op::Detach))
                .then_some(a.detach_requested)
                .flatten()
                .map(|t| t + config.max_wait_for_unmount);
            [unmount, a.retry_at]
                .into_iter()
                .flatten()
                .filter(|t| *t > now)
                .min()
        })
        .min()
}

#[cfg(test)]
mod tests;
