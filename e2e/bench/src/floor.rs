//! `stowage-bench floor`: the apiserver's write floor of a workload. A bare writer, run as its own
//! process like the controllers (so its CPU, RSS and lifetime are measured the same way), with no
//! client rate limit and no decision logic: driven by the same watch events a controller sees, it
//! sends exactly the writes one object needs, `--concurrency` objects at a time, to the object the
//! bench made for it (paired by index name).
//!
//! - static, burst: per claim seen Pending, the 4 PUTs of a bind (volume `spec.claimRef`, volume
//!   status `Bound`, claim `spec.volumeName`, claim status `Bound`).
//! - attach: per pod seen with `nodeName`, its VolumeAttachment (1 create).
//! - expand: per claim whose request grew past its capacity, one event on it (the hand-off).

use std::collections::{BTreeMap, HashSet};
use std::fmt::Debug;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, anyhow};
use futures::StreamExt;
use futures::channel::mpsc;
use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::{VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::fixtures::{RUN_LABEL, attach_driver, paired_volume};

/// What the floor process writes for each object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FloorWorkload {
    Static,
    Burst,
    Attach,
    Expand,
}

impl FloorWorkload {
    pub fn name(self) -> &'static str {
        match self {
            FloorWorkload::Static => "static",
            FloorWorkload::Burst => "burst",
            FloorWorkload::Attach => "attach",
            FloorWorkload::Expand => "expand",
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct FloorArgs {
    #[arg(long)]
    pub workload: FloorWorkload,
    #[arg(long)]
    pub kubeconfig: PathBuf,
    /// Namespace of the run's claims and pods.
    #[arg(long)]
    pub namespace: String,
    /// The run id: the label on the run's objects and the prefix of its volume names.
    #[arg(long)]
    pub run: String,
    /// Objects written at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
}

pub async fn run(args: FloorArgs) -> anyhow::Result<()> {
    let kc = kube::config::Kubeconfig::read_from(&args.kubeconfig)
        .with_context(|| format!("read {}", args.kubeconfig.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    // The controllers' transport (HTTP/2, as client-go's), nothing above it: no token bucket,
    // no retry, no metrics.
    let client = stowage_common::api::transport::client_builder(config)?.build();
    let by_run = watcher::Config::default().labels(&format!("{RUN_LABEL}={}", args.run));
    let ns = args.namespace.as_str();
    let c = args.concurrency.max(1);
    eprintln!(
        "floor: workload {}, namespace {ns}, concurrency {c}",
        args.workload.name()
    );
    match args.workload {
        FloorWorkload::Static | FloorWorkload::Burst => {
            let pvs: Api<PersistentVolume> = Api::all(client.clone());
            let (volumes, writer) = reflector::store();
            let volumes_seen = watcher(pvs.clone(), by_run.clone())
                .default_backoff()
                .modify(strip);
            let feed = reflector::reflector(writer, volumes_seen).for_each(|_| async {});
            let feed = tokio::spawn(feed);
            volumes
                .wait_until_ready()
                .await
                .map_err(|e| anyhow!("volume cache: {e}"))?;
            let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
            let work = each_new(claims.clone(), by_run, wants_bind, c, |claim| {
                let (pvs, claims, volumes) = (&pvs, &claims, &volumes);
                let pv = paired_volume(&args.run, &claim.name_any());
                async move { bind(pvs, claims, volumes, claim, &pv).await }
            });
            let r = work.await;
            feed.abort();
            r
        }
        FloorWorkload::Attach => {
            let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
            let vas: Api<VolumeAttachment> = Api::all(client.clone());
            let attacher = attach_driver(&args.run);
            let scheduled = |p: &Pod| p.spec.as_ref().is_some_and(|s| s.node_name.is_some());
            each_new(pods, by_run, scheduled, c, |pod| {
                let (vas, attacher) = (&vas, &attacher);
                let pv = paired_volume(&args.run, &pod.name_any());
                async move { attach(vas, attacher, &pod, &pv).await }
            })
            .await
        }
        FloorWorkload::Expand => {
            let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
            let events: Api<Event> = Api::namespaced(client.clone(), ns);
            each_new(claims, by_run, grown, c, |claim| {
                let events = &events;
                async move { hand_off(events, &claim).await }
            })
            .await
        }
    }
}

/// Watches `api` and runs `write` once for every object that `wanted` picks (the first time it
/// does), at most `concurrency` at once. Returns only when the watch ends (it does not: the bench
/// stops the process). A failed write is logged and retried a few times; then the bench sees the
/// object stall.
async fn each_new<K, Fut>(
    api: Api<K>,
    config: watcher::Config,
    wanted: impl Fn(&K) -> bool + Send + 'static,
    concurrency: usize,
    write: impl Fn(K) -> Fut,
) -> anyhow::Result<()>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let (tx, rx) = mpsc::unbounded::<K>();
    let seen = Mutex::new(HashSet::<String>::new());
    let feed = tokio::spawn(async move {
        let mut stream = watcher(api, config).default_backoff().modify(strip).boxed();
        while let Some(ev) = stream.next().await {
            if let Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) = ev
                && wanted(&o)
                && tx.unbounded_send(o).is_err()
            {
                return;
            }
        }
    });
    rx.filter(|o| {
        let first = seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(o.name_any());
        async move { first }
    })
    .for_each_concurrent(concurrency, |o| {
        let write = &write;
        async move {
            // A transient failure (timeout, 5xx) is retried from the start: every write here is
            // idempotent or re-reads on conflict, so a retry only costs what it sends.
            for attempt in 0..5u32 {
                match write(o.clone()).await {
                    Ok(()) => return,
                    Err(e) => eprintln!("floor: {} (try {}): {e:#}", o.name_any(), attempt + 1),
                }
                tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
            }
        }
    })
    .await;
    feed.abort();
    Ok(())
}

/// Drops what no write here needs and what would only make requests and memory bigger.
fn strip<K: Resource>(o: &mut K) {
    o.meta_mut().managed_fields = None;
}

/// A claim the binder would bind: Pending (or not yet given a phase) and not bound to a volume.
fn wants_bind(c: &PersistentVolumeClaim) -> bool {
    let phase = c.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, None | Some("Pending")) && c.spec.as_ref().is_none_or(|s| s.volume_name.is_none())
}

/// A claim whose request is above its capacity: an expansion for the controller to hand off.
fn grown(c: &PersistentVolumeClaim) -> bool {
    let request = c
        .spec
        .as_ref()
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"));
    let capacity = c
        .status
        .as_ref()
        .and_then(|s| s.capacity.as_ref())
        .and_then(|c| c.get("storage"));
    match (request, capacity) {
        (Some(r), Some(cap)) => r != cap,
        _ => false,
    }
}

/// PUT of `obj` after `edit`; on a conflict the object is read again and the edit reapplied
/// (the retry counts in the bench's 409 column like any controller's).
async fn put<K>(api: &Api<K>, mut obj: K, status: bool, edit: impl Fn(&mut K)) -> anyhow::Result<K>
where
    K: Resource + Clone + Serialize + DeserializeOwned + Debug,
{
    let pp = PostParams::default();
    let name = obj.name_any();
    let mut attempt = 0;
    loop {
        // Omitted managedFields are kept as they are by the apiserver: no need to send them back
        // (a controller that strips them from its cache does not either).
        obj.meta_mut().managed_fields = None;
        edit(&mut obj);
        let r = if status {
            api.replace_status(&name, &pp, &obj).await
        } else {
            api.replace(&name, &pp, &obj).await
        };
        match r {
            Ok(o) => return Ok(o),
            Err(kube::Error::Api(s)) if s.code == 409 && attempt < 5 => {
                attempt += 1;
                obj = api.get(&name).await?;
            }
            Err(e) => return Err(e).context(format!("update {name}")),
        }
    }
}

const BOUND_BY_CONTROLLER: &str = "pv.kubernetes.io/bound-by-controller";
const BIND_COMPLETED: &str = "pv.kubernetes.io/bind-completed";

fn annotate<K: Resource>(o: &mut K, key: &str) {
    o.meta_mut()
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(key.into(), "yes".into());
}

/// The 4 writes of a bind, in the order a binder makes them (volume first, so a claim never
/// points at a volume that does not point back).
async fn bind(
    pvs: &Api<PersistentVolume>,
    claims: &Api<PersistentVolumeClaim>,
    volumes: &Store<PersistentVolume>,
    claim: PersistentVolumeClaim,
    pv: &str,
) -> anyhow::Result<()> {
    let volume = match volumes.get(&ObjectRef::new(pv)) {
        Some(v) => (*v).clone(),
        None => pvs.get(pv).await?,
    };
    let claim_ref = ObjectReference {
        kind: Some("PersistentVolumeClaim".into()),
        api_version: Some("v1".into()),
        namespace: claim.namespace(),
        name: Some(claim.name_any()),
        uid: claim.uid(),
        resource_version: claim.resource_version(),
        ..Default::default()
    };
    let volume = put(pvs, volume, false, |v| {
        annotate(v, BOUND_BY_CONTROLLER);
        v.spec.get_or_insert_with(Default::default).claim_ref = Some(claim_ref.clone());
    })
    .await?;
    let volume = put(pvs, volume, true, |v| {
        v.status.get_or_insert_with(Default::default).phase = Some("Bound".into());
    })
    .await?;
    let claim = put(claims, claim, false, |c| {
        annotate(c, BOUND_BY_CONTROLLER);
        annotate(c, BIND_COMPLETED);
        c.spec.get_or_insert_with(Default::default).volume_name = Some(pv.to_string());
    })
    .await?;
    let spec = volume.spec.unwrap_or_default();
    put(claims, claim, true, |c| {
        let st = c.status.get_or_insert_with(Default::default);
        st.phase = Some("Bound".into());
        st.access_modes = spec.access_modes.clone();
        st.capacity = spec.capacity.clone();
    })
    .await
    .map(|_| ())
}

/// The VolumeAttachment of `pod`'s volume on its node.
async fn attach(vas: &Api<VolumeAttachment>, attacher: &str, pod: &Pod, pv: &str) -> anyhow::Result<()> {
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    let va = VolumeAttachment {
        metadata: ObjectMeta {
            name: Some(format!("{pv}-{node}")),
            ..Default::default()
        },
        spec: VolumeAttachmentSpec {
            attacher: attacher.into(),
            node_name: node,
            source: VolumeAttachmentSource {
                persistent_volume_name: Some(pv.into()),
                ..Default::default()
            },
        },
        status: None,
    };
    match vas.create(&PostParams::default(), &va).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e).context(format!("create the attachment of {pv}")),
    }
}

