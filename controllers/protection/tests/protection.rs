//! pvc-protection and pv-protection against the real kube-apiserver: its admission puts the
//! finalizers on, these controllers take them off. Each test has its own control plane, so the
//! controllers (and their metrics) see only that test's objects. Timeouts are bounds, not speeds.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    EphemeralVolumeSource, PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PersistentVolumeClaimTemplate, Pod, Volume, VolumeResourceRequirements,
};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use stowage_common::observe::metrics::Registry;
use stowage_common::store::informers::Informers;
use stowage_protection::core::{PV_FINALIZER, PVC_FINALIZER};
use stowage_protection::error::Error;
use stowage_protection::exec as write;
use stowage_protection::{Metrics, REASON_CLAIM_IN_USE, run_pv_protection, run_pvc_protection};
use stowage_testkit::{ControlPlane, builders, eventually};
use tokio::task::JoinSet;

const BOUND: Duration = Duration::from_secs(60);

struct Env {
    // Dropped first: the controllers and informers stop before the control plane does.
    _tasks: JoinSet<()>,
    client: Client,
    registry: Registry,
    _cp: ControlPlane,
}

enum Which {
    Pvc,
    Pv,
}

async fn start(which: Which) -> Env {
    let cp = tokio::task::spawn_blocking(ControlPlane::start)
        .await
        .unwrap()
        .expect("start the control plane");
    let client = cp.client().await;
    let registry = Registry::new();
    let mut tasks = JoinSet::new();
    let cluster: Arc<Informers> = Informers::start(client.clone(), registry.clone(), &mut tasks);
    cluster.ready().await;
    let metrics = Metrics::new(&registry);
    match which {
        Which::Pvc => tasks.spawn(async move {
            run_pvc_protection(cluster, metrics)
                .await
                .expect("pvc-protection")
        }),
        Which::Pv => {
            tasks.spawn(async move { run_pv_protection(cluster, metrics).await.expect("pv-protection") })
        }
    };
    Env {
        _tasks: tasks,
        client,
        registry,
        _cp: cp,
    }
}

impl Env {
    async fn namespace(&self, name: &str) {
        builders::create_namespace(&self.client, name).await;
    }

    /// The value of a metric, summed over series matching `label` (if given).
    fn metric(&self, name: &str, label: Option<(&str, &str)>) -> f64 {
        self.registry
            .gather()
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric().iter())
            .filter(|m| {
                label.is_none_or(|(k, v)| m.get_label().iter().any(|l| l.name() == k && l.value() == v))
            })
            .map(|m| {
                if m.get_gauge().has_value() {
                    m.get_gauge().value()
                } else {
                    m.get_counter().value()
                }
            })
            .sum()
    }

    /// Notes of the ClaimInUse events on claim `name`.
    async fn in_use_notes(&self, ns: &str, name: &str) -> Vec<String> {
        let events: Api<Event> = Api::namespaced(self.client.clone(), ns);
        let mut notes: Vec<String> = events
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some(REASON_CLAIM_IN_USE))
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
            .filter_map(|e| e.note)
            .collect();
        notes.sort();
        notes
    }
}

async fn set_pod_phase(pods: &Api<Pod>, name: &str, phase: &str) {
    pods.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": phase}})),
    )
    .await
    .unwrap();
}

async fn gone<K>(api: &Api<K>, name: &str) -> Result<(), String>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.get_opt(name).await {
        Ok(None) => Ok(()),
        Ok(Some(o)) => Err(format!(
            "{name} still exists, finalizers {:?}",
            o.meta().finalizers
        )),
        Err(e) => Err(e.to_string()),
    }
}

fn force() -> DeleteParams {
    DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    }
}

