//! Upstream's own binder, delete and recycle test tables (`binder_test.go`, `delete_test.go`,
//! `recycle_test.go` of kubernetes/kubernetes v1.36 `pkg/controller/volume/persistentvolume`),
//! replayed on the real apiserver.
//!
//! Upstream's tables check one call of syncClaim/syncVolume against a fake client. A real
//! controller keeps syncing until nothing changes, so what is compared here is the state the
//! controller *settles in*, and the oracle is kube-controller-manager itself: with
//! `STOWAGE_BLESS_UPSTREAM=1` each scenario is run under the real kube-controller-manager (only
//! its persistentvolume-binder-controller, resync 1 s) and its settled state is written to
//! `tests/upstream_settled.json`; normally each scenario runs under stowage's binder and must
//! settle in exactly that state (phases, claimRefs, volumeNames, the bind annotations, claim
//! status capacity/access modes/attributes class, finalizers the controller manages).
//! Scenarios whose upstream test needs a mocked in-tree plugin (a deleter or recycler that
//! succeeds or fails on cue) run with no such plugin, as on a real cluster: both controllers
//! then find no deleter/recycler. Not replayed: scenarios about the upstream controller's cache
//! internals (4-11, 4-12) or its mocked operations' timing (8-4..8-7, 9-1, 6-3..6-8: a plugin
//! that fails or an object that changes between two of its calls), and 6-10, whose "Unknown"
//! reclaim policy the real apiserver refuses to store. From provision_test.go, 11-23 (a selected
//! node: the free volume is left to the scheduler) is replayed; the rest of that table needs a
//! mocked in-tree provisioner.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{
    GCEPersistentDiskVolumeSource, ObjectReference, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeSpec, Pod, VolumeResourceRequirements,
};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use stowage_testkit::ControlPlane;
use tokio::task::JoinSet;

const NS: &str = "upstream";
const GOLDEN: &str = "tests/upstream_settled.json";
/// A snapshot unchanged for this long (more than two resync periods of 1 s) is settled.
const STABLE: Duration = Duration::from_millis(2600);
const LIMIT: Duration = Duration::from_secs(40);

#[path = "upstream_replay/cases.rs"]
mod cases;
#[path = "upstream_replay/scenario.rs"]
mod scenario;

use cases::cases;
use scenario::*;

