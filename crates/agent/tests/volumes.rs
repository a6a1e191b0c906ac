//! The agent against the real apiserver, with real loop devices, ext4 and mounts. No controllers
//! run: the tests create VolumeAttachments where the attach/detach controller would (and delete
//! them only once the node no longer lists the volume in use, as it does).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::{VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec};
use kube::api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use stowage_agent::mountinfo::{self, MountEntry};
use stowage_agent::paths::{DRIVER, Layout, unique_name, va_name};
use stowage_testkit::binary::Running;
use stowage_testkit::{builders, eventually, shared, unique};

const LIMIT: Duration = Duration::from_secs(90);

use stowage_testkit::host::Cleanup;

struct Env {
    client: Client,
    ns: String,
    base: PathBuf,
    images: PathBuf,
    logs: PathBuf,
}

async fn env(prefix: &str) -> (Env, Cleanup) {
    let client = shared().client().await;
    let ns = unique(prefix);
    let (n, sa) = builders::namespace(&ns);
    Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .create(&PostParams::default(), &n)
        .await
        .unwrap();
    Api::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &sa)
        .await
        .unwrap();
    let base = std::env::temp_dir().join(unique(&format!("stowage-agent-{prefix}")));
    let images = base.join("images");
    std::fs::create_dir_all(&images).unwrap();
    let base = std::fs::canonicalize(&base).unwrap();
    let images = std::fs::canonicalize(&images).unwrap();
    let logs = std::env::temp_dir().join("stowage-test-logs");
    std::fs::create_dir_all(&logs).unwrap();
    let guard = Cleanup {
        base: base.clone(),
        images: images.clone(),
    };
    (
        Env {
            client,
            ns,
            base,
            images,
            logs,
        },
        guard,
    )
}

impl Env {
    fn root(&self, node: &str) -> PathBuf {
        self.base.join(format!("root-{node}"))
    }

    fn layout(&self, node: &str) -> Layout {
        Layout::new(self.root(node))
    }

    fn agent(&self, node: &str, label: &str) -> Running {
        self.agent_with(node, label, &[])
    }

    /// An agent with extra flags.
    fn agent_with(&self, node: &str, label: &str, extra: &[String]) -> Running {
        let mut args = vec![
            format!("--kubeconfig={}", shared().kubeconfig().display()),
            format!("--node-name={node}"),
            format!("--root-dir={}", self.root(node).display()),
            format!("--image-dir={}", self.images.display()),
            "--register-node".to_string(),
        ];
        args.extend_from_slice(extra);
        Running::start(
            Path::new(env!("CARGO_BIN_EXE_stowage-agent")),
            &args,
            &self.logs,
            &format!("{label}-{node}"),
        )
        .unwrap()
    }

    fn image(&self, handle: &str) -> PathBuf {
        let p = self.images.join(format!("{handle}.img"));
        let st = std::process::Command::new("truncate")
            .arg("-s")
            .arg("64M")
            .arg(&p)
            .status()
            .unwrap();
        assert!(st.success());
        p
    }

    /// A PV of the loop driver pre-bound to a claim, and the claim.
    async fn volume(&self, pv: &str, claim: &str) {
        self.volume_with(pv, claim, &["ReadWriteMany"]).await
    }