/// Upstream's StatefulSet test "PVC should be recreated when pod is pending due to missing PVC",
/// reduced to what pvc-protection sees: a pod naming the claim that is not scheduled (its node
/// was cordoned) when the claim is deleted. The scheduler refuses a pod whose claim is being
/// deleted, so the pod would never be scheduled: the claim goes at once, as with
/// kube-controller-manager, and the StatefulSet can make a new one.
#[tokio::test]
async fn a_pending_unscheduled_pod_does_not_hold_a_claim_being_deleted() {
    let env = start(Which::Pvc).await;
    let ns = "pending";
    env.namespace(ns).await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), ns);
    claims
        .create(&PostParams::default(), &builders::pvc(ns, "datadir-ss-0").build())
        .await
        .unwrap();
    pods.create(
        &PostParams::default(),
        &builders::pod(ns, "ss-0").claim("datadir", "datadir-ss-0").build(),
    )
    .await
    .unwrap();
    // The finalizer is on before the deletion, so its removal is the controller's decision.
    eventually(BOUND, || async {
        let c = claims.get("datadir-ss-0").await.map_err(|e| e.to_string())?;
        match c
            .metadata
            .finalizers
            .iter()
            .flatten()
            .any(|f| f == "kubernetes.io/pvc-protection")
        {
            true => Ok(()),
            false => Err("no pvc-protection finalizer yet".to_string()),
        }
    })
    .await;
    claims
        .delete("datadir-ss-0", &DeleteParams::default())
        .await
        .unwrap();
    eventually(BOUND, || async {
        match claims.get_opt("datadir-ss-0").await.map_err(|e| e.to_string())? {
            None => Ok(()),
            Some(_) => Err("the claim is still there".to_string()),
        }
    })
    .await;
    assert!(env.in_use_notes(ns, "datadir-ss-0").await.is_empty());
    assert_eq!(env.metric("stowage_protection_claims_waiting_on_pods", None), 0.0);
}

#[tokio::test]
async fn claim_used_by_a_running_pod_waits_with_an_event_then_goes() {
    let env = start(Which::Pvc).await;
    let ns = "work";
    env.namespace(ns).await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), ns);
    claims
        .create(&PostParams::default(), &builders::pvc(ns, "data").build())
        .await
        .unwrap();
    pods.create(
        &PostParams::default(),
        &builders::pod(ns, "app").claim("v", "data").node("n1").build(),
    )
    .await
    .unwrap();
    set_pod_phase(&pods, "app", "Running").await;

    claims.delete("data", &DeleteParams::default()).await.unwrap();
    let notes = eventually(BOUND, || async {
        let n = env.in_use_notes(ns, "data").await;
        if n.is_empty() {
            Err("no ClaimInUse event yet".to_string())
        } else {
            Ok(n)
        }
    })
    .await;
    assert!(notes[0].contains("app"), "{notes:?}");
    let pvc = claims
        .get("data")
        .await
        .expect("the claim stays while a pod uses it");
    assert!(pvc.metadata.deletion_timestamp.is_some());
    assert_eq!(env.metric("stowage_protection_claims_waiting_on_pods", None), 1.0);

    // A second user changes the set: one more event, naming both.
    pods.create(
        &PostParams::default(),
        &builders::pod(ns, "app2").claim("v", "data").node("n1").build(),
    )
    .await
    .unwrap();
    eventually(BOUND, || async {
        let n = env.in_use_notes(ns, "data").await;
        if n.iter().any(|x| x.contains("app2") && x.contains("app,")) {
            Ok(())
        } else {
            Err(format!("{n:?}"))
        }
    })
    .await;
    let events_before = env.metric("stowage_protection_claim_in_use_events_total", None);
    assert_eq!(events_before, 2.0);

    // Churn that does not change the set of users (a label on a pod) syncs the claim again but
    // records no new event.
    let syncs = env.metric("stowage_protection_reconcile_total", None);
    pods.patch(
        "app",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
    )
    .await
    .unwrap();
    eventually(BOUND, || async {
        let now = env.metric("stowage_protection_reconcile_total", None);
        if now > syncs {
            Ok(())
        } else {
            Err("claim not synced again yet".into())
        }
    })
    .await;
    assert_eq!(
        env.metric("stowage_protection_claim_in_use_events_total", None),
        events_before
    );

    // A finished pod still counts (upstream: its volume may still be mounted on its node until
    // the pod object goes); once the running one goes, the finished one alone holds the claim.
    set_pod_phase(&pods, "app2", "Succeeded").await;
    pods.delete("app", &force()).await.unwrap();
    eventually(BOUND, || async {
        let n = env.metric("stowage_protection_claim_in_use_events_total", None);
        if n == 3.0 {
            Ok(())
        } else {
            Err(format!("{n} ClaimInUse events"))
        }
    })
    .await;
    claims
        .get("data")
        .await
        .expect("still named by the finished app2");

    pods.delete("app2", &force()).await.unwrap();
    eventually(BOUND, || gone(&claims, "data")).await;
    eventually(BOUND, || async {
        let w = env.metric("stowage_protection_claims_waiting_on_pods", None);
        if w == 0.0 {
            Ok(())
        } else {
            Err(format!("waiting gauge {w}"))
        }
    })
    .await;
    assert_eq!(
        env.metric(
            "stowage_protection_finalizers_removed_total",
            Some(("kind", "PersistentVolumeClaim"))
        ),
        1.0
    );
}

