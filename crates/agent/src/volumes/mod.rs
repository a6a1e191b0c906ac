//! The volume manager's loop: one task observes (`ingest`: caches and mount table), decides
//! with `crate::core`, and starts operations (`exec`); each runs as a task of its own and reports
//! an `Outcome` (`results`). The mount table is read on every pass, so the actual state is
//! reconstructed at start and can never drift from the node's truth.
//!
//! A task reports through `stowage_common::runtime::owed::Owed`, so one that panics still reports a
//! failed `Outcome` and its volume is retried with backoff.
//!
//! Why its own task set and `Tracker` rather than `stowage_common::runtime::inflight::Window` (decided in
//! issue 17; the attacher's own reason is at the top of `attacher/mod.rs`): the window runs one
//! task per key with keys compared for equality, while these keys nest (a key without a pod
//! stands for the whole volume and excludes every pod's operation on it,
//! `tracker::OpKey::conflicts`), backoff is per key *and* kind of operation, and every volume is
//! decided in one pass over the mount table rather than per queued key.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use stowage_common::observe::events::{Occurrence, Subject};
use stowage_common::store::informer::Informer;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::core::{Op, reconcile, schedule};
use stowage_common::errors::MetricLabel;

use crate::ctx::Ctx;
use crate::paths::unique_name;
use crate::probe::{Health, Prober};
use crate::state::{Actual, Desired, DesiredVolume, PodInfo};
use crate::tracker::Tracker;
use stowage_common::runtime::driver::Inputs;
use stowage_common::runtime::owed::Owed;

use crate::passes::{self, Woke};

mod claim;
mod exec;
mod ingest;
mod results;

/// How a failure Event repeats while it stays the same (the volume manager's, the image loop's
/// and the attacher's).
pub(crate) use results::REPEAT;

pub use claim::finish_claim_resize;
use exec::Executor;
pub use ingest::observe;
use ingest::observe_and_decide;
use results::{Noted, Outcome, finish, note_errors, note_unsure};

/// Longest sleep between passes: mounts are re-checked for health at least this often.
const PERIOD: Duration = Duration::from_secs(1);

/// Channels between the volume manager and the node status task.
pub struct NodeLink {
    /// Unique names to list in `volumesInUse` (None until the first pass).
    pub in_use: watch::Sender<Option<BTreeSet<String>>>,
    /// Unique names the node status lists now.
    pub reported: watch::Receiver<BTreeSet<String>>,
    /// This node's Node object (`status.volumesAttached`).
    pub node: Informer<Node>,
}

pub async fn run(ctx: Arc<Ctx>, mut link: NodeLink, mut stop: watch::Receiver<bool>) {
    tokio::join!(
        ctx.pods.ready(),
        ctx.pvcs.ready(),
        ctx.pvs.ready(),
        ctx.vas.ready(),
        link.node.ready()
    );
    let mut inputs = Inputs::new()
        .feed(link.node.feed(), |_| ())
        .feed(ctx.pods.feed(), |_| ())
        .feed(ctx.pvcs.feed(), |_| ())
        .feed(ctx.pvs.feed(), |_| ())
        .feed(ctx.vas.feed(), |_| ());
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Outcome>();
    let mut tasks = JoinSet::new();
    let mut tracker = Tracker::default();
    let mut expanded: BTreeMap<String, String> = BTreeMap::new();
    let mut known_pods: HashMap<String, PodInfo> = HashMap::new();
    let mut handles: HashMap<String, String> = HashMap::new();
    let mut noted = Noted::new();
    // Reasons the node could not be observed for, said on the Node until it can be again.
    let mut blind: HashSet<&'static str> = HashSet::new();
    let prober = Prober::new(ctx.metrics.probes_in_flight.clone());
    tracing::info!("volume manager started");
    loop {
        let now = Instant::now();
        match observe_and_decide(&ctx, &link, &expanded, &prober).await {
            Ok((d, a)) => {
                if !blind.is_empty() {
                    tracing::info!("the node can be observed again, resuming");
                    for reason in blind.drain() {
                        ctx.events.forget(&blind_subject(reason));
                    }
                }
                pass(
                    &ctx,
                    &link,
                    Pass {
                        d,
                        a,
                        now,
                        tracker: &mut tracker,
                        known_pods: &mut known_pods,
                        handles: &mut handles,
                        noted: &mut noted,
                        tasks: &mut tasks,
                        done_tx: &done_tx,
                    },
                )
                .await;
            }
            Err(e) => {
                // Keep the last known state: publish nothing, start nothing, look again soon.
                ctx.metrics
                    .observe_errors
                    .with_label_values(&[e.metric_label()])
                    .inc();
                tracing::error!(error = %e, "cannot observe the node's volumes; keeping the last known state");
                let note = format!(
                    "{e}; the volume manager keeps its last known state (volumesInUse unchanged, nothing mounted or unmounted) and retries"
                );
                let node = k8s_openapi::api::core::v1::ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Node".into()),
                    name: Some(ctx.node.clone()),
                    ..Default::default()
                };
                blind.insert(e.reason());
                let e = Occurrence {
                    warning: true,
                    reason: e.reason(),
                    action: "Observe",
                    note,
                };
                ctx.events.report(&blind_subject(e.reason), REPEAT, &node, e);
            }
        }

        // Sleep until something changes, an operation ends, a backoff expires or the period ends.
        let wake = tracker
            .next_expiry(now)
            .map_or(now + PERIOD, |t| t.min(now + PERIOD));
        // What changed does not matter (the next pass reads the stores); a feed that ended does:
        // its informer stopped, and the agent must exit rather than decide on a frozen store.
        let reported = async {
            let _ = link.reported.changed().await;
        };
        let fold = |done| finish(&mut tracker, &mut expanded, done);
        match passes::wait(&mut inputs, &mut done_rx, fold, reported, wake, &mut stop).await {
            Ok(Woke::Look) => {}
            Ok(Woke::Stop) => break,
            Err(e) => {
                tracing::error!(error = %e, "volume manager stops");
                break;
            }
        }
        // Let a burst of changes settle before the next full pass.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let running operations end: a tool killed half-way (mkfs above all) could leave a device
    // that can neither be used nor safely reformatted.
    tracing::info!(running = tracker.running(), "volume manager stopping");
    let _ = tokio::time::timeout(Duration::from_secs(30), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
}

/// The state one pass works on, and the loop's memory it updates.
struct Pass<'a> {
    d: Desired,
    a: Actual,
    now: Instant,
    tracker: &'a mut Tracker,
    known_pods: &'a mut HashMap<String, PodInfo>,
    handles: &'a mut HashMap<String, String>,
    noted: &'a mut Noted,
    tasks: &'a mut JoinSet<()>,
    done_tx: &'a mpsc::UnboundedSender<Outcome>,
}

