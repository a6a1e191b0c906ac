//! The image archive of `make image` (e2e/scripts/image.sh): a valid OCI layout whose digests,
//! sizes and diff_ids hold, whose layers unpack into a root file system in which both binaries
//! and the agent's tools start (run with chroot), whose controller user is non-root, and whose
//! name is the chart's default image.
//!
//! `make test` runs `make image` first; when the archive is missing (a plain `cargo test`), the
//! first test to need it builds it with the script. Needs root (chroot, owners in the layers).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Instant;

use serde_json::Value;
use stowage_chart_tests::{Helm, chart_dir, document, repo_root};

const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The uid:gid the controller runs as (the chart's runAsUser/runAsGroup).
const CONTROLLER_USER: &str = "65532:65532";

fn archive_path() -> PathBuf {
    repo_root().join(format!("target/image/stowage-{VERSION}.oci.tar"))
}

/// The archive, built by the script once per test run if it does not exist yet.
fn archive() -> &'static Path {
    static ARCHIVE: OnceLock<PathBuf> = OnceLock::new();
    ARCHIVE.get_or_init(|| {
        let path = archive_path();
        if !path.exists() {
            println!("{} is missing: running e2e/scripts/image.sh", path.display());
            let t = Instant::now();
            let status = Command::new("bash")
                .arg(repo_root().join("e2e/scripts/image.sh"))
                .status()
                .expect("run e2e/scripts/image.sh");
            assert!(status.success(), "e2e/scripts/image.sh failed: {status}");
            println!("image.sh took {:.1?}", t.elapsed());
        }
        assert!(path.exists(), "image.sh did not write {}", path.display());
        path
    })
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    out
}

fn sha256_hex(file: &Path) -> String {
    let out = run(Command::new("sha256sum").arg(file));
    String::from_utf8_lossy(&out.stdout)[..64].to_string()
}

/// sha256 of the uncompressed content of a gzip file: a layer's diff_id.
fn gunzipped_sha256_hex(file: &Path) -> String {
    let out = run(Command::new("sh")
        .arg("-c")
        .arg("gzip -dc \"$1\" | sha256sum")
        .arg("sh")
        .arg(file));
    String::from_utf8_lossy(&out.stdout)[..64].to_string()
}

/// An unpacked archive: its layout directory, parsed documents and the digests they name.
struct Layout {
    dir: tempfile::TempDir,
    index: Value,
    manifest: Value,
    config: Value,
}

impl Layout {
    fn open(archive: &Path) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("stowage-image-layout-")
            .tempdir()
            .expect("temp dir");
        run(Command::new("tar")
            .arg("-xf")
            .arg(archive)
            .arg("-C")
            .arg(dir.path()));
        let read = |p: &Path| -> Value {
            let text = std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            serde_json::from_slice(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        };
        let layout = read(&dir.path().join("oci-layout"));
        assert_eq!(layout["imageLayoutVersion"], "1.0.0");
        let index = read(&dir.path().join("index.json"));
        let mut this = Self {
            dir,
            index,
            manifest: Value::Null,
            config: Value::Null,
        };
        let m = this.descriptor_blob(&this.index["manifests"][0].clone());
        this.manifest = read(&m);
        let c = this.descriptor_blob(&this.manifest["config"].clone());
        this.config = read(&c);
        this
    }

    /// The blob a descriptor names, after checking its digest and size.
    fn descriptor_blob(&self, d: &Value) -> PathBuf {
        let digest = d["digest"].as_str().expect("descriptor digest");
        let hex = digest
            .strip_prefix("sha256:")
            .unwrap_or_else(|| panic!("{digest} is not sha256"));
        let blob = self.dir.path().join("blobs/sha256").join(hex);
        let size = std::fs::metadata(&blob)
            .unwrap_or_else(|e| panic!("blob {digest}: {e}"))
            .len();
        assert_eq!(Some(size), d["size"].as_u64(), "size of {digest}");
        assert_eq!(sha256_hex(&blob), hex, "content of blob {digest}");
        blob
    }

    fn layers(&self) -> Vec<PathBuf> {
        self.manifest["layers"]
            .as_array()
            .expect("manifest layers")
            .iter()
            .map(|l| {
                assert_eq!(
                    l["mediaType"], "application/vnd.oci.image.layer.v1.tar+gzip",
                    "{l}"
                );
                self.descriptor_blob(l)
            })
            .collect()
    }
}

#[test]
fn archive_is_a_valid_oci_layout_named_and_configured_for_the_chart() {
    let t = Instant::now();
    let archive = archive();
    let size = std::fs::metadata(archive).unwrap().len();
    let l = Layout::open(archive);

    let manifests = l.index["manifests"].as_array().expect("index manifests");
    assert_eq!(manifests.len(), 1, "{}", l.index);
    let m = &manifests[0];
    assert_eq!(m["mediaType"], "application/vnd.oci.image.manifest.v1+json");
    // ctr images import names the image by this annotation; skopeo and others by ref.name.
    assert_eq!(
        m["annotations"]["io.containerd.image.name"],
        format!("localhost/stowage:{VERSION}").as_str(),
        "{m}"
    );
    assert_eq!(m["annotations"]["org.opencontainers.image.ref.name"], VERSION);
    assert_eq!(m["platform"]["os"], "linux");

    assert_eq!(l.manifest["schemaVersion"], 2);
    assert_eq!(
        l.manifest["config"]["mediaType"],
        "application/vnd.oci.image.config.v1+json"
    );
    // Every layer's diff_id is the digest of its uncompressed tar, in order.
    let layers = l.layers();
    assert_eq!(layers.len(), 2, "a Debian base and a binaries layer");
    let diff_ids: Vec<String> = layers
        .iter()
        .map(|p| format!("sha256:{}", gunzipped_sha256_hex(p)))
        .collect();
    let want: Vec<&str> = l.config["rootfs"]["diff_ids"]
        .as_array()
        .expect("rootfs.diff_ids")
        .iter()
        .map(|d| d.as_str().unwrap())
        .collect();
    assert_eq!(diff_ids, want);
    assert_eq!(l.config["rootfs"]["type"], "layers");

    let c = &l.config["config"];
    assert_eq!(c["User"], CONTROLLER_USER, "the controller runs as non-root");
    assert_eq!(
        c["Entrypoint"],
        serde_json::json!(["/usr/local/bin/stowage-controller"])
    );
    let env = c["Env"].as_array().expect("Env");
    assert!(
        env.iter().any(|e| e
            .as_str()
            .is_some_and(|e| e.starts_with("PATH=") && e.contains("/usr/local/bin"))),
        "{env:?}"
    );
    assert_eq!(c["Labels"]["org.opencontainers.image.version"], VERSION);
    assert!(l.config["architecture"].is_string() && l.config["os"] == "linux");
    println!(
        "{}: {size} bytes, checked in {:.1?}",
        archive.display(),
        t.elapsed()
    );
}

