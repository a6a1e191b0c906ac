//! What an operation reports back (`Outcome`) and how it is folded into the loop's memory; the
//! rate-limited Events that tell users why a volume is not mounted yet.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use k8s_openapi::api::core::v1::ObjectReference;
use std::time::Duration;
use stowage_common::observe::events::{Occurrence, Repeat, Subject};

use tokio::time::Instant;

use crate::core::Op;
use crate::ctx::Ctx;
use crate::probe::{self, Health};
use crate::state::{Actual, Desired, PodInfo};
use crate::tracker::Tracker;

/// What an operation reports back to the loop.
pub(crate) struct Outcome {
    pub(crate) op: Op,
    pub(crate) ok: bool,
    /// A claim whose expansion was finished: (uid, resourceVersion written).
    pub(crate) expanded: Option<(String, String)>,
}

/// One operation per task: its report settles its one debt.
impl stowage_common::runtime::owed::Work for Outcome {
    fn same_work(&self, _: &Self) -> bool {
        true
    }
}

/// The (pod UID, volume, reason) triples whose events are being repeated: when one clears, the
/// recorder forgets it, so a recurrence is said at once.
pub(crate) type Noted = HashSet<(String, String, &'static str)>;

/// How a "cannot mount yet" event repeats while it stays the same: after 10 s, then gaps that
/// double up to 5 minutes.
pub(crate) const REPEAT: Repeat = Repeat::Backoff {
    first: Duration::from_secs(10),
    max: Duration::from_secs(300),
};

/// The events gate's subject of one (pod, volume, reason).
fn subject((uid, volume, reason): &(String, String, &'static str)) -> Subject {
    Subject::new("pod", uid).about(volume).about(reason)
}

/// Says one (pod, volume, reason) event under `REPEAT`; returns whether it was said.
fn note(
    ctx: &Ctx,
    noted: &mut Noted,
    key: (String, String, &'static str),
    on: &ObjectReference,
    note: String,
) -> bool {
    let said = ctx.events.report(
        &subject(&key),
        REPEAT,
        on,
        Occurrence {
            warning: true,
            reason: key.2,
            action: "Mount",
            note,
        },
    );
    noted.insert(key);
    said
}

/// Forgets the triples of `class` (by `in_class`) that were not seen in this pass.
fn forget_cleared(
    ctx: &Ctx,
    noted: &mut Noted,
    seen: &BTreeSet<(String, String, &'static str)>,
    in_class: impl Fn(&str) -> bool,
) {
    noted.retain(|k| {
        let keep = seen.contains(k) || !in_class(k.2);
        if !keep {
            ctx.events.forget(&subject(k));
        }
        keep
    });
}

pub(crate) fn finish(tracker: &mut Tracker, expanded: &mut BTreeMap<String, String>, done: Outcome) {
    tracker.finish(&done.op.key(), done.op.kind(), done.ok, Instant::now());
    if let Some((uid, rv)) = done.expanded {
        expanded.insert(uid, rv);
    }
}

/// Events for pods whose volumes cannot be mounted yet, each repeated with growing gaps.
pub(crate) async fn note_errors(ctx: &Ctx, d: &Desired, noted: &mut Noted) {
    let mut seen = BTreeSet::new();
    for e in &d.errors {
        let key = (e.pod.uid.clone(), e.volume.clone(), e.reason);
        seen.insert(key.clone());
        let text = format!("Unable to mount volume \"{}\": {}", e.volume, e.message);
        if note(ctx, noted, key, &e.pod.reference(), text.clone()) {
            tracing::info!(pod = %e.pod.name, ns = %e.pod.namespace, reason = e.reason, "{text}");
        }
    }
    forget_cleared(ctx, noted, &seen, |r| !UNSURE_REASONS.contains(&r));
}

/// Event reasons of `note_unsure`.
pub(crate) const UNSURE_REASONS: [&str; 2] = ["VolumeMountUnresponsive", "VolumeMountCheckFailed"];

/// Events for running pods whose mount did not answer its probe or answered with an error that
/// does not prove it broken: the mount is left in place; the user hears why it may misbehave.
pub(crate) fn note_unsure(
    ctx: &Ctx,
    d: &Desired,
    a: &Actual,
    known_pods: &HashMap<String, PodInfo>,
    noted: &mut Noted,
) {
    let mut seen = BTreeSet::new();
    for (pv, av) in &a.volumes {
        for (uid, pm) in &av.pods {
            let (reason, message) = match &pm.state.health {
                Health::Pending if pm.state.mounted => (
                    UNSURE_REASONS[0],
                    format!(
                        "the mount of volume \"{pv}\" does not answer (stat has not returned within {}s); it is left in place, a running pod's volume is never unmounted for being slow",
                        probe::PROBE_WAIT.as_secs()
                    ),
                ),
                Health::Unknown(why) if pm.state.mounted => (
                    UNSURE_REASONS[1],
                    format!("the health check of volume \"{pv}\" failed ({why}); the mount is left in place"),
                ),
                _ => continue,
            };
            tracing::debug!(pv, pod_uid = %uid, "{message}");
            let (Some(pod), true) = (known_pods.get(uid), d.live_pods.contains(uid)) else {
                continue;
            };
            let key = (uid.clone(), pv.clone(), reason);
            seen.insert(key.clone());
            if note(ctx, noted, key, &pod.reference(), message.clone()) {
                tracing::warn!(pv, pod = %pod.name, ns = %pod.namespace, "{message}");
            }
        }
    }
    forget_cleared(ctx, noted, &seen, |r| UNSURE_REASONS.contains(&r));
}