/// What the table compares, with real UIDs turned back into the table's symbols.
async fn snapshot(client: &Client, case: &Case, syms: &BTreeMap<String, &str>) -> Value {
    let sym = |uid: Option<&str>| -> Value {
        match uid {
            None => Value::Null,
            Some(u) => syms
                .get(u)
                .map(|s| json!(s))
                .or_else(|| u.strip_prefix("00000000-fake-").map(|s| json!(s)))
                .unwrap_or_else(|| json!("<other>")),
        }
    };
    let kept = |anns: &BTreeMap<String, String>| -> Value {
        anns.iter()
            .filter(|(k, _)| KEPT_ANNOTATIONS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let mut out = serde_json::Map::new();
    for v in &case.vols {
        let got = pvs.get_opt(v.name).await.expect("get PV");
        let state = match got {
            None => json!("deleted"),
            Some(pv) => {
                let spec = pv.spec.clone().unwrap_or_default();
                let r = spec.claim_ref.as_ref();
                json!({
                    "phase": pv.status.as_ref().and_then(|s| s.phase.clone()),
                    "claimRef": r.map(|r| json!({"name": r.name, "uid": sym(r.uid.as_deref())})),
                    "annotations": kept(pv.annotations()),
                    "finalizers": pv.finalizers().iter().filter(|f| KEPT_FINALIZERS.contains(&f.as_str())).collect::<Vec<_>>(),
                })
            }
        };
        out.insert(format!("pv/{}", v.name), state);
    }
    for c in &case.claims {
        let got = pvcs.get_opt(c.name).await.expect("get claim");
        let state = match got {
            None => json!("deleted"),
            Some(pvc) => {
                let st = pvc.status.clone().unwrap_or_default();
                json!({
                    "phase": st.phase,
                    "volumeName": pvc.spec.as_ref().and_then(|s| s.volume_name.clone()),
                    "annotations": kept(pvc.annotations()),
                    "capacity": st.capacity.as_ref().and_then(|c| c.get("storage")).map(|q| q.0.clone()),
                    "accessModes": st.access_modes,
                    "currentVolumeAttributesClassName": st.current_volume_attributes_class_name,
                })
            }
        };
        out.insert(format!("pvc/{}", c.name), state);
    }
    Value::Object(out)
}

/// Event reasons per object (for the report; events are not compared: stowage reports once per
/// change and adds its own, as docs/binder.md says).
async fn events(client: &Client) -> Vec<String> {
    let api: Api<Event> = Api::all(client.clone());
    let mut out: Vec<String> = api
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|e| {
            let who = e.regarding.as_ref()?.name.clone()?;
            Some(format!(
                "{who}: {} {}",
                e.type_.unwrap_or_default(),
                e.reason.unwrap_or_default()
            ))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

// ---- running one scenario ----

enum Runner {
    Stowage,
    Upstream,
}

/// The controller under test for one scenario; stopped when dropped.
enum Running {
    Stowage(JoinSet<()>, tokio::task::JoinHandle<anyhow::Result<()>>),
    Upstream(#[allow(dead_code)] stowage_testkit::controlplane::Kcm),
}

impl Drop for Running {
    fn drop(&mut self) {
        match self {
            Running::Stowage(informers, ctrl) => {
                ctrl.abort();
                informers.abort_all();
            }
            Running::Upstream(_) => {}
        }
    }
}

async fn start(runner: &Runner, cp: &ControlPlane, client: &Client) -> Running {
    match runner {
        Runner::Stowage => {
            let mut informers = JoinSet::new();
            let registry = stowage_common::observe::metrics::Registry::new();
            let cluster = stowage_common::store::informers::Informers::start(
                client.clone(),
                registry.clone(),
                &mut informers,
            );
            cluster.ready().await;
            let config = stowage_binder::Config {
                resync: Duration::from_secs(1),
                image_dir: std::env::temp_dir(),
                max_in_flight: 16,
                store_mode: Default::default(),
            };
            let ctrl = tokio::spawn(stowage_binder::run(
                cluster,
                stowage_binder::Metrics::new(&registry),
                config,
            ));
            Running::Stowage(informers, ctrl)
        }
        Runner::Upstream => Running::Upstream(cp.start_kcm(
            "persistentvolume-binder-controller",
            &["--pvclaimbinder-sync-period=1s"],
        )),
    }
}

async fn clean(client: &Client) {
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let unfinalize = Patch::Merge(json!({"metadata": {"finalizers": null}}));
    let pp = PatchParams::default();
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    for p in pods.list(&ListParams::default()).await.unwrap().items {
        let _ = pods.delete(&p.name_any(), &now).await;
    }
    for c in pvcs.list(&ListParams::default()).await.unwrap().items {
        let _ = pvcs.patch(&c.name_any(), &pp, &unfinalize).await;
        let _ = pvcs.delete(&c.name_any(), &now).await;
    }
    for v in pvs.list(&ListParams::default()).await.unwrap().items {
        let _ = pvs.patch(&v.name_any(), &pp, &unfinalize).await;
        let _ = pvs.delete(&v.name_any(), &now).await;
    }
    let _ = events
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let _ = Api::<Event>::namespaced(client.clone(), "default")
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let deadline = Instant::now() + LIMIT;
    loop {
        let left = pvs.list(&ListParams::default()).await.unwrap().items.len()
            + pvcs.list(&ListParams::default()).await.unwrap().items.len()
            + pods.list(&ListParams::default()).await.unwrap().items.len();
        if left == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "{left} objects left after clean-up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Creates the scenario (controller stopped), runs the controller until the state holds still,
/// returns the settled state and the events seen.
async fn run_case(runner: &Runner, cp: &ControlPlane, client: &Client, case: &Case) -> (Value, Vec<String>) {
    clean(client).await;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pp = PatchParams::default();
    let mut uids: BTreeMap<&str, String> = BTreeMap::new();
    for c in &case.claims {
        let made = pvcs
            .create(&PostParams::default(), &claim_object(c))
            .await
            .unwrap();
        uids.insert(c.uid, made.uid().unwrap());
        pvcs.patch_status(c.name, &pp, &Patch::Merge(claim_status(c)))
            .await
            .unwrap();
    }
    for v in &case.vols {
        pvs.create(&PostParams::default(), &volume_object(v, &uids))
            .await
            .unwrap();
        if !v.phase.is_empty() {
            pvs.patch_status(v.name, &pp, &Patch::Merge(json!({"status": {"phase": v.phase}})))
                .await
                .unwrap();
        }
    }
    for p in &case.pods {
        let pod = stowage_testkit::builders::pod(NS, p.name)
            .claim("data", p.claim)
            .node("node1")
            .build();
        pods.create(&PostParams::default(), &pod).await.unwrap();
        pods.patch_status(p.name, &pp, &Patch::Merge(json!({"status": {"phase": p.phase}})))
            .await
            .unwrap();
    }
    let syms: BTreeMap<String, &str> = uids.iter().map(|(s, u)| (u.clone(), *s)).collect();
    let running = start(runner, cp, client).await;
    let deadline = Instant::now() + LIMIT;
    let mut last = snapshot(client, case, &syms).await;
    let mut since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = snapshot(client, case, &syms).await;
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() >= STABLE {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{}: never settled; last state {last:#}",
            case.id
        );
    }
    drop(running);
    (last, events(client).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_scenarios_settle_where_kube_controller_manager_does() {
    let cp = tokio::task::spawn_blocking(ControlPlane::start)
        .await
        .unwrap()
        .unwrap();
    let client = cp.client().await;
    stowage_testkit::builders::create_namespace(&client, NS).await;
    let wait_class = StorageClass {
        metadata: ObjectMeta {
            name: Some("wait".into()),
            ..Default::default()
        },
        provisioner: "kubernetes.io/no-provisioner".into(),
        volume_binding_mode: Some("WaitForFirstConsumer".into()),
        ..Default::default()
    };
    // provision_test.go's classExternalWait: a delayed class of an external provisioner.
    let external_wait = StorageClass {
        metadata: ObjectMeta {
            name: Some("external-wait".into()),
            ..Default::default()
        },
        provisioner: "vendor.com/my-volume".into(),
        volume_binding_mode: Some("WaitForFirstConsumer".into()),
        ..Default::default()
    };
    for class in [&wait_class, &external_wait] {
        Api::<StorageClass>::all(client.clone())
            .create(&PostParams::default(), class)
            .await
            .unwrap();
    }
    let golden_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(GOLDEN);
    let bless = std::env::var_os("STOWAGE_BLESS_UPSTREAM").is_some();
    let runner = if bless { Runner::Upstream } else { Runner::Stowage };
    // STOWAGE_REPLAY_ONLY=<id prefix>,...: run (or re-record) only those scenarios; a partial
    // recording is merged into the file, so adding a scenario needs only its own oracle run.
    let only: Vec<String> = std::env::var("STOWAGE_REPLAY_ONLY")
        .map(|v| {
            v.split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let golden: BTreeMap<String, Value> = match std::fs::read_to_string(&golden_path) {
        Ok(text) => serde_json::from_str(&text).expect("golden JSON"),
        Err(_) if bless => BTreeMap::new(),
        Err(e) => panic!(
            "{}: {e} (record it with STOWAGE_BLESS_UPSTREAM=1)",
            golden_path.display()
        ),
    };
    let mut recorded = if bless && !only.is_empty() {
        golden.clone()
    } else {
        BTreeMap::new()
    };
    let mut failures = Vec::new();
    let cases: Vec<Case> = cases()
        .into_iter()
        .filter(|c| only.is_empty() || only.iter().any(|o| c.id.starts_with(o.as_str())))
        .collect();
    for case in &cases {
        let (state, seen) = run_case(&runner, &cp, &client, case).await;
        if bless {
            recorded.insert(case.id.to_string(), json!({"settled": state, "events": seen}));
            eprintln!("recorded {}", case.id);
            continue;
        }
        let want = &golden.get(case.id).unwrap_or_else(|| {
            panic!(
                "{} not in {GOLDEN}: record it with STOWAGE_BLESS_UPSTREAM=1",
                case.id
            )
        })["settled"];
        if canonical(case, &state) == canonical(case, want) {
            eprintln!("ok   {}", case.id);
        } else {
            eprintln!("FAIL {}", case.id);
            failures.push(format!(
                "{}:\n  kube-controller-manager settled in {want}\n  stowage settled in         {state}\n  stowage's events: {seen:?}\n  upstream's events: {}",
                case.id,
                golden[case.id]["events"]
            ));
        }
    }
    if bless {
        std::fs::write(
            &golden_path,
            serde_json::to_string_pretty(&recorded).unwrap() + "\n",
        )
        .unwrap();
        eprintln!("wrote {} scenarios to {}", recorded.len(), golden_path.display());
        return;
    }
    eprintln!(
        "{} scenarios, {} settled as upstream",
        cases.len(),
        cases.len() - failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} scenarios differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