    /// `volume` with the given access modes (on the PV and the claim).
    async fn volume_with(&self, pv: &str, claim: &str, modes: &[&str]) {
        let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
        pvs.create(
            &PostParams::default(),
            &builders::pv(pv)
                .capacity("64Mi")
                .access_modes(modes)
                .claim_ref(&self.ns, claim, "")
                .build(),
        )
        .await
        .unwrap();
        let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), &self.ns);
        pvcs.create(
            &PostParams::default(),
            &builders::pvc(&self.ns, claim)
                .request("64Mi")
                .access_modes(modes)
                .class("")
                .volume_name(pv)
                .build(),
        )
        .await
        .unwrap();
    }

    async fn pod(&self, name: &str, node: &str, claim: &str) -> String {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.ns);
        let p = pods
            .create(
                &PostParams::default(),
                &builders::pod(&self.ns, name)
                    .claim("data", claim)
                    .node(node)
                    .build(),
            )
            .await
            .unwrap();
        p.uid().unwrap()
    }

    async fn delete_pod(&self, name: &str) {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.ns);
        pods.delete(
            name,
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    }

    /// What the attach/detach controller would create for (pv, node).
    async fn attach(&self, pv: &str, node: &str) -> String {
        let name = va_name(pv, node);
        let va = VolumeAttachment {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..Default::default()
            },
            spec: VolumeAttachmentSpec {
                attacher: DRIVER.into(),
                node_name: node.into(),
                source: VolumeAttachmentSource {
                    persistent_volume_name: Some(pv.into()),
                    ..Default::default()
                },
            },
            status: None,
        };
        Api::<VolumeAttachment>::all(self.client.clone())
            .create(&PostParams::default(), &va)
            .await
            .unwrap();
        name
    }

    async fn wait_attached(&self, va: &str) -> String {
        let api: Api<VolumeAttachment> = Api::all(self.client.clone());
        eventually(LIMIT, || async {
            let v = api.get(va).await.map_err(|e| e.to_string())?;
            let st = v.status.ok_or("no status yet")?;
            if !st.attached {
                return Err(format!("not attached: {:?}", st.attach_error));
            }
            st.attachment_metadata
                .and_then(|m| m.get("devicePath").cloned())
                .ok_or("no devicePath".to_string())
        })
        .await
    }

    /// Deletes the attachment the way the controller does: once the node no longer lists the
    /// volume as in use; then waits until the agent released it.
    async fn detach(&self, va: &str, node: &str, pv: &str) {
        self.wait_not_in_use(node, pv).await;
        let api: Api<VolumeAttachment> = Api::all(self.client.clone());
        api.delete(va, &DeleteParams::default()).await.unwrap();
        eventually(LIMIT, || async {
            match api.get_opt(va).await.map_err(|e| e.to_string())? {
                None => Ok(()),
                Some(v) => Err(format!("still there: {:?}", v.status)),
            }
        })
        .await;
    }

    /// Attaches `pv` to `node` and waits until the pod `uid` has it mounted.
    async fn attach_and_mount(&self, pv: &str, node: &str, uid: &str) -> Mounted {
        let va = self.attach(pv, node).await;
        let dev = self.wait_attached(&va).await;
        let layout = self.layout(node);
        let (target, global) = (layout.pod_mount(uid, pv), layout.global_mount(pv));
        let mount = wait_mounted(&target).await;
        Mounted {
            va,
            dev,
            target,
            global,
            mount,
        }
    }

    /// Deletes the pods, waits until `mounts` are gone, then detaches the way the controller does.
    async fn release(&self, pods: &[&str], mounts: &[&Path], va: &str, node: &str, pv: &str) {
        for p in pods {
            self.delete_pod(p).await;
        }
        for m in mounts {
            wait_unmounted(m).await;
        }
        self.detach(va, node, pv).await;
    }

    async fn in_use(&self, node: &str) -> Vec<String> {
        let n = Api::<Node>::all(self.client.clone()).get(node).await.unwrap();
        n.status.and_then(|s| s.volumes_in_use).unwrap_or_default()
    }

    async fn wait_in_use(&self, node: &str, pv: &str) {
        let want = unique_name(pv);
        eventually(LIMIT, || async {
            let v = self.in_use(node).await;
            if v.contains(&want) {
                Ok(())
            } else {
                Err(format!("volumesInUse {v:?}"))
            }
        })
        .await
    }

    async fn wait_not_in_use(&self, node: &str, pv: &str) {
        let want = unique_name(pv);
        eventually(LIMIT, || async {
            let v = self.in_use(node).await;
            if !v.contains(&want) {
                Ok(())
            } else {
                Err(format!("volumesInUse {v:?}"))
            }
        })
        .await
    }

    async fn events(&self, ns: &str, name: &str) -> Vec<(String, String)> {
        let evs = Api::<Event>::namespaced(self.client.clone(), ns)
            .list(&ListParams::default())
            .await
            .unwrap();
        evs.items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
            .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
            .collect()
    }

    async fn wait_event(&self, ns: &str, name: &str, reason: &str) -> String {
        eventually(LIMIT, || async {
            let evs = self.events(ns, name).await;
            evs.iter()
                .find(|(r, _)| r == reason)
                .map(|(_, n)| n.clone())
                .ok_or(format!("events of {name}: {evs:?}"))
        })
        .await
    }
}

/// A volume attached to a node and mounted into one pod.
struct Mounted {
    va: String,
    dev: String,
    target: PathBuf,
    global: PathBuf,
    mount: MountEntry,
}

fn mounts_at(path: &Path) -> Vec<MountEntry> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    mountinfo::parse(&table)
        .into_iter()
        .filter(|m| m.mount_point == path)
        .collect()
}

async fn wait_mounted(path: &Path) -> MountEntry {
    eventually(LIMIT, || async {
        mounts_at(path)
            .pop()
            .ok_or(format!("{} is not mounted", path.display()))
    })
    .await
}

async fn wait_unmounted(path: &Path) {
    eventually(LIMIT, || async {
        if mounts_at(path).is_empty() {
            Ok(())
        } else {
            Err(format!("{} is still mounted", path.display()))
        }
    })
    .await
}

fn loops_of(image: &Path) -> String {
    let out = std::process::Command::new("losetup")
        .arg("-j")
        .arg(image)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test]
async fn full_cycle_moves_data_between_two_agents() {
    let (e, _guard) = env("cycle").await;
    let (na, nb) = (unique("node-a"), unique("node-b"));
    let _a = e.agent(&na, "cycle");
    let _b = e.agent(&nb, "cycle");
    let pv = unique("pv-cycle");
    let image = e.image(&pv);
    e.volume(&pv, "data").await;

    let uid = e.pod("writer", &na, "data").await;
    let a = e.attach_and_mount(&pv, &na, &uid).await;
    assert!(a.dev.starts_with("/dev/loop"), "{}", a.dev);
    assert_eq!(a.mount.fstype, "ext4", "a blank image is formatted once");
    e.wait_in_use(&na, &pv).await;
    std::fs::write(a.target.join("hello.txt"), b"written on node a").unwrap();
    e.wait_event(&e.ns, "writer", "SuccessfulMountVolume").await;
    assert_eq!(mounts_at(&a.global).len(), 1);

    e.release(&["writer"], &[&a.target, &a.global], &a.va, &na, &pv)
        .await;
    assert_eq!(loops_of(&image), "", "the loop device is released");

    let uid2 = e.pod("reader", &nb, "data").await;
    let b = e.attach_and_mount(&pv, &nb, &uid2).await;
    let text = std::fs::read_to_string(b.target.join("hello.txt")).unwrap();
    assert_eq!(
        text, "written on node a",
        "never reformatted: the data moved with the volume"
    );

    e.release(&["reader"], &[&b.target], &b.va, &nb, &pv).await;
    assert_eq!(loops_of(&image), "");
}