#[tokio::test]
async fn missing_claim_finalizer_is_added_and_ephemeral_claims_are_protected() {
    let env = start(Which::Pvc).await;
    let ns = "eph";
    env.namespace(ns).await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), ns);

    // A claim that lost its finalizer (created before admission was on) gets it back.
    claims
        .create(&PostParams::default(), &builders::pvc(ns, "old").build())
        .await
        .unwrap();
    claims
        .patch(
            "old",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    eventually(BOUND, || async {
        let c = claims.get("old").await.map_err(|e| e.to_string())?;
        let f = c.metadata.finalizers.unwrap_or_default();
        if f.iter().any(|x| x == PVC_FINALIZER) {
            Ok(())
        } else {
            Err(format!("finalizers {f:?}"))
        }
    })
    .await;
    assert!(
        env.metric(
            "stowage_protection_finalizers_added_total",
            Some(("kind", "PersistentVolumeClaim"))
        ) >= 1.0
    );

    // A removal decided on a stale view writes nothing: the resourceVersion test fails.
    let seen = claims.get("old").await.unwrap();
    claims
        .patch(
            "old",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"changed": "yes"}}})),
        )
        .await
        .unwrap();
    let patch = write::remove_finalizer(&seen.metadata, PVC_FINALIZER).unwrap();
    match write::send(&claims, "old", patch).await {
        Err(Error::Stale) => {}
        other => panic!("expected a stale write, got {other:?}"),
    }
    let now = claims.get("old").await.unwrap();
    assert!(
        now.metadata
            .finalizers
            .unwrap_or_default()
            .iter()
            .any(|f| f == PVC_FINALIZER)
    );

    // A pod with a generic ephemeral volume uses the claim `<pod>-<volume>` it owns.
    ephemeral_pod_and_claim(&pods, &claims, ns).await;
    claims
        .delete("web-scratch", &DeleteParams::default())
        .await
        .unwrap();
    let notes = eventually(BOUND, || async {
        let n = env.in_use_notes(ns, "web-scratch").await;
        if n.is_empty() {
            Err("no ClaimInUse event yet".to_string())
        } else {
            Ok(n)
        }
    })
    .await;
    assert!(notes[0].contains("web"), "{notes:?}");
    claims.get("web-scratch").await.expect("kept while its pod runs");

    pods.delete("web", &force()).await.unwrap();
    eventually(BOUND, || gone(&claims, "web-scratch")).await;
}

/// Upstream's `podUsesPVC`: a pod that names a claim keeps it whatever its phase, also when it
/// was force-deleted and waits for its own finalizers (its volume may still be mounted on the
/// node); only the generic ephemeral claim of a shut-down pod is released.
#[tokio::test]
async fn finished_and_force_deleted_pods_keep_the_claims_they_name() {
    let env = start(Which::Pvc).await;
    let ns = "done";
    env.namespace(ns).await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), ns);
    const HOLD: &str = "stowage.dev/test-hold";
    let hold = |pod: &str| {
        let pods = pods.clone();
        let pod = pod.to_string();
        async move {
            pods.patch(
                &pod,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"finalizers": [HOLD]}})),
            )
            .await
            .unwrap();
        }
    };
    let release = |pod: &str| {
        let pods = pods.clone();
        let pod = pod.to_string();
        async move {
            pods.patch(
                &pod,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"finalizers": null}})),
            )
            .await
            .unwrap();
        }
    };

    for (claim, pod) in [("a", "succeeded"), ("b", "failed"), ("c", "forced")] {
        claims
            .create(&PostParams::default(), &builders::pvc(ns, claim).build())
            .await
            .unwrap();
        pods.create(
            &PostParams::default(),
            &builders::pod(ns, pod).claim("v", claim).node("n1").build(),
        )
        .await
        .unwrap();
    }
    set_pod_phase(&pods, "succeeded", "Succeeded").await;
    set_pod_phase(&pods, "failed", "Failed").await;
    set_pod_phase(&pods, "forced", "Running").await;
    // Force-deleted, still there behind a finalizer: deletionGracePeriodSeconds 0.
    hold("forced").await;
    pods.delete("forced", &force()).await.unwrap();
    let forced = pods.get("forced").await.unwrap();
    assert_eq!(forced.metadata.deletion_grace_period_seconds, Some(0));

    // An ephemeral claim of a pod shut down the same way is released (upstream's one exception).
    ephemeral_pod_and_claim(&pods, &claims, ns).await;
    hold("web").await;
    pods.delete("web", &force()).await.unwrap();

    for claim in ["a", "b", "c", "web-scratch"] {
        claims.delete(claim, &DeleteParams::default()).await.unwrap();
    }
    eventually(BOUND, || gone(&claims, "web-scratch")).await;
    // Every claim is synced by now (the waiting gauge counts the three), and each names its pod.
    eventually(BOUND, || async {
        let w = env.metric("stowage_protection_claims_waiting_on_pods", None);
        if w == 3.0 {
            Ok(())
        } else {
            Err(format!("waiting gauge {w}"))
        }
    })
    .await;
    for (claim, pod) in [("a", "succeeded"), ("b", "failed"), ("c", "forced")] {
        let c = claims
            .get(claim)
            .await
            .unwrap_or_else(|e| panic!("claim {claim} of pod {pod} was freed: {e}"));
        assert!(c.metadata.deletion_timestamp.is_some());
        let notes = env.in_use_notes(ns, claim).await;
        assert!(notes.iter().any(|n| n.contains(pod)), "{claim}: {notes:?}");
    }

    // The pods go: their claims follow.
    release("forced").await;
    release("web").await;
    pods.delete("succeeded", &force()).await.unwrap();
    pods.delete("failed", &force()).await.unwrap();
    for claim in ["a", "b", "c"] {
        eventually(BOUND, || gone(&claims, claim)).await;
    }
}

