//! Workload `agent`: one stowage-agent with N loop volumes. There is no upstream counterpart on
//! this bench (the kubelet is not built), so the row has absolute numbers only.
//!
//! Before the window: N sparse images, N pre-bound PV/PVC pairs of `loop.stowage.dev`, the agent
//! running with `--register-node`, and a warm-up pod whose volume got mounted. In the window, for
//! each volume (64 in flight): the pod is created with `nodeName` set, then its VolumeAttachment
//! (what the attach/detach controller does once the pod is scheduled). Latency: pod create sent →
//! the pod's bind mount seen in the mount table (polled every 20 ms), so it includes attach,
//! `volumesInUse`, mkfs of a blank 16 MiB ext4, the device mount and the bind mount.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::storage::v1::{VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec};
use kube::api::{Api, ObjectMeta, PostParams};
use stowage_testkit::host::{Cleanup, mounts_under};
use stowage_testkit::process::{free_port, spawn_tied, stop};

use crate::apiserver::Requests;
use crate::controller::stowage_agent_defaults;
use crate::fixtures::{label, pairs, pod};
use crate::procstat;
use crate::report::RunResult;
use crate::tracker::Tracker;
use crate::window::{Watched, WindowStart, wait_for};
use crate::workload::Env;

const DRIVER: &str = "loop.stowage.dev";
const WARM: &str = "warm";

pub fn name(n: usize) -> String {
    format!("agent-{n}")
}

pub fn describe(n: usize) -> String {
    format!(
        "One stowage-agent (`--register-node`, its default client limits) and {n} volumes of the loop \
         driver (sparse 16 MiB images, pre-bound PV/PVC pairs). After a warm-up pod got its volume, \
         {n} pods are created with `nodeName` set, each followed by its VolumeAttachment as the \
         attach/detach controller would create it (64 in flight). Latency: pod create sent → its bind \
         mount in the mount table (attach, volumesInUse, mkfs, device mount, bind mount). No upstream \
         counterpart is run (the kubelet is not built): absolute numbers only."
    )
}

/// The agent process; stopped (SIGTERM, grace, SIGKILL) on drop.
struct Agent {
    child: Child,
    pid: u32,
    log: PathBuf,
}

impl Drop for Agent {
    fn drop(&mut self) {
        tokio::task::block_in_place(|| stop(&mut self.child, Duration::from_secs(40)));
    }
}

impl Watched for Agent {
    fn failure(&mut self) -> Option<String> {
        let Ok(Some(st)) = self.child.try_wait() else {
            return None;
        };
        Some(format!("agent exited ({st}); see {}", self.log.display()))
    }

    fn usage(&self) -> String {
        format!(
            "agent CPU {:.1} s, RSS {:.0} MiB",
            procstat::cpu_seconds(self.pid).unwrap_or(0.0),
            procstat::peak_rss_bytes(self.pid).unwrap_or(0) as f64 / 1048576.0
        )
    }
}

pub async fn run(env: &Env, n: usize, bin: &Path) -> anyhow::Result<RunResult> {
    let run = format!("b{:06x}", rand::random::<u32>() & 0xff_ffff);
    let base = std::env::temp_dir().join(format!("stowage-bench-agent-{run}"));
    let images = base.join("images");
    std::fs::create_dir_all(&images).with_context(|| format!("create {}", images.display()))?;
    // The mount table shows canonical paths.
    let base = std::fs::canonicalize(&base)?;
    let images = std::fs::canonicalize(&images)?;
    // The install step: the agent attaches nothing from a store without its marker.
    let marked = std::process::Command::new(&env.setup.stowage_bin)
        .arg("init-image-store")
        .arg(&images)
        .output()
        .context("stowage-controller init-image-store")?;
    anyhow::ensure!(
        marked.status.success(),
        "stowage-controller init-image-store: {}",
        String::from_utf8_lossy(&marked.stderr)
    );
    // Declared before the agent, so it drops after the agent stopped: unmounts and frees whatever
    // the teardown below left, also when the run fails half-way.
    let _guard = Cleanup {
        base: base.clone(),
        images: images.clone(),
    };
    let result = measure(env, n, bin, &run, &base, &images).await;
    eprintln!("  {}: cleaning up", name(n));
    env.objects
        .cleanup(&run, &run, &format!("{run}-pv-"))
        .await
        .context("cleanup")?;
    // The agent registered its Node itself (no run label): remove it too.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(env.objects.client.clone());
    let _ = nodes.delete(&format!("{run}-node"), &Default::default()).await;
    result
}

