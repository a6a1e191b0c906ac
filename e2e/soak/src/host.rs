//! What the soak reads and changes on the host: the mount table, loop devices, file-system UUIDs,
//! the image store's own small file system (frozen to pause it), and the data pattern pods keep
//! in their volumes. Everything is matched by this run's own paths: other tests on the machine use
//! loop devices and mounts too.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use sha2::{Digest, Sha256};

/// One line of `/proc/self/mountinfo` that matters here.
#[derive(Clone, Debug)]
pub struct Mount {
    pub target: PathBuf,
    pub source: String,
}

fn unescape(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// Mounts whose target is under `base`.
pub fn mounts_under(base: &Path) -> anyhow::Result<Vec<Mount>> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").context("read mountinfo")?;
    Ok(table
        .lines()
        .filter_map(|l| {
            let fields: Vec<&str> = l.split(' ').collect();
            let target = PathBuf::from(unescape(fields.get(4)?));
            let sep = fields.iter().position(|f| *f == "-")?;
            let source = unescape(fields.get(sep + 2)?);
            target.starts_with(base).then_some(Mount { target, source })
        })
        .collect())
}

/// Loop devices (`/dev/loopN`) whose backing file is under `dir`, with that file.
pub fn loops_backed_under(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/sys/block") else {
        return out;
    };
    let prefix = dir.display().to_string();
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Some(b) = backing_file(&name)
            && b.starts_with(&format!("{prefix}/"))
        {
            out.push((format!("/dev/{name}"), b));
        }
    }
    out
}

/// What loop device `name` (`loopN`) is backed by, as the kernel shows it.
fn backing_file(name: &str) -> Option<String> {
    std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"))
        .ok()
        .map(|b| b.trim().to_string())
}

/// A loop device in use, as `losetup --list --json` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct LoopDevice {
    pub name: String,
    pub file: String,
    /// `major:minor` of the file system that holds the backing file.
    pub back_dev: String,
    pub back_ino: u64,
}

/// Every loop device in use on the host (one kernel: every simulated node's and every other
/// test's).
pub fn loop_devices() -> anyhow::Result<Vec<LoopDevice>> {
    let out = run(Command::new("losetup").args([
        "--list",
        "--json",
        "--output",
        "NAME,BACK-FILE,BACK-INO,BACK-MAJ:MIN",
    ]))?;
    parse_losetup(&out)
}

fn parse_losetup(json: &str) -> anyhow::Result<Vec<LoopDevice>> {
    if json.trim().is_empty() {
        return Ok(Vec::new());
    }
    let v: serde_json::Value = serde_json::from_str(json).context("losetup --json")?;
    let text = |d: &serde_json::Value, k: &str| match &d[k] {
        serde_json::Value::String(s) => s.trim().to_string(),
        serde_json::Value::Number(n) => n.to_string(),
        _ => String::new(),
    };
    Ok(v["loopdevices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| {
            Some(LoopDevice {
                name: text(d, "name"),
                file: text(d, "back-file"),
                back_dev: text(d, "back-maj:min"),
                back_ino: text(d, "back-ino").parse().ok()?,
            })
        })
        .collect())
}

/// `major:minor` of the file system holding `path`, as losetup prints a backing file's.
pub fn dev_of(path: &Path) -> std::io::Result<String> {
    let d = std::fs::metadata(path)?.dev();
    // Linux's dev_t layout (glibc's gnu_dev_major/minor).
    let major = ((d >> 8) & 0xfff) | ((d >> 32) & !0xfff);
    let minor = (d & 0xff) | ((d >> 12) & !0xff);
    Ok(format!("{major}:{minor}"))
}

/// Images in `dir` backed by more than one loop device at once, matched by inode (a path may be
/// shown as seen from another mount namespace): image file → its devices.
pub fn images_on_two_devices(
    dir: &Path,
    devices: &[LoopDevice],
) -> std::io::Result<BTreeMap<String, Vec<String>>> {
    let store = dev_of(dir)?;
    let mut by_ino: BTreeMap<u64, Vec<&LoopDevice>> = BTreeMap::new();
    for d in devices.iter().filter(|d| d.back_dev == store) {
        by_ino.entry(d.back_ino).or_default().push(d);
    }
    Ok(by_ino
        .into_values()
        .filter(|ds| ds.len() > 1)
        .map(|ds| (ds[0].file.clone(), ds.iter().map(|d| d.name.clone()).collect()))
        .collect())
}

