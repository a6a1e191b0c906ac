//! The CSI Node service on real loop devices, ext4 and mounts (run as root): the full life of a
//! volume with every call repeated (idempotency), online expansion, and the broken and hostile
//! states a node meets: a target something else is mounted on, a stale device path, a blank
//! read-only volume, an image holding another file system, a target with files in it; an offline
//! resize that outlives the stage that started it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use stowage_loopdriver::ImageStore;
use stowage_loopdriver::csi::VolumeLocks;
use stowage_loopdriver::csi::controller::ControllerService;
use stowage_loopdriver::csi::node::{NodeService, OfflineRepairs, RepairTools};
use stowage_loopdriver::csi::v1::controller_server::Controller;
use stowage_loopdriver::csi::v1::node_server::Node;
use stowage_loopdriver::csi::v1::volume_capability::access_mode::Mode;
use stowage_loopdriver::csi::v1::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use stowage_loopdriver::csi::v1::*;
use tonic::{Code, Request};

mod support;
use support::Scratch;

struct Driver {
    node: NodeService,
    ctrl: ControllerService,
    s: Scratch,
}

fn driver(name: &str) -> Driver {
    driver_with(name, |_| OfflineRepairs::default())
}

/// A driver whose offline repairs `repairs` makes (given the scratch dir).
fn driver_with(name: &str, repairs: impl FnOnce(&Path) -> OfflineRepairs) -> Driver {
    let s = Scratch::new("node", name);
    let images = ImageStore::new(s.base.join("images"));
    let locks = VolumeLocks::default();
    Driver {
        node: NodeService {
            node_id: "node-a".into(),
            images: images.clone(),
            state_dir: s.base.join("state"),
            max_volumes: 0,
            local: false,
            locks: locks.clone(),
            repairs: repairs(&s.base),
        },
        ctrl: ControllerService { images, locks },
        s,
    }
}

fn capability(mode: Mode, block: bool) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(if block {
            AccessType::Block(BlockVolume {})
        } else {
            AccessType::Mount(MountVolume::default())
        }),
    }
}

impl Driver {
    fn path(&self, p: &str) -> PathBuf {
        self.s.base.join(p)
    }