#[tokio::test]
async fn bound_volume_waits_until_released() {
    let env = start(Which::Pv).await;
    let volumes: Api<PersistentVolume> = Api::all(env.client.clone());
    let created = volumes
        .create(&PostParams::default(), &builders::pv("vol-a").build())
        .await
        .unwrap();
    assert!(
        created
            .metadata
            .finalizers
            .unwrap_or_default()
            .iter()
            .any(|f| f == PV_FINALIZER),
        "admission adds it"
    );
    volumes
        .patch_status(
            "vol-a",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Bound"}})),
        )
        .await
        .unwrap();
    volumes.delete("vol-a", &DeleteParams::default()).await.unwrap();
    eventually(BOUND, || async {
        let w = env.metric("stowage_protection_volumes_waiting_on_unbind", None);
        if w == 1.0 {
            Ok(())
        } else {
            Err(format!("waiting gauge {w}"))
        }
    })
    .await;
    let pv = volumes.get("vol-a").await.expect("a Bound volume stays");
    assert!(pv.metadata.deletion_timestamp.is_some());

    volumes
        .patch_status(
            "vol-a",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Released"}})),
        )
        .await
        .unwrap();
    eventually(BOUND, || gone(&volumes, "vol-a")).await;
    assert_eq!(
        env.metric(
            "stowage_protection_finalizers_removed_total",
            Some(("kind", "PersistentVolume"))
        ),
        1.0
    );
    assert_eq!(
        env.metric("stowage_protection_volumes_waiting_on_unbind", None),
        0.0
    );

    // A volume without the finalizer gets it back; one never Bound goes at once.
    volumes
        .create(&PostParams::default(), &builders::pv("vol-b").build())
        .await
        .unwrap();
    volumes
        .patch(
            "vol-b",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    eventually(BOUND, || async {
        let v = volumes.get("vol-b").await.map_err(|e| e.to_string())?;
        let f = v.metadata.finalizers.unwrap_or_default();
        if f.iter().any(|x| x == PV_FINALIZER) {
            Ok(())
        } else {
            Err(format!("finalizers {f:?}"))
        }
    })
    .await;
    volumes.delete("vol-b", &DeleteParams::default()).await.unwrap();
    eventually(BOUND, || gone(&volumes, "vol-b")).await;
}

fn rv(meta: &ObjectMeta) -> u64 {
    meta.resource_version
        .as_deref()
        .and_then(|r| r.parse().ok())
        .expect("etcd resourceVersion")
}

/// Creates a pod and deletes its claim at the same moment, many times. A pod created before the
/// claim's deletion (in the apiserver's order) must never be left without its claim. One created
/// after it refers to a claim already being deleted (the kubelet would not start it); the
/// controller still catches most of those, and those it misses are counted, not failed: no
/// controller can order its last check against a pod create that arrives later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_created_with_the_claim_deletion_never_loses_its_claim() {
    const N: usize = 40;
    let env = start(Which::Pvc).await;
    let ns = "race";
    env.namespace(ns).await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), ns);

    // (claim, pod rv, deletion rv)
    let mut rounds = Vec::new();
    let (pp, dp) = (PostParams::default(), DeleteParams::default());
    for i in 0..N {
        let claim = format!("c{i}");
        claims
            .create(&PostParams::default(), &builders::pvc(ns, &claim).build())
            .await
            .unwrap();
        let pod = builders::pod(ns, &format!("p{i}"))
            .claim("v", &claim)
            .node("n1")
            .build();
        // Every other round orders the pod first for sure, so the rule below is always tested
        // on at least N/2 claims; the others race the two requests.
        let (created, deleted) = if i % 2 == 0 {
            let created = pods.create(&pp, &pod).await;
            (created, claims.delete(&claim, &dp).await)
        } else {
            tokio::join!(pods.create(&pp, &pod), claims.delete(&claim, &dp))
        };
        let pod_rv = rv(&created.expect("pod create").metadata);
        let deleting = deleted
            .expect("claim delete")
            .left()
            .expect("a protected claim is not deleted at once");
        let del_rv = rv(&deleting.metadata);
        rounds.push((claim, pod_rv, del_rv));
    }

    // Settle: every claim still present has been seen as waiting by the controller.
    let present = eventually(BOUND, || async {
        let list = claims
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        let names: Vec<String> = list
            .items
            .iter()
            .filter_map(|c| c.metadata.name.clone())
            .collect();
        let waiting = env.metric("stowage_protection_claims_waiting_on_pods", None) as usize;
        if waiting == names.len() {
            Ok(names)
        } else {
            Err(format!("{} present, {waiting} waiting", names.len()))
        }
    })
    .await;

    let earlier = rounds.iter().filter(|r| r.1 < r.2).count();
    assert!(earlier >= N / 2, "only {earlier} rounds created the pod first");
    let mut late_lost = 0;
    for (claim, pod_rv, del_rv) in &rounds {
        let kept = present.contains(claim);
        if pod_rv < del_rv {
            assert!(
                kept,
                "{claim}: its pod (rv {pod_rv}) predates the deletion (rv {del_rv}) but the claim is gone"
            );
        } else if !kept {
            late_lost += 1;
        }
    }
    eprintln!(
        "{N} rounds: {} pods created before the deletion, {} after; {late_lost} of the later ones found the claim gone",
        rounds.iter().filter(|r| r.1 < r.2).count(),
        rounds.iter().filter(|r| r.1 > r.2).count()
    );

    // Once the pods are gone, every claim goes.
    for i in 0..N {
        pods.delete(&format!("p{i}"), &force()).await.unwrap();
    }
    eventually(BOUND, || async {
        let n = claims
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?
            .items
            .len();
        if n == 0 {
            Ok(())
        } else {
            Err(format!("{n} claims left"))
        }
    })
    .await;
}