/// The names of the files in `dir` (the image store's own `lost+found` is a directory, left out).
pub fn files_in(dir: &Path) -> std::io::Result<Vec<String>> {
    Ok(std::fs::read_dir(dir)?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| !t.is_dir()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect())
}

/// The size in bytes the ext2/3/4 file system on `device` gives itself in its superblock (block
/// count times block size): what `mkfs` and `resize2fs` set from the device's size. (`statfs`
/// leaves the file system's own overhead out, which differs between a made and a grown one.)
pub fn ext_fs_bytes(device: &Path) -> anyhow::Result<u64> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(device).with_context(|| format!("open {}", device.display()))?;
    let mut sb = [0u8; 1024];
    f.seek(SeekFrom::Start(1024))?;
    f.read_exact(&mut sb)
        .with_context(|| format!("read the superblock of {}", device.display()))?;
    let le32 = |at: usize| u64::from(u32::from_le_bytes([sb[at], sb[at + 1], sb[at + 2], sb[at + 3]]));
    if u16::from_le_bytes([sb[0x38], sb[0x39]]) != 0xEF53 {
        bail!("no ext file system on {}", device.display());
    }
    let log_block = le32(0x18);
    if log_block > 6 {
        bail!("{}: implausible block size 1024 << {log_block}", device.display());
    }
    let mut blocks = le32(0x04);
    // INCOMPAT_64BIT: the block count's high half.
    if le32(0x60) & 0x80 != 0 {
        blocks |= le32(0x150) << 32;
    }
    Ok(blocks * (1024 << log_block))
}

/// Whether this process (and so the agents it starts) holds `CAP_SYS_RESOURCE`, which growing a
/// mounted ext4 needs.
pub fn may_grow_mounted_ext4() -> bool {
    const CAP_SYS_RESOURCE: u32 = 24;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let hex = s
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))?
                .trim()
                .to_string();
            u64::from_str_radix(&hex, 16).ok()
        })
        .is_some_and(|caps| caps & (1 << CAP_SYS_RESOURCE) != 0)
}

/// The file-system UUID `blkid` reads from `device` (probing the device itself, not the cache).
pub fn fs_uuid(device: &str) -> anyhow::Result<String> {
    let out = Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "UUID", device])
        .output()
        .context("run blkid")?;
    let uuid = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if uuid.is_empty() {
        bail!("blkid found no UUID on {device} (exit {:?})", out.status.code());
    }
    Ok(uuid)
}

fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("run {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The image store: a small ext4 file system of its own (a sparse file on a loop device) mounted
/// at `<run>/images`, so it can be paused (frozen) without touching anything else on the host.
pub struct ImageStore {
    pub dir: PathBuf,
    device: String,
}

impl ImageStore {
    pub fn create(base: &Path, size: &str) -> anyhow::Result<Self> {
        let file = base.join("image-store.fs");
        let dir = base.join("images");
        std::fs::create_dir_all(&dir)?;
        run(Command::new("truncate").args(["-s", size]).arg(&file))?;
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&file))?;
        let device = run(Command::new("losetup").args(["--find", "--show"]).arg(&file))?;
        if let Err(e) = run(Command::new("mount").arg(&device).arg(&dir)) {
            let _ = Command::new("losetup").arg("-d").arg(&device).status();
            return Err(e);
        }
        Ok(Self { dir, device })
    }

    /// Freezes the file system: every write to an image (new images, writes through the volumes'
    /// loop devices) blocks until [`thaw`](Self::thaw), as on a stalled network store.
    pub fn freeze(&self) -> anyhow::Result<()> {
        run(Command::new("fsfreeze").arg("-f").arg(&self.dir)).map(|_| ())
    }

    pub fn thaw(&self) -> anyhow::Result<()> {
        run(Command::new("fsfreeze").arg("-u").arg(&self.dir)).map(|_| ())
    }

    /// Thaws (if frozen), detaches the loop devices of images still attached, unmounts and
    /// detaches the store. Best effort: called on every exit path.
    pub fn teardown(&self) {
        let _ = Command::new("fsfreeze").arg("-u").arg(&self.dir).output();
        for (dev, _) in loops_backed_under(&self.dir) {
            let _ = Command::new("losetup").arg("-d").arg(&dev).status();
        }
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        let _ = Command::new("losetup").arg("-d").arg(&self.device).status();
    }
}

