//! Stale loop devices: a device of the store that nothing mounts and no VolumeAttachment names
//! (an attachment the controller released while the node was out of service, an attach never
//! recorded) is released after the grace period, with a Node Event; a mounted device, one an
//! attachment of another node names, one held open exclusively (as a mount in a mount namespace
//! the agent cannot see holds it) and one over a file outside the store stay.

use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::Api;
use kube::api::{Patch, PatchParams};
use stowage_testkit::eventually;

use crate::env::*;

fn losetup(file: &std::path::Path) -> String {
    let out = std::process::Command::new("losetup")
        .args(["--find", "--show"])
        .arg(file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test]
async fn a_stale_loop_device_of_the_store_is_released_and_nothing_in_use() {
    let (e, _guard) = env("sweep").await;
    let node = unique("node-sw");
    let stale_image = e.image(&unique("stale"));
    let stale = losetup(&stale_image);
    // Mounted (outside any node's root: an admin's mount): in use.
    let mounted_image = e.image(&unique("mounted"));
    sh(&format!("mkfs.ext4 -q -F {}", mounted_image.display()));
    let mounted = losetup(&mounted_image);
    let at = e.base.join("admin-mount");
    std::fs::create_dir_all(&at).unwrap();
    sh(&format!("mount {mounted} {}", at.display()));
    // Named by another node's attachment (attached there, not mounted yet).
    let named_pv = unique("pv-named");
    let named_image = e.image(&named_pv);
    let named = losetup(&named_image);
    let va = e.attach(&named_pv, "some-other-node").await;
    let status =
        serde_json::json!({"status": {"attached": true, "attachmentMetadata": {"devicePath": named}}});
    Api::<VolumeAttachment>::all(e.client.clone())
        .patch_status(&va, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    // A file outside the store: not ours, whatever its name.
    let outside_dir = e.base.join("elsewhere");
    std::fs::create_dir_all(&outside_dir).unwrap();
    let outside_image = outside_dir.join("pvc-outside.img");
    sh(&format!("truncate -s 16M {}", outside_image.display()));
    let outside = losetup(&outside_image);

    // Held open exclusively, as a mount in a mount namespace the agent cannot see holds it (or
    // an offline repair does): in use, though no table shows it.
    let held_image = e.image(&unique("held"));
    let held = losetup(&held_image);
    let holder = {
        use std::os::unix::fs::OpenOptionsExt;
        // O_EXCL on a block device: an exclusive claim, as a mount makes.
        const O_EXCL: i32 = 0o200;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(O_EXCL)
            .open(&held)
            .unwrap()
    };

    let agent = e.agent_with(&node, "sweep", &["--stale-device-grace-seconds=4".into()]);
    let note = e.wait_event("default", &node, "StaleLoopDeviceReleased").await;
    assert!(note.contains(&stale), "{note}");
    eventually(LIMIT, || async {
        match loops_of(&stale_image).as_str() {
            "" => Ok(()),
            left => Err(format!("still attached: {left}")),
        }
    })
    .await;
    // Three more grace periods: the others stay.
    tokio::time::sleep(std::time::Duration::from_secs(12)).await;
    for (dev, image) in [
        (&mounted, &mounted_image),
        (&named, &named_image),
        (&outside, &outside_image),
        (&held, &held_image),
    ] {
        assert!(
            loops_of(image).starts_with(&format!("{dev}:")),
            "{dev} over {} was released",
            image.display()
        );
    }
    assert_eq!(
        gauge(&agent, "stowage_agent_stale_devices_released_total", &[]),
        1.0
    );
    let events = e.events("default", &node).await;
    assert_eq!(
        events
            .iter()
            .filter(|(r, _)| r == "StaleLoopDeviceReleased")
            .count(),
        1,
        "{events:?}"
    );

    sh(&format!("umount {}", at.display()));
    drop(holder);
    for dev in [&mounted, &named, &outside, &held] {
        sh(&format!("losetup -d {dev}"));
    }
    let _ = Api::<VolumeAttachment>::all(e.client.clone())
        .delete(&va, &Default::default())
        .await;
}
