//! Volumes through their life: attach, mount, share, resize, block mode, fsGroup, read-only, and
//! agents that restart or move data between them.

use crate::env::*;

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
            ["mount_device", "setup"].contains(&l["operation"].as_str()) && l["result"] == "success"
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

/// The controller lists an attachment in `status.volumesAttached` once it is attached and takes
/// it out before it deletes the attachment: an attached VolumeAttachment the node status does not
/// list may be on its way out, so nothing is mounted from it (a kubelet's
/// verifyControllerAttachedVolume). Found by the soak: a pod that arrived while its volume's
/// detach was being decided was mounted from the attachment being deleted.
#[tokio::test]
async fn nothing_is_mounted_that_the_node_status_does_not_list_as_attached() {
    let (e, _guard) = env("unlisted").await;
    let node = unique("node-u");
    let agent = e.agent(&node, "unlisted");
    let pv = unique("pv-unlisted");
    e.image(&pv);
    e.volume(&pv, "data").await;
    let uid = e.pod("app", &node, "data").await;
    let va = e.attach(&pv, &node).await;
    let (_, _, dev) = e.wait_va_attached(&va).await;
    e.wait_in_use(&node, &pv).await;
    let target = e.layout(&node).pod_mount(&uid, &pv);

    // Several passes that saw the attachment attached and the volume in use: still nothing.
    let passes = |a: &Running| counter(a, "stowage_agent_reconcile_passes_total", &[("loop", "volumes")]);
    let from = passes(&agent);
    eventually(LIMIT, || async {
        let n = passes(&agent);
        (n >= from + 3.0).then_some(()).ok_or(format!("{n} passes"))
    })
    .await;
    assert!(mounts_at(&target).is_empty(), "mounted without volumesAttached");
    assert!(
        mounts_at(&e.layout(&node).global_mount(&pv)).is_empty(),
        "device mounted without volumesAttached"
    );

    // Listed: mounted.
    e.list_attached(&node, &pv, Some(&dev)).await;
    wait_mounted(&target).await;
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