/// One pass on a node that could be observed: publish the in-use set, report, decide, start.
async fn pass(ctx: &Arc<Ctx>, link: &NodeLink, p: Pass<'_>) {
    let Pass {
        d,
        a,
        now,
        tracker,
        known_pods,
        handles,
        noted,
        tasks,
        done_tx,
    } = p;
    for (pv, dv) in &d.volumes {
        handles.insert(pv.clone(), dv.handle.clone());
        for u in dv.pods.values() {
            known_pods.insert(u.pod.uid.clone(), u.pod.clone());
        }
    }
    // volumesInUse: wanted or still (partly) mounted here.
    let in_use: BTreeSet<String> = d
        .volumes
        .values()
        .map(DesiredVolume::unique_name)
        .chain(a.volumes.keys().map(|pv| {
            let handle = handles.get(pv).cloned().or_else(|| {
                ctx.pv(pv)
                    .and_then(|p| p.spec.as_ref()?.csi.as_ref().map(|c| c.volume_handle.clone()))
            });
            unique_name(handle.as_deref().unwrap_or(pv))
        }))
        .collect();
    link.in_use.send_if_modified(|cur| {
        let changed = cur.as_ref() != Some(&in_use);
        if changed {
            *cur = Some(in_use.clone());
        }
        changed
    });
    note_errors(ctx, &d, noted).await;
    note_unsure(ctx, &d, &a, known_pods, noted);
    ctx.metrics
        .volumes
        .with_label_values(&["desired"])
        .set(d.volumes.len() as i64);
    ctx.metrics
        .volumes
        .with_label_values(&["actual"])
        .set(a.volumes.len() as i64);
    let want_pods: usize = d.volumes.values().map(|v| v.pods.len()).sum();
    ctx.metrics
        .pod_volumes
        .with_label_values(&["desired"])
        .set(want_pods as i64);
    let have_pods = a
        .volumes
        .values()
        .flat_map(|v| v.pods.values())
        .filter(|p| p.state.ok())
        .count();
    ctx.metrics
        .pod_volumes
        .with_label_values(&["actual"])
        .set(have_pods as i64);
    let mut health: BTreeMap<&str, i64> = crate::metrics::HEALTH_STATES.iter().map(|h| (*h, 0)).collect();
    let states = a
        .volumes
        .values()
        .flat_map(|v| v.device.iter().chain(v.pods.values().map(|p| &p.state)))
        .filter(|m| m.mounted);
    for m in states {
        let label = match m.health {
            Health::Healthy => "healthy",
            Health::Pending => "pending",
            Health::Unknown(_) => "unknown",
            Health::Broken(_) => "broken",
        };
        *health.entry(label).or_default() += 1;
    }
    for (label, n) in health {
        ctx.metrics.mount_health.with_label_values(&[label]).set(n);
    }
    ctx.metrics.passes.with_label_values(&["volumes"]).inc();

    let ops = reconcile(&d, &a);
    let wanted: BTreeSet<_> = ops.iter().map(|o| o.key()).collect();
    tracker.retain(|k| wanted.contains(k));
    for op in schedule(ops, tracker, now) {
        tracker.start(op.key());
        let job = Executor {
            ctx: ctx.clone(),
            dv: d.volumes.get(op.pv()).cloned(),
            actual: a.volumes.get(op.pv()).cloned().unwrap_or_default(),
            pod: match &op {
                Op::Teardown { uid, .. } | Op::Mount { uid, .. } => known_pods.get(uid).cloned(),
                _ => None,
            },
        };
        let owed = Owed::new(
            done_tx,
            vec![Outcome {
                op: op.clone(),
                ok: false,
                expanded: None,
            }],
        );
        tasks.spawn(async move {
            let _guard = owed.guard();
            owed.send(job.run(op).await);
        });
    }
    known_pods
        .retain(|uid, _| d.live_pods.contains(uid) || a.volumes.values().any(|v| v.pods.contains_key(uid)));
}

/// The events gate's subject of "the node cannot be observed" for one reason: reported while it
/// lasts, forgotten when the node can be observed again.
fn blind_subject(reason: &str) -> Subject {
    Subject::new("node", "self").about(reason)
}