#[tokio::test]
async fn restart_while_mounted_neither_remounts_nor_forgets() {
    let (e, _guard) = env("restart").await;
    let node = unique("node-r");
    let mut agent = e.agent(&node, "restart-1");
    let pv = unique("pv-restart");
    e.image(&pv);
    e.volume(&pv, "data").await;
    let uid = e.pod("app", &node, "data").await;
    let Mounted {
        va, target, global, ..
    } = e.attach_and_mount(&pv, &node, &uid).await;
    std::fs::write(target.join("keep.txt"), b"still here").unwrap();
    let ids = |p: &Path| mounts_at(p).iter().map(|m| m.id).collect::<BTreeSet<_>>();
    let before = (ids(&global), ids(&target));

    agent.sigterm();
    assert_eq!(agent.wait_exit(Duration::from_secs(60)), Some(0));
    let agent = e.agent(&node, "restart-2");
    // Wait until the new agent has looked at the node a few times and counts the mount.
    eventually(LIMIT, || async {
        let m = agent.metrics()?;
        let passes = m
            .samples
            .get("stowage_agent_reconcile_passes_total")
            .and_then(|s| {
                s.iter()
                    .find(|(l, _)| l.get("loop").map(String::as_str) == Some("volumes"))
            })
            .map_or(0.0, |(_, v)| *v);
        let mounted = m
            .samples
            .get("stowage_agent_pod_volumes")
            .and_then(|s| {
                s.iter()
                    .find(|(l, _)| l.get("state").map(String::as_str) == Some("actual"))
            })
            .map_or(0.0, |(_, v)| *v);
        if passes >= 5.0 && mounted == 1.0 {
            Ok(())
        } else {
            Err(format!("passes {passes}, mounted {mounted}"))
        }
    })
    .await;
    assert_eq!((ids(&global), ids(&target)), before, "same mounts, not new ones");
    let m = agent.metrics().unwrap();
    let ops = m
        .samples
        .get("stowage_agent_operations_total")
        .cloned()
        .unwrap_or_default();
    let done: f64 = ops
        .iter()
        .filter(|(l, _)| {
            ["mount_device", "setup"].contains(&l["operation"].as_str()) && l["status"] == "success"
        })
        .map(|(_, v)| v)
        .sum();
    assert_eq!(done, 0.0, "the restarted agent mounted nothing");
    assert_eq!(
        std::fs::read_to_string(target.join("keep.txt")).unwrap(),
        "still here"
    );
    e.wait_in_use(&node, &pv).await;

    // And it still cleans up what the previous run mounted.
    e.release(&["app"], &[&target, &global], &va, &node, &pv).await;
}

#[tokio::test]
async fn missing_image_reports_attach_error_then_recovers() {
    let (e, _guard) = env("noimage").await;
    let node = unique("node-m");
    let _agent = e.agent(&node, "noimage");
    let pv = unique("pv-missing");
    e.volume(&pv, "data").await;
    let uid = e.pod("app", &node, "data").await;
    let va = e.attach(&pv, &node).await;
    let api: Api<VolumeAttachment> = Api::all(e.client.clone());
    let msg = eventually(LIMIT, || async {
        let v = api.get(&va).await.map_err(|e| e.to_string())?;
        v.status
            .and_then(|s| s.attach_error)
            .and_then(|err| err.message)
            .ok_or("no attachError yet".to_string())
    })
    .await;
    assert!(msg.contains(&format!("{pv}.img")), "{msg}");
    let note = e.wait_event("default", &va, "FailedAttach").await;
    assert!(note.contains("img"), "{note}");
    e.wait_event(&e.ns, "app", "FailedAttachVolume").await;

    // The image appears (e.g. provisioning caught up): the retry attaches and mounts.
    e.image(&pv);
    e.wait_attached(&va).await;
    let target = e.layout(&node).pod_mount(&uid, &pv);
    wait_mounted(&target).await;
    let v = api.get(&va).await.unwrap();
    assert!(
        v.status.unwrap().attach_error.is_none(),
        "a success clears the error"
    );

    e.release(&["app"], &[&target], &va, &node, &pv).await;
}

#[tokio::test]
async fn two_pods_share_one_device_mount() {
    let (e, _guard) = env("shared").await;
    let node = unique("node-s");
    let _agent = e.agent(&node, "shared");
    let pv = unique("pv-shared");
    e.image(&pv);
    e.volume(&pv, "data").await;
    let u1 = e.pod("one", &node, "data").await;
    let u2 = e.pod("two", &node, "data").await;
    let va = e.attach(&pv, &node).await;
    e.wait_attached(&va).await;
    let l = e.layout(&node);
    let (t1, t2, global) = (l.pod_mount(&u1, &pv), l.pod_mount(&u2, &pv), l.global_mount(&pv));
    let m1 = wait_mounted(&t1).await;
    let m2 = wait_mounted(&t2).await;
    let g = mounts_at(&global);
    assert_eq!(g.len(), 1, "one device mount per node");
    assert_eq!(
        (m1.devno, m2.devno),
        (g[0].devno, g[0].devno),
        "both pods see the same device"
    );
    std::fs::write(t1.join("shared.txt"), b"from one").unwrap();
    assert_eq!(
        std::fs::read_to_string(t2.join("shared.txt")).unwrap(),
        "from one"
    );

    e.delete_pod("one").await;
    wait_unmounted(&t1).await;
    assert_eq!(
        mounts_at(&global).len(),
        1,
        "the device stays while pod two uses it"
    );
    assert_eq!(mounts_at(&t2).len(), 1);
    assert!(e.in_use(&node).await.contains(&unique_name(&pv)));

    e.release(&["two"], &[&t2, &global], &va, &node, &pv).await;
}