    async fn create(&self, id: &str, bytes: i64) {
        self.ctrl
            .create_volume(Request::new(CreateVolumeRequest {
                name: id.into(),
                capacity_range: Some(CapacityRange {
                    required_bytes: bytes,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![capability(Mode::SingleNodeWriter, false)],
                ..Default::default()
            }))
            .await
            .unwrap();
    }

    async fn stage(
        &self,
        id: &str,
        mode: Mode,
        block: bool,
        ctx: HashMap<String, String>,
    ) -> Result<(), tonic::Status> {
        self.node
            .node_stage_volume(Request::new(NodeStageVolumeRequest {
                volume_id: id.into(),
                staging_target_path: self.path(&format!("stage/{id}")).display().to_string(),
                volume_capability: Some(capability(mode, block)),
                publish_context: ctx,
                ..Default::default()
            }))
            .await
            .map(|_| ())
    }

    async fn unstage(&self, id: &str) {
        self.node
            .node_unstage_volume(Request::new(NodeUnstageVolumeRequest {
                volume_id: id.into(),
                staging_target_path: self.path(&format!("stage/{id}")).display().to_string(),
            }))
            .await
            .unwrap();
    }

    async fn publish(&self, id: &str, target: &Path, mode: Mode, block: bool) -> Result<(), tonic::Status> {
        self.node
            .node_publish_volume(Request::new(NodePublishVolumeRequest {
                volume_id: id.into(),
                target_path: target.display().to_string(),
                staging_target_path: self.path(&format!("stage/{id}")).display().to_string(),
                volume_capability: Some(capability(mode, block)),
                ..Default::default()
            }))
            .await
            .map(|_| ())
    }

    async fn unpublish(&self, id: &str, target: &Path) -> Result<(), tonic::Status> {
        self.node
            .node_unpublish_volume(Request::new(NodeUnpublishVolumeRequest {
                volume_id: id.into(),
                target_path: target.display().to_string(),
            }))
            .await
            .map(|_| ())
    }

    async fn stats(&self, id: &str, path: &Path) -> NodeGetVolumeStatsResponse {
        self.node
            .node_get_volume_stats(Request::new(NodeGetVolumeStatsRequest {
                volume_id: id.into(),
                volume_path: path.display().to_string(),
                staging_target_path: String::new(),
            }))
            .await
            .unwrap()
            .into_inner()
    }
}

fn total_bytes(s: &NodeGetVolumeStatsResponse) -> i64 {
    s.usage
        .iter()
        .find(|u| u.unit == volume_usage::Unit::Bytes as i32)
        .map(|u| u.total)
        .unwrap()
}

#[tokio::test]
async fn a_volume_lives_stage_publish_expand_unpublish_unstage_each_call_repeated() {
    let d = driver("life");
    d.create("v", 64 << 20).await;
    let target = d.path("pods/p1/mount");
    for _ in 0..2 {
        d.stage("v", Mode::SingleNodeWriter, false, HashMap::new())
            .await
            .unwrap();
    }
    for _ in 0..2 {
        d.publish("v", &target, Mode::SingleNodeWriter, false)
            .await
            .unwrap();
    }
    assert_eq!(d.s.loops().len(), 1, "one loop device however often staged");
    std::fs::write(target.join("data"), b"kept").unwrap();

    let before = d.stats("v", &target).await;
    let cond = before.volume_condition.clone().unwrap();
    assert!(!cond.abnormal, "{cond:?}");
    assert!(total_bytes(&before) > 50 << 20);
    assert!(
        before
            .usage
            .iter()
            .any(|u| u.unit == volume_usage::Unit::Inodes as i32 && u.total > 0)
    );

    // Online expansion: the controller grows the image, the node the device and ext4.
    let grown = d
        .ctrl
        .controller_expand_volume(Request::new(ControllerExpandVolumeRequest {
            volume_id: "v".into(),
            capacity_range: Some(CapacityRange {
                required_bytes: 128 << 20,
                limit_bytes: 0,
            }),
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(grown.node_expansion_required);
    let mut online = true;
    for _ in 0..2 {
        let r = d
            .node
            .node_expand_volume(Request::new(NodeExpandVolumeRequest {
                volume_id: "v".into(),
                volume_path: target.display().to_string(),
                capacity_range: Some(CapacityRange {
                    required_bytes: 128 << 20,
                    limit_bytes: 0,
                }),
                ..Default::default()
            }))
            .await;
        match r {
            Ok(r) => assert_eq!(r.into_inner().capacity_bytes, 128 << 20),
            // Where the kernel refuses online growth (no CAP_SYS_RESOURCE), the error says so
            // and the next stage grows the file system offline (checked below).
            Err(e) if e.message().contains("CAP_SYS_RESOURCE") => online = false,
            Err(e) => panic!("{e}"),
        }
    }
    if online {
        let after = d.stats("v", &target).await;
        assert!(total_bytes(&after) > 110 << 20, "ext4 grew online: {after:?}");
    }
    assert_eq!(std::fs::read(target.join("data")).unwrap(), b"kept");

    for _ in 0..2 {
        d.unpublish("v", &target).await.unwrap();
    }
    assert!(!target.exists(), "publish's target is removed");
    for _ in 0..2 {
        d.unstage("v").await;
    }
    assert!(d.s.mounts().is_empty(), "{:?}", d.s.mounts());
    assert!(d.s.loops().is_empty(), "the loop device stage made is freed");

    // Staged again: the data is there, nothing was reformatted, the file system has its new size.
    d.stage("v", Mode::SingleNodeWriter, false, HashMap::new())
        .await
        .unwrap();
    d.publish("v", &target, Mode::SingleNodeWriter, false)
        .await
        .unwrap();
    assert_eq!(std::fs::read(target.join("data")).unwrap(), b"kept");
    let restaged = d.stats("v", &target).await;
    assert!(total_bytes(&restaged) > 110 << 20, "grown by now: {restaged:?}");
    d.unpublish("v", &target).await.unwrap();
    d.unstage("v").await;

    // A block volume: the device node is bound at a file target.
    let dev_target = d.path("pods/p2/dev");
    d.stage("v", Mode::SingleNodeWriter, true, HashMap::new())
        .await
        .unwrap();
    for _ in 0..2 {
        d.publish("v", &dev_target, Mode::SingleNodeWriter, true)
            .await
            .unwrap();
    }
    let blk = d.stats("v", &dev_target).await;
    assert_eq!(total_bytes(&blk), 128 << 20);
    d.unpublish("v", &dev_target).await.unwrap();
    assert!(!dev_target.exists());
    d.unstage("v").await;
    assert!(d.s.loops().is_empty() && d.s.mounts().is_empty());
}

#[tokio::test]
async fn broken_and_foreign_targets_are_reported_never_overwritten() {
    let d = driver("broken");
    d.create("v", 64 << 20).await;
    d.stage("v", Mode::SingleNodeWriter, false, HashMap::new())
        .await
        .unwrap();

    // Something else is mounted at the target: publish refuses, the mount stays.
    let target = d.path("pods/p1/mount");
    std::fs::create_dir_all(&target).unwrap();
    assert!(
        Command::new("mount")
            .args(["-t", "tmpfs", "tmpfs"])
            .arg(&target)
            .status()
            .unwrap()
            .success()
    );
    std::fs::write(target.join("theirs"), b"x").unwrap();
    let e = d
        .publish("v", &target, Mode::SingleNodeWriter, false)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    // Stats of a path mounted from another device: abnormal, said why.
    let foreign = d.stats("v", &target).await.volume_condition.unwrap();
    assert!(
        foreign.abnormal && foreign.message.contains("not from the volume's loop device"),
        "{foreign:?}"
    );
    assert_eq!(std::fs::read(target.join("theirs")).unwrap(), b"x");
    assert!(Command::new("umount").arg(&target).status().unwrap().success());

    // A target directory holding files that is not a mount: unpublish keeps them.
    std::fs::write(target.join("stray"), b"y").unwrap();
    let e = d.unpublish("v", &target).await.unwrap_err();
    assert!(e.message().contains("left for inspection"), "{e}");
    assert_eq!(std::fs::read(target.join("stray")).unwrap(), b"y");
    std::fs::remove_file(target.join("stray")).unwrap();

    // A published volume whose mount broke under it (unmounted behind the driver's back).
    d.publish("v", &target, Mode::SingleNodeWriter, false)
        .await
        .unwrap();
    assert!(Command::new("umount").arg(&target).status().unwrap().success());
    let gone = d.stats("v", &target).await.volume_condition.unwrap();
    assert!(
        gone.abnormal && gone.message.contains("is not mounted"),
        "{gone:?}"
    );
    d.unpublish("v", &target).await.unwrap();
    d.unstage("v").await;

    // A stale device path from an attachment: refused, nothing formatted or mounted.
    d.create("w", 64 << 20).await;
    let other = d.s.base.join("images/v.img");
    let out = Command::new("losetup")
        .args(["--find", "--show"])
        .arg(&other)
        .output()
        .unwrap();
    let stale = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let ctx = HashMap::from([("devicePath".to_string(), stale.clone())]);
    let e = d
        .stage("w", Mode::SingleNodeWriter, false, ctx)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("no longer backs"), "{e}");
    assert!(d.s.mounts().is_empty());
    Command::new("losetup").arg("-d").arg(&stale).status().unwrap();

    // A blank volume staged read-only is never formatted.
    let e = d
        .stage("w", Mode::MultiNodeReaderOnly, false, HashMap::new())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    d.unstage("w").await;
    let probe = Command::new("blkid")
        .arg("-p")
        .arg(d.s.base.join("images/w.img"))
        .output()
        .unwrap();
    assert_eq!(probe.status.code(), Some(2), "still blank");

    // An image holding another file system is never reformatted.
    assert!(
        Command::new("mkswap")
            .arg(d.s.base.join("images/w.img"))
            .output()
            .unwrap()
            .status
            .success()
    );
    let e = d
        .stage("w", Mode::SingleNodeWriter, false, HashMap::new())
        .await
        .unwrap_err();
    assert!(
        e.code() == Code::FailedPrecondition && e.message().contains("swap"),
        "{e}"
    );
    d.unstage("w").await;
    let probe = Command::new("blkid")
        .arg("-p")
        .arg("-o")
        .arg("value")
        .arg("-s")
        .arg("TYPE")
        .arg(d.s.base.join("images/w.img"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&probe.stdout).trim(), "swap");

    // Delete refuses an image still behind a loop device.
    d.stage("v", Mode::SingleNodeWriter, false, HashMap::new())
        .await
        .unwrap();
    let e = d
        .ctrl
        .delete_volume(Request::new(DeleteVolumeRequest {
            volume_id: "v".into(),
            ..Default::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    d.unstage("v").await;
    assert!(d.s.loops().is_empty() && d.s.mounts().is_empty());
}

#[tokio::test]
async fn reader_modes_get_a_read_only_device_and_mount() {
    let d = driver("ro");
    d.create("v", 64 << 20).await;
    // A writer formats it first, then readers use it read-only.
    d.stage("v", Mode::SingleNodeWriter, false, HashMap::new())
        .await
        .unwrap();
    d.unstage("v").await;
    d.stage("v", Mode::MultiNodeReaderOnly, false, HashMap::new())
        .await
        .unwrap();
    let target = d.path("pods/r/mount");
    d.publish("v", &target, Mode::MultiNodeReaderOnly, false)
        .await
        .unwrap();
    let e = std::fs::write(target.join("x"), b"no").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc_erofs()), "{e}");
    let dev = &d.s.loops()[0];
    let name = dev.trim_start_matches("/dev/");
    let ro = std::fs::read_to_string(format!("/sys/block/{name}/ro")).unwrap();
    assert_eq!(ro.trim(), "1", "the loop device itself is read-only");
    d.unpublish("v", &target).await.unwrap();
    d.unstage("v").await;
}

fn libc_erofs() -> i32 {
    30
}

#[tokio::test]
async fn a_device_is_matched_to_its_image_by_inode_and_after_deletion_by_name() {
    let s = Scratch::new("node", "backs");
    let img = s.base.join("images/v.img");
    let other = s.base.join("images/w.img");
    for p in [&img, &other] {
        std::fs::write(p, vec![0u8; 1 << 20]).unwrap();
    }
    let out = Command::new("losetup")
        .args(["--find", "--show"])
        .arg(&img)
        .output()
        .unwrap();
    let dev = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let sys = stowage_loopdriver::sys::backs;
    assert!(sys(&dev, &img).await);
    assert!(!sys(&dev, &other).await, "another image is not this device's");
    // Through another path to the same file (a bind mount in another container sees this).
    let link = s.base.join("images/hard.img");
    std::fs::hard_link(&img, &link).unwrap();
    assert!(sys(&dev, &link).await, "same inode, other path");
    std::fs::remove_file(&link).unwrap();
    std::fs::remove_file(&img).unwrap();
    assert!(sys(&dev, &img).await, "deleted image: matched by name");
    assert!(!sys(&dev, &s.base.join("images/x.img")).await);
}

#[tokio::test]
async fn a_detach_returns_only_once_the_kernel_has_freed_a_device_held_open() {
    use stowage_loopdriver::sys::{backing_file, loop_attach, loop_detach_within};
    let s = Scratch::new("node", "held");
    let img = s.base.join("images/v.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let dev = loop_attach(&img, false).await.unwrap();

    // Another opener (as udev's probe after an unmount is): the kernel only defers the clear.
    let holder = std::fs::File::open(&dev).unwrap();
    let e = loop_detach_within(&dev, std::time::Duration::from_millis(300), || {})
        .await
        .expect_err("a device still open elsewhere is not detached");
    assert!(e.to_string().contains("still open"), "{e}");
    assert!(backing_file(&dev).await.is_some(), "still this image's device");

    // The retry succeeds once the holder closes, and the device is free when it returns. Until
    // then it keeps looking: after ten looks that found the device held it has not returned.
    let (looked, mut looks) = tokio::sync::watch::channel(0u32);
    let detach = tokio::spawn({
        let dev = dev.clone();
        async move {
            let count = move || looked.send_modify(|n| *n += 1);
            loop_detach_within(&dev, std::time::Duration::from_secs(60), count).await
        }
    });
    tokio::time::timeout(std::time::Duration::from_secs(30), looks.wait_for(|n| *n >= 10))
        .await
        .expect("the detach looks at the held device again")
        .expect("the detach is still running");
    assert!(!detach.is_finished(), "waits while the device is held");
    drop(holder);
    detach.await.unwrap().unwrap();
    // Tests run in parallel: another one may already have the freed device, so ask only that it
    // no longer backs this image.
    assert_ne!(
        backing_file(&dev).await.as_deref(),
        Some(img.to_str().unwrap()),
        "the device was freed"
    );
    assert!(s.loops().is_empty(), "{:?}", s.loops());
}

/// A second stage of a volume already staged at the same path, asking the other mode (rw on a
/// read-only staging mount, or ro on a read-write one), is an incompatible existing stage: CSI's
/// AlreadyExists, never OK, and the mount is left as it was.
#[tokio::test]
async fn a_second_stage_asking_another_mode_is_already_exists() {
    let d = driver("stage-mode");
    d.create("v", 64 << 20).await;
    let staging = d.path("stage/v");
    let staged_ro = || {
        let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        table
            .lines()
            .find(|l| l.split(' ').nth(4) == Some(staging.to_str().unwrap()))
            .map(|l| l.split(' ').nth(5).unwrap().split(',').any(|o| o == "ro"))
            .expect("staged")
    };

    // Staged read-write: a read-only stage of the same path is refused, the mount stays rw.
    d.stage("v", Mode::SingleNodeWriter, false, HashMap::new())
        .await
        .unwrap();
    let e = d
        .stage("v", Mode::SingleNodeReaderOnly, false, HashMap::new())
        .await
        .expect_err("ro asked on a rw staging mount");
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    assert!(!staged_ro(), "the rw staging mount is left as it was");
    // The same mode again is still idempotent.
    d.stage("v", Mode::SingleNodeWriter, false, HashMap::new())
        .await
        .unwrap();
    d.unstage("v").await;

    // Staged read-only (formatted by the writer above): a read-write stage is refused.
    d.stage("v", Mode::MultiNodeReaderOnly, false, HashMap::new())
        .await
        .unwrap();
    assert!(staged_ro());
    let e = d
        .stage("v", Mode::SingleNodeWriter, false, HashMap::new())
        .await
        .expect_err("rw asked on a ro staging mount");
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    assert!(staged_ro(), "the ro staging mount is left as it was");
    d.stage("v", Mode::MultiNodeReaderOnly, false, HashMap::new())
        .await
        .unwrap();
    d.unstage("v").await;
    assert!(d.s.loops().is_empty() && d.s.mounts().is_empty());
}

/// Stats of a Block volume published at its target: healthy when the device node bound there is
/// the volume's loop device (the mount table shows devtmpfs for such a bind, not the loop
/// device), abnormal when another device is bound there.
#[tokio::test]
async fn block_volume_stats_are_healthy_on_its_device_and_abnormal_on_another() {
    let d = driver("block-stats");
    d.create("v", 64 << 20).await;
    d.create("w", 64 << 20).await;
    let target = d.path("pods/p/dev");
    d.stage("v", Mode::SingleNodeWriter, true, HashMap::new())
        .await
        .unwrap();
    d.publish("v", &target, Mode::SingleNodeWriter, true)
        .await
        .unwrap();
    let ok = d.stats("v", &target).await;
    let cond = ok.volume_condition.clone().unwrap();
    assert!(!cond.abnormal, "{cond:?}");
    assert_eq!(total_bytes(&ok), 64 << 20);
    d.unpublish("v", &target).await.unwrap();

    // Another volume's device bound at the target v's stats are asked about.
    d.stage("w", Mode::SingleNodeWriter, true, HashMap::new())
        .await
        .unwrap();
    d.publish("w", &target, Mode::SingleNodeWriter, true)
        .await
        .unwrap();
    let wrong = d.stats("v", &target).await.volume_condition.unwrap();
    assert!(
        wrong.abnormal && wrong.message.contains("not the volume's loop device"),
        "{wrong:?}"
    );
    d.unpublish("w", &target).await.unwrap();
    d.unstage("w").await;
    d.unstage("v").await;
    assert!(d.s.loops().is_empty() && d.s.mounts().is_empty());
}

/// An offline resize is never killed with the stage that started it. A stage that must grow ext4
/// offline is cancelled (its task aborted, as tonic drops a handler when the CO gives up) while
/// `resize2fs` runs, held by a wrapper until the test lets it go: the process lives on, every
/// call on the volume meanwhile is Aborted saying why, and once it is done the next stage mounts
/// a clean file system of the new size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_stage_never_kills_its_offline_resize() {
    let d = driver_with("repair", |base| {
        let tools = base.join("tools");
        std::fs::create_dir_all(&tools).unwrap();
        let wrapper = tools.join("resize2fs");
        let t = tools.display();
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\necho $$ > {t}/pid.tmp && mv {t}/pid.tmp {t}/pid\n\
                 while [ ! -e {t}/release ]; do sleep 0.05; done\n\
                 resize2fs \"$@\"\nrc=$?\necho $rc > {t}/rc\nexit $rc\n"
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
        OfflineRepairs::new(
            RepairTools {
                e2fsck: "e2fsck".into(),
                resize2fs: wrapper.display().to_string(),
            },
            std::time::Duration::from_secs(3600),
        )
    });
    let tools = d.path("tools");
    d.create("v", 64 << 20).await;
    d.stage("v", Mode::SingleNodeWriter, false, HashMap::new())
        .await
        .unwrap();
    d.unstage("v").await;
    // Grown while unstaged: the next stage grows ext4 offline.
    d.ctrl
        .controller_expand_volume(Request::new(ControllerExpandVolumeRequest {
            volume_id: "v".into(),
            capacity_range: Some(CapacityRange {
                required_bytes: 1 << 30,
                limit_bytes: 0,
            }),
            ..Default::default()
        }))
        .await
        .unwrap();

    let node = d.node.clone();
    let request = NodeStageVolumeRequest {
        volume_id: "v".into(),
        staging_target_path: d.path("stage/v").display().to_string(),
        volume_capability: Some(capability(Mode::SingleNodeWriter, false)),
        ..Default::default()
    };
    let first = tokio::spawn(async move { node.node_stage_volume(Request::new(request)).await });
    let pid_file = tools.join("pid");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !pid_file.exists() {
        assert!(std::time::Instant::now() < deadline, "resize2fs never started");
        assert!(!first.is_finished(), "{:?}", first.await);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let pid: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| !r.trim_start().starts_with('Z'))
        })
    };
    assert!(
        alive(pid),
        "resize2fs (pid {pid}) was killed with the cancelled stage"
    );

    // While it runs: every call on the volume is Aborted, stage saying why.
    let e = d
        .stage("v", Mode::SingleNodeWriter, false, HashMap::new())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Aborted, "{e}");
    assert!(
        e.message().contains("resize") && e.message().contains("in progress"),
        "{e}"
    );
    let e = d
        .node
        .node_unstage_volume(Request::new(NodeUnstageVolumeRequest {
            volume_id: "v".into(),
            staging_target_path: d.path("stage/v").display().to_string(),
        }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Aborted, "{e}");
    assert!(alive(pid));

    std::fs::write(tools.join("release"), b"").unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        match d.stage("v", Mode::SingleNodeWriter, false, HashMap::new()).await {
            Ok(()) => break,
            Err(e) if e.code() == Code::Aborted && std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(
        std::fs::read_to_string(tools.join("rc")).unwrap().trim(),
        "0",
        "resize2fs ran to its end"
    );
    assert!(!alive(pid));
    let staged = d.stats("v", &d.path("stage/v")).await;
    assert!(total_bytes(&staged) > 900 << 20, "grown: {staged:?}");
    d.unstage("v").await;
    assert!(d.s.loops().is_empty() && d.s.mounts().is_empty());

    let image = d.s.base.join("images/v.img");
    let fsck = Command::new("e2fsck").arg("-fn").arg(&image).output().unwrap();
    assert_eq!(
        fsck.status.code(),
        Some(0),
        "clean: {}{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
    let dump = Command::new("dumpe2fs").arg("-h").arg(&image).output().unwrap();
    let dump = String::from_utf8_lossy(&dump.stdout);
    let field = |name: &str| {
        dump.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap()
    };
    assert_eq!(field("Block count:") * field("Block size:"), 1 << 30, "{dump}");
}

fn xfs_capability() -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "xfs".into(),
            ..Default::default()
        })),
    }
}

