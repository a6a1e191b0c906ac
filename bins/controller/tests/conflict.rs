//! A second storage controller beside stowage, on the real apiserver: a kube-controller-manager
//! pod whose flags turn the binder on is reported and, with `--on-conflict=pause`, stops
//! stowage's binder; the real kube-controller-manager's binds are then seen as rival writes
//! (Event, metric); once both are gone, stowage's binder starts again and binds. The same for
//! attach/detach: kube-controller-manager's VolumeAttachment is reported, and stowage, resumed,
//! reports the attachment it then finds in the Node's status.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use stowage_controller::rival;
use stowage_testkit::binary::Running;
use stowage_testkit::builders::{node, pod, pv, pvc};
use stowage_testkit::controlplane::Kcm;
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

/// A test control plane of its own, and a client of it.
async fn control_plane() -> (ControlPlane, kube::Client) {
    let cp = tokio::task::spawn_blocking(ControlPlane::start)
        .await
        .unwrap()
        .unwrap();
    let client = cp.client().await;
    (cp, client)
}

/// stowage has seen no conflict from any source, counted no rival write, and runs.
fn assert_no_conflict(stowage: &Running) {
    assert_eq!(
        gauge(stowage, "stowage_conflict", &[]),
        0.0,
        "{}",
        stowage.log_text()
    );
    assert_eq!(gauge(stowage, "stowage_conflicting_writes_total", &[]), 0.0);
    assert_eq!(gauge(stowage, "stowage_controllers_paused", &[]), 0.0);
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

/// A PV and a claim of class `c` that match, as an admin makes them for static binding.
async fn static_pair(client: &kube::Client, volume: &str, claim: &str) {
    Api::<PersistentVolume>::all(client.clone())
        .create(&PostParams::default(), &pv(volume).class("c").build())
        .await
        .unwrap();
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &pvc("default", claim).class("c").build())
        .await
        .unwrap();
}

/// Waits until `volume` is bound, and by stowage: kube-controller-manager owns no claimRef.
async fn bound_by_stowage(pvs: &Api<PersistentVolume>, volume: &str) {
    eventually(LIMIT, || async {
        let v = pvs.get(volume).await.map_err(|e| e.to_string())?;
        match claim_ref_managers(&v).as_slice() {
            [] => Err(format!("{volume} not bound yet")),
            m if m.iter().any(|m| m == "kube-controller-manager") => Err(format!("bound by {m:?}")),
            _ => Ok(()),
        }
    })
    .await;
}

/// kubeadm's static kube-controller-manager pod as the apiserver shows it, with `controllers` as
/// its `--controllers`. It never runs (no such node); what it says is the evidence.
async fn kcm_pod(client: &kube::Client, controllers: &str) -> Api<Pod> {
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
                            format!("--controllers={controllers}")]
            }]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &kcm_pod).await.unwrap();
    pods
}

/// stowage-controller running `controllers`, paused on a conflict, quiet after 5 s.
fn stowage(cp: &ControlPlane, controllers: &str, images: &std::path::Path) -> Running {
    Running::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_stowage-controller")),
        &[
            format!("--kubeconfig={}", cp.kubeconfig().display()),
            format!("--controllers={controllers}"),
            "--leader-elect=false".into(),
            "--on-conflict=pause".into(),
            "--conflict-quiet-period=5s".into(),
            format!("--image-dir={}", images.display()),
        ],
        cp.dir(),
        "stowage-conflict",
    )
    .unwrap()
}

/// The flags are caught before anything is written: the pod gets an Event naming the flag entry
/// that turns `kcm_name` off, and the controllers stop.
async fn paused_by_flags(client: &kube::Client, stowage: &Running, kcm_name: &str) {
    until_gauge(stowage, "stowage_conflict", &[("source", "flags")], |v| v == 1.0).await;
    until_gauge(stowage, "stowage_controllers_paused", &[], |v| v == 1.0).await;
    eventually(LIMIT, || async {
        let evs = conflict_events(client, "kube-system", "Pod").await;
        match evs.first().and_then(|e| e.note.clone()) {
            Some(note) if note.contains(&format!("-{kcm_name}")) => Ok(()),
            other => Err(format!(
                "no ConflictingController event on the pod yet: {other:?}"
            )),
        }
    })
    .await;
}