#[tokio::test]
async fn resize_grows_the_file_system_and_finishes_the_claim() {
    let (e, _guard) = env("resize").await;
    let node = unique("node-x");
    let _agent = e.agent(&node, "resize");
    let pv = unique("pv-resize");
    let image = e.image(&pv);
    e.volume(&pv, "data").await;
    let uid = e.pod("app", &node, "data").await;
    let Mounted { va, target, .. } = e.attach_and_mount(&pv, &node, &uid).await;
    let size = |p: &Path| {
        let out = std::process::Command::new("df")
            .arg("-B1")
            .arg("--output=size")
            .arg(p)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .nth(1)
            .unwrap_or("0")
            .trim()
            .parse::<u64>()
            .unwrap()
    };
    let before = size(&target);

    // What the expand controller does: grow the image, then ask for the node step.
    let st = std::process::Command::new("truncate")
        .arg("-s")
        .arg("128M")
        .arg(&image)
        .status()
        .unwrap();
    assert!(st.success());
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(e.client.clone(), &e.ns);
    let patch = serde_json::json!({ "status": {
        "phase": "Bound",
        "capacity": { "storage": "64Mi" },
        "allocatedResources": { "storage": "128Mi" },
        "allocatedResourceStatuses": { "storage": "NodeResizePending" },
    }});
    pvcs.patch_status("data", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();

    let finished = || async {
        let c = pvcs.get("data").await.map_err(|e| e.to_string())?;
        let st = c.status.unwrap_or_default();
        let cap = st.capacity.and_then(|c| c.get("storage").cloned()).map(|q| q.0);
        let pending = st
            .allocated_resource_statuses
            .and_then(|m| m.get("storage").cloned());
        if cap.as_deref() == Some("128Mi") && pending.is_none() {
            Ok(())
        } else {
            Err(format!("capacity {cap:?}, resize status {pending:?}"))
        }
    };
    let target = if can_resize_online() {
        eventually(LIMIT, finished).await;
        target
    } else {
        // Online ext4 growth needs CAP_SYS_RESOURCE, which this sandbox may lack: the agent
        // says why, and grows the file system offline on the next device mount instead.
        let note = e.wait_event(&e.ns, "data", "FileSystemResizeFailed").await;
        assert!(note.contains("CAP_SYS_RESOURCE"), "{note}");
        e.delete_pod("app").await;
        wait_unmounted(&target).await;
        wait_unmounted(&e.layout(&node).global_mount(&pv)).await;
        let uid = e.pod("app2", &node, "data").await;
        let target = e.layout(&node).pod_mount(&uid, &pv);
        eventually(LIMIT, finished).await;
        wait_mounted(&target).await;
        target
    };
    assert!(size(&target) > before + 32 * 1024 * 1024, "the file system grew");
    e.wait_event(&e.ns, "data", "FileSystemResizeSuccessful").await;
    let pods: Api<Pod> = Api::namespaced(e.client.clone(), &e.ns);
    for p in pods.list(&ListParams::default()).await.unwrap() {
        e.delete_pod(&p.name_any()).await;
    }
    wait_unmounted(&target).await;
    e.detach(&va, &node, &pv).await;
}

/// CAP_SYS_RESOURCE (bit 24) in this process's effective set: ext4 online resize needs it.
fn can_resize_online() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(str::trim)
        .unwrap_or("0");
    u64::from_str_radix(eff, 16).is_ok_and(|c| c & (1 << 24) != 0)
}

#[tokio::test]
async fn block_volume_is_published_as_a_device_and_never_formatted() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let (e, _guard) = env("block").await;
    let node = unique("node-b");
    let _agent = e.agent(&node, "block");
    let pv = unique("pv-block");
    let image = e.image(&pv);
    let pvs: Api<PersistentVolume> = Api::all(e.client.clone());
    pvs.create(
        &PostParams::default(),
        &builders::pv(&pv)
            .capacity("64Mi")
            .block()
            .claim_ref(&e.ns, "raw", "")
            .build(),
    )
    .await
    .unwrap();
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(e.client.clone(), &e.ns);
    pvcs.create(
        &PostParams::default(),
        &builders::pvc(&e.ns, "raw")
            .request("64Mi")
            .class("")
            .block()
            .volume_name(&pv)
            .build(),
    )
    .await
    .unwrap();
    let pods: Api<Pod> = Api::namespaced(e.client.clone(), &e.ns);
    let p = pods
        .create(
            &PostParams::default(),
            &builders::pod(&e.ns, "dev")
                .claim_device("raw", "raw")
                .node(&node)
                .fs_group(3456)
                .build(),
        )
        .await
        .unwrap();
    let va = e.attach(&pv, &node).await;
    let dev = e.wait_attached(&va).await;
    let file = e.layout(&node).pod_device(&p.uid().unwrap(), &pv);
    let want = std::fs::metadata(&dev).unwrap().rdev();
    let meta = eventually(LIMIT, || async {
        std::fs::symlink_metadata(&file).map_err(|e| format!("{}: {e}", file.display()))
    })
    .await;
    assert!(meta.file_type().is_block_device());
    assert_eq!(
        meta.rdev(),
        want,
        "the pod's device file is the attached loop device"
    );
    assert_eq!(meta.gid(), 3456, "fsGroup owns the device");
    let probe = std::process::Command::new("blkid")
        .arg("-p")
        .arg(&image)
        .status()
        .unwrap();
    assert_eq!(probe.code(), Some(2), "a block volume is never formatted");

    e.delete_pod("dev").await;
    eventually(LIMIT, || async {
        if file.exists() {
            Err("device file still there".to_string())
        } else {
            Ok(())
        }
    })
    .await;
    e.detach(&va, &node, &pv).await;
    assert_eq!(loops_of(&image), "");
}

#[tokio::test]
async fn fs_group_owns_the_mounted_volume() {
    use std::os::unix::fs::MetadataExt;
    let (e, _guard) = env("fsgroup").await;
    let node = unique("node-g");
    let _agent = e.agent(&node, "fsgroup");
    let pv = unique("pv-fsgroup");
    e.image(&pv);
    e.volume(&pv, "data").await;
    let pods: Api<Pod> = Api::namespaced(e.client.clone(), &e.ns);
    let p = pods
        .create(
            &PostParams::default(),
            &builders::pod(&e.ns, "app")
                .claim("data", "data")
                .node(&node)
                .fs_group(2345)
                .build(),
        )
        .await
        .unwrap();
    let Mounted { va, target, .. } = e.attach_and_mount(&pv, &node, &p.uid().unwrap()).await;
    let m = std::fs::metadata(&target).unwrap();
    assert_eq!(m.gid(), 2345);
    assert_eq!(
        m.mode() & 0o2070,
        0o2070,
        "group rwx and setgid on the volume root"
    );
    e.release(&["app"], &[&target], &va, &node, &pv).await;
}