/// Pod `web` on node `n1` with a generic ephemeral volume `scratch`, and the claim `web-scratch`
/// the ephemeral-volume controller would make for it (owned by the pod, as upstream's is).
async fn ephemeral_pod_and_claim(pods: &Api<Pod>, claims: &Api<PersistentVolumeClaim>, ns: &str) {
    let mut web = builders::pod(ns, "web").node("n1").build();
    let spec = PersistentVolumeClaimSpec {
        access_modes: Some(vec!["ReadWriteOnce".into()]),
        resources: Some(VolumeResourceRequirements {
            requests: Some(BTreeMap::from([("storage".to_string(), Quantity("1Gi".into()))])),
            ..Default::default()
        }),
        ..Default::default()
    };
    web.spec.as_mut().unwrap().volumes = Some(vec![Volume {
        name: "scratch".into(),
        ephemeral: Some(EphemeralVolumeSource {
            volume_claim_template: Some(PersistentVolumeClaimTemplate {
                metadata: None,
                spec: spec.clone(),
            }),
        }),
        ..Default::default()
    }]);
    let web = pods.create(&PostParams::default(), &web).await.unwrap();
    let eph = PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some("web-scratch".into()),
            namespace: Some(ns.into()),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name: "web".into(),
                uid: web.metadata.uid.clone().unwrap(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    };
    claims.create(&PostParams::default(), &eph).await.unwrap();
}
