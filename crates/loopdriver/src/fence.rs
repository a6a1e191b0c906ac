//! Multi-mount protection (ext4 MMP): the fence between two kernels that could mount one image.
//!
//! A loop image on a shared store has no ControllerUnpublish that cuts a node off, so the file
//! system fences itself: with the `mmp` feature, a read-write mount writes a fresh sequence number
//! into the MMP block and the kernel's `kmmpd` rewrites it every update interval while mounted. A
//! second read-write mount (another kernel, or another loop device on the same host) finds the
//! number not "clean", waits about twice the check interval, and is refused (EBUSY) if the number
//! moved. A clean unmount writes "clean" back; after a crash the number stands still, so the next
//! mount only waits. The e2fsprogs tools that open it read-write (e2fsck, resize2fs, tune2fs)
//! write "fsck" while they run, which the kernel refuses at once.
//!
//! Here: the format options, turning MMP on for an older image before its next read-write mount,
//! the "fsck" number an interrupted repair of this node left (cleared only with this node's own
//! record of that repair), and a refused mount explained as such.

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::sys::{self, SysError};

/// `mmp_update_interval` of new images, seconds. e2fsprogs' default: a live mount rewrites its
/// block every 5 s and advertises a check interval of about 10 s, so a mount after a crash waits
/// about 2 × 21 s and a refused one about 21 s. Shorter intervals cut the wait (to about 11 s per
/// step at ≤ 2 s, the kernel's 5 s minimum check interval) for more synchronous writes to the
/// store, and tolerate a shorter stall of the owner's writes before another node concludes it is
/// gone; see docs/attachdetach.md.
pub const UPDATE_INTERVAL_SECS: u32 = 5;

/// What the kernel and e2fsprogs write when nothing has the file system open.
const SEQ_CLEAN: u32 = 0xFF4D_4D50;
/// What e2fsprogs write while a tool has it open read-write.
const SEQ_FSCK: u32 = 0xE24D_4D50;

/// The `mkfs.ext4` options that give a new file system MMP.
pub fn mkfs_options() -> [String; 4] {
    [
        "-O".into(),
        "mmp".into(),
        "-E".into(),
        format!("mmp_update_interval={UPDATE_INTERVAL_SECS}"),
    ]
}

/// The MMP block's sequence number, classified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seq {
    /// Not open anywhere.
    Clean,
    /// An e2fsprogs tool has it open read-write, or was stopped while it had.
    Fsck,
    /// A kernel has it mounted read-write, or crashed while it had.
    Live(u32),
}

/// The MMP block as `dumpe2fs -h` shows it; the names are informational, written by the last
/// opener (the kernel: node name and device; e2fsprogs: host name and the path it was given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmpBlock {
    pub seq: Seq,
    pub node: String,
    pub device: String,
    pub updated: String,
}

/// What the superblock says about MMP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Protection {
    /// `None`: the feature is off.
    pub mmp: Option<MmpBlock>,
    /// The journal needs replaying: mounted somewhere now, or not unmounted cleanly.
    pub needs_recovery: bool,
}

/// Parses `dumpe2fs -h`; `None` when it shows no feature list (not an ext file system).
pub fn parse_dumpe2fs(out: &str) -> Option<Protection> {
    let features: Vec<&str> = out
        .lines()
        .find_map(|l| l.strip_prefix("Filesystem features:"))?
        .split_whitespace()
        .collect();
    let needs_recovery = features.contains(&"needs_recovery");
    if !features.contains(&"mmp") {
        return Some(Protection {
            mmp: None,
            needs_recovery,
        });
    }
    // The block's fields follow "MMP_block:" (printed more than once by some versions; the
    // first is as good as any, all are one read).
    let block = out.split("MMP_block:").nth(1).unwrap_or_default();
    let field = |name: &str| {
        block
            .lines()
            .find_map(|l| l.trim().strip_prefix(name))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    let raw = field("mmp_sequence:");
    let seq = u32::from_str_radix(raw.trim_start_matches("0x"), 16).ok()?;
    let seq = match seq {
        SEQ_CLEAN => Seq::Clean,
        SEQ_FSCK => Seq::Fsck,
        n => Seq::Live(n),
    };
    Some(Protection {
        mmp: Some(MmpBlock {
            seq,
            node: field("mmp_node_name:"),
            device: field("mmp_device_name:"),
            updated: field("mmp_update_date:"),
        }),
        needs_recovery,
    })
}

/// Reads the superblock and MMP block of `dev` (read-only: no MMP wait).
pub async fn read(dev: &str) -> Result<Protection, SysError> {
    let out = sys::run("dumpe2fs", &["-h", dev]).await?;
    parse_dumpe2fs(&out).ok_or_else(|| SysError::Io(format!("dumpe2fs -h {dev} shows no ext file system")))
}

/// Is `dev` held on this host: mounted, or open by a tool that opens it exclusively (e2fsck,
/// resize2fs and tune2fs on an unmounted file system do)? An exclusive open fails then.
pub async fn held_here(dev: &str) -> bool {
    let dev = dev.to_string();
    tokio::task::spawn_blocking(move || {
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_EXCL)
            .open(&dev)
        {
            Ok(_) => false,
            // Anything but "busy" (gone, unreadable) is not evidence of a holder; the steps that
            // follow fail on their own.
            Err(e) => e.raw_os_error() == Some(libc::EBUSY),
        }
    })
    .await
    .unwrap_or(true)
}

