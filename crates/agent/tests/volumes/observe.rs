//! When the node cannot be observed: an unreadable mount table, a mount that hangs.

use crate::env::*;

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
            &[("error", "mount_table")],
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
