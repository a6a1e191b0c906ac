//! The detector's I/O: a metadata-only watch per kind that stowage writes, a poll of
//! kube-controller-manager's pods, and the reports (Events, metrics, log lines, the conflict flag
//! the controller loop reads).

use std::collections::HashMap;
use std::time::Duration;

use futures::{StreamExt, pin_mut};
use k8s_openapi::api::core::v1::{Node, ObjectReference, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, ObjectList, WatchEvent, WatchParams};
use kube::core::Request;
use kube::{Api, Client, Resource};
use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Opts};
use stowage_common::observe::events::pod_reference;
use stowage_common::observe::events::{Events, Occurrence, Repeat, Subject};
use stowage_common::observe::metrics::{Registry, register};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{Kind, Object, Owned, RivalWrite, Seen, kcm_storage_controllers, owned, rival_write};

/// How often kube-controller-manager's pods are listed.
const POD_PERIOD: Duration = Duration::from_secs(30);
/// At most one Event per kind this often: a rival binding thousands of claims must not become
/// thousands of Events; the counter counts every write.
const EVENT_PERIOD: Duration = Duration::from_secs(60);
/// How often a clash of flags that has not changed is reported again.
const REPEAT_PERIOD: Duration = Duration::from_secs(600);

/// The events gate's subject of a kube-controller-manager pod whose flags clash.
fn flag_subject(pod: &str) -> Subject {
    Subject::new("pod", pod).about("kube-controller-manager flags")
}
/// Objects a watcher remembers the rivals' storage fields of (two bytes and a key each), so a
/// rival write is told from a re-dated entry (`rival_write`). Beyond this the memory starts
/// again: objects then seen for the first time are baselines, not evidence.
const REMEMBERED: usize = 200_000;
/// The label selector of kubeadm's and kind's kube-controller-manager static pods.
const KCM_POD_SELECTOR: &str = "component=kube-controller-manager";
const KCM_NAMESPACE: &str = "kube-system";

/// Sources, the `source` label values.
pub const WRITES: &str = "writes";
pub const FLAGS: &str = "flags";

#[derive(Clone)]
pub struct Metrics {
    /// 1 while a source shows a conflict.
    pub conflict: IntGaugeVec,
    pub writes: IntCounterVec,
    pub errors: IntCounterVec,
    /// 1 while `--on-conflict=pause` holds the controllers stopped.
    pub paused: IntGauge,
}

impl Metrics {
    pub fn new(registry: &Registry) -> Self {
        let m = Self {
            conflict: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "stowage_conflict",
                        "1 while another storage controller is seen acting on what stowage runs, by source (writes: kube-controller-manager wrote a storage field within the quiet period; flags: a kube-controller-manager pod's --controllers turns one on).",
                    ),
                    &["source"],
                )
                .expect("static metric definition"),
            ),
            writes: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "stowage_conflicting_writes_total",
                        "Writes by kube-controller-manager to storage fields of objects a running stowage controller owns, by resource and that controller.",
                    ),
                    &["resource", "controller"],
                )
                .expect("static metric definition"),
            ),
            errors: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "stowage_conflict_check_errors_total",
                        "Failed watches or lists of the conflict detector, by source; retried with backoff.",
                    ),
                    &["source"],
                )
                .expect("static metric definition"),
            ),
            paused: register(
                registry,
                IntGauge::new(
                    "stowage_controllers_paused",
                    "1 while --on-conflict=pause keeps the controllers stopped because of a conflict.",
                )
                .expect("static metric definition"),
            ),
        };
        for s in [WRITES, FLAGS] {
            m.conflict.with_label_values(&[s]).set(0);
        }
        m
    }
}