/// Runs a shell command behind the agent's back (the faults below); it must succeed.
fn sh(cmd: &str) {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Sum of a counter family's samples whose labels all match `want`.
fn counter(agent: &Running, family: &str, want: &[(&str, &str)]) -> f64 {
    let m = agent.metrics().unwrap();
    m.samples
        .get(family)
        .map(|s| {
            s.iter()
                .filter(|(l, _)| {
                    want.iter()
                        .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
                })
                .map(|(_, v)| v)
                .sum()
        })
        .unwrap_or(0.0)
}

#[tokio::test]
async fn broken_and_vanished_mounts_are_repaired_and_torn_down() {
    let (e, _guard) = env("broken").await;
    let node = unique("node-k");
    let mut agent = e.agent(&node, "broken-1");
    let pv = unique("pv-broken");
    let image = e.image(&pv);
    e.volume(&pv, "data").await;
    let uid = e.pod("app", &node, "data").await;
    let Mounted {
        va,
        target,
        global,
        mount: first,
        ..
    } = e.attach_and_mount(&pv, &node, &uid).await;
    std::fs::write(target.join("keep.txt"), b"before the faults").unwrap();

    // A foreign file system stacked on the pod's mount: the table still lists a mount at the
    // target, but not the volume's device. Health, not existence, decides: repaired.
    sh(&format!("mount -t tmpfs stale {}", target.display()));
    let note = e.wait_event(&e.ns, "app", "VolumeMountBroken").await;
    assert!(note.contains(&pv), "{note}");
    eventually(LIMIT, || async {
        let m = mounts_at(&target);
        if m.len() == 1 && m[0].devno == first.devno && m[0].fstype == "ext4" {
            Ok(())
        } else {
            Err(format!("{m:?}"))
        }
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(target.join("keep.txt")).unwrap(),
        "before the faults"
    );
    assert!(
        counter(
            &agent,
            "stowage_agent_operations_total",
            &[("operation", "teardown"), ("status", "success")]
        ) >= 1.0
    );

    // While the agent is down, someone unmounts everything and removes the pod's mount point;
    // then the pod goes. The next agent must clean up without getting stuck on what is missing.
    agent.sigterm();
    assert_eq!(agent.wait_exit(Duration::from_secs(60)), Some(0));
    sh(&format!(
        "umount -l {t} && rmdir {t} && umount -l {g}",
        t = target.display(),
        g = global.display()
    ));
    e.delete_pod("app").await;
    let agent = e.agent(&node, "broken-2");
    let pod_dir = e.layout(&node).pods_dir().join(&uid);
    eventually(LIMIT, || async {
        if pod_dir.exists() || global.exists() {
            Err(format!(
                "left: pod dir {}, global {}",
                pod_dir.exists(),
                global.exists()
            ))
        } else {
            Ok(())
        }
    })
    .await;
    e.detach(&va, &node, &pv).await;
    assert_eq!(loops_of(&image), "", "the device could be released");
    for op in ["teardown", "unmount_device"] {
        assert_eq!(
            counter(
                &agent,
                "stowage_agent_operation_errors_total",
                &[("operation", op)]
            ),
            0.0,
            "{op} did not fail on missing targets"
        );
    }

    // No data lost: the next pod reads what the first one wrote.
    let uid2 = e.pod("again", &node, "data").await;
    let again = e.attach_and_mount(&pv, &node, &uid2).await;
    assert_eq!(
        std::fs::read_to_string(again.target.join("keep.txt")).unwrap(),
        "before the faults"
    );
    e.release(&["again"], &[&again.target], &again.va, &node, &pv)
        .await;
}

#[tokio::test]
async fn a_lost_device_is_reported_and_attached_again_without_reformat() {
    let (e, _guard) = env("lost").await;
    let node = unique("node-l");
    let agent = e.agent(&node, "lost");
    let pv = unique("pv-lost");
    let image = e.image(&pv);
    e.volume(&pv, "data").await;
    let uid = e.pod("app", &node, "data").await;
    let Mounted {
        va,
        dev,
        target,
        global,
        ..
    } = e.attach_and_mount(&pv, &node, &uid).await;
    std::fs::write(target.join("keep.txt"), b"survives the device").unwrap();
    sh("sync");

    // The device goes away under the volume (a mounted loop device cannot be freed, so its
    // mounts go first). The agent is frozen meanwhile so the whole fault lands between passes.
    let pid = agent.child.id();
    sh(&format!("kill -STOP {pid}"));
    let fault = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "umount {t} && umount {g} && losetup -d {dev}",
            t = target.display(),
            g = global.display()
        ))
        .status()
        .unwrap();
    sh(&format!("kill -CONT {pid}"));
    assert!(fault.success());
    assert_eq!(loops_of(&image), "", "the device is gone");

    // The attacher's health check notices and says so on the VA, then attaches again.
    let note = e.wait_event("default", &va, "DeviceLost").await;
    assert!(note.contains(&dev), "{note}");
    e.wait_attached(&va).await;
    let m = wait_mounted(&target).await;
    assert_eq!(m.fstype, "ext4");
    assert_eq!(
        std::fs::read_to_string(target.join("keep.txt")).unwrap(),
        "survives the device",
        "mounted again, never reformatted"
    );
    let api: Api<VolumeAttachment> = Api::all(e.client.clone());
    let st = api.get(&va).await.unwrap().status.unwrap();
    assert!(st.attached && st.attach_error.is_none());

    e.release(&["app"], &[&target, &global], &va, &node, &pv).await;
    assert_eq!(loops_of(&image), "");
}

