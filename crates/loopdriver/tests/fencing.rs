//! Multi-mount protection on real loop devices, ext4 and mounts (run as root). Two nodes are two
//! `NodeService`s with their own state over one image store; the second one is handed its own
//! loop device of the image (as an attacher would), which is what a second kernel would have.
//!
//! MMP makes the kernel wait before it refuses (about 21 s with the 5 s update interval), so
//! these tests take a minute or two; the waits are the kernel's, not the tests'.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use stowage_loopdriver::ImageStore;
use stowage_loopdriver::csi::VolumeLocks;
use stowage_loopdriver::csi::controller::ControllerService;
use stowage_loopdriver::csi::node::{NodeService, OfflineRepairs, RepairTools};
use stowage_loopdriver::csi::v1::controller_server::Controller;
use stowage_loopdriver::csi::v1::node_server::Node;
use stowage_loopdriver::csi::v1::volume_capability::access_mode::Mode;
use stowage_loopdriver::csi::v1::volume_capability::{AccessMode, AccessType, MountVolume};
use stowage_loopdriver::csi::v1::*;
use stowage_loopdriver::fence::{self, Seq};
use tonic::{Code, Request};

mod support;
use support::Scratch;

/// One node's driver over the scratch dir's shared image store.
fn node(s: &Scratch, name: &str, repairs: OfflineRepairs) -> NodeService {
    NodeService {
        node_id: name.into(),
        images: ImageStore::new(s.base.join("images")),
        state_dir: s.base.join(name).join("state"),
        max_volumes: 0,
        local: false,
        locks: VolumeLocks::default(),
        repairs,
    }
}

fn controller(s: &Scratch) -> ControllerService {
    ControllerService {
        images: ImageStore::new(s.base.join("images")),
        locks: VolumeLocks::default(),
    }
}

fn capability(mode: Mode) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume::default())),
    }
}

async fn create(ctrl: &ControllerService, id: &str, bytes: i64) {
    ctrl.create_volume(Request::new(CreateVolumeRequest {
        name: id.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![capability(Mode::SingleNodeWriter)],
        ..Default::default()
    }))
    .await
    .unwrap();
}

fn staging(s: &Scratch, node: &NodeService, id: &str) -> PathBuf {
    s.base.join(&node.node_id).join("stage").join(id)
}

/// Stages `id` on `node`; `device`: the attacher's loop device (else the node attaches one).
async fn stage(
    s: &Scratch,
    node: &NodeService,
    id: &str,
    mode: Mode,
    device: Option<&str>,
) -> Result<(), tonic::Status> {
    let publish_context: HashMap<String, String> = device
        .map(|d| HashMap::from([("devicePath".to_string(), d.to_string())]))
        .unwrap_or_default();
    node.node_stage_volume(Request::new(NodeStageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging(s, node, id).display().to_string(),
        volume_capability: Some(capability(mode)),
        publish_context,
        ..Default::default()
    }))
    .await
    .map(|_| ())
}

async fn unstage(s: &Scratch, node: &NodeService, id: &str) {
    node.node_unstage_volume(Request::new(NodeUnstageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging(s, node, id).display().to_string(),
    }))
    .await
    .unwrap();
}

/// Stages until it is not Aborted (an offline repair in progress) or `within` has passed.
async fn stage_through_repairs(
    s: &Scratch,
    node: &NodeService,
    id: &str,
    within: Duration,
) -> Result<(), tonic::Status> {
    let deadline = Instant::now() + within;
    loop {
        match stage(s, node, id, Mode::SingleNodeWriter, None).await {
            Err(e) if e.code() == Code::Aborted && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            r => return r,
        }
    }
}

fn protection(image: &Path) -> fence::Protection {
    let out = Command::new("dumpe2fs").arg("-h").arg(image).output().unwrap();
    fence::parse_dumpe2fs(&String::from_utf8_lossy(&out.stdout)).expect("an ext file system")
}