enum Finding {
    Write {
        kind: Kind,
        name: String,
        namespace: Option<String>,
        uid: Option<String>,
        write: RivalWrite,
    },
    Pods(Vec<(String, Option<String>, Vec<&'static str>)>),
    Error(&'static str),
}

/// Starts the detector for the controllers in `running`. The receiver is true while a conflict
/// holds; the tasks end when the returned set is dropped.
pub fn spawn(
    client: Client,
    running: &[&'static str],
    quiet: Duration,
    metrics: Metrics,
) -> (watch::Receiver<bool>, JoinSet<()>) {
    let (flag_tx, flag_rx) = watch::channel(false);
    let (tx, rx) = mpsc::channel(256);
    let mut tasks = JoinSet::new();
    // Truncated to whole seconds: managedFields times have no more precision.
    let since = Timestamp::from_second(Timestamp::now().as_second()).unwrap_or_else(|_| Timestamp::now());
    for kind in Kind::ALL {
        if running.contains(&kind.owner()) {
            tasks.spawn(watch_kind(client.clone(), kind, since, tx.clone()));
        }
    }
    tasks.spawn(poll_pods(client.clone(), running.to_vec(), tx));
    let events = Events::new(client, "stowage-controller");
    tasks.spawn(report(rx, flag_tx, quiet, metrics, events));
    (flag_rx, tasks)
}

fn collection(kind: Kind) -> String {
    match kind {
        Kind::PersistentVolume => PersistentVolume::url_path(&(), None),
        Kind::PersistentVolumeClaim => PersistentVolumeClaim::url_path(&(), None),
        Kind::VolumeAttachment => VolumeAttachment::url_path(&(), None),
        Kind::Node => Node::url_path(&(), None),
    }
}

/// The collection's current resourceVersion: the watch starts there, so only changes made from
/// now on are read (the objects themselves were written before stowage looked).
async fn current_version(client: &Client, path: &str) -> Result<String, kube::Error> {
    let req = Request::new(path)
        .list_metadata(&ListParams::default().limit(1))
        .map_err(kube::Error::BuildRequest)?;
    let list: ObjectList<Object> = client.request(req).await?;
    Ok(list.metadata.resource_version.unwrap_or_default())
}

/// A compact key of an object: its UID's 128 bits, or a hash of its name where it has none.
fn object_key(meta: &super::Meta) -> u128 {
    let uid = meta.uid.as_deref().unwrap_or_default().replace('-', "");
    u128::from_str_radix(&uid, 16).unwrap_or_else(|_| {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&meta.namespace, &meta.name, &meta.uid).hash(&mut h);
        u128::from(h.finish())
    })
}

async fn watch_kind(client: Client, kind: Kind, since: Timestamp, tx: mpsc::Sender<Finding>) {
    let path = collection(kind);
    let mut version: Option<String> = None;
    // Object → what the rivals owned of its storage fields when last seen.
    let mut seen: HashMap<u128, Owned> = HashMap::new();
    let mut delay = Duration::from_secs(1);
    loop {
        let from = match version.take() {
            Some(v) => v,
            None => match current_version(&client, &path).await {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!(kind = kind.as_str(), error = %e, "conflict detector: list failed");
                    let _ = tx.send(Finding::Error(WRITES)).await;
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(60));
                    continue;
                }
            },
        };
        let wp = WatchParams::default().timeout(290);
        let stream = match Request::new(&path).watch_metadata(&wp, &from) {
            Ok(req) => client.request_events::<Object>(req).await,
            Err(e) => Err(kube::Error::BuildRequest(e)),
        };
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(kind = kind.as_str(), error = %e, "conflict detector: watch failed");
                let _ = tx.send(Finding::Error(WRITES)).await;
                version = Some(from);
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(60));
                continue;
            }
        };
        delay = Duration::from_secs(1);
        // Resumes where this watch ended, unless the server says that version is gone.
        version = Some(from);
        pin_mut!(stream);
        while let Some(event) = stream.next().await {
            let object = match event {
                Ok(WatchEvent::Added(o) | WatchEvent::Modified(o)) => o,
                Ok(WatchEvent::Deleted(o)) => {
                    seen.remove(&object_key(&o.metadata));
                    version = o.metadata.resource_version;
                    continue;
                }
                Ok(WatchEvent::Bookmark(b)) => {
                    version = Some(b.metadata.resource_version);
                    continue;
                }
                Ok(WatchEvent::Error(e)) => {
                    if e.code == 410 {
                        version = None;
                    }
                    break;
                }
                Err(e) => {
                    tracing::debug!(kind = kind.as_str(), error = %e, "conflict detector: watch ended");
                    break;
                }
            };
            version = object.metadata.resource_version.clone();
            let key = object_key(&object.metadata);
            let before = seen.get(&key).copied();
            if seen.len() >= REMEMBERED && before.is_none() {
                seen.clear();
            }
            seen.insert(key, owned(kind, &object.metadata));
            let Some(write) = rival_write(kind, &object.metadata, since, before) else {
                continue;
            };
            let meta = object.metadata;
            let finding = Finding::Write {
                kind,
                name: meta.name,
                namespace: meta.namespace,
                uid: meta.uid,
                write,
            };
            if tx.send(finding).await.is_err() {
                return;
            }
        }
    }
}