/// The real kube-controller-manager with only `controller` on.
fn real_kcm(cp: &ControlPlane, controller: &str) -> Kcm {
    cp.start_kcm(controller, &["--pvclaimbinder-sync-period=1s"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rival_binder_is_reported_and_pauses_stowage_until_it_is_gone() {
    let (cp, client) = control_plane().await;
    let images = tempfile::tempdir().unwrap();
    let pods = kcm_pod(
        &client,
        "*,bootstrapsigner,tokencleaner,-persistentvolume-attach-detach-controller",
    )
    .await;
    let stowage = stowage(&cp, "binder", images.path());
    paused_by_flags(&client, &stowage, "persistentvolume-binder-controller").await;

    // The real kube-controller-manager binds a pair while stowage's binder is paused.
    let kcm = real_kcm(&cp, "persistentvolume-binder-controller");
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    static_pair(&client, "rival-1", "claim-1").await;
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
    rival_gone(kcm, &pods, &stowage).await;
    until_gauge(&stowage, "stowage_conflict", &[], |v| v == 0.0).await;
    static_pair(&client, "own-2", "claim-2").await;
    bound_by_stowage(&pvs, "own-2").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rival_attach_detach_controller_is_reported_and_stowage_takes_over() {
    let (cp, client) = control_plane().await;
    let images = tempfile::tempdir().unwrap();
    let pods = kcm_pod(&client, "*,-persistentvolume-binder-controller").await;
    let stowage = stowage(&cp, "attachdetach", images.path());
    paused_by_flags(&client, &stowage, "persistentvolume-attach-detach-controller").await;

    // A managed, Ready node; a claim and volume bound as a binder leaves them; a pod on the node.
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(
            &PostParams::default(),
            &node("node-a").controller_attach().build(),
        )
        .await
        .unwrap();
    let ready = json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}});
    nodes
        .patch_status("node-a", &PatchParams::default(), &Patch::Merge(ready))
        .await
        .unwrap();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    let claim = claims
        .create(
            &PostParams::default(),
            &pvc("default", "data").volume_name("vol-1").build(),
        )
        .await
        .unwrap();
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    pvs.create(
        &PostParams::default(),
        &pv("vol-1")
            .claim_ref("default", "data", &claim.uid().unwrap())
            .build(),
    )
    .await
    .unwrap();
    let bound = Patch::Merge(json!({"status": {"phase": "Bound"}}));
    pvs.patch_status("vol-1", &PatchParams::default(), &bound)
        .await
        .unwrap();
    claims
        .patch_status("data", &PatchParams::default(), &bound)
        .await
        .unwrap();
    let app_pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
    let _ = sas
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "default"}})).unwrap(),
        )
        .await;
    app_pods
        .create(
            &PostParams::default(),
            &pod("default", "app").claim("data", "data").node("node-a").build(),
        )
        .await
        .unwrap();

    // kube-controller-manager creates the VolumeAttachment while stowage's attach/detach waits.
    let kcm = real_kcm(&cp, "persistentvolume-attach-detach-controller");
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    let va = eventually(LIMIT, || async {
        let list = vas
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        list.items
            .into_iter()
            .next()
            .ok_or_else(|| "no VolumeAttachment yet".to_string())
    })
    .await;
    let creators: Vec<String> = va
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|e| e.manager.clone())
        .collect();
    assert_eq!(
        creators,
        vec!["kube-controller-manager".to_string()],
        "paused stowage wrote it"
    );
    until_gauge(
        &stowage,
        "stowage_conflicting_writes_total",
        &[("resource", "VolumeAttachment"), ("controller", "attachdetach")],
        |v| v >= 1.0,
    )
    .await;
    eventually(LIMIT, || async {
        if conflict_events(&client, "default", "VolumeAttachment")
            .await
            .is_empty()
        {
            Err("no ConflictingController event on the VolumeAttachment".to_string())
        } else {
            Ok(())
        }
    })
    .await;

    // kube-controller-manager goes; stowage resumes and takes over the attachment it left: once
    // the attacher reports it attached, stowage lists it in the Node's status.
    rival_gone(kcm, &pods, &stowage).await;
    let attached = json!({"status": {"attached": true}});
    vas.patch_status(&va.name_any(), &PatchParams::default(), &Patch::Merge(attached))
        .await
        .unwrap();
    let csi = pvs.get("vol-1").await.unwrap().spec.unwrap().csi.unwrap();
    let want = format!("kubernetes.io/csi/{}^{}", csi.driver, csi.volume_handle);
    eventually(LIMIT, || async {
        let n = nodes.get("node-a").await.map_err(|e| e.to_string())?;
        let listed = n
            .status
            .and_then(|s| s.volumes_attached)
            .unwrap_or_default()
            .iter()
            .any(|v| v.name == want);
        if listed {
            Ok(())
        } else {
            Err(format!("{want} not in node-a's volumesAttached"))
        }
    })
    .await;
}