#[tokio::test]
async fn full_file_system_mounts_and_bad_claims_get_failed_mount_events() {
    let (e, _guard) = env("full").await;
    let node = unique("node-f");
    let agent = e.agent(&node, "full");
    let pv = unique("pv-full");
    let image = e.image(&pv);
    e.volume(&pv, "data").await;

    // Pods naming a claim that does not exist, and one that is not bound yet.
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(e.client.clone(), &e.ns);
    pvcs.create(
        &PostParams::default(),
        &builders::pvc(&e.ns, "pending")
            .request("64Mi")
            .access_modes(&["ReadWriteMany"])
            .class("")
            .build(),
    )
    .await
    .unwrap();
    let pods: Api<Pod> = Api::namespaced(e.client.clone(), &e.ns);
    for (pod, claim) in [("lost", "nope"), ("waiting", "pending")] {
        pods.create(
            &PostParams::default(),
            &builders::pod(&e.ns, pod).claim("v", claim).node(&node).build(),
        )
        .await
        .unwrap();
    }
    let note = e.wait_event(&e.ns, "lost", "FailedMount").await;
    assert!(note.contains("\"nope\" not found"), "the reason in words: {note}");
    let note = e.wait_event(&e.ns, "waiting", "FailedMount").await;
    assert!(note.contains("not bound"), "the reason in words: {note}");

    // A volume filled to the last block.
    let uid = e.pod("filler", &node, "data").await;
    let Mounted {
        va, target, global, ..
    } = e.attach_and_mount(&pv, &node, &uid).await;
    std::fs::write(target.join("keep.txt"), b"written before full").unwrap();
    let fill = std::process::Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", target.join("fill").display()))
        .args(["bs=1M", "status=none"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&fill.stderr).contains("No space left"),
        "the file system is full"
    );
    e.delete_pod("filler").await;
    wait_unmounted(&target).await;
    wait_unmounted(&global).await;

    // The full file system mounts again (no format, no fsck refusal) and keeps its data.
    let uid = e.pod("reader", &node, "data").await;
    let target = e.layout(&node).pod_mount(&uid, &pv);
    wait_mounted(&target).await;
    assert_eq!(
        std::fs::read_to_string(target.join("keep.txt")).unwrap(),
        "written before full"
    );

    // The claim gets bound (as the binder would): the retry mounts it.
    let pv2 = unique("pv-late");
    e.image(&pv2);
    Api::<PersistentVolume>::all(e.client.clone())
        .create(
            &PostParams::default(),
            &builders::pv(&pv2)
                .capacity("64Mi")
                .access_modes(&["ReadWriteMany"])
                .claim_ref(&e.ns, "pending", "")
                .build(),
        )
        .await
        .unwrap();
    pvcs.patch(
        "pending",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "spec": { "volumeName": pv2 } })),
    )
    .await
    .unwrap();
    let waiting = pods.get("waiting").await.unwrap().uid().unwrap();
    let late = e.attach_and_mount(&pv2, &node, &waiting).await;

    assert_eq!(agent.get("/healthz").unwrap().0, 200, "no panic, still serving");
    assert!(
        e.events(&e.ns, "lost")
            .await
            .iter()
            .all(|(r, _)| r == "FailedMount"),
        "the pod with the missing claim only ever failed"
    );
    e.release(
        &["lost", "waiting", "reader"],
        &[&target, &late.target],
        &va,
        &node,
        &pv,
    )
    .await;
    e.detach(&late.va, &node, &pv2).await;
    assert_eq!(loops_of(&image), "");
}

/// One metric sample (a gauge) whose labels all match `want`; 0 when absent.
fn gauge(agent: &Running, family: &str, want: &[(&str, &str)]) -> f64 {
    counter(agent, family, want)
}

/// Every version of the Node's `volumesInUse` the apiserver sends from now on, gathered by a
/// watch in the background until the returned task is aborted.
async fn watch_in_use(
    client: &Client,
    node: &str,
) -> (
    std::sync::Arc<std::sync::Mutex<Vec<Vec<String>>>>,
    tokio::task::JoinHandle<()>,
) {
    use futures::StreamExt;
    use kube::api::{WatchEvent, WatchParams};
    let api: Api<Node> = Api::all(client.clone());
    let current = api.get(node).await.unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(vec![
        current.status.and_then(|s| s.volumes_in_use).unwrap_or_default(),
    ]));
    let mut rv = current.metadata.resource_version.unwrap_or_default();
    let wp = WatchParams::default()
        .fields(&format!("metadata.name={node}"))
        .timeout(60);
    let out = seen.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok(stream) = api.watch(&wp, &rv).await else {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            };
            let mut stream = std::pin::pin!(stream);
            while let Some(ev) = stream.next().await {
                match ev {
                    Ok(WatchEvent::Added(n)) | Ok(WatchEvent::Modified(n)) => {
                        rv = n.metadata.resource_version.clone().unwrap_or_default();
                        let v = n.status.and_then(|s| s.volumes_in_use).unwrap_or_default();
                        out.lock().unwrap().push(v);
                    }
                    Ok(WatchEvent::Bookmark(b)) => rv = b.metadata.resource_version,
                    _ => {}
                }
            }
        }
    });
    (seen, task)
}

