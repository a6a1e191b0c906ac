//! The apiserver restarting under a running controller: the process stays up, its watches resume,
//! and binding goes on.

use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::Api;
use kube::api::PostParams;
use stowage_testkit::binary::Running;
use stowage_testkit::builders::{pv, pvc};
use stowage_testkit::{ControlPlane, eventually};

async fn bound(api: &Api<PersistentVolumeClaim>, name: &str) {
    eventually(Duration::from_secs(120), || async {
        let c = api.get(name).await.map_err(|e| e.to_string())?;
        match c.status.and_then(|s| s.phase).as_deref() {
            Some("Bound") => Ok(()),
            other => Err(format!("claim {name} is {other:?}")),
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_resume_after_an_apiserver_restart() {
    let cp = tokio::task::spawn_blocking(ControlPlane::start)
        .await
        .unwrap()
        .unwrap();
    let images = tempfile::tempdir().unwrap();
    let args = vec![
        format!("--kubeconfig={}", cp.kubeconfig().display()),
        "--controllers=binder".into(),
        "--leader-elect-resource-namespace=default".into(),
        format!("--image-dir={}", images.path().display()),
    ];
    let mut ctl = Running::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_stowage-controller")),
        &args,
        cp.dir(),
        "restart-ctl",
    )
    .unwrap();
    let client = cp.client().await;
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    pvs.create(&PostParams::default(), &pv("before").build())
        .await
        .unwrap();
    claims
        .create(
            &PostParams::default(),
            &pvc("default", "before").class("").build(),
        )
        .await
        .unwrap();
    bound(&claims, "before").await;

    let restarted = tokio::task::block_in_place(|| cp.restart_apiserver(Duration::from_secs(3)));
    restarted.unwrap();
    assert!(
        ctl.child.try_wait().unwrap().is_none(),
        "the controller survived the restart:\n{}",
        ctl.log_text()
    );

    let client = cp.client().await;
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client, "default");
    pvs.create(&PostParams::default(), &pv("after").build())
        .await
        .unwrap();
    claims
        .create(&PostParams::default(), &pvc("default", "after").class("").build())
        .await
        .unwrap();
    bound(&claims, "after").await;
    assert!(ctl.child.try_wait().unwrap().is_none());
    let m = ctl.metrics().unwrap();
    assert_eq!(m.value("stowage_leader"), Some(1.0));
}