/// The rival goes: its process stops and its pod is deleted; stowage, paused until then, resumes
/// once the quiet period has passed.
async fn rival_gone(kcm: Kcm, pods: &Api<Pod>, stowage: &Running) {
    drop(kcm);
    pods.delete(
        "kube-controller-manager-cp0",
        &DeleteParams::default().grace_period(0),
    )
    .await
    .unwrap();
    until_gauge(stowage, "stowage_controllers_paused", &[], |v| v == 0.0).await;
}

/// k3s runs kube-controller-manager inside its own process, and there is no pod to read its flags
/// from: its writes are the only evidence, recorded under the field manager `k3s`. The real
/// kube-controller-manager, run under that process name, binds a pair; what it wrote reads as a
/// rival binder's write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_controller_manager_in_k3s_is_seen_by_its_writes() {
    let (cp, client) = control_plane().await;
    // managedFields times are whole seconds: a write in this second may read as its start.
    let since = k8s_openapi::jiff::Timestamp::now()
        .checked_sub(Duration::from_secs(1))
        .unwrap();
    let _kcm = cp.start_kcm_as(
        "k3s",
        "persistentvolume-binder-controller",
        &["--pvclaimbinder-sync-period=1s"],
    );
    static_pair(&client, "k3s-1", "claim-k3s").await;
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    eventually(LIMIT, || async {
        let v = pvs.get("k3s-1").await.map_err(|e| e.to_string())?;
        let managers = claim_ref_managers(&v);
        if managers != ["k3s"] {
            return Err(format!("spec.claimRef of k3s-1 owned by {managers:?}"));
        }
        let object: rival::Object = serde_json::from_value(serde_json::to_value(&v).unwrap()).unwrap();
        match rival::rival_write(
            rival::Kind::PersistentVolume,
            &object.metadata,
            since,
            Some(rival::Owned::default()),
        ) {
            Some(w) if w.manager == "k3s" => Ok(()),
            other => Err(format!("not read as k3s's write: {other:?}")),
        }
    })
    .await;
}

/// docs/distributions.md, whose steps the tests below run as written.
fn guide() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/distributions.md"
    ))
    .unwrap()
}

/// The value docs/distributions.md gives kube-controller-manager, read from the guide itself.
fn documented_value() -> String {
    let guide = guide();
    let line = guide
        .lines()
        .find(|l| {
            l.trim_start()
                .starts_with("value: \"*,bootstrapsigner,tokencleaner,")
        })
        .expect("the kubeadm value in docs/distributions.md");
    line.trim()
        .trim_start_matches("value: ")
        .trim_matches('"')
        .to_string()
}

/// kubeadm of the pinned release (`e2e/kubeadm`, built by `make kubeadm`), as the guide's
/// clusters run it.
fn kubeadm() -> std::path::PathBuf {
    let bin = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../e2e/kubeadm/bin/kubeadm");
    assert!(bin.exists(), "{} is missing: run `make kubeadm`", bin.display());
    bin
}