/// The driver's own format gives MMP; while node A has the volume mounted read-write, node B's
/// read-write stage through its own loop device is refused, FailedPrecondition naming
/// multi-mount protection, and so is its offline check of the grown volume; once A unstages (a
/// clean unmount), B's stage checks, grows and mounts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_loop_device_cannot_mount_the_image_until_the_first_mount_is_gone() {
    let s = Scratch::new("fence", "second");
    let ctrl = controller(&s);
    let a = node(&s, "node-a", OfflineRepairs::default());
    let b = node(&s, "node-b", OfflineRepairs::default());
    create(&ctrl, "v", 64 << 20).await;
    let image = s.base.join("images/v.img");

    stage(&s, &a, "v", Mode::SingleNodeWriter, None).await.unwrap();
    let block = protection(&image).mmp.expect("formatted with MMP");
    assert!(matches!(block.seq, Seq::Live(_)), "{block:?}");
    std::fs::write(staging(&s, &a, "v").join("data"), b"written through node A").unwrap();

    let other = s.attach(&image);
    let started = Instant::now();
    let e = stage(&s, &b, "v", Mode::SingleNodeWriter, Some(&other))
        .await
        .unwrap_err();
    let refused_after = started.elapsed();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(
        e.message().contains("multi-mount protection")
            && e.message().contains("mounted read-write elsewhere"),
        "{e}"
    );
    assert!(
        !s.mounts().contains(&staging(&s, &b, "v")),
        "node B has no mount of the volume"
    );
    eprintln!("second read-write mount refused after {refused_after:?}");

    // Grown meanwhile: node B's stage must check and grow it offline first, which e2fsck refuses
    // while A's mount keeps the MMP block moving; said the same way.
    ctrl.controller_expand_volume(Request::new(ControllerExpandVolumeRequest {
        volume_id: "v".into(),
        capacity_range: Some(CapacityRange {
            required_bytes: 128 << 20,
            limit_bytes: 0,
        }),
        ..Default::default()
    }))
    .await
    .unwrap();
    let e = stage(&s, &b, "v", Mode::SingleNodeWriter, Some(&other))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(
        e.message().contains("multi-mount protection") && e.message().contains("offline check"),
        "{e}"
    );

    // Node A unmounts cleanly: node B's stage goes through (its offline growth waits only for
    // e2fsprogs' own MMP checks), and sees A's data.
    unstage(&s, &a, "v").await;
    assert_eq!(protection(&image).mmp.unwrap().seq, Seq::Clean);
    let started = Instant::now();
    stage(&s, &b, "v", Mode::SingleNodeWriter, Some(&other))
        .await
        .unwrap();
    eprintln!(
        "stage after a clean unmount, with an offline check and grow, took {:?}",
        started.elapsed()
    );
    assert_eq!(
        std::fs::read(staging(&s, &b, "v").join("data")).unwrap(),
        b"written through node A"
    );
    unstage(&s, &b, "v").await;
}

/// An image made before MMP (no `mmp` feature) gets it at its next read-write stage, never at a
/// read-only one (which does not write to the image at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_image_gets_mmp_at_its_next_read_write_stage_only() {
    let s = Scratch::new("fence", "older");
    let ctrl = controller(&s);
    let a = node(&s, "node-a", OfflineRepairs::default());
    create(&ctrl, "v", 64 << 20).await;
    let image = s.base.join("images/v.img");
    // The format of earlier versions.
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-m", "0"])
        .arg(&image)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(protection(&image).mmp, None);

    stage(&s, &a, "v", Mode::MultiNodeReaderOnly, None).await.unwrap();
    unstage(&s, &a, "v").await;
    assert_eq!(protection(&image).mmp, None, "a read-only stage changes nothing");

    stage(&s, &a, "v", Mode::SingleNodeWriter, None).await.unwrap();
    let block = protection(&image).mmp.expect("MMP turned on");
    assert!(matches!(block.seq, Seq::Live(_)), "mounted under MMP: {block:?}");
    unstage(&s, &a, "v").await;
    assert_eq!(protection(&image).mmp.unwrap().seq, Seq::Clean);
}