impl Driver {
    async fn stage_xfs(&self, id: &str) -> Result<(), tonic::Status> {
        self.node
            .node_stage_volume(Request::new(NodeStageVolumeRequest {
                volume_id: id.into(),
                staging_target_path: self.path(&format!("stage/{id}")).display().to_string(),
                volume_capability: Some(xfs_capability()),
                ..Default::default()
            }))
            .await
            .map(|_| ())
    }
}

fn fs_type_of(dev_or_image: &Path) -> String {
    let out = Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "TYPE"])
        .arg(dev_or_image)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// XFS on a node-local store: made when blank, grown online through NodeExpandVolume, grown at
/// the next stage after the image grew while unstaged, its data kept throughout. A shared store
/// refuses it at stage and at CreateVolume: XFS has no multi-mount protection.
#[tokio::test]
async fn xfs_lives_on_a_node_local_store_and_is_refused_on_a_shared_one() {
    let mut d = driver("xfs");
    d.node.local = true;
    d.create("x", 320 << 20).await;
    let staging = d.path("stage/x");
    for _ in 0..2 {
        d.stage_xfs("x").await.unwrap();
    }
    assert_eq!(fs_type_of(&d.path("images/x.img")), "xfs");
    std::fs::write(staging.join("data"), b"kept").unwrap();
    let before = d.stats("x", &staging).await;
    assert!(total_bytes(&before) < 320 << 20, "{before:?}");

    // Node expansion in local mode: the node grows the image, the device and XFS, online.
    let r = d
        .node
        .node_expand_volume(Request::new(NodeExpandVolumeRequest {
            volume_id: "x".into(),
            volume_path: staging.display().to_string(),
            capacity_range: Some(CapacityRange {
                required_bytes: 512 << 20,
                limit_bytes: 0,
            }),
            ..Default::default()
        }))
        .await
        .unwrap();
    assert_eq!(r.into_inner().capacity_bytes, 512 << 20);
    let grown = d.stats("x", &staging).await;
    assert!(total_bytes(&grown) > 400 << 20, "XFS grew online: {grown:?}");
    d.unstage("x").await;

    // Grown while unstaged: the next stage takes it up once mounted.
    d.node.images.grow("x", 768 << 20).unwrap();
    d.stage_xfs("x").await.unwrap();
    assert_eq!(std::fs::read(staging.join("data")).unwrap(), b"kept");
    let restaged = d.stats("x", &staging).await;
    assert!(total_bytes(&restaged) > 640 << 20, "grown at stage: {restaged:?}");
    d.unstage("x").await;
    assert!(d.s.loops().is_empty() && d.s.mounts().is_empty());

    // A shared store: refused before anything is formatted or mounted.
    d.node.local = false;
    let e = d.stage_xfs("x").await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("node-local image stores only"), "{e}");
    assert!(d.s.mounts().is_empty());
    let e = d
        .ctrl
        .create_volume(Request::new(CreateVolumeRequest {
            name: "y".into(),
            volume_capabilities: vec![xfs_capability()],
            ..Default::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
}

/// A kind node's `/dev` is a copy taken when its container started: a loop device the kernel adds
/// later has no node there, and `losetup --find` fails. The attach path makes the node of the
/// next free device from sysfs; here in a `/dev` that holds only loop-control.
#[tokio::test]
async fn the_next_free_loop_device_gets_a_node_where_dev_is_a_copy() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let s = Scratch::new("node", "devcopy");
    let dev = s.base.join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    let ok = Command::new("mknod")
        .arg(dev.join("loop-control"))
        .args(["c", "10", "237"])
        .status()
        .unwrap();
    assert!(ok.success());
    let img = s.base.join("images/v.img");
    let mut data = vec![0u8; 1 << 20];
    data[..12].copy_from_slice(b"through-node");
    std::fs::write(&img, &data).unwrap();

    // Tests beside this one attach devices too: the free one may be taken between the look and
    // the attach, and then the next look gives another.
    let mut attached = None;
    for _ in 0..20 {
        let node = stowage_loopdriver::sys::free_loop_node(&dev).unwrap();
        let meta = std::fs::metadata(&node).unwrap();
        assert!(meta.file_type().is_block_device(), "{}", node.display());
        let name = node.file_name().unwrap().to_str().unwrap().to_string();
        let kernel = std::fs::read_to_string(format!("/sys/block/{name}/dev")).unwrap();
        let rdev = meta.rdev();
        let (major, minor) = (libc::major(rdev), libc::minor(rdev));
        assert_eq!(format!("{major}:{minor}"), kernel.trim(), "the kernel's numbers");
        // A second look while it is still free leaves the node as it is.
        let again = stowage_loopdriver::sys::free_loop_node(&dev).unwrap();
        if again == node {
            assert_eq!(
                std::fs::metadata(&again).unwrap().ino(),
                meta.ino(),
                "not made again"
            );
        }
        if Command::new("losetup")
            .arg(&node)
            .arg(&img)
            .status()
            .unwrap()
            .success()
        {
            attached = Some(node);
            break;
        }
    }
    let node = attached.expect("a free loop device attached through the node made for it");
    let mut head = [0u8; 12];
    use std::io::Read;
    std::fs::File::open(&node).unwrap().read_exact(&mut head).unwrap();
    Command::new("losetup").arg("-d").arg(&node).status().unwrap();
    assert_eq!(&head, b"through-node");
}
