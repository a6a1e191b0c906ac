//! A second storage controller beside stowage, on the real apiserver: a kube-controller-manager
//! pod whose flags turn the binder on is reported and, with `--on-conflict=pause`, stops
//! stowage's binder; the real kube-controller-manager's binds are then seen as rival writes
//! (Event, metric); once both are gone, stowage's binder starts again and binds.

use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde_json::json;
use stowage_testkit::binary::Running;
use stowage_testkit::builders::{pv, pvc};
use stowage_testkit::{ControlPlane, eventually};

const LIMIT: Duration = Duration::from_secs(90);

fn gauge(r: &Running, name: &str, labels: &[(&str, &str)]) -> f64 {
    r.metrics().map(|m| m.sum_where(name, labels)).unwrap_or(-1.0)
}

async fn until_gauge(r: &Running, name: &str, labels: &[(&str, &str)], want: impl Fn(f64) -> bool) {
    eventually(LIMIT, || async {
        let v = gauge(r, name, labels);
        if want(v) {
            Ok(())
        } else {
            Err(format!("{name}{labels:?} is {v}\n{}", r.log_text()))
        }
    })
    .await
}

/// `ConflictingController` Events in `ns` about objects of `kind`.
async fn conflict_events(client: &kube::Client, ns: &str, kind: &str) -> Vec<Event> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("ConflictingController"))
        .filter(|e| e.regarding.as_ref().and_then(|r| r.kind.as_deref()) == Some(kind))
        .collect()
}

/// The managers that own a PV's `spec.claimRef`.
fn claim_ref_managers(pv: &PersistentVolume) -> Vec<String> {
    pv.metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|e| {
            e.fields_v1
                .as_ref()
                .and_then(|f| f.0.get("f:spec"))
                .and_then(|s| s.get("f:claimRef"))
                .is_some()
        })
        .filter_map(|e| e.manager.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rival_binder_is_reported_and_pauses_stowage_until_it_is_gone() {
    let cp = tokio::task::spawn_blocking(ControlPlane::start)
        .await
        .unwrap()
        .unwrap();
    let client = cp.client().await;
    let images = tempfile::tempdir().unwrap();

    // kubeadm's static pod, as the apiserver shows it: the binder left on by its flags. It never
    // runs (no such node); what it says is the evidence.
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), "kube-system");
    let _ = sas
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "default"}})).unwrap(),
        )
        .await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "kube-system");
    let kcm_pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "kube-controller-manager-cp0", "labels": {"component": "kube-controller-manager", "tier": "control-plane"}},
        "spec": {
            "nodeName": "cp0",
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "kube-controller-manager",
                "image": "registry.k8s.io/kube-controller-manager:v1.36.3",
                "command": ["kube-controller-manager", "--kubeconfig=/etc/kubernetes/controller-manager.conf",
                            "--controllers=*,bootstrapsigner,tokencleaner,-persistentvolume-attach-detach-controller"]
            }]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &kcm_pod).await.unwrap();

    let stowage = Running::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_stowage-controller")),
        &[
            format!("--kubeconfig={}", cp.kubeconfig().display()),
            "--controllers=binder".into(),
            "--leader-elect=false".into(),
            "--on-conflict=pause".into(),
            "--conflict-quiet-period=5s".into(),
            format!("--image-dir={}", images.path().display()),
        ],
        cp.dir(),
        "stowage-conflict",
    )
    .unwrap();

    // The flags are caught before anything is written, and the binder stops.
    until_gauge(&stowage, "stowage_conflict", &[("source", "flags")], |v| v == 1.0).await;
    until_gauge(&stowage, "stowage_controllers_paused", &[], |v| v == 1.0).await;
    eventually(LIMIT, || async {
        let evs = conflict_events(&client, "kube-system", "Pod").await;
        match evs.first().and_then(|e| e.note.clone()) {
            Some(note) if note.contains("-persistentvolume-binder-controller") => Ok(()),
            other => Err(format!(
                "no ConflictingController event on the pod yet: {other:?}"
            )),
        }
    })
    .await;

    // The real kube-controller-manager binds a pair while stowage's binder is paused.
    let kcm =
        std::process::Command::new(stowage_testkit::controlplane::bin_dir().join("kube-controller-manager"))
            .args([
                format!("--kubeconfig={}", cp.kubeconfig().display()),
                "--leader-elect=false".into(),
                "--use-service-account-credentials=false".into(),
                "--secure-port=0".into(),
                "--controllers=persistentvolume-binder-controller".into(),
                "--pvclaimbinder-sync-period=1s".into(),
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("kube-controller-manager starts");
    let mut kcm = scopeguard(kcm);
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    pvs.create(&PostParams::default(), &pv("rival-1").class("c").build())
        .await
        .unwrap();
    claims
        .create(
            &PostParams::default(),
            &pvc("default", "claim-1").class("c").build(),
        )
        .await
        .unwrap();
    until_gauge(
        &stowage,
        "stowage_conflicting_writes_total",
        &[("controller", "binder")],
        |v| v >= 1.0,
    )
    .await;
    until_gauge(&stowage, "stowage_conflict", &[("source", "writes")], |v| {
        v == 1.0
    })
    .await;
    eventually(LIMIT, || async {
        let on_pv = conflict_events(&client, "default", "PersistentVolume").await;
        let on_claim = conflict_events(&client, "default", "PersistentVolumeClaim").await;
        if on_pv.is_empty() && on_claim.is_empty() {
            Err("no ConflictingController event on the PV or claim".to_string())
        } else {
            Ok(())
        }
    })
    .await;
    eventually(LIMIT, || async {
        let v = pvs.get("rival-1").await.map_err(|e| e.to_string())?;
        let managers = claim_ref_managers(&v);
        if managers.is_empty() {
            return Err("rival-1 not bound yet".into());
        }
        // Paused: only kube-controller-manager bound it.
        if managers.iter().all(|m| m == "kube-controller-manager") {
            Ok(())
        } else {
            Err(format!("spec.claimRef of rival-1 owned by {managers:?}"))
        }
    })
    .await;

    // Both gone: after the quiet period stowage's binder runs again and binds the next pair.
    let _ = kcm.0.kill();
    let _ = kcm.0.wait();
    pods.delete(
        "kube-controller-manager-cp0",
        &DeleteParams::default().grace_period(0),
    )
    .await
    .unwrap();
    until_gauge(&stowage, "stowage_controllers_paused", &[], |v| v == 0.0).await;
    until_gauge(&stowage, "stowage_conflict", &[], |v| v == 0.0).await;
    pvs.create(&PostParams::default(), &pv("own-2").class("c").build())
        .await
        .unwrap();
    claims
        .create(
            &PostParams::default(),
            &pvc("default", "claim-2").class("c").build(),
        )
        .await
        .unwrap();
    eventually(LIMIT, || async {
        let v = pvs.get("own-2").await.map_err(|e| e.to_string())?;
        let managers = claim_ref_managers(&v);
        match managers.as_slice() {
            [] => Err("own-2 not bound yet".to_string()),
            m if m.iter().any(|m| m == "kube-controller-manager") => Err(format!("bound by {m:?}")),
            _ => Ok(()),
        }
    })
    .await;
}

/// Kills kube-controller-manager when the test ends, also on failure.
struct Guard(std::process::Child);

fn scopeguard(c: std::process::Child) -> Guard {
    Guard(c)
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