/// This host's name as e2fsprogs write it into the MMP block (`gethostname`).
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its whole length, which is passed.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// The record an offline repair of this node keeps while its tools run: the device and host name
/// they write into the MMP block. Left in place when a tool stopped without writing "clean" back,
/// it is this node's proof that the "fsck" number is its own.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RepairRecord {
    device: String,
    host: String,
}

impl RepairRecord {
    fn encode(&self) -> String {
        format!("device={}\nhost={}\n", self.device, self.host)
    }
    fn decode(s: &str) -> Option<Self> {
        let get = |k: &str| {
            s.lines()
                .find_map(|l| l.strip_prefix(k)?.strip_prefix('='))
                .map(String::from)
        };
        Some(Self {
            device: get("device")?,
            host: get("host")?,
        })
    }
    /// Does the MMP block carry this record's marks? e2fsprogs cut the names to the block's
    /// fields (64 and 32 bytes).
    fn matches(&self, block: &MmpBlock) -> bool {
        let cut = |s: &str, n: usize| s.bytes().take(n).collect::<Vec<u8>>();
        cut(&self.device, 32) == cut(&block.device, 32) && cut(&self.host, 64) == cut(&block.node, 64)
    }
}

async fn write_record(path: &Path, rec: &RepairRecord) -> Result<(), SysError> {
    let io = |e: std::io::Error| SysError::Io(format!("cannot record the repair at {}: {e}", path.display()));
    if let Some(dir) = path.parent() {
        tokio::fs::create_dir_all(dir).await.map_err(io)?;
    }
    let (path, body) = (path.to_path_buf(), rec.encode());
    // Durable before the tool starts: a crash right after must still find it.
    tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut f = std::fs::File::create(&path)?;
        f.write_all(body.as_bytes())?;
        f.sync_all()
    })
    .await
    .map_err(|e| SysError::Io(format!("repair record task: {e}")))?
    .map_err(io)
}

async fn read_record(path: &Path) -> Option<RepairRecord> {
    RepairRecord::decode(&tokio::fs::read_to_string(path).await.ok()?)
}

/// The offline check and resize (`e2fsck -f -p`, `resize2fs`, each run to its end), with this
/// node's record of it at `record` while they run. The record goes when they are done and the
/// MMP block is not left at "fsck" (a tool killed halfway leaves it there, and the record with it).
/// A failure names its step: "repair record", "e2fsck" or "resize2fs".
pub async fn repair(
    e2fsck: &str,
    resize2fs: &str,
    dev: &str,
    record: &Path,
) -> Result<(), (&'static str, SysError)> {
    write_record(
        record,
        &RepairRecord {
            device: dev.to_string(),
            host: host_name(),
        },
    )
    .await
    .map_err(|e| ("repair record", e))?;
    let result = async {
        if let Err(e) = sys::fsck_ext_to_end(e2fsck, dev).await {
            return Err(("e2fsck", explain_tool_failure(dev, e).await));
        }
        if let Err(e) = sys::resize2fs_to_end(resize2fs, dev).await {
            return Err(("resize2fs", explain_tool_failure(dev, e).await));
        }
        Ok(())
    }
    .await;
    let left_fsck = match read(dev).await {
        Ok(p) => p.mmp.is_some_and(|m| m.seq == Seq::Fsck),
        // Unreadable: keep the record; a stale one only ever clears a "fsck" that matches it.
        Err(_) => true,
    };
    if !left_fsck {
        let _ = tokio::fs::remove_file(record).await;
    }
    result
}

