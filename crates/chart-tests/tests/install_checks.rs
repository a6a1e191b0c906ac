//! What the chart checks at `helm install` against the cluster, on the real apiserver, so that an
//! install that could never run fails with the fix instead of succeeding and waiting for ever:
//!
//! - Pod Security: what level each pod needs, as the operator guide says, judged by the real
//!   admission; a namespace that would refuse the agent fails the install with the command that
//!   fixes it.
//! - A store on a claim: a claim that is not Bound, or whose volume needs attaching, is refused
//!   (stowage's binder and attach/detach controller run in the pod that would wait for it).
//! - The shared store's init container on an NFS export that squashes root.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim, Pod, PodTemplateSpec};
use k8s_openapi::api::storage::v1::CSIDriver;
use kube::Api;
use kube::api::PostParams;
use stowage_chart_tests::{Helm, chart_dir, document, kubectl_bin};
use stowage_testkit::{ControlPlane, unique};

const RELEASE: &str = "st";

/// A namespace whose Pod Security `enforce` level is `level` (none: no label).
async fn namespace(client: &kube::Client, level: Option<&str>) -> String {
    let name = unique(&format!("ps-{}", level.unwrap_or("none")));
    let (mut ns, sa) = stowage_testkit::builders::namespace(&name);
    if let Some(level) = level {
        ns.metadata.labels = Some(BTreeMap::from([(
            "pod-security.kubernetes.io/enforce".to_string(),
            level.to_string(),
        )]));
    }
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    // No controller manager makes the namespace's default account here.
    Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(client.clone(), &name)
        .create(&PostParams::default(), &sa)
        .await
        .unwrap();
    name
}

/// Whether the namespace's enforced level admits a pod made from `template` (a server-side dry
/// run: admission runs, nothing is stored), with the refusal when it does not.
async fn admitted(client: &kube::Client, ns: &str, template: &PodTemplateSpec) -> Result<(), String> {
    let mut pod = Pod {
        metadata: template.metadata.clone().unwrap_or_default(),
        spec: template.spec.clone(),
        ..Default::default()
    };
    pod.metadata.name = Some("probe".into());
    pod.metadata.namespace = Some(ns.into());
    // The release's accounts are not made here; Pod Security does not judge them.
    if let Some(spec) = pod.spec.as_mut() {
        spec.service_account_name = None;
    }
    let pp = PostParams {
        dry_run: true,
        ..Default::default()
    };
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&pp, &pod)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// One rendered object, read as kubectl reads it (YAML to JSON, locally: no server asked).
fn parse<K: serde::de::DeserializeOwned>(manifest: &str, kind: &str, name: &str) -> K {
    let doc = document(manifest, kind, name).unwrap_or_else(|| panic!("no {kind} {name}"));
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), doc).unwrap();
    let out = std::process::Command::new(kubectl_bin())
        .env("KUBECONFIG", "/dev/null")
        .args(["annotate", "--local", "-o", "json", "-f"])
        .arg(file.path())
        .arg("stowage.dev/read-by=test")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test]