/// The one event of an expansion hand-off.
async fn hand_off(events: &Api<Event>, claim: &PersistentVolumeClaim) -> anyhow::Result<()> {
    let now = Timestamp::now();
    let name = claim.name_any();
    let ev = Event {
        metadata: ObjectMeta {
            name: Some(format!("{name}.{:x}", now.as_nanosecond())),
            namespace: claim.namespace(),
            ..Default::default()
        },
        event_time: Some(MicroTime(now)),
        action: Some("Resize".into()),
        reason: Some("ExternalExpanding".into()),
        note: Some("waiting for an external controller to expand this claim".into()),
        regarding: Some(ObjectReference {
            kind: Some("PersistentVolumeClaim".into()),
            api_version: Some("v1".into()),
            namespace: claim.namespace(),
            name: Some(name.clone()),
            uid: claim.uid(),
            ..Default::default()
        }),
        reporting_controller: Some("stowage-bench-floor".into()),
        reporting_instance: Some("stowage-bench-floor".into()),
        type_: Some("Normal".into()),
        ..Default::default()
    };
    events
        .create(&PostParams::default(), &ev)
        .await
        .map(|_| ())
        .with_context(|| format!("event on {name}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        PersistentVolumeClaimSpec, PersistentVolumeClaimStatus, VolumeResourceRequirements,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn claim(
        phase: Option<&str>,
        volume: Option<&str>,
        request: &str,
        capacity: Option<&str>,
    ) -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            spec: Some(PersistentVolumeClaimSpec {
                volume_name: volume.map(Into::into),
                resources: Some(VolumeResourceRequirements {
                    requests: Some([("storage".to_string(), Quantity(request.into()))].into()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: Some(PersistentVolumeClaimStatus {
                phase: phase.map(Into::into),
                capacity: capacity.map(|c| [("storage".to_string(), Quantity(c.into()))].into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn binds_only_pending_unbound_claims() {
        assert!(wants_bind(&claim(Some("Pending"), None, "1Gi", None)));
        assert!(wants_bind(&claim(None, None, "1Gi", None)));
        // Its own volumeName write comes back Pending: not a second bind.
        assert!(!wants_bind(&claim(Some("Pending"), Some("pv"), "1Gi", None)));
        assert!(!wants_bind(&claim(Some("Bound"), Some("pv"), "1Gi", Some("1Gi"))));
    }

    #[test]
    fn hands_off_only_grown_claims() {
        assert!(grown(&claim(Some("Bound"), Some("pv"), "2Gi", Some("1Gi"))));
        assert!(!grown(&claim(Some("Bound"), Some("pv"), "1Gi", Some("1Gi"))));
        assert!(!grown(&claim(Some("Pending"), None, "1Gi", None)));
    }
}
