//! Faults behind the agent's back: broken and vanished mounts, lost devices, full file systems
//! and claims that cannot be mounted.

use crate::env::*;

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
            &[("operation", "teardown"), ("result", "success")]
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

/// An attach task and a mount task that panic (a debug-build test hook makes each panic once)
/// still report a failure, so both are retried with backoff and the volume ends up attached and
/// mounted; without that report their keys stayed "running" and the volume was never
/// reconciled again.
#[tokio::test]
async fn a_panicked_attach_and_a_panicked_mount_are_retried() {
    let (e, _guard) = env("panic").await;
    let node = unique("node-p");
    let pv = unique("pv-panic");
    let agent = e.agent_with(
        &node,
        "panic",
        &[
            format!("--debug-panic-once=attach:{pv}"),
            format!("--debug-panic-once=mount:{pv}"),
        ],
    );
    let image = e.image(&pv);
    e.volume(&pv, "data").await;
    let uid = e.pod("app", &node, "data").await;
    let m = e.attach_and_mount(&pv, &node, &uid).await;
    let log = agent.log_text();
    for op in ["attach", "mount"] {
        assert!(
            log.contains(&format!("test hook: the {op} of {pv} panics")),
            "the {op} hook fired:\n{log}"
        );
    }
    std::fs::write(m.target.join("ok.txt"), b"written after the retries").unwrap();
    e.release(&["app"], &[&m.target], &m.va, &node, &pv).await;
    assert_eq!(loops_of(&image), "", "the device was released");
}

/// A process holding a mount in a mount namespace of its own; killed (its namespace and mount go
/// with it) on drop.
struct OtherNamespace(std::process::Child);

impl Drop for OtherNamespace {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn a_device_mounted_in_another_mount_namespace_is_not_adopted() {
    let (e, _guard) = env("otherns").await;
    let node = unique("node-o");
    let _agent = e.agent(&node, "otherns");
    let pv = unique("pv-otherns");
    let image = e.image(&pv);
    e.volume(&pv, "data").await;
    sh(&format!("mkfs.ext4 -q -F {}", image.display()));
    // Another node's mount where one kernel plays several nodes, each in its own mount namespace:
    // the device is the image's, held, and in no mount table the agent can read.
    let out = std::process::Command::new("losetup")
        .args(["--find", "--show"])
        .arg(&image)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let theirs = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let dir = e.base.join("other-node");
    std::fs::create_dir_all(&dir).unwrap();
    let holder = OtherNamespace(
        std::process::Command::new("unshare")
            .args(["-m", "--propagation", "private", "sh", "-c"])
            .arg(format!("mount {theirs} {} && exec sleep 100000", dir.display()))
            .spawn()
            .unwrap(),
    );
    let pid = holder.0.id();
    eventually(LIMIT, || async {
        let table = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).map_err(|e| e.to_string())?;
        match table.contains(dir.to_str().unwrap()) {
            true => Ok(()),
            false => Err(format!("{theirs} not mounted in the other namespace yet")),
        }
    })
    .await;
    assert!(
        mounts_at(&dir).is_empty(),
        "the other namespace's mount is visible here"
    );

    let va = e.attach(&pv, &node).await;
    let dev = e.wait_attached(&va).await;
    assert_ne!(
        dev, theirs,
        "the agent adopted a device mounted in another namespace"
    );
    let devices = loops_of(&image);
    assert!(devices.contains(&dev) && devices.contains(&theirs), "{devices}");

    drop(holder);
    e.detach(&va, &node, &pv).await;
}