async fn each_pod_needs_the_level_the_guide_names_and_a_refusing_namespace_fails_the_install() {
    let cp = ControlPlane::start().expect("start the test control plane");
    let client = cp.client().await;
    let helm = Helm::new(Some(&cp.kubeconfig()));
    let chart = chart_dir();
    let chart = chart.to_str().unwrap();
    let template = |sets: &'static [&'static str]| {
        let helm = &helm;
        async move {
            let mut args = vec!["template", RELEASE, chart, "--namespace", "stowage"];
            for s in sets {
                args.extend(["--set", s]);
            }
            helm.run(&args).await.unwrap()
        }
    };
    let restricted = namespace(&client, Some("restricted")).await;
    let baseline = namespace(&client, Some("baseline")).await;
    let privileged = namespace(&client, Some("privileged")).await;

    // Local mode (the default): the controller mounts no store and runs as a non-root user with
    // nothing added, so it passes `restricted`; the agent is privileged and passes only
    // `privileged`.
    let m = template(&[]).await;
    let controller: Deployment = parse(&m, "Deployment", "st-stowage-controller");
    let agent: DaemonSet = parse(&m, "DaemonSet", "st-stowage-agent");
    let c = &controller.spec.unwrap().template;
    let a = &agent.spec.unwrap().template;
    admitted(&client, &restricted, c).await.unwrap();
    let e = admitted(&client, &baseline, a).await.unwrap_err();
    assert!(e.contains("violates PodSecurity"), "{e}");
    admitted(&client, &privileged, a).await.unwrap();

    // Shared mode on a host directory: the store is a hostPath and the init container hands it to
    // the controller's user, so the controller is not even `baseline`.
    let m = template(&["imageStore.mode=shared"]).await;
    let controller: Deployment = parse(&m, "Deployment", "st-stowage-controller");
    let c = &controller.spec.unwrap().template;
    let e = admitted(&client, &baseline, c).await.unwrap_err();
    assert!(e.contains("hostPath"), "{e}");
    admitted(&client, &privileged, c).await.unwrap();

    // Installing into a namespace that enforces less than `privileged` is refused, with the fix.
    for (ns, level) in [(&baseline, "baseline"), (&restricted, "restricted")] {
        let e = helm.try_install(RELEASE, chart, ns, &[]).await.unwrap_err();
        assert!(
            e.contains(&format!("enforces Pod Security level \"{level}\""))
                && e.contains(&format!(
                    "kubectl label namespace {ns} pod-security.kubernetes.io/enforce=privileged"
                )),
            "{e}"
        );
    }
    // A namespace that allows it, or one with no label (the cluster's default decides; the
    // guide says to label it), installs; so does a refused one with the check turned off.
    let unlabelled = namespace(&client, None).await;
    for (ns, extra) in [
        (&privileged, None),
        (&unlabelled, None),
        (&baseline, Some("podSecurity.check=false")),
    ] {
        let sets = extra.map(|s| vec!["--set", s]).unwrap_or_default();
        let out = helm.try_install(RELEASE, chart, ns, &sets).await.unwrap();
        assert!(
            out.contains("Pod Security"),
            "the NOTES say what the namespace needs:\n{out}"
        );
    }
}

/// The shared-mode init container's script and its argument, as rendered.
async fn init_script() -> (String, String) {
    let helm = Helm::new(None);
    let chart = chart_dir();
    let m = helm
        .run(&[
            "template",
            RELEASE,
            chart.to_str().unwrap(),
            "--set",
            "imageStore.mode=shared",
        ])
        .await
        .unwrap();
    let d: Deployment = parse(&m, "Deployment", "st-stowage-controller");
    let init = d.spec.unwrap().template.spec.unwrap().init_containers.unwrap();
    let cmd = init[0].command.clone().unwrap();
    assert_eq!(&cmd[..2], ["sh", "-c"]);
    (cmd[2].clone(), cmd[3].clone())
}

/// Runs the script on `dir` as `uid` (root, or the user an NFS server maps a squashed root to).
fn run_as(uid: u32, script: &str, dir: &std::path::Path) -> std::process::Output {
    std::process::Command::new("setpriv")
        .args([
            format!("--reuid={uid}"),
            format!("--regid={uid}"),
            "--clear-groups".into(),
            "sh".into(),
            "-c".into(),
            script.into(),
        ])
        .arg(dir)
        .output()
        .unwrap()
}

fn owner_and_mode(dir: &std::path::Path) -> (u32, u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(dir).unwrap();
    (m.uid(), m.gid(), m.mode() & 0o7777)
}