#[test]
fn binaries_and_agent_tools_start_in_the_unpacked_image() {
    let t = Instant::now();
    let l = Layout::open(archive());
    let rootfs = tempfile::Builder::new()
        .prefix("stowage-image-rootfs-")
        .tempdir()
        .expect("temp dir");
    for layer in l.layers() {
        // Plain extraction is a faithful unpack only without whiteouts (deletions of lower files).
        let list = run(Command::new("tar").arg("-tzf").arg(&layer));
        let list = String::from_utf8_lossy(&list.stdout);
        assert!(
            !list
                .lines()
                .any(|p| p.rsplit('/').next().unwrap_or("").starts_with(".wh.")),
            "{} has whiteouts",
            layer.display()
        );
        run(Command::new("tar")
            .args(["-xzf"])
            .arg(&layer)
            .arg("--numeric-owner")
            .arg("-C")
            .arg(rootfs.path()));
    }
    let unpacked = t.elapsed();

    // (user, command, text expected in stdout+stderr)
    let cases: &[(&str, &[&str], &str)] = &[
        (
            CONTROLLER_USER,
            &["stowage-controller", "--help"],
            "Usage: stowage-controller",
        ),
        (
            CONTROLLER_USER,
            &["stowage-controller", "--help"],
            "--leader-elect",
        ),
        (CONTROLLER_USER, &["stowage-controller", "--version"], VERSION),
        ("0:0", &["stowage-agent", "--help"], "Usage: stowage-agent"),
        ("0:0", &["stowage-agent", "--help"], "--node-name"),
        ("0:0", &["losetup", "--version"], "util-linux"),
        ("0:0", &["blkid", "-V"], "blkid from util-linux"),
        ("0:0", &["findmnt", "--version"], "util-linux"),
        ("0:0", &["mount", "--version"], "util-linux"),
        ("0:0", &["umount", "--version"], "util-linux"),
        ("0:0", &["mkfs.ext4", "-V"], "mke2fs"),
        ("0:0", &["e2fsck", "-V"], "e2fsck"),
        // resize2fs has no version flag; -P on no file fails, so only check that it is there.
        ("0:0", &["sh", "-c", "command -v resize2fs"], "/resize2fs"),
    ];
    for (user, argv, want) in cases {
        // The image's PATH, not the host's.
        let out = run(Command::new("chroot")
            .arg(format!("--userspec={user}"))
            .arg(rootfs.path())
            .args([
                "/usr/bin/env",
                "-i",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            ])
            .args(*argv));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains(want), "{argv:?} as {user}: no {want:?} in:\n{text}");
    }
    // No device nodes in the layers: the runtime mounts its own /dev on the empty directory.
    let dev: Vec<_> = std::fs::read_dir(rootfs.path().join("dev"))
        .expect("/dev in the image")
        .collect();
    assert!(dev.is_empty(), "/dev is not empty: {dev:?}");
    // The controller's user has a name in the image (tools that look it up find it).
    let passwd = std::fs::read_to_string(rootfs.path().join("etc/passwd")).unwrap();
    assert!(
        passwd.lines().any(|l| l.starts_with("nonroot:x:65532:65532:")),
        "{passwd}"
    );
    println!(
        "unpacked in {unpacked:.1?}, {} commands run in {:.1?}",
        cases.len(),
        t.elapsed() - unpacked
    );
}

#[tokio::test]
async fn chart_default_image_is_the_one_make_image_builds() {
    let l = Layout::open(archive());
    let name = l.index["manifests"][0]["annotations"]["io.containerd.image.name"]
        .as_str()
        .expect("io.containerd.image.name")
        .to_string();
    let helm = Helm::new(None);
    let chart = chart_dir();
    let m = helm
        .run(&["template", "st", chart.to_str().unwrap()])
        .await
        .unwrap();
    for (kind, obj) in [
        ("Deployment", "st-stowage-controller"),
        ("DaemonSet", "st-stowage-agent"),
    ] {
        let d = document(&m, kind, obj).unwrap_or_else(|| panic!("no {kind}/{obj}"));
        let images: Vec<&str> = d
            .lines()
            .filter_map(|l| l.trim().strip_prefix("image: "))
            .map(|i| i.trim_matches('"'))
            .collect();
        assert!(!images.is_empty(), "{kind}/{obj} has no image:\n{d}");
        for image in images {
            assert_eq!(image, name, "{kind}/{obj}");
        }
        // An imported image is used as is; Always would try a registry that does not have it.
        assert!(d.contains("imagePullPolicy: IfNotPresent"), "{d}");
    }
}