/// What a node's power-off does to its share of the host: every mount under the node's root dir
/// goes (pod mounts first, then device mounts), and its loop devices are freed when nothing else
/// mounts them: a shut-down kernel holds no device. Its devices are those its mounts were on and
/// those its attachments name (`attached`: device and volume handle; attached but not mounted
/// yet, or no longer), minus any another node's attachment names (`others`). (One kernel plays
/// every node here, so without this a "shut down" node would keep writing to its images, and
/// devices no mount named would outlive it.)
pub fn power_off(root: &Path, attached: &[(String, String)], others: &BTreeSet<String>) -> Vec<String> {
    let mut done = Vec::new();
    let mounts = mounts_under(root).unwrap_or_default();
    let mut devices: BTreeSet<String> = mounts
        .iter()
        .filter(|m| m.source.starts_with("/dev/loop"))
        .map(|m| m.source.clone())
        .collect();
    // Only while the device still backs that volume's image (a freed device may be reused).
    for (dev, handle) in attached {
        let name = Path::new(dev)
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let backing = backing_file(name).unwrap_or_default();
        let image = format!("/{handle}.img");
        if backing.trim_end_matches(" (deleted)").ends_with(&image) && !others.contains(dev) {
            devices.insert(dev.clone());
        }
    }
    let mut points: Vec<PathBuf> = mounts.into_iter().map(|m| m.target).collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        let ok = Command::new("umount").arg(&p).status().is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&p).status();
        }
        done.push(format!("umount {}", p.display()));
    }
    let still: BTreeSet<String> = mounts_under(Path::new("/"))
        .unwrap_or_default()
        .into_iter()
        .map(|m| m.source)
        .collect();
    for dev in devices.difference(&still) {
        let _ = Command::new("losetup").arg("-d").arg(dev).status();
        done.push(format!("losetup -d {dev}"));
    }
    done
}

/// Lazily unmounts everything under `base`, deepest first, except `keep`.
pub fn unmount_all_under(base: &Path, keep: &Path) {
    let mut points: Vec<PathBuf> = mounts_under(base)
        .unwrap_or_default()
        .into_iter()
        .map(|m| m.target)
        .filter(|t| t != keep)
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        let _ = Command::new("umount").arg("-l").arg(&p).status();
    }
}

/// The content generation `generation` of a claim's pattern file: 64 KiB derived from the seed,
/// the claim's UID and the generation, so any lost, stale or foreign write is told apart.
pub fn pattern(seed: u64, claim_uid: &str, generation: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 * 1024);
    let mut block = 0u64;
    while out.len() < 64 * 1024 {
        let mut h = Sha256::new();
        h.update(seed.to_le_bytes());
        h.update(claim_uid.as_bytes());
        h.update(generation.to_le_bytes());
        h.update(block.to_le_bytes());
        out.extend_from_slice(&h.finalize());
        block += 1;
    }
    out
}

pub const PATTERN_FILE: &str = "soak-pattern";

