//! csi-sanity, the CSI community's conformance suite (built from its Go module by
//! `e2e/scripts/build-csi-sanity.sh`), against the real `stowage-agent` binary serving the
//! driver's Identity, Node and Controller services on a unix socket: real images, loop devices,
//! ext4 and mounts. Run once per access type the driver serves (Mount and Block).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use stowage_testkit::binary::Running;
use stowage_testkit::host::{Cleanup, mounts_under};
use stowage_testkit::unique;

fn csi_sanity() -> PathBuf {
    let p = std::env::var_os("STOWAGE_CSI_SANITY")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../e2e/csi/bin/csi-sanity"));
    assert!(
        p.exists(),
        "{} is missing: run `make test` (or e2e/scripts/build-csi-sanity.sh) first",
        p.display()
    );
    p
}

/// The counts in ginkgo's summary line `SUCCESS! -- 44 Passed | 0 Failed | 1 Pending | 47 Skipped`.
#[derive(Debug, Default, PartialEq, Eq)]
struct Summary {
    passed: u32,
    failed: u32,
    pending: u32,
    skipped: u32,
}

fn summary(out: &str) -> Option<Summary> {
    let line = out.lines().rev().find(|l| l.contains(" Passed | "))?;
    let mut s = Summary::default();
    for part in line.split(['|', '-']) {
        let mut w = part.split_whitespace();
        let (Some(n), Some(what)) = (w.next(), w.next()) else {
            continue;
        };
        let Ok(n) = n.parse() else { continue };
        match what {
            "Passed" => s.passed = n,
            "Failed" => s.failed = n,
            "Pending" => s.pending = n,
            "Skipped" => s.skipped = n,
            _ => {}
        }
    }
    Some(s)
}

fn run_sanity(base: &Path, socket: &Path, access_type: &str) -> Summary {
    let out = Command::new(csi_sanity())
        .arg(format!("--csi.endpoint={}", socket.display()))
        .arg(format!("--csi.mountdir={}", base.join("mnt").display()))
        .arg(format!("--csi.stagingdir={}", base.join("stage").display()))
        // Sparse 64 MiB images: big enough for ext4, cheap on any disk.
        .arg("--csi.testvolumesize=67108864")
        .arg(format!("--csi.testvolumeaccesstype={access_type}"))
        .arg("--ginkgo.no-color")
        .current_dir(base)
        .output()
        .expect("run csi-sanity");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let s = summary(&text).unwrap_or_else(|| panic!("csi-sanity printed no summary:\n{text}"));
    println!("csi-sanity ({access_type}): {s:?}");
    assert!(
        out.status.success() && s.failed == 0,
        "csi-sanity ({access_type}) failed:\n{text}"
    );
    s
}

#[test]
fn csi_sanity_passes_for_mount_and_block_volumes() {
    let base = std::env::temp_dir().join(unique("stowage-csi-sanity"));
    let images = base.join("images");
    std::fs::create_dir_all(&images).unwrap();
    // The install step (`stowage-controller init-image-store`): CreateVolume needs the marker.
    stowage_loopdriver::ImageStore::new(&images).init().unwrap();
    let base = std::fs::canonicalize(&base).unwrap();
    let images = std::fs::canonicalize(&images).unwrap();
    let _cleanup = Cleanup {
        base: base.clone(),
        images: images.clone(),
    };
    let socket = base.join("csi.sock");
    let args: Vec<String> = vec![
        "--node-name=sanity-node".into(),
        format!("--csi-endpoint=unix://{}", socket.display()),
        "--csi-controller".into(),
        "--csi-only".into(),
        format!("--image-dir={}", images.display()),
        format!("--root-dir={}", base.join("root").display()),
    ];
    let mut agent = Running::start(
        Path::new(env!("CARGO_BIN_EXE_stowage-agent")),
        &args,
        &base,
        "agent",
    )
    .unwrap();
    let start = Instant::now();
    while !socket.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no CSI socket: {}",
            agent.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    for access_type in ["mount", "block"] {
        let s = run_sanity(&base, &socket, access_type);
        // Identity, Node (stage, publish, stats, expand) and Controller (create, delete, expand,
        // validate) specs: fewer passing means a capability stopped being advertised.
        assert!(s.passed >= 44, "{access_type}: {s:?}");
        // What the driver leaves behind after the suite: nothing.
        assert_eq!(
            mounts_under(&base),
            Vec::<PathBuf>::new(),
            "{access_type}: mounts left"
        );
        let left: Vec<_> = std::fs::read_dir(&images)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| !p.ends_with(stowage_loopdriver::image::MARKER))
            .collect();
        assert!(left.is_empty(), "{access_type}: images left: {left:?}");
        let loops = String::from_utf8(Command::new("losetup").arg("-a").output().unwrap().stdout).unwrap();
        assert!(
            !loops.contains(images.to_str().unwrap()),
            "{access_type}: loop devices left:\n{loops}"
        );
    }

    agent.sigterm();
    assert_eq!(
        agent.wait_exit(Duration::from_secs(30)),
        Some(0),
        "{}",
        agent.log_text()
    );
    assert!(!socket.exists(), "the socket is removed on exit");
}

#[test]
fn the_summary_line_is_read() {
    assert_eq!(
        summary("x\nSUCCESS! -- 44 Passed | 0 Failed | 1 Pending | 47 Skipped\n"),
        Some(Summary {
            passed: 44,
            failed: 0,
            pending: 1,
            skipped: 47
        })
    );
    assert_eq!(
        summary("FAIL! -- 40 Passed | 4 Failed | 1 Pending | 47 Skipped").map(|s| s.failed),
        Some(4)
    );
    assert_eq!(summary("no summary"), None);
}