#[tokio::test]
async fn unreadable_mount_table_keeps_volumes_in_use_and_mounts() {
    let (e, _guard) = env("blind").await;
    let node = unique("node-t");
    // The agent reads the table through a link we can break: while it points at
    // /proc/self/mountinfo the agent sees its own table, as in production.
    let table = e.base.join(format!("mountinfo-{node}"));
    std::os::unix::fs::symlink("/proc/self/mountinfo", &table).unwrap();
    let agent = e.agent_with(&node, "blind", &[format!("--mount-table={}", table.display())]);
    let pv = unique("pv-blind");
    let image = e.image(&pv);
    e.volume(&pv, "data").await;
    let uid = e.pod("app", &node, "data").await;
    let Mounted {
        va, target, global, ..
    } = e.attach_and_mount(&pv, &node, &uid).await;
    e.wait_in_use(&node, &pv).await;
    std::fs::write(target.join("keep.txt"), b"mounted before the blind spell").unwrap();
    let (seen, watch) = watch_in_use(&e.client, &node).await;
    let errors = |a: &Running| {
        counter(
            a,
            "stowage_agent_observe_errors_total",
            &[("source", "mount_table")],
        )
    };
    assert_eq!(errors(&agent), 0.0);

    // The table cannot be read any more (a directory where the file was).
    std::fs::remove_file(&table).unwrap();
    std::fs::create_dir(&table).unwrap();
    let note = e.wait_event("default", &node, "MountTableUnreadable").await;
    assert!(note.contains("last known state"), "{note}");
    // Meanwhile the pod goes: without the table the agent cannot know what to unmount safely,
    // so it does nothing and keeps saying the volume is in use.
    e.delete_pod("app").await;
    let pods: Api<Pod> = Api::namespaced(e.client.clone(), &e.ns);
    eventually(LIMIT, || async {
        match pods.get_opt("app").await.map_err(|e| e.to_string())? {
            None => Ok(()),
            Some(_) => Err("pod still there".to_string()),
        }
    })
    .await;
    let blind_from = errors(&agent);
    eventually(LIMIT, || async {
        let n = errors(&agent);
        if n >= blind_from + 5.0 {
            Ok(())
        } else {
            Err(format!("{n} failed reads"))
        }
    })
    .await;
    assert!(!mounts_at(&target).is_empty(), "no teardown while blind");
    assert!(!mounts_at(&global).is_empty());
    assert_eq!(
        counter(
            &agent,
            "stowage_agent_operations_total",
            &[("operation", "teardown")]
        ),
        0.0
    );
    let want = unique_name(&pv);
    assert!(
        e.in_use(&node).await.contains(&want),
        "still listed while the table is unreadable"
    );

    // Readable again: the agent catches up (the pod is gone) and only then lets go.
    std::fs::remove_dir(&table).unwrap();
    std::os::unix::fs::symlink("/proc/self/mountinfo", &table).unwrap();
    wait_unmounted(&target).await;
    wait_unmounted(&global).await;
    e.wait_not_in_use(&node, &pv).await;
    watch.abort();
    let versions = seen.lock().unwrap().clone();
    // The volume left the list only after the table could be read again and it was unmounted:
    // every version before the first one without it listed it.
    let first_gone = versions
        .iter()
        .position(|v| !v.contains(&want))
        .expect("the watch saw the volume go");
    assert!(
        first_gone > 0,
        "the list was complete when the watch began: {versions:?}"
    );
    assert!(
        versions[first_gone..].iter().all(|v| !v.contains(&want)),
        "dropped once, for good (never dropped and listed again): {versions:?}"
    );
    assert!(
        errors(&agent) >= blind_from + 5.0,
        "the failed reads were counted"
    );
    e.detach(&va, &node, &pv).await;
    assert_eq!(loops_of(&image), "");
    // The data is still there.
    let uid2 = e.pod("again", &node, "data").await;
    let again = e.attach_and_mount(&pv, &node, &uid2).await;
    assert_eq!(
        std::fs::read_to_string(again.target.join("keep.txt")).unwrap(),
        "mounted before the blind spell"
    );
    e.release(&["again"], &[&again.target, &again.global], &again.va, &node, &pv)
        .await;
}

/// A FUSE mount whose daemon never answers: every `stat` of it blocks in the kernel until the
/// daemon's end of /dev/fuse is closed (the process killed), then fails with ENOTCONN. No FUSE
/// library is involved: a shell opens /dev/fuse, mounts with that descriptor and sleeps.
struct HungFuse(std::process::Child);

impl HungFuse {
    fn mount(at: &Path) -> Self {
        let child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "exec 3<>/dev/fuse && mount -t fuse -o fd=3,rootmode=40000,user_id=0,group_id=0 hang {} && exec sleep 100000",
                at.display()
            ))
            .spawn()
            .unwrap();
        Self(child)
    }

    /// The daemon dies: the mount stays, every access fails with ENOTCONN.
    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for HungFuse {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Threads of `pid` with this name (`/proc/<pid>/task/*/comm`).
fn threads_named(pid: u32, name: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|rd| {
            rd.flatten()
                .filter(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == name))
                .count()
        })
        .unwrap_or(0)
}