/// The init container that hands a shared store to the controller's user changes only what
/// differs: on an export whose squashed root acts as the store's owner (`anonuid=65532`) it
/// passes without privilege, and where root is squashed to someone else it stops with what to
/// change on the server, not a bare `Operation not permitted`. (Needs root, as CI runs.)
#[tokio::test]
async fn the_store_init_container_works_with_a_squashing_nfs_export() {
    let (script, path) = init_script().await;
    assert_eq!(path, "/var/lib/stowage/images");
    let parent = tempfile::tempdir().unwrap();
    std::fs::set_permissions(parent.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let dir = parent.path().join("images");
    std::fs::create_dir(&dir).unwrap();

    // Root, as on a local disk or with no_root_squash: the directory is handed over.
    let out = run_as(0, &script, &dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(owner_and_mode(&dir), (65532, 65532, 0o750));

    // root_squash,anonuid=65532: root acts as the owner; nothing to change, nothing refused.
    let out = run_as(65532, &script, &dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // ... and a mode to mend is the owner's to mend.
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = run_as(65532, &script, &dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(owner_and_mode(&dir).2, 0o750);

    // root_squash to nobody: refused, saying what to export instead.
    std::os::unix::fs::chown(&dir, Some(0), Some(0)).unwrap();
    let out = run_as(65534, &script, &dir);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("root_squash,anonuid=65532,anongid=65532") && err.contains("no_root_squash"),
        "{err}"
    );
    assert_eq!(owner_and_mode(&dir).0, 0, "nothing changed");
}

/// Sets a claim's or volume's phase, as a binder would.
async fn set_phase<K>(api: &Api<K>, name: &str, phase: &str)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let patch = serde_json::json!({"status": {"phase": phase}});
    api.patch_status(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&patch),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn a_store_claim_that_stowage_itself_would_have_to_bind_or_attach_is_refused() {
    use stowage_testkit::builders::{pv, pvc};
    let cp = ControlPlane::start().expect("start the test control plane");
    let client = cp.client().await;
    let helm = Helm::new(Some(&cp.kubeconfig()));
    let chart = chart_dir();
    let chart = chart.to_str().unwrap();
    let ns = namespace(&client, Some("privileged")).await;
    let install = |claim: &'static str| {
        let (helm, ns) = (&helm, ns.clone());
        async move {
            let claim = format!("imageStore.existingClaim={claim}");
            let sets = [
                "--set",
                "imageStore.mode=shared,imageStore.type=pvc",
                "--set",
                &claim,
            ];
            helm.try_install(RELEASE, chart, &ns, &sets).await
        }
    };
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    let pp = PostParams::default();

    // Pending: refused, with the order that works.
    claims
        .create(&pp, &pvc(&ns, "store").access_modes(&["ReadWriteMany"]).build())
        .await
        .unwrap();
    let e = install("store").await.unwrap_err();
    assert!(
        e.contains("is Pending, not Bound") && e.contains("Bind it first"),
        "{e}"
    );

    // Bound to a volume whose CSI driver needs attaching: refused.
    let bind = |volume: PersistentVolume| {
        let (claims, volumes) = (claims.clone(), volumes.clone());
        async move {
            let name = volume.metadata.name.clone().unwrap();
            volumes.create(&PostParams::default(), &volume).await.unwrap();
            set_phase(&volumes, &name, "Bound").await;
            let patch = serde_json::json!({"spec": {"volumeName": name}});
            let _ = claims
                .patch(
                    "store",
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&patch),
                )
                .await;
            set_phase(&claims, "store", "Bound").await;
        }
    };
    let mut block = pv(&format!("{ns}-block")).build();
    block.spec.as_mut().unwrap().csi = Some(k8s_openapi::api::core::v1::CSIPersistentVolumeSource {
        driver: "block.example.com".into(),
        volume_handle: "v1".into(),
        ..Default::default()
    });
    bind(block).await;
    let e = install("store").await.unwrap_err();
    assert!(
        e.contains("CSI driver block.example.com requires attach") && e.contains("never be attached"),
        "{e}"
    );
    // The same driver saying it needs no attach (an NFS CSI driver's CSIDriver does): installs.
    let driver = CSIDriver {
        metadata: kube::api::ObjectMeta {
            name: Some("block.example.com".into()),
            ..Default::default()
        },
        spec: k8s_openapi::api::storage::v1::CSIDriverSpec {
            attach_required: Some(false),
            ..Default::default()
        },
    };
    Api::<CSIDriver>::all(client.clone())
        .create(&pp, &driver)
        .await
        .unwrap();
    install("store").await.unwrap();

    // An in-tree NFS volume: no attach, installs; and a claim not found is the pods' to report.
    claims
        .create(
            &pp,
            &pvc(&ns, "nfs-store").access_modes(&["ReadWriteMany"]).build(),
        )
        .await
        .unwrap();
    let mut nfs = pv(&format!("{ns}-nfs")).build();
    nfs.spec.as_mut().unwrap().csi = None;
    nfs.spec.as_mut().unwrap().nfs = Some(k8s_openapi::api::core::v1::NFSVolumeSource {
        server: "192.0.2.1".into(),
        path: "/srv/stowage".into(),
        ..Default::default()
    });
    let (c2, v2) = (claims.clone(), volumes.clone());
    let name = nfs.metadata.name.clone().unwrap();
    v2.create(&pp, &nfs).await.unwrap();
    set_phase(&v2, &name, "Bound").await;
    let patch = serde_json::json!({"spec": {"volumeName": name}});
    c2.patch(
        "nfs-store",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&patch),
    )
    .await
    .unwrap();
    set_phase(&c2, "nfs-store", "Bound").await;
    install("nfs-store").await.unwrap();
    install("no-such-claim").await.unwrap();
}