/// What the read-write mount needs first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ready {
    /// Mount it.
    Mount,
    /// This node's own repair was stopped halfway: MMP was reset, and the file system must be
    /// checked (and grown, if it was being grown) before it is mounted.
    RepairFirst,
}

/// A refusal in the name of multi-mount protection ([`SysError::Fenced`]).
fn fenced(msg: String) -> SysError {
    SysError::Fenced(format!("multi-mount protection: {msg}"))
}

/// Readies `dev` (a loop device of `image`, about to be mounted read-write on this node) for
/// MMP. `record` is where this node keeps its repair record for the volume ([`repair`]).
///
/// - MMP off: turned on (`tune2fs -O mmp`), unless the image could be mounted anywhere: a loop
///   device of it held on this host, or a journal that needs replaying (mounted elsewhere or
///   crashed; without MMP the two cannot be told apart, so it waits for a clean stage).
/// - Clean, with this node's repair record still there: a repair that did not finish; repaired
///   again before the mount.
/// - "fsck": this node's own stopped repair (its record matches the block and nothing here holds
///   the device) is reset (`tune2fs -f -E clear_mmp`) and must be repaired again before the mount;
///   anything else is refused, never cleared: the tool may be running on another node.
/// - Clean or live: the kernel decides at mount (a live number may be a crash's, or a mount).
pub async fn ready_for_write(dev: &str, image: &Path, record: &Path) -> Result<Ready, SysError> {
    let p = read(dev).await?;
    let Some(block) = p.mmp else {
        let mut held = vec![];
        for d in sys::loops_of(image).await? {
            if held_here(&d).await {
                held.push(d);
            }
        }
        if !held.is_empty() {
            tracing::warn!(device = dev, held = ?held, "image has no multi-mount protection and a loop device of it is held here; not enabling it now");
        } else if p.needs_recovery {
            tracing::warn!(
                device = dev,
                "image has no multi-mount protection and its journal needs recovery (mounted elsewhere, or not unmounted cleanly); enabling it after a clean unmount"
            );
        } else {
            sys::run(
                "tune2fs",
                &[
                    "-O",
                    "mmp",
                    "-E",
                    &format!("mmp_update_interval={UPDATE_INTERVAL_SECS}"),
                    dev,
                ],
            )
            .await?;
            tracing::info!(device = dev, "multi-mount protection enabled on an older image");
        }
        return Ok(Ready::Mount);
    };
    let record_left = read_record(record).await;
    if block.seq == Seq::Clean && record_left.is_some() {
        // A repair of this node did not finish cleanly (its "fsck" mark was reset, or the block
        // could not be read after it): check again before mounting.
        tracing::warn!(
            device = dev,
            "an offline repair of this node did not finish; repairing again before mounting"
        );
        return Ok(Ready::RepairFirst);
    }
    if block.seq != Seq::Fsck {
        return Ok(Ready::Mount);
    }
    let own = record_left.filter(|r| r.device == dev && r.matches(&block));
    if own.is_some() && !held_here(dev).await {
        tracing::warn!(
            device = dev,
            "an offline repair of this node was stopped halfway (MMP left at fsck); resetting MMP and repairing again before mounting"
        );
        sys::run("tune2fs", &["-f", "-E", "clear_mmp", dev]).await?;
        return Ok(Ready::RepairFirst);
    }
    Err(fenced(format!(
        "{dev} is held by a file-system tool (e2fsck, resize2fs or tune2fs) that ran on {:?} through {:?} \
         (MMP sequence \"fsck\", last update {}); it is running there or was stopped halfway. Mounting waits \
         for it; if nothing uses the image any more, check it with e2fsck and reset MMP with \
         `tune2fs -f -E clear_mmp`",
        block.node, block.device, block.updated
    )))
}

/// Explains a failed offline tool on `dev`: e2fsprogs refuse to open a file system whose MMP
/// number moves (mounted read-write elsewhere), which is multi-mount protection at work.
async fn explain_tool_failure(dev: &str, err: SysError) -> SysError {
    if !matches!(err, SysError::Failed { .. }) {
        return err;
    }
    match read(dev).await {
        Ok(Protection {
            mmp:
                Some(
                    block @ MmpBlock {
                        seq: Seq::Live(_), ..
                    },
                ),
            ..
        }) => fenced(format!(
            "the offline check of {dev} was refused: the file system is mounted read-write elsewhere \
             (another node, or another loop device of the image); its MMP block was last updated by \
             {:?} through {:?} at {}. It is checked once that mount is gone ({err})",
            block.node, block.device, block.updated
        )),
        _ => err,
    }
}