async fn poll_pods(client: Client, running: Vec<&'static str>, tx: mpsc::Sender<Finding>) {
    let pods: Api<Pod> = Api::namespaced(client, KCM_NAMESPACE);
    let lp = ListParams::default().labels(KCM_POD_SELECTOR);
    let mut tick = tokio::time::interval(POD_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let finding = match pods.list(&lp).await {
            Ok(list) => Finding::Pods(
                list.items
                    .iter()
                    .filter(|p| live(p))
                    .filter_map(|p| {
                        let clash: Vec<&'static str> = kcm_storage_controllers(&argv(p))
                            .into_iter()
                            .filter(|c| running.contains(c))
                            .collect();
                        (!clash.is_empty()).then(|| {
                            (
                                p.metadata.name.clone().unwrap_or_default(),
                                p.metadata.uid.clone(),
                                clash,
                            )
                        })
                    })
                    .collect(),
            ),
            Err(e) => {
                tracing::debug!(error = %e, "conflict detector: listing kube-controller-manager pods failed");
                Finding::Error(FLAGS)
            }
        };
        if tx.send(finding).await.is_err() {
            return;
        }
    }
}

/// A pod that is or may soon be running: not finished, not being deleted.
fn live(p: &Pod) -> bool {
    let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
    p.metadata.deletion_timestamp.is_none() && !matches!(phase, Some("Succeeded" | "Failed"))
}

/// Every container's command and arguments, in order (the flags may sit in either).
fn argv(p: &Pod) -> Vec<String> {
    p.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .flat_map(|c| c.command.iter().flatten().chain(c.args.iter().flatten()).cloned())
        .collect()
}

/// The kube-controller-manager `--controllers` entries that turn off what clashes.
fn kcm_off(controllers: &[&str]) -> String {
    let off: Vec<String> = controllers
        .iter()
        .filter_map(|n| {
            crate::KCM_ALIASES
                .iter()
                .find(|(k, ours)| ours == n && k.ends_with("-controller"))
                .map(|(k, _)| format!("-{k}"))
        })
        .collect();
    off.join(",")
}

fn reference(kind: Kind, name: &str, namespace: Option<String>, uid: Option<String>) -> ObjectReference {
    let api_version = match kind {
        Kind::VolumeAttachment => "storage.k8s.io/v1",
        _ => "v1",
    };
    ObjectReference {
        api_version: Some(api_version.into()),
        kind: Some(kind.as_str().into()),
        name: Some(name.into()),
        namespace,
        uid,
        ..Default::default()
    }
}

