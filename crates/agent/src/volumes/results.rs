//! What an operation reports back (`Outcome`) and how it is folded into the loop's memory; the
//! rate-limited Events that tell users why a volume is not mounted yet.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

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

/// Rate limit for repeated "cannot mount yet" events of one (pod, volume, reason).
pub(crate) struct Noted {
    pub(crate) message: String,
    pub(crate) next: Instant,
    pub(crate) delay: Duration,
}

/// First gap between repeats of the same event; it doubles up to `NOTE_MAX`.
pub(crate) const NOTE_FIRST: Duration = Duration::from_secs(10);
pub(crate) const NOTE_MAX: Duration = Duration::from_secs(300);

/// Records that `key` wants to say `message` now; true when it is due (first time, a new
/// message, or the gap since the last one passed; gaps double while the message stays).
pub(crate) fn note_due<K: std::hash::Hash + Eq>(
    noted: &mut HashMap<K, Noted>,
    key: K,
    message: &str,
    now: Instant,
) -> bool {
    let due = match noted.get(&key) {
        None => true,
        Some(n) => n.message != message || now >= n.next,
    };
    if !due {
        return false;
    }
    let delay = noted
        .get(&key)
        .filter(|n| n.message == message)
        .map_or(NOTE_FIRST, |n| (n.delay * 2).min(NOTE_MAX));
    noted.insert(
        key,
        Noted {
            message: message.to_string(),
            next: now + delay,
            delay,
        },
    );
    true
}

pub(crate) fn finish(tracker: &mut Tracker, expanded: &mut BTreeMap<String, String>, done: Outcome) {
    tracker.finish(&done.op.key(), done.op.kind(), done.ok, Instant::now());
    if let Some((uid, rv)) = done.expanded {
        expanded.insert(uid, rv);
    }
}

/// Events for pods whose volumes cannot be mounted yet, each repeated with growing gaps.
pub(crate) async fn note_errors(
    ctx: &Ctx,
    d: &Desired,
    noted: &mut HashMap<(String, String, &'static str), Noted>,
    now: Instant,
) {
    let mut seen = BTreeSet::new();
    for e in &d.errors {
        let key = (e.pod.uid.clone(), e.volume.clone(), e.reason);
        seen.insert(key.clone());
        if !note_due(noted, key, &e.message, now) {
            continue;
        }
        let note = format!("Unable to mount volume \"{}\": {}", e.volume, e.message);
        tracing::info!(pod = %e.pod.name, ns = %e.pod.namespace, reason = e.reason, "{note}");
        ctx.events.warning(&e.pod.reference(), e.reason, "Mount", note);
    }
    noted.retain(|k, _| seen.contains(k) || UNSURE_REASONS.contains(&k.2));
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
    noted: &mut HashMap<(String, String, &'static str), Noted>,
    now: Instant,
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
            if note_due(noted, key, &message, now) {
                tracing::warn!(pv, pod = %pod.name, ns = %pod.namespace, "{message}");
                ctx.events.warning(&pod.reference(), reason, "Mount", message);
            }
        }
    }
    noted.retain(|k, _| seen.contains(k) || !UNSURE_REASONS.contains(&k.2));
}
