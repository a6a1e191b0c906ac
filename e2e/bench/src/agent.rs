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

use crate::apiserver::Writes;
use crate::objects::{Pair, label, pod};
use crate::procstat;
use crate::report::RunResult;
use crate::tracker::{Tracker, percentile_ms};
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

/// The agent's client limits: the shared flags' defaults, as it runs without flags.
fn agent_defaults() -> (f32, u32) {
    use clap::Parser;
    #[derive(Parser)]
    struct Defaults {
        #[command(flatten)]
        api: stowage_common::client::ApiArgs,
    }
    let d = Defaults::parse_from(["stowage-agent"]);
    (d.api.kube_api_qps, d.api.kube_api_burst)
}

pub async fn run(env: &Env, n: usize, bin: &Path) -> anyhow::Result<RunResult> {
    let run = format!("b{:06x}", rand::random::<u32>() & 0xff_ffff);
    let base = std::env::temp_dir().join(format!("stowage-bench-agent-{run}"));
    let images = base.join("images");
    std::fs::create_dir_all(&images).with_context(|| format!("create {}", images.display()))?;
    // The mount table shows canonical paths.
    let base = std::fs::canonicalize(&base)?;
    let images = std::fs::canonicalize(&images)?;
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
    let mut pairs: Vec<Pair> = (0..n)
        .map(|i| Pair {
            pv: pv_name(i),
            claim: format!("claim-{i:05}"),
        })
        .collect();
    pairs.push(Pair {
        pv: warm_pv.clone(),
        claim: WARM.into(),
    });
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
    if let Some(why) = wait(env, &tag, "warm-up", warm_done, &mut agent, started).await {
        poller.abort();
        bail!("{why}");
    }

    let writes0 = Writes::scrape(&client).await?;
    let cpu0 = procstat::cpu_seconds(agent.pid).unwrap_or(0.0);
    o.own_writes.store(0, Ordering::Relaxed);
    let start = Instant::now();
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
    let waited = wait(env, &tag, "done", || tracker.progress(), &mut agent, start);
    let (fired, failure) = tokio::join!(fire, waited);
    fired?;
    let end_cpu = procstat::cpu_seconds(agent.pid).unwrap_or(0.0);
    let rss = procstat::peak_rss_bytes(agent.pid).unwrap_or(0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let delta = Writes::scrape(&client).await?.since(&writes0);
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
    if let Some(why) = wait(env, &tag, "teardown", unmounted, &mut agent, t0).await {
        eprintln!("  {tag}: {why}; the cleanup guard unmounts the rest");
    } else {
        eprintln!(
            "  {tag}: every volume unmounted {:.1} s after the pods were deleted",
            t0.elapsed().as_secs_f64()
        );
    }
    let log = agent.log.display().to_string();
    drop(agent);

    let (lat, last) = tracker.latencies();
    let (done, total) = tracker.progress();
    let wall = last.map_or(0.0, |l| l.saturating_duration_since(start).as_secs_f64());
    let writes = (delta.controller_writes() - o.own_writes.load(Ordering::Relaxed) as f64).max(0.0);
    let (qps, burst) = agent_defaults();
    Ok(RunResult {
        workload: name(n),
        mode: "defaults".into(),
        implementation: "stowage-agent".into(),
        qps,
        burst,
        objects: n,
        done,
        converged: failure.is_none() && done == total,
        note: failure,
        wall_s: wall,
        throughput_per_s: if wall > 0.0 { done as f64 / wall } else { 0.0 },
        p50_ms: percentile_ms(&lat, 50.0),
        p99_ms: percentile_ms(&lat, 99.0),
        max_ms: percentile_ms(&lat, 100.0),
        cpu_s: end_cpu - cpu0,
        cpu_total_s: end_cpu,
        peak_rss_mib: rss as f64 / 1024.0 / 1024.0,
        writes,
        writes_per_object: if done > 0 { writes / done as f64 } else { 0.0 },
        conflicts: delta.conflicts(),
        writes_by_resource: delta.0,
        controller_log: log,
    })
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

/// Polls `progress` until done == total, with a progress line every 2 s; returns why it gave up
/// (stall, overall timeout, agent exited), if it did.
async fn wait(
    env: &Env,
    tag: &str,
    phase: &str,
    progress: impl Fn() -> (usize, usize),
    agent: &mut Agent,
    since: Instant,
) -> Option<String> {
    let mut last_done = usize::MAX;
    let mut last_change = Instant::now();
    let mut last_print = Instant::now();
    loop {
        let (done, total) = progress();
        if done >= total {
            return None;
        }
        let now = Instant::now();
        if done != last_done {
            last_done = done;
            last_change = now;
        }
        if now.duration_since(last_change) > env.stall {
            return Some(format!("{phase}: stalled at {done}/{total} for {:?}", env.stall));
        }
        if now.duration_since(since) > env.timeout {
            return Some(format!(
                "{phase}: {done}/{total} after the {:?} timeout",
                env.timeout
            ));
        }
        if let Ok(Some(st)) = agent.child.try_wait() {
            return Some(format!(
                "{phase}: agent exited ({st}); see {}",
                agent.log.display()
            ));
        }
        if now.duration_since(last_print) >= Duration::from_secs(2) {
            last_print = now;
            eprintln!(
                "  {tag}: {phase} {done}/{total} after {:.1} s (agent CPU {:.1} s, RSS {:.0} MiB)",
                now.duration_since(since).as_secs_f64(),
                procstat::cpu_seconds(agent.pid).unwrap_or(0.0),
                procstat::peak_rss_bytes(agent.pid).unwrap_or(0) as f64 / 1048576.0
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