#[tokio::test]
async fn a_hung_mount_is_left_in_place_and_repaired_only_once_it_errors() {
    let (e, _guard) = env("hung").await;
    let node = unique("node-h");
    let agent = e.agent(&node, "hung");
    let pv = unique("pv-hung");
    e.image(&pv);
    e.volume(&pv, "data").await;
    let uid = e.pod("app", &node, "data").await;
    let Mounted {
        va,
        target,
        global,
        mount: first,
        ..
    } = e.attach_and_mount(&pv, &node, &uid).await;
    std::fs::write(target.join("keep.txt"), b"outlives the hang").unwrap();
    let passes = |a: &Running| counter(a, "stowage_agent_reconcile_passes_total", &[("loop", "volumes")]);

    // The pod's mount stops answering (stat blocks).
    let mut fuse = HungFuse::mount(&target);
    eventually(LIMIT, || async {
        let m = mounts_at(&target);
        match m.last() {
            Some(top) if top.fstype == "fuse" => Ok(()),
            _ => Err(format!("{m:?}")),
        }
    })
    .await;
    let note = e.wait_event(&e.ns, "app", "VolumeMountUnresponsive").await;
    assert!(note.contains(&pv), "{note}");
    // Many passes later: still one probe thread for the one hung mount, nothing torn down.
    let from = passes(&agent);
    eventually(LIMIT, || async {
        let n = passes(&agent);
        if n >= from + 10.0 {
            Ok(())
        } else {
            Err(format!("{n} passes"))
        }
    })
    .await;
    let pid = agent.child.id();
    assert_eq!(
        threads_named(pid, "mount-probe"),
        1,
        "no pile-up of blocked threads"
    );
    assert_eq!(gauge(&agent, "stowage_agent_mount_probes_in_flight", &[]), 1.0);
    assert_eq!(
        gauge(&agent, "stowage_agent_mount_health", &[("health", "pending")]),
        1.0
    );
    assert_eq!(
        counter(
            &agent,
            "stowage_agent_operations_total",
            &[("operation", "teardown")]
        ),
        0.0,
        "a slow mount of a running pod is never torn down"
    );
    let m = mounts_at(&target);
    assert_eq!(m.len(), 2, "the pod's mount and the hung one over it: {m:?}");
    assert_eq!(m[0].id, first.id, "the pod's own mount was never touched");
    assert!(
        e.events(&e.ns, "app")
            .await
            .iter()
            .all(|(r, _)| r != "VolumeMountBroken"),
        "not judged broken for being slow"
    );
    assert_eq!(agent.get("/healthz").unwrap().0, 200, "the agent is not stalled");

    // The daemon dies: stat now fails with ENOTCONN, a corrupted mount; repaired.
    fuse.kill();
    let note = e.wait_event(&e.ns, "app", "VolumeMountBroken").await;
    assert!(note.contains("not connected"), "{note}");
    eventually(LIMIT, || async {
        let m = mounts_at(&target);
        if m.len() == 1 && m[0].devno == first.devno && m[0].fstype == "ext4" {
            Ok(())
        } else {
            Err(format!("{m:?}"))
        }
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(target.join("keep.txt")).unwrap(),
        "outlives the hang"
    );
    // The stuck thread returned and ended.
    eventually(LIMIT, || async {
        let out = gauge(&agent, "stowage_agent_mount_probes_in_flight", &[]);
        let threads = threads_named(pid, "mount-probe");
        if out == 0.0 && threads == 0 {
            Ok(())
        } else {
            Err(format!("{out} probes out, {threads} probe threads"))
        }
    })
    .await;
    e.release(&["app"], &[&target, &global], &va, &node, &pv).await;
}

#[tokio::test]
async fn read_only_many_volume_is_mounted_read_only_and_never_formatted() {
    let (e, _guard) = env("rox").await;
    let node = unique("node-o");
    let _agent = e.agent(&node, "rox");

    // A ReadOnlyMany volume with data on it; the pod does not ask for read-only.
    let pv = unique("pv-rox");
    let image = e.image(&pv);
    let seed = e.base.join("seed");
    std::fs::create_dir_all(&seed).unwrap();
    std::fs::write(seed.join("shared.txt"), b"read by many").unwrap();
    sh(&format!(
        "mkfs.ext4 -q -F -d {} {}",
        seed.display(),
        image.display()
    ));
    e.volume_with(&pv, "data", &["ReadOnlyMany"]).await;
    let uid = e.pod("reader", &node, "data").await;
    let m = e.attach_and_mount(&pv, &node, &uid).await;
    // The attacher made the loop device itself read-only: no node's kernel can write the image.
    let loop_name = m.dev.trim_start_matches("/dev/");
    assert_eq!(
        std::fs::read_to_string(format!("/sys/block/{loop_name}/ro"))
            .unwrap()
            .trim(),
        "1",
        "loop device {} of a ReadOnlyMany volume is read-only",
        m.dev
    );
    assert!(m.mount.read_only(), "pod mount: {:?}", m.mount);
    let dev_mounts = mounts_at(&m.global);
    assert!(
        !dev_mounts.is_empty() && dev_mounts.iter().all(MountEntry::read_only),
        "device mount: {dev_mounts:?}"
    );
    assert_eq!(
        std::fs::read_to_string(m.target.join("shared.txt")).unwrap(),
        "read by many"
    );
    let write = std::fs::write(m.target.join("new.txt"), b"x");
    assert_eq!(
        write.unwrap_err().raw_os_error(),
        Some(30),
        "EROFS: nothing can be written"
    );

    // A blank ReadOnlyMany volume is never formatted: the mount fails and says why.
    let blank = unique("pv-rox-blank");
    let blank_image = e.image(&blank);
    e.volume_with(&blank, "empty", &["ReadOnlyMany"]).await;
    let uid2 = e.pod("empty-reader", &node, "empty").await;
    let va2 = e.attach(&blank, &node).await;
    e.wait_attached(&va2).await;
    let note = eventually(LIMIT, || async {
        e.events(&e.ns, "empty-reader")
            .await
            .into_iter()
            .find(|(r, n)| r == "FailedMount" && n.contains("MountDevice"))
            .map(|(_, n)| n)
            .ok_or("no FailedMount from MountDevice yet".to_string())
    })
    .await;
    assert!(note.contains("never formatted"), "{note}");
    let probe = std::process::Command::new("blkid")
        .arg("-p")
        .arg(&blank_image)
        .status()
        .unwrap();
    assert_eq!(probe.code(), Some(2), "still blank: no mkfs ran");
    assert!(mounts_at(&e.layout(&node).pod_mount(&uid2, &blank)).is_empty());

    e.delete_pod("empty-reader").await;
    e.detach(&va2, &node, &blank).await;
    e.release(&["reader"], &[&m.target, &m.global], &m.va, &node, &pv)
        .await;
    assert_eq!(loops_of(&image), "");
}