async fn measure(
    env: &Env,
    n: usize,
    bin: &Path,
    run: &str,
    base: &Path,
    images: &Path,
) -> anyhow::Result<RunResult> {
    let o = &env.objects;
    let client = o.client.clone();
    let ns = run;
    let node = format!("{run}-node");
    let root = base.join("root");
    let tag = format!("{}-{run}", name(n));
    let pv_name = |i: usize| format!("{run}-pv-{i:05}");
    let warm_pv = format!("{run}-pv-warm");

    eprintln!("  {tag}: creating {n} images and volumes");
    for pv in (0..n).map(pv_name).chain([warm_pv.clone()]) {
        let f = std::fs::File::create(images.join(format!("{pv}.img")))?;
        // Sparse: only what mkfs and the test write takes space.
        f.set_len(16 << 20)?;
    }
    o.namespace(ns, run).await?;
    let pairs = pairs(n, pv_name, |i| format!("claim-{i:05}"), &warm_pv, WARM);
    o.bound_pairs(ns, run, pairs, "", DRIVER, "16Mi").await?;

    let log = env.setup.log_dir.join(format!("{tag}.log"));
    let out = std::fs::File::create(&log).with_context(|| format!("create {}", log.display()))?;
    let mut cmd = Command::new(bin);
    cmd.arg(format!("--kubeconfig={}", env.setup.kubeconfig.display()))
        .arg(format!("--node-name={node}"))
        .arg(format!("--root-dir={}", root.display()))
        .arg(format!("--image-dir={}", images.display()))
        .arg("--register-node")
        .arg(format!("--metrics-bind-address=127.0.0.1:{}", free_port()))
        // The operator's default log level, whatever the bench itself runs with.
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out);
    let child = spawn_tied(cmd).with_context(|| format!("start {}", bin.display()))?;
    let mut agent = Agent {
        pid: child.id(),
        child,
        log,
    };

    let tracker = Tracker::new((0..n).map(pv_name), [warm_pv.clone()]);
    let poller = tokio::spawn(poll_mounts(root.clone(), tracker.clone()));
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    let pp = PostParams::default();
    let va = |i: &str, pv: &str| {
        label(
            VolumeAttachment {
                metadata: ObjectMeta {
                    name: Some(format!("{run}-va-{i}")),
                    ..Default::default()
                },
                spec: VolumeAttachmentSpec {
                    attacher: DRIVER.into(),
                    node_name: node.clone(),
                    source: VolumeAttachmentSource {
                        persistent_volume_name: Some(pv.into()),
                        ..Default::default()
                    },
                },
                status: None,
            },
            run,
        )
    };
    pods.create(&pp, &pod(ns, "pod-warm", WARM, &node, run)).await?;
    vas.create(&pp, &va(WARM, &warm_pv)).await?;
    let started = Instant::now();
    let warm_done = || (usize::from(tracker.is_done(&warm_pv)), 1);
    if let Some(why) = wait_for(env, &tag, "warm-up", warm_done, &mut agent, started).await {
        poller.abort();
        bail!("{why}");
    }

    let writes0 = Requests::scrape(&client).await?;
    let cpu0 = procstat::cpu_seconds(agent.pid).unwrap_or(0.0);
    o.own_writes.store(0, Ordering::Relaxed);
    let window = WindowStart {
        start: Instant::now(),
        cpu0,
        writes0,
    };
    let start = window.start;
    let fire = futures::StreamExt::buffer_unordered(
        futures::stream::iter((0..n).map(|i| {
            let (pods, vas, tracker, pp) = (&pods, &vas, &tracker, &pp);
            let pv = pv_name(i);
            let key = format!("{i:05}");
            let p = pod(ns, &format!("pod-{key}"), &format!("claim-{key}"), &node, run);
            let a = va(&key, &pv);
            async move {
                tracker.start(&pv);
                o.count_own_write();
                pods.create(pp, &p)
                    .await
                    .with_context(|| format!("create pod {key}"))?;
                o.count_own_write();
                vas.create(pp, &a)
                    .await
                    .with_context(|| format!("create attachment {key}"))?;
                anyhow::Ok(())
            }
        })),
        o.concurrency,
    );
    let fire = async {
        futures::pin_mut!(fire);
        while let Some(r) = futures::StreamExt::next(&mut fire).await {
            r?;
        }
        anyhow::Ok(())
    };
    let waited = wait_for(env, &tag, "done", || tracker.progress(), &mut agent, start);
    let (fired, failure) = tokio::join!(fire, waited);
    fired?;
    let end = window.close(&client, agent.pid).await?;
    poller.abort();

    // Teardown through the agent (pods gone → unmounted), bounded; the guard handles the rest.
    eprintln!("  {tag}: deleting pods, waiting for the agent to unmount");
    let dp = kube::api::DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    let _ = pods
        .delete_collection(&dp, &kube::api::ListParams::default())
        .await;
    let t0 = Instant::now();
    let root_c = root.clone();
    let unmounted = || (usize::from(mounts_under(&root_c).is_empty()), 1);
    if let Some(why) = wait_for(env, &tag, "teardown", unmounted, &mut agent, t0).await {
        eprintln!("  {tag}: {why}; the cleanup guard unmounts the rest");
    } else {
        eprintln!(
            "  {tag}: every volume unmounted {:.1} s after the pods were deleted",
            t0.elapsed().as_secs_f64()
        );
    }
    let log = agent.log.display().to_string();
    drop(agent);

    let base = RunResult {
        controller_log: log,
        ..RunResult::unmeasured(name(n), "defaults", "stowage-agent", stowage_agent_defaults(), n)
    };
    Ok(end.result(base, o, &tracker, failure))
}

/// Reports every volume whose pod bind mount (`<root>/pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount`)
/// is in the mount table. Polling, since the mount table has no watch.
async fn poll_mounts(root: PathBuf, tracker: Arc<Tracker>) {
    let pods = root.join("pods");
    let mut seen: HashMap<String, ()> = HashMap::new();
    loop {
        let table = tokio::fs::read_to_string("/proc/self/mountinfo")
            .await
            .unwrap_or_default();
        for mp in table.lines().filter_map(|l| l.split(' ').nth(4)) {
            let Some(rest) = Path::new(mp).strip_prefix(&pods).ok() else {
                continue;
            };
            // <uid>/volumes/kubernetes.io~csi/<pv>/mount
            let parts: Vec<_> = rest.iter().filter_map(|c| c.to_str()).collect();
            if let [_, "volumes", _, pv, "mount"] = parts.as_slice()
                && seen.insert(pv.to_string(), ()).is_none()
            {
                tracker.observe(pv);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