/// The release kubeadm was built from (`kubeadm version -o short`), the cluster's version in the
/// configurations it is given.
fn kubeadm_version() -> String {
    let out = std::process::Command::new(kubeadm())
        .args(["version", "-o", "short"])
        .output()
        .unwrap();
    assert!(out.status.success(), "kubeadm version");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The kube-controller-manager static pod manifest that the real kubeadm writes for `config` (a
/// kubeadm configuration; `kubernetesVersion` is added, as `kubeadm init` would take it from
/// the cluster), in a directory of its own.
fn kubeadm_manifest(config: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("kubeadm.yaml");
    std::fs::write(
        &file,
        format!(
            "{}\nkubernetesVersion: {}\n",
            config.trim_end(),
            kubeadm_version()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(kubeadm())
        .args([
            "init",
            "phase",
            "control-plane",
            "controller-manager",
            "--dry-run",
            "--config",
        ])
        .arg(&file)
        .env("KUBEADM_INIT_DRYRUN_DIR", dir.path())
        .output()
        .unwrap();
    let manifest = dir.path().join("kube-controller-manager.yaml");
    assert!(
        out.status.success() && manifest.exists(),
        "kubeadm wrote no manifest for\n{config}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (dir, manifest)
}

/// The `--controllers` flag kubeadm gives kube-controller-manager for `config`.
fn kubeadm_controllers(config: &str) -> String {
    let (_dir, path) = kubeadm_manifest(config);
    let manifest = std::fs::read_to_string(path).unwrap();
    let flags: Vec<&str> = manifest
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- --controllers="))
        .collect();
    assert_eq!(flags.len(), 1, "one --controllers flag in\n{manifest}");
    flags[0].to_string()
}

/// The guide's yaml block that starts with `first`, as written (indentation kept).
fn guide_block(guide: &str, first: &str) -> String {
    let mut lines = guide.lines().skip_while(|l| l.trim() != first);
    let head = lines
        .next()
        .unwrap_or_else(|| panic!("no block starting `{first}` in the guide"));
    let indent = head.len() - head.trim_start().len();
    std::iter::once(head)
        .chain(lines.take_while(|l| l.trim() != "```"))
        .map(|l| l.get(indent..).unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every kubeadm-based path in docs/distributions.md, rendered by the real kubeadm: the guide's
/// `sed` on the manifest kubeadm writes by default, its `ClusterConfiguration` for
/// `kubeadm-config`, and the kubeadm patch of its kind cluster configuration (kind applies it to
/// the `ClusterConfiguration` it generates). Each gives kube-controller-manager the one value the
/// guide documents, which the test below runs the real kube-controller-manager with.
#[test]
fn kubeadm_renders_the_guides_flag_for_kubeadm_and_kind() {
    let guide = guide();
    let value = documented_value();
    let bare = "apiVersion: kubeadm.k8s.io/v1beta4\nkind: ClusterConfiguration";
    assert_eq!(
        kubeadm_controllers(bare),
        "*,bootstrapsigner,tokencleaner",
        "kubeadm's default, which the guide's sed expects"
    );

    // Step 1: the sed, on the manifest kubeadm writes.
    let (_dir, manifest) = kubeadm_manifest(bare);
    let ok = std::process::Command::new("sed")
        .args(["-i", &guide_sed_script(&guide)])
        .arg(&manifest)
        .status()
        .unwrap()
        .success();
    assert!(ok, "the guide's sed");
    let edited = std::fs::read_to_string(&manifest).unwrap();
    assert!(
        edited.contains(&format!("    - --controllers={value}\n")),
        "the guide's sed on kubeadm's manifest:\n{edited}"
    );

    // Step 2: kubeadm-config's ClusterConfiguration (v1beta4, extraArgs a list).
    let cluster_configuration = format!("{bare}\n{}", guide_block(&guide, "controllerManager:"));
    assert_eq!(
        kubeadm_controllers(&cluster_configuration),
        value,
        "kubeadm-config"
    );

    // kind: its kubeadmConfigPatches entry is a ClusterConfiguration of the same version.
    let kind_config = guide_block(&guide, "kind: Cluster");
    let patch: String = kind_config
        .lines()
        .skip_while(|l| l.trim() != "- |")
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .map(|l| format!("{}\n", &l[2..]))
        .collect();
    assert!(
        patch.contains("kind: ClusterConfiguration"),
        "kind's patch:\n{kind_config}"
    );
    assert_eq!(kubeadm_controllers(&patch), value, "kind's patch:\n{patch}");
}

/// The guide's `sed` script (step 1 of kubeadm), as written.
fn guide_sed_script(guide: &str) -> String {
    guide
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("sudo sed -i '")
                .map(|s| s.split('\'').next().unwrap().to_string())
        })
        .expect("the guide's sed command")
}

/// The guide's kube-controller-manager flag on the real kube-controller-manager, beside stowage.
/// Nothing of KCM's touches the storage objects, stowage reports no conflict, and stowage binds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_kcm_flag_leaves_the_storage_controllers_to_stowage() {
    // The value every path of the guide gives KCM (the test above renders each with kubeadm).
    let value = documented_value();
    let (cp, client) = control_plane().await;
    let images = tempfile::tempdir().unwrap();
    // The static pod as kubeadm leaves it after the step: its flags are clean.
    let _pods = kcm_pod(&client, &value).await;
    let stowage = stowage(&cp, "*", images.path());
    // KCM v1.36.3 takes the value (an unknown name would stop it at once) and runs the rest.
    let mut kcm = real_kcm(&cp, &value);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        kcm.running(),
        "kube-controller-manager refused --controllers={value}"
    );

    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    static_pair(&client, "after-1", "claim-after").await;
    bound_by_stowage(&pvs, "after-1").await;
    // Past the pod poll: still no conflict from either source, nothing paused.
    tokio::time::sleep(Duration::from_secs(31)).await;
    assert_no_conflict(&stowage);
    assert!(kcm.running(), "kube-controller-manager stopped");
}

/// Every manager of an object's fields.
fn managers<K: kube::Resource>(o: &K) -> Vec<String> {
    o.meta()
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|e| e.manager.clone())
        .collect()
}

/// stowage's writes name stowage in managedFields, as kube-controller-manager's name it: a
/// reader of managedFields (an operator, an audit, stowage's own conflict detector on another
/// cluster's controllers) sees who bound the pair, never `unknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stowages_writes_are_signed_by_stowage_controller() {
    let (cp, client) = control_plane().await;
    let images = tempfile::tempdir().unwrap();
    let _stowage = stowage(&cp, "*", images.path());
    static_pair(&client, "signed-1", "claim-signed").await;
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    eventually(LIMIT, || async {
        let v = pvs.get("signed-1").await.map_err(|e| e.to_string())?;
        let c = pvcs.get("claim-signed").await.map_err(|e| e.to_string())?;
        let phase = |p: Option<&str>| p == Some("Bound");
        if !phase(v.status.as_ref().and_then(|s| s.phase.as_deref()))
            || !phase(c.status.as_ref().and_then(|s| s.phase.as_deref()))
        {
            return Err("not bound yet".into());
        }
        Ok(())
    })
    .await;
    let v = pvs.get("signed-1").await.unwrap();
    let c = pvcs.get("claim-signed").await.unwrap();
    assert_eq!(claim_ref_managers(&v), ["stowage-controller"]);
    for (what, m) in [("PV", managers(&v)), ("claim", managers(&c))] {
        assert!(
            !m.iter().any(|m| m == "unknown"),
            "{what}: a write without a manager: {m:?}"
        );
        assert!(m.iter().any(|m| m == "stowage-controller"), "{what}: {m:?}");
    }
    // The status writes (phase) too: the Bound phases are stowage's.
    let status_owners = |o: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry]| {
        o.iter()
            .filter(|e| e.subresource.as_deref() == Some("status"))
            .filter_map(|e| e.manager.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        status_owners(v.metadata.managed_fields.as_deref().unwrap_or_default()),
        ["stowage-controller"]
    );
    assert_eq!(
        status_owners(c.metadata.managed_fields.as_deref().unwrap_or_default()),
        ["stowage-controller"]
    );
}

/// kube-controller-manager's entry on a PV keeps `spec.claimRef` from when it bound the pair,
/// before stowage took over; its later writes to the same object under the same manager (a label
/// here, as node lifecycle writes a Node's conditions; k3s's process writes everything as `k3s`)
/// move the entry's time but write no storage field. stowage, told to pause on a conflict, sees
/// none and keeps binding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rivals_old_field_redated_by_an_unrelated_write_is_no_conflict() {
    let (cp, client) = control_plane().await;
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    // Pairs bound by each rival manager before stowage starts.
    for manager in rival::KCM_MANAGERS {
        let (volume, claim) = (format!("old-{manager}"), format!("claim-old-{manager}"));
        let c = pvcs
            .create(&PostParams::default(), &pvc("default", &claim).class("c").build())
            .await
            .unwrap();
        let as_rival = PostParams {
            field_manager: Some(manager.into()),
            ..Default::default()
        };
        let v = pv(&volume)
            .class("c")
            .claim_ref("default", &claim, &c.uid().unwrap())
            .build();
        pvs.create(&as_rival, &v).await.unwrap();
        assert_eq!(claim_ref_managers(&pvs.get(&volume).await.unwrap()), [manager]);
    }
    // Whole seconds: the writes below are dated after stowage's start.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let images = tempfile::tempdir().unwrap();
    let stowage = stowage(&cp, "binder", images.path());
    until_gauge(&stowage, "stowage_controllers_paused", &[], |v| v == 0.0).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Twice: first seen, then seen again with the entry re-dated.
    for (manager, round) in rival::KCM_MANAGERS.iter().flat_map(|m| [(*m, 1), (*m, 2)]) {
        let volume = format!("old-{manager}");
        let patch = json!({"metadata": {"labels": {"touched-by": manager, "round": round.to_string()}}});
        let pp = PatchParams {
            field_manager: Some(manager.into()),
            ..Default::default()
        };
        let v = pvs.patch(&volume, &pp, &Patch::Merge(&patch)).await.unwrap();
        // The apiserver re-dated the entry that still owns spec.claimRef.
        assert_eq!(claim_ref_managers(&v), [manager], "{volume}");
    }
    static_pair(&client, "fresh-1", "claim-fresh").await;
    bound_by_stowage(&pvs, "fresh-1").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_no_conflict(&stowage);
    // A rival that takes a storage field is still seen: claimRef of a pair stowage bound.
    let patch = json!({"spec": {"claimRef": {"resourceVersion": "1"}}});
    let pp = PatchParams {
        field_manager: Some("kube-controller-manager".into()),
        ..Default::default()
    };
    pvs.patch("fresh-1", &pp, &Patch::Merge(&patch)).await.unwrap();
    until_gauge(&stowage, "stowage_conflicting_writes_total", &[], |v| v >= 1.0).await;
}

/// The guide's k3s section imports the image with k3s's own containerd client: plain `ctr`
/// talks to a system containerd's socket where one runs, and the image never reaches k3s.
#[test]
fn the_k3s_section_imports_into_k3s_own_containerd() {
    let guide = guide();
    let k3s: String = guide
        .lines()
        .skip_while(|l| *l != "## k3s")
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(k3s.contains("`k3s ctr images import"), "{k3s}");
    assert!(k3s.contains("/var/lib/rancher/k3s/agent/images/"), "{k3s}");
    let plain = k3s
        .lines()
        .filter(|l| l.contains("ctr -n k8s.io images import"))
        .all(|l| l.contains("Plain") || l.contains("plain"));
    assert!(plain, "plain ctr only as the warning:\n{k3s}");
}
