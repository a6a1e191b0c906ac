//! The control plane the whole suite relies on is the real one: admission, validation and status
//! subresources behave as upstream.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, PersistentVolumeClaim, ServiceAccount};
use kube::Api;
use kube::api::PostParams;
use stowage_testkit::{builders, shared, unique};

#[tokio::test]
async fn pvc_gets_the_protection_finalizer_from_real_admission() {
    let client = shared().client().await;
    let ns = unique("cp");
    let (n, sa) = builders::namespace(&ns);
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &n)
        .await
        .unwrap();
    Api::<ServiceAccount>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &sa)
        .await
        .unwrap();

    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
    let created = pvcs
        .create(&PostParams::default(), &builders::pvc(&ns, "data").build())
        .await
        .unwrap();
    let finalizers = created.metadata.finalizers.unwrap_or_default();
    assert!(
        finalizers.contains(&"kubernetes.io/pvc-protection".to_string()),
        "finalizers: {finalizers:?}"
    );
    // The apiserver itself defaults a new claim's phase (nothing runs the binder here).
    assert_eq!(created.status.and_then(|s| s.phase).as_deref(), Some("Pending"));
}

#[tokio::test]
async fn validation_is_real() {
    let client = shared().client().await;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client, "default");
    let mut bad = builders::pvc("default", &unique("bad")).build();
    bad.spec.as_mut().unwrap().access_modes = Some(vec![]);
    let err = pvcs.create(&PostParams::default(), &bad).await.unwrap_err();
    match err {
        kube::Error::Api(s) => assert_eq!(s.code, 422, "{s:?}"),
        other => panic!("expected a validation error, got {other}"),
    }
}

#[tokio::test]
async fn readyz_answers_ok() {
    let client = shared().client().await;
    let body = stowage_testkit::eventually(Duration::from_secs(30), || {
        let client = client.clone();
        async move {
            client
                .request_text(http::Request::get("/readyz").body(Vec::new()).unwrap())
                .await
                .map_err(|e| e.to_string())
        }
    })
    .await;
    assert_eq!(body.trim(), "ok");
}

/// A killed etcd comes back on its data dir: what it had accepted is still there, and the
/// apiserver serves again (the soak's etcd fault relies on both).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_killed_and_restarted_keeps_its_data() {
    let cp = tokio::task::spawn_blocking(stowage_testkit::ControlPlane::start)
        .await
        .unwrap()
        .unwrap();
    let client = cp.client().await;
    let ns = unique("etcd");
    let (n, _) = builders::namespace(&ns);
    let created = Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &n)
        .await
        .unwrap();
    let cp = std::sync::Arc::new(cp);
    let c2 = cp.clone();
    tokio::task::spawn_blocking(move || c2.restart_etcd(Duration::from_millis(500)))
        .await
        .unwrap()
        .unwrap();
    let got = stowage_testkit::eventually(Duration::from_secs(60), || async {
        Api::<Namespace>::all(client.clone())
            .get(&ns)
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    assert_eq!(got.metadata.uid, created.metadata.uid);
    let c3 = cp.clone();
    tokio::task::spawn_blocking(move || c3.kill_and_restart_apiserver(Duration::from_millis(200)))
        .await
        .unwrap()
        .unwrap();
    let again = Api::<Namespace>::all(cp.client().await).get(&ns).await.unwrap();
    assert_eq!(again.metadata.uid, created.metadata.uid);
}
