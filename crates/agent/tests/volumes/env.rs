//! The test environment: a shared control plane, a node per test, agents run as real
//! processes, and the helpers the tests share.

pub(crate) use std::collections::BTreeSet;
pub(crate) use std::path::{Path, PathBuf};
pub(crate) use std::time::Duration;

pub(crate) use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
pub(crate) use k8s_openapi::api::events::v1::Event;
pub(crate) use k8s_openapi::api::storage::v1::{
    VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec,
};
pub(crate) use kube::api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
pub(crate) use kube::{Api, Client, ResourceExt};
pub(crate) use stowage_agent::mountinfo::{self, MountEntry};
pub(crate) use stowage_agent::paths::{DRIVER, Layout, unique_name, va_name};
pub(crate) use stowage_testkit::binary::Running;
pub(crate) use stowage_testkit::{builders, eventually, shared, unique};

pub(crate) use stowage_testkit::host::Cleanup;

pub(crate) const LIMIT: Duration = Duration::from_secs(90);

pub(crate) struct Env {
    pub(crate) client: Client,
    pub(crate) ns: String,
    pub(crate) base: PathBuf,
    pub(crate) images: PathBuf,
    pub(crate) logs: PathBuf,
}

pub(crate) async fn env(prefix: &str) -> (Env, Cleanup) {
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
    // The install step (`stowage-controller init-image-store`): attaches need the marker.
    stowage_loopdriver::ImageStore::new(&images).init().unwrap();
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
    pub(crate) fn root(&self, node: &str) -> PathBuf {
        self.base.join(format!("root-{node}"))
    }

    pub(crate) fn layout(&self, node: &str) -> Layout {
        Layout::new(self.root(node))
    }

    pub(crate) fn agent(&self, node: &str, label: &str) -> Running {
        self.agent_with(node, label, &[])
    }

    /// An agent with extra flags.
    pub(crate) fn agent_with(&self, node: &str, label: &str, extra: &[String]) -> Running {
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

    pub(crate) fn image(&self, handle: &str) -> PathBuf {
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
    pub(crate) async fn volume(&self, pv: &str, claim: &str) {
        self.volume_with(pv, claim, &["ReadWriteMany"]).await
    }

    /// `volume` with the given access modes (on the PV and the claim).
    pub(crate) async fn volume_with(&self, pv: &str, claim: &str, modes: &[&str]) {
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

    pub(crate) async fn pod(&self, name: &str, node: &str, claim: &str) -> String {
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

    pub(crate) async fn delete_pod(&self, name: &str) {
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
    pub(crate) async fn attach(&self, pv: &str, node: &str) -> String {
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

    /// Waits until the attachment is attached, then lists it in the node's
    /// `status.volumesAttached` as the controller does (the agent mounts nothing before).
    pub(crate) async fn wait_attached(&self, va: &str) -> String {
        let (node, pv, dev) = self.wait_va_attached(va).await;
        self.list_attached(&node, &pv, Some(&dev)).await;
        dev
    }

    /// Waits until the attachment is attached; returns its (node, PV, device path).
    pub(crate) async fn wait_va_attached(&self, va: &str) -> (String, String, String) {
        let api: Api<VolumeAttachment> = Api::all(self.client.clone());
        eventually(LIMIT, || async {
            let v = api.get(va).await.map_err(|e| e.to_string())?;
            let st = v.status.ok_or("no status yet")?;
            if !st.attached {
                return Err(format!("not attached: {:?}", st.attach_error));
            }
            let dev = st
                .attachment_metadata
                .and_then(|m| m.get("devicePath").cloned())
                .ok_or("no devicePath".to_string())?;
            let pv = v.spec.source.persistent_volume_name.unwrap_or_default();
            Ok((v.spec.node_name, pv, dev))
        })
        .await
    }

    /// Sets (`Some(device)`) or removes (`None`) the volume's entry in the node's
    /// `status.volumesAttached` (an atomic list: read, change, write with its resourceVersion).
    pub(crate) async fn list_attached(&self, node: &str, pv: &str, device: Option<&str>) {
        let name = unique_name(pv);
        let nodes: Api<Node> = Api::all(self.client.clone());
        eventually(LIMIT, || async {
            let n = nodes.get_status(node).await.map_err(|e| e.to_string())?;
            let mut list: Vec<serde_json::Value> = n
                .status
                .and_then(|s| s.volumes_attached)
                .unwrap_or_default()
                .into_iter()
                .filter(|v| v.name != name)
                .map(|v| serde_json::json!({"name": v.name, "devicePath": v.device_path}))
                .collect();
            if let Some(dev) = device {
                list.push(serde_json::json!({"name": name, "devicePath": dev}));
            }
            let patch = serde_json::json!({
                "metadata": {"resourceVersion": n.metadata.resource_version},
                "status": {"volumesAttached": list},
            });
            nodes
                .patch_status(node, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
        .await
    }

    /// Deletes the attachment the way the controller does: once the node no longer lists the
    /// volume as in use, and after taking it out of `volumesAttached`; then waits until the
    /// agent released it.
    pub(crate) async fn detach(&self, va: &str, node: &str, pv: &str) {
        self.wait_not_in_use(node, pv).await;
        self.list_attached(node, pv, None).await;
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
    pub(crate) async fn attach_and_mount(&self, pv: &str, node: &str, uid: &str) -> Mounted {
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
    pub(crate) async fn release(&self, pods: &[&str], mounts: &[&Path], va: &str, node: &str, pv: &str) {
        for p in pods {
            self.delete_pod(p).await;
        }
        for m in mounts {
            wait_unmounted(m).await;
        }
        self.detach(va, node, pv).await;
    }

    pub(crate) async fn in_use(&self, node: &str) -> Vec<String> {
        let n = Api::<Node>::all(self.client.clone()).get(node).await.unwrap();
        n.status.and_then(|s| s.volumes_in_use).unwrap_or_default()
    }

    pub(crate) async fn wait_in_use(&self, node: &str, pv: &str) {
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

    pub(crate) async fn wait_not_in_use(&self, node: &str, pv: &str) {
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

    pub(crate) async fn events(&self, ns: &str, name: &str) -> Vec<(String, String)> {
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

    pub(crate) async fn wait_event(&self, ns: &str, name: &str, reason: &str) -> String {
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
pub(crate) struct Mounted {
    pub(crate) va: String,
    pub(crate) dev: String,
    pub(crate) target: PathBuf,
    pub(crate) global: PathBuf,
    pub(crate) mount: MountEntry,
}

pub(crate) fn mounts_at(path: &Path) -> Vec<MountEntry> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    mountinfo::parse(&table)
        .into_iter()
        .filter(|m| m.mount_point == path)
        .collect()
}

pub(crate) async fn wait_mounted(path: &Path) -> MountEntry {
    eventually(LIMIT, || async {
        mounts_at(path)
            .pop()
            .ok_or(format!("{} is not mounted", path.display()))
    })
    .await
}

pub(crate) async fn wait_unmounted(path: &Path) {
    eventually(LIMIT, || async {
        if mounts_at(path).is_empty() {
            Ok(())
        } else {
            Err(format!("{} is still mounted", path.display()))
        }
    })
    .await
}

pub(crate) fn loops_of(image: &Path) -> String {
    let out = std::process::Command::new("losetup")
        .arg("-j")
        .arg(image)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// CAP_SYS_RESOURCE (bit 24) in this process's effective set: ext4 online resize needs it.
pub(crate) fn can_resize_online() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(str::trim)
        .unwrap_or("0");
    u64::from_str_radix(eff, 16).is_ok_and(|c| c & (1 << 24) != 0)
}

/// Runs a shell command behind the agent's back (the faults below); it must succeed.
pub(crate) fn sh(cmd: &str) {
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
pub(crate) fn counter(agent: &Running, family: &str, want: &[(&str, &str)]) -> f64 {
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

/// One metric sample (a gauge) whose labels all match `want`; 0 when absent.
pub(crate) fn gauge(agent: &Running, family: &str, want: &[(&str, &str)]) -> f64 {
    counter(agent, family, want)
}

/// Every version of the Node's `volumesInUse` the apiserver sends from now on, gathered by a
/// watch in the background until the returned task is aborted.
pub(crate) async fn watch_in_use(
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

/// A FUSE mount whose daemon never answers: every `stat` of it blocks in the kernel until the
/// daemon's end of /dev/fuse is closed (the process killed), then fails with ENOTCONN. No FUSE
/// library is involved: a shell opens /dev/fuse, mounts with that descriptor and sleeps.
pub(crate) struct HungFuse(std::process::Child);

impl HungFuse {
    pub(crate) fn mount(at: &Path) -> Self {
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
    pub(crate) fn kill(&mut self) {
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
pub(crate) fn threads_named(pid: u32, name: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|rd| {
            rd.flatten()
                .filter(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == name))
                .count()
        })
        .unwrap_or(0)
}