/// Explains a failed mount of `dev`: when MMP is on and its number is not clean, the kernel
/// refused the mount because the file system is active elsewhere (or a tool holds it), and the
/// error says so ([`SysError::Fenced`]); any other error is returned as it was.
pub async fn explain_mount_failure(dev: &str, err: SysError) -> SysError {
    if !matches!(err, SysError::Failed { .. }) {
        return err;
    }
    let Ok(Protection { mmp: Some(block), .. }) = read(dev).await else {
        return err;
    };
    let holder = match block.seq {
        Seq::Clean => return err,
        Seq::Fsck => "a file-system tool (e2fsck, resize2fs or tune2fs) holds it",
        Seq::Live(_) => {
            "the file system is mounted read-write elsewhere (another node, or another loop device of the image)"
        }
    };
    fenced(format!(
        "the mount of {dev} was refused: {holder}; its MMP block was last updated by {:?} through {:?} at {}. \
         It mounts once that mount is gone ({err})",
        block.node, block.device, block.updated
    ))
}

/// Where a node keeps its repair record of a volume, under its state directory.
pub fn record_path(state_dir: &Path, volume: &str) -> PathBuf {
    state_dir.join("repairs").join(volume)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTED: &str = "Filesystem volume name:   <none>\n\
Filesystem features:      has_journal ext_attr resize_inode dir_index filetype needs_recovery extent 64bit mmp flex_bg\n\
MMP block number:         7986\n\
MMP update interval:      5\n\
MMP_block:\n    mmp_magic: 0x4d4d50\n    mmp_check_interval: 10\n    mmp_sequence: 0x000001\n    mmp_update_date: Fri Nov 27 17:48:48 2026\n    mmp_update_time: 1795801728\n    mmp_node_name: vm\n    mmp_device_name: loop0\n";

    #[test]
    fn the_mmp_block_is_read_from_dumpe2fs() {
        let p = parse_dumpe2fs(MOUNTED).unwrap();
        assert!(p.needs_recovery);
        let b = p.mmp.unwrap();
        assert_eq!(b.seq, Seq::Live(1));
        assert_eq!((b.node.as_str(), b.device.as_str()), ("vm", "loop0"));
        assert_eq!(b.updated, "Fri Nov 27 17:48:48 2026");

        let clean = MOUNTED
            .replace("0x000001", "0xff4d4d50")
            .replace(" needs_recovery", "");
        let p = parse_dumpe2fs(&clean).unwrap();
        assert!(!p.needs_recovery);
        assert_eq!(p.mmp.unwrap().seq, Seq::Clean);
        let fsck = MOUNTED.replace("0x000001", "0xe24d4d50");
        assert_eq!(parse_dumpe2fs(&fsck).unwrap().mmp.unwrap().seq, Seq::Fsck);

        let off = "Filesystem features:      has_journal ext_attr extent 64bit\n";
        assert_eq!(
            parse_dumpe2fs(off).unwrap(),
            Protection {
                mmp: None,
                needs_recovery: false
            }
        );
        assert!(parse_dumpe2fs("garbage").is_none());
    }

    #[test]
    fn a_repair_record_matches_only_its_own_marks_as_e2fsprogs_cut_them() {
        let rec = RepairRecord {
            device: "/dev/loop12".into(),
            host: "node-a".into(),
        };
        assert_eq!(RepairRecord::decode(&rec.encode()), Some(rec.clone()));
        assert_eq!(RepairRecord::decode("device=/dev/loop1\n"), None);
        let block = |node: &str, device: &str| MmpBlock {
            seq: Seq::Fsck,
            node: node.into(),
            device: device.into(),
            updated: String::new(),
        };
        assert!(rec.matches(&block("node-a", "/dev/loop12")));
        assert!(!rec.matches(&block("node-b", "/dev/loop12")));
        assert!(!rec.matches(&block("node-a", "/dev/loop1")));
        let long = RepairRecord {
            device: format!("/dev/{}", "x".repeat(40)),
            host: "h".repeat(80),
        };
        assert!(long.matches(&block(&"h".repeat(64), &long.device[..32])));
    }
}