/// An offline repair of node A stopped halfway (its tool killed, as a killed agent takes its
/// children with it) leaves MMP at "fsck". Node B, which has no record of that repair, is refused
/// naming multi-mount protection and never clears it; node A recognises its own record, resets
/// MMP, repairs again and mounts the grown file system.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repair_stopped_halfway_is_reset_only_by_the_node_that_ran_it() {
    let s = Scratch::new("fence", "stopped");
    // e2fsck that, the first time, stands for one killed halfway: an e2fsprogs tool (debugfs,
    // which stays open until told to quit: no race with a fast check) opens the device
    // read-write, writes "fsck" to MMP as every such tool does, and is SIGKILLed.
    let tools = s.base.join("tools");
    std::fs::create_dir_all(&tools).unwrap();
    let wrapper = tools.join("e2fsck");
    let t = tools.display();
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nif [ -e {t}/killed ]; then exec e2fsck \"$@\"; fi\n\
             for dev; do :; done\n\
             mkfifo {t}/in; debugfs -w \"$dev\" < {t}/in > /dev/null 2>&1 & pid=$!\n\
             exec 3> {t}/in\n\
             until dumpe2fs -h \"$dev\" 2>/dev/null | grep -q 'mmp_sequence: 0xe24d4d50'; do\n\
             kill -0 $pid 2>/dev/null || exit 99; sleep 0.1; done\n\
             kill -9 $pid; wait $pid; exec 3>&-; touch {t}/killed; exit 8\n"
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let repairs = OfflineRepairs::new(
        RepairTools {
            e2fsck: wrapper.display().to_string(),
            resize2fs: "resize2fs".into(),
        },
        Duration::from_secs(3600),
    );
    let ctrl = controller(&s);
    let a = node(&s, "node-a", repairs);
    let b = node(&s, "node-b", OfflineRepairs::default());
    create(&ctrl, "v", 64 << 20).await;
    let image = s.base.join("images/v.img");
    stage(&s, &a, "v", Mode::SingleNodeWriter, None).await.unwrap();
    unstage(&s, &a, "v").await;
    // Grown while unstaged: the next stage checks and grows ext4 offline.
    ctrl.controller_expand_volume(Request::new(ControllerExpandVolumeRequest {
        volume_id: "v".into(),
        capacity_range: Some(CapacityRange {
            required_bytes: 256 << 20,
            limit_bytes: 0,
        }),
        ..Default::default()
    }))
    .await
    .unwrap();

    let e = stage_through_repairs(&s, &a, "v", Duration::from_secs(300))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Internal, "{e}");
    assert!(e.message().starts_with("e2fsck: "), "{e}");
    assert!(tools.join("killed").exists());
    assert_eq!(protection(&image).mmp.unwrap().seq, Seq::Fsck);

    let other = s.attach(&image);
    let e = stage(&s, &b, "v", Mode::SingleNodeWriter, Some(&other))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(
        e.message().contains("multi-mount protection") && e.message().contains("file-system tool"),
        "{e}"
    );
    assert_eq!(
        protection(&image).mmp.unwrap().seq,
        Seq::Fsck,
        "another node never clears it"
    );
    Command::new("losetup").arg("-d").arg(&other).status().unwrap();

    stage_through_repairs(&s, &a, "v", Duration::from_secs(300))
        .await
        .unwrap();
    let stats = a
        .node_get_volume_stats(Request::new(NodeGetVolumeStatsRequest {
            volume_id: "v".into(),
            volume_path: staging(&s, &a, "v").display().to_string(),
            staging_target_path: String::new(),
        }))
        .await
        .unwrap()
        .into_inner();
    let total = stats
        .usage
        .iter()
        .find(|u| u.unit == volume_usage::Unit::Bytes as i32)
        .unwrap()
        .total;
    assert!(total > 200 << 20, "grown after the repeated repair: {stats:?}");
    assert!(
        !fence::record_path(&a.state_dir, "v").exists(),
        "the record goes with a finished repair"
    );
    unstage(&s, &a, "v").await;
    let fsck = Command::new("e2fsck").arg("-fn").arg(&image).output().unwrap();
    assert_eq!(fsck.status.code(), Some(0), "{fsck:?}");
}