async fn report(
    mut rx: mpsc::Receiver<Finding>,
    flag: watch::Sender<bool>,
    quiet: Duration,
    metrics: Metrics,
    events: Events,
) {
    let started = Instant::now();
    let mut seen = Seen::default();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            f = rx.recv() => match f {
                None => return,
                Some(Finding::Write { kind, name, namespace, uid, write }) => {
                    let RivalWrite { at, fields, manager } = write;
                    // k3s's embedded kube-controller-manager writes as `k3s`: say which.
                    let who = match manager {
                        "kube-controller-manager" => manager.to_string(),
                        other => format!("kube-controller-manager (field manager {other})"),
                    };
                    let owner = kind.owner();
                    metrics.writes.with_label_values(&[kind.as_str(), owner]).inc();
                    seen.last_write = Some(started.elapsed());
                    // Once a minute per kind of object, however many KCM writes.
                    let said = events.report(
                        &Subject::new("rival writes to", kind.as_str()),
                        Repeat::Every(EVENT_PERIOD),
                        &reference(kind, &name, namespace.clone(), uid),
                        Occurrence {
                            warning: true,
                            reason: "ConflictingController",
                            action: "DetectConflict",
                            note: format!(
                                "{who} wrote {fields} of this {} at {at}, as stowage's {owner} controller does: both controllers are running. Turn one off: add {} to kube-controller-manager's --controllers, or leave {owner} out of stowage-controller's",
                                kind.as_str(),
                                kcm_off(&[owner]),
                            ),
                        },
                    );
                    if said {
                        let target = match &namespace {
                            Some(ns) => format!("{ns}/{name}"),
                            None => name.clone(),
                        };
                        tracing::warn!(
                            kind = kind.as_str(), object = %target, %fields, at = %at, controller = owner, manager,
                            "kube-controller-manager wrote what stowage's {owner} controller writes: two controllers are acting on the same objects"
                        );
                    }
                }
                Some(Finding::Pods(pods)) => {
                    // A clash is said when it appears or changes, then again only every
                    // REPEAT_PERIOD (the Event stays fresh), not on every 30 s poll; a pod that no
                    // longer clashes is forgotten, so a new clash of it is said at once.
                    for (name, _) in &seen.flagged {
                        if !pods.iter().any(|(n, _, _)| n == name) {
                            events.forget(&flag_subject(name));
                        }
                    }
                    for (name, uid, clash) in &pods {
                        let said = events.report(
                            &flag_subject(name),
                            Repeat::Backoff {
                                first: REPEAT_PERIOD,
                                max: REPEAT_PERIOD,
                            },
                            &pod_reference(KCM_NAMESPACE, name, uid.as_deref()),
                            Occurrence {
                                warning: true,
                                reason: "ConflictingController",
                                action: "DetectConflict",
                                note: format!(
                                    "this kube-controller-manager runs {} (its --controllers flag), which stowage-controller runs too; add {} to its --controllers",
                                    clash.join(", "),
                                    kcm_off(clash),
                                ),
                            },
                        );
                        if said {
                            tracing::warn!(
                                pod = %format!("{KCM_NAMESPACE}/{name}"), controllers = ?clash,
                                "a kube-controller-manager pod's flags turn on controllers stowage runs"
                            );
                        }
                    }
                    seen.flagged = pods.into_iter().map(|(n, _, c)| (n, c)).collect();
                }
                Some(Finding::Error(source)) => metrics.errors.with_label_values(&[source]).inc(),
            },
            _ = tick.tick() => {}
        }
        let now = started.elapsed();
        let writes = seen.writes_active(now, quiet);
        metrics
            .conflict
            .with_label_values(&[WRITES])
            .set(i64::from(writes));
        metrics
            .conflict
            .with_label_values(&[FLAGS])
            .set(i64::from(!seen.flagged.is_empty()));
        let active = seen.active(now, quiet);
        if active != *flag.borrow() {
            if active {
                tracing::warn!("conflict: another storage controller is acting on what stowage runs");
            } else {
                tracing::info!(quiet = ?quiet, "conflict over: no rival write or flag seen for the quiet period");
            }
            let _ = flag.send(active);
        }
    }
}
