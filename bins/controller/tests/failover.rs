//! Leader failover in the middle of a 200-claim burst: every claim ends Bound, no volume holds
//! two claims, and nothing the first leader half-wrote is left inconsistent.

use std::collections::HashMap;
use std::time::Duration;

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::Api;
use kube::api::PostParams;
use stowage_testkit::binary::Running;
use stowage_testkit::builders::{pv, pvc};
use stowage_testkit::{ControlPlane, eventually};

const N: usize = 200;

fn replica(cp: &ControlPlane, id: &str, images: &std::path::Path) -> Running {
    let args = vec![
        format!("--kubeconfig={}", cp.kubeconfig().display()),
        "--controllers=binder".into(),
        "--leader-elect-resource-namespace=default".into(),
        format!("--leader-elect-identity={id}"),
        "--leader-elect-lease-duration=4s".into(),
        "--leader-elect-renew-deadline=3s".into(),
        "--leader-elect-retry-period=1s".into(),
        // Slow enough that the kill lands mid-burst on any machine.
        "--kube-api-qps=40".into(),
        "--kube-api-burst=40".into(),
        format!("--image-dir={}", images.display()),
    ];
    Running::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_stowage-controller")),
        &args,
        cp.dir(),
        id,
    )
    .unwrap()
}

fn leads(r: &Running) -> bool {
    r.metrics().ok().and_then(|m| m.value("stowage_leader")) == Some(1.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_mid_burst_binds_every_claim_exactly_once() {
    let cp = tokio::task::spawn_blocking(ControlPlane::start)
        .await
        .unwrap()
        .unwrap();
    let images = tempfile::tempdir().unwrap();
    let client = cp.client().await;
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    let mut a = replica(&cp, "a", images.path());
    let mut b = replica(&cp, "b", images.path());
    eventually(Duration::from_secs(60), || async {
        if leads(&a) || leads(&b) {
            Ok(())
        } else {
            Err("no leader yet".to_string())
        }
    })
    .await;

    stream::iter(0..N)
        .map(|i| {
            let (pvs, claims) = (pvs.clone(), claims.clone());
            async move {
                pvs.create(
                    &PostParams::default(),
                    &pv(&format!("v{i:03}")).class("burst").build(),
                )
                .await
                .unwrap();
                claims
                    .create(
                        &PostParams::default(),
                        &pvc("default", &format!("c{i:03}")).class("burst").build(),
                    )
                    .await
                    .unwrap();
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await;

    // Kill the leader once binding is under way but far from done.
    let bound_count = || async {
        let list = claims
            .list(&Default::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok::<usize, String>(
            list.items
                .iter()
                .filter(|c| c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
                .count(),
        )
    };
    let at_kill = eventually(Duration::from_secs(120), || async {
        let n = bound_count().await?;
        if n >= 10 { Ok(n) } else { Err(format!("{n} bound")) }
    })
    .await;
    let (killed, survivor) = if leads(&a) { (&mut a, &b) } else { (&mut b, &a) };
    killed.sigkill();
    assert!(
        at_kill < N,
        "the kill must land mid-burst (bound at kill: {at_kill})"
    );

    eventually(Duration::from_secs(300), || async {
        let n = bound_count().await?;
        if n == N {
            Ok(())
        } else {
            Err(format!("{n}/{N} bound"))
        }
    })
    .await;
    assert!(leads(survivor), "the survivor leads:\n{}", survivor.log_text());

    // One-to-one: every claim's volume points back at that claim, and no volume is named twice.
    let claim_list = claims.list(&Default::default()).await.unwrap().items;
    let mut owner: HashMap<String, String> = HashMap::new();
    for c in &claim_list {
        let vol = c.spec.as_ref().unwrap().volume_name.clone().unwrap();
        assert!(
            owner
                .insert(vol.clone(), c.metadata.name.clone().unwrap())
                .is_none(),
            "{vol} bound twice"
        );
        let v = pvs.get(&vol).await.unwrap();
        assert_eq!(
            v.spec.unwrap().claim_ref.unwrap().uid,
            c.metadata.uid,
            "{vol} points elsewhere"
        );
        assert_eq!(v.status.unwrap().phase.as_deref(), Some("Bound"));
    }
}