/// Reads the pattern file in a mounted volume: `None` when absent.
pub fn read_pattern(dir: &Path) -> std::io::Result<Option<Vec<u8>>> {
    match std::fs::read(dir.join(PATTERN_FILE)) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Replaces the pattern file atomically and durably (temp file, fsync, rename, fsync of the
/// directory), so a reader later sees the old or the new generation, never a torn one.
pub fn write_pattern(dir: &Path, data: &[u8]) -> std::io::Result<()> {
    let tmp = dir.join(format!("{PATTERN_FILE}.tmp"));
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, dir.join(PATTERN_FILE))?;
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_differ_by_claim_and_generation() {
        let a = pattern(1, "u1", 1);
        assert_eq!(a.len(), 64 * 1024);
        assert_eq!(a, pattern(1, "u1", 1));
        assert_ne!(a, pattern(1, "u1", 2));
        assert_ne!(a, pattern(1, "u2", 1));
        assert_ne!(a, pattern(2, "u1", 1));
    }

    #[test]
    fn pattern_files_round_trip() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(read_pattern(d.path()).unwrap(), None);
        write_pattern(d.path(), b"one").unwrap();
        write_pattern(d.path(), b"two").unwrap();
        assert_eq!(read_pattern(d.path()).unwrap().as_deref(), Some(&b"two"[..]));
    }

    #[test]
    fn mounts_are_matched_by_path() {
        let all = mounts_under(Path::new("/")).unwrap();
        assert!(all.iter().any(|m| m.target == Path::new("/")));
        assert!(mounts_under(Path::new("/no/such/soak/dir")).unwrap().is_empty());
    }

    #[test]
    fn losetup_json_is_read_with_padded_device_numbers() {
        let json = r#"{"loopdevices": [
            {"name": "/dev/loop0", "back-file": "/s/images/pvc-1.img", "back-ino": 12, "back-maj:min": "     7:3  "},
            {"name": "/dev/loop1", "back-file": "/s/images/pvc-1.img (deleted)", "back-ino": "13", "back-maj:min": "7:3"}
        ]}"#;
        let d = parse_losetup(json).unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!((d[0].back_dev.as_str(), d[0].back_ino), ("7:3", 12));
        assert_eq!((d[1].name.as_str(), d[1].back_ino), ("/dev/loop1", 13));
        assert!(parse_losetup("").unwrap().is_empty());
    }

    #[test]
    fn two_devices_on_one_image_are_found_by_inode() {
        let dir = tempfile::tempdir().unwrap();
        let store = dev_of(dir.path()).unwrap();
        let dev = |name: &str, file: &str, back_dev: &str, ino: u64| LoopDevice {
            name: name.into(),
            file: file.into(),
            back_dev: back_dev.into(),
            back_ino: ino,
        };
        let devices = vec![
            dev("/dev/loop1", "/a.img", &store, 10),
            dev("/dev/loop2", "/b.img", &store, 11),
            // The same image as another mount namespace shows it: same inode.
            dev("/dev/loop3", "/elsewhere/a.img", &store, 10),
            // Inode 11 on another file system: not this store's image.
            dev("/dev/loop4", "/other/b.img", "254:9", 11),
        ];
        let twice = images_on_two_devices(dir.path(), &devices).unwrap();
        assert_eq!(
            twice.into_iter().collect::<Vec<_>>(),
            vec![(
                "/a.img".to_string(),
                vec!["/dev/loop1".to_string(), "/dev/loop3".to_string()]
            )]
        );
    }

    /// What `mkfs.ext4` and an offline `resize2fs` write is what the superblock read says.
    #[test]
    fn ext_fs_bytes_reads_made_and_grown_sizes() {
        let d = tempfile::tempdir().unwrap();
        let img = d.path().join("v.img");
        let sh = |cmd: &mut Command| assert!(cmd.output().unwrap().status.success(), "{cmd:?}");
        sh(Command::new("truncate").args(["-s", "16M"]).arg(&img));
        assert!(ext_fs_bytes(&img).is_err(), "no file system yet");
        sh(Command::new("mkfs.ext4").args(["-q", "-F", "-m", "0"]).arg(&img));
        assert_eq!(ext_fs_bytes(&img).unwrap(), 16 << 20);
        sh(Command::new("truncate").args(["-s", "24M"]).arg(&img));
        sh(Command::new("e2fsck").args(["-f", "-p"]).arg(&img));
        sh(Command::new("resize2fs").arg("-p").arg(&img));
        assert_eq!(ext_fs_bytes(&img).unwrap(), 24 << 20);
    }
}
