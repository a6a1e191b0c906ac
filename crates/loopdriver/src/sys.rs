//! The node's tools: losetup, blkid, mkfs.ext4, mount, umount, resize2fs, mknod. Each call has a
//! time limit (a hung device must not hang the agent) and its error carries the tool's own words;
//! only the `*_to_end` forms of the offline repair tools have none (see [`run_to_end`]).

use std::io::ErrorKind;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::process::Command;

use crate::mountinfo::{self, DevNo, split_dev};

const TOOL_TIMEOUT: Duration = Duration::from_secs(120);
/// `stat` of a path the agent is about to use; no answer in this time counts as none.
const STAT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum SysError {
    #[error("cannot run {tool}: {source}")]
    Spawn {
        tool: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{tool} timed out after {}s", TOOL_TIMEOUT.as_secs())]
    Timeout { tool: String },
    #[error("{tool} failed (exit {code:?}): {stderr}")]
    Failed {
        tool: String,
        code: Option<i32>,
        stderr: String,
    },
    #[error("{0}")]
    Io(String),
    /// Refused by multi-mount protection (`fence`): the file system is in use elsewhere.
    #[error("{0}")]
    Fenced(String),
}

pub type Result<T, E = SysError> = std::result::Result<T, E>;

pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs a tool and returns its output whatever the exit code.
pub async fn run_raw(tool: &str, args: &[&str]) -> Result<Output> {
    let mut cmd = Command::new(tool);
    cmd.args(args)
        .kill_on_drop(true)
        .stdin(std::process::Stdio::null());
    let out = match tokio::time::timeout(TOOL_TIMEOUT, cmd.output()).await {
        Err(_) => return Err(SysError::Timeout { tool: tool.into() }),
        Ok(Err(source)) => {
            return Err(SysError::Spawn {
                tool: tool.into(),
                source,
            });
        }
        Ok(Ok(o)) => o,
    };
    Ok(Output {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    })
}

/// Runs a tool to its end: no time limit and no kill when the caller stops waiting. For tools
/// that must never be stopped halfway (an offline `e2fsck` or `resize2fs` killed mid-run can
/// leave the file system inconsistent); callers run it in a task of its own.
pub async fn run_to_end(tool: &str, args: &[&str]) -> Result<Output> {
    let mut cmd = Command::new(tool);
    cmd.args(args)
        .kill_on_drop(false)
        .stdin(std::process::Stdio::null());
    let out = cmd.output().await.map_err(|source| SysError::Spawn {
        tool: tool.into(),
        source,
    })?;
    Ok(Output {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    })
}

/// Runs a tool; a non-zero exit is an error.
pub async fn run(tool: &str, args: &[&str]) -> Result<String> {
    let out = run_raw(tool, args).await?;
    checked(tool, args, out)
}

/// A tool's stdout when it exited 0, else the error with its own words.
fn checked(tool: &str, args: &[&str], out: Output) -> Result<String> {
    if out.code == Some(0) {
        Ok(out.stdout)
    } else {
        let stderr = if out.stderr.is_empty() {
            out.stdout.trim().to_string()
        } else {
            out.stderr
        };
        Err(SysError::Failed {
            tool: format!("{tool} {}", args.join(" ")),
            code: out.code,
            stderr,
        })
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap_or_default()
}

/// Loop devices backed by `image` (by inode, as `losetup -j` matches). Empty when the file is gone.
pub async fn loops_of(image: &Path) -> Result<Vec<String>> {
    if tokio::fs::metadata(image).await.is_err() {
        return Ok(vec![]);
    }
    let out = run("losetup", &["-j", s(image)]).await?;
    Ok(out
        .lines()
        .filter_map(|l| l.split(':').next())
        .filter(|d| d.starts_with("/dev/"))
        .map(String::from)
        .collect())
}

/// Attaches `image` to a free loop device and returns it.
pub async fn loop_attach(image: &Path, read_only: bool) -> Result<String> {
    // Where /dev is a copy (a kind node is a container), the free device may have no node yet.
    if let Err(e) = tokio::task::spawn_blocking(|| free_loop_node(Path::new("/dev")))
        .await
        .map_err(std::io::Error::other)
        .and_then(|r| r)
    {
        tracing::debug!(error = %e, "could not make sure the next free loop device has a node");
    }
    let mut args = vec!["--find", "--show"];
    if read_only {
        args.push("--read-only");
    }
    args.push(s(image));
    let out = run("losetup", &args).await?;
    let dev = out.trim().to_string();
    if !dev.starts_with("/dev/") {
        return Err(SysError::Io(format!(
            "losetup printed no device for {}: {out:?}",
            image.display()
        )));
    }
    Ok(dev)
}

/// Makes sure the loop device the kernel hands out next (`LOOP_CTL_GET_FREE`, which adds one when
/// none is free) has a device node in `dev_dir`, and returns that node's path.
///
/// On a host, devtmpfs makes the node as the kernel adds the device. In a container whose `/dev`
/// is a copy taken when it started (a kind node: Docker's privileged `/dev` is a tmpfs), a device
/// added later has no node, and `losetup --find` fails with "No such file or directory". The node
/// is made from the device numbers the kernel gives in sysfs (`/sys/block/loopN/dev`), so a
/// `max_part` other than 0 is honoured. An existing node is left as it is.
pub fn free_loop_node(dev_dir: &Path) -> std::io::Result<PathBuf> {
    use std::os::fd::AsRawFd;
    const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
    let ctl = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dev_dir.join("loop-control"))?;
    // SAFETY: the fd is open for the call's duration; LOOP_CTL_GET_FREE takes no argument.
    let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let node = dev_dir.join(format!("loop{n}"));
    match std::fs::symlink_metadata(&node) {
        Ok(_) => return Ok(node),
        Err(e) if e.kind() != ErrorKind::NotFound => return Err(e),
        Err(_) => {}
    }
    let numbers = std::fs::read_to_string(format!("/sys/block/loop{n}/dev"))?;
    let (major, minor) = numbers
        .trim()
        .split_once(':')
        .and_then(|(a, b)| Some((a.parse::<u32>().ok()?, b.parse::<u32>().ok()?)))
        .ok_or_else(|| std::io::Error::other(format!("/sys/block/loop{n}/dev: {numbers:?}")))?;
    let path = std::ffi::CString::new(node.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: `path` is a NUL-terminated string that outlives the call.
    let rc = unsafe { libc::mknod(path.as_ptr(), libc::S_IFBLK | 0o660, libc::makedev(major, minor)) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        // Another attach made it first.
        if e.kind() != ErrorKind::AlreadyExists {
            return Err(e);
        }
    } else {
        tracing::info!(node = %node.display(), major, minor, "made the device node of a new loop device");
    }
    Ok(node)
}

/// Releases a loop device and returns once the kernel has freed it; a device that is already
/// free is fine.
///
/// On a device someone else still holds open (udev's probe after an unmount, a stray reader),
/// `losetup -d` succeeds but the kernel only marks it auto-clear and frees it at the last close.
/// "Detached" must mean free — the controller may attach the image elsewhere next — so this waits
/// up to `DETACH_SETTLE` and otherwise fails, for the caller to retry.
pub async fn loop_detach(dev: &str) -> Result<()> {
    loop_detach_within(dev, DETACH_SETTLE, || {}).await
}

/// How long a detach waits for the last holder of a device to close it.
const DETACH_SETTLE: Duration = Duration::from_secs(10);

/// `loop_detach` waiting up to `settle`; `still_held` is called after each look that finds the
/// device still this image's, so a test can tell the wait went on.
pub async fn loop_detach_within(dev: &str, settle: Duration, mut still_held: impl FnMut()) -> Result<()> {
    let Some(before) = backing_file(dev).await else {
        return Ok(());
    };
    if let Err(e) = run("losetup", &["-d", dev]).await
        && backing_file(dev).await.is_some_and(|f| f == before)
    {
        return Err(e);
    }
    let deadline = tokio::time::Instant::now() + settle;
    // Free, or already reused for another file: either way no longer this image's device.
    while backing_file(dev).await.is_some_and(|f| f == before) {
        still_held();
        if tokio::time::Instant::now() >= deadline {
            return Err(SysError::Io(format!(
                "loop device {dev} is still open elsewhere after {}s; the kernel frees it at the \
                 last close",
                settle.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Makes the loop device pick up a grown image.
pub async fn loop_refresh(dev: &str) -> Result<()> {
    run("losetup", &["-c", dev]).await.map(|_| ())
}

fn loop_sysfs(dev: &str) -> Option<PathBuf> {
    let name = dev.strip_prefix("/dev/")?;
    (name.starts_with("loop") && !name.contains('/'))
        .then(|| PathBuf::from(format!("/sys/block/{name}/loop")))
}

/// The file a loop device is backed by (kernel's view, " (deleted)" when unlinked); `None` when
/// the device is free or not a loop device.
pub async fn backing_file(dev: &str) -> Option<String> {
    let p = loop_sysfs(dev)?.join("backing_file");
    tokio::fs::read_to_string(p)
        .await
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// Is `dev` the loop device of `image` right now? Guards against mounting another volume's data
/// when a device path in an attachment went stale (device freed and reused).
///
/// Compared by the backing file's device and inode (what `losetup -j` matches), not by path: the
/// kernel prints the backing path as seen from the mount namespace that attached it, so a device
/// an earlier agent container attached shows only `/<handle>.img` to its successor.
pub async fn backs(dev: &str, image: &Path) -> bool {
    let Some(file) = backing_file(dev).await else {
        return false;
    };
    match tokio::fs::metadata(image).await {
        Ok(m) => backing_inode(dev).await == Some((m.dev(), m.ino())),
        // The image is gone; the kernel marks its old path as deleted (a path that may be
        // relative to another container's view, so only the file name is compared).
        Err(_) => image
            .file_name()
            .is_some_and(|n| file.ends_with(&format!("/{} (deleted)", n.to_string_lossy()))),
    }
}

/// `(st_dev, st_ino)` of the file behind a loop device (LOOP_GET_STATUS64).
pub async fn backing_inode(dev: &str) -> Option<(u64, u64)> {
    let dev = dev.to_string();
    tokio::task::spawn_blocking(move || {
        use std::os::fd::AsRawFd;
        // struct loop_info64: lo_device and lo_inode lead; 232 bytes in all.
        #[repr(C)]
        struct LoopInfo64 {
            lo_device: u64,
            lo_inode: u64,
            rest: [u8; 216],
        }
        const LOOP_GET_STATUS64: libc::c_ulong = 0x4C05;
        let f = std::fs::File::open(&dev).ok()?;
        let mut info = LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            rest: [0; 216],
        };
        // SAFETY: the fd is open for the call's duration and `info` is a writable buffer of the
        // size the kernel fills for LOOP_GET_STATUS64.
        let rc = unsafe { libc::ioctl(f.as_raw_fd(), LOOP_GET_STATUS64, &mut info as *mut LoopInfo64) };
        (rc == 0).then_some((info.lo_device, info.lo_inode))
    })
    .await
    .ok()
    .flatten()
}

/// The device numbers of a block device node.
pub async fn rdev(dev: &Path) -> Option<DevNo> {
    let m = tokio::fs::metadata(dev).await.ok()?;
    m.file_type().is_block_device().then(|| split_dev(m.rdev()))
}

/// Is the block device read-only (the kernel's flag, `/sys/dev/block/M:m/ro`)? `None` when the
/// kernel does not say; only `Some(false)` lets a blank device be formatted.
pub async fn device_read_only(devno: DevNo) -> Option<bool> {
    let p = format!("/sys/dev/block/{}:{}/ro", devno.0, devno.1);
    let v = tokio::fs::read_to_string(p).await.ok()?;
    Some(v.trim() != "0")
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// blkid found nothing it recognises: the device is blank as far as we can tell.
    Blank,
    /// Something is there (a file system, a partition table, RAID metadata…).
    Found(String),
}

/// Probes the device directly (no cache). Exit 2 is blkid's "nothing found"; every other failure
/// is an error, never "blank", so an I/O problem can never lead to a format.
pub async fn probe(dev: &str) -> Result<Probe> {
    let out = run_raw("blkid", &["-p", "-o", "export", dev]).await?;
    decide_probe(out.code, &out.stdout, &out.stderr)
}

pub fn decide_probe(code: Option<i32>, stdout: &str, stderr: &str) -> Result<Probe> {
    match code {
        Some(2) => Ok(Probe::Blank),
        Some(0) => {
            let kind = stdout
                .lines()
                .find_map(|l| l.strip_prefix("TYPE=").or_else(|| l.strip_prefix("PTTYPE=")))
                .unwrap_or("unknown signature");
            Ok(Probe::Found(kind.to_string()))
        }
        code => Err(SysError::Failed {
            tool: "blkid -p".into(),
            code,
            stderr: stderr.to_string(),
        }),
    }
}

pub async fn mkfs_ext4(dev: &str) -> Result<()> {
    // -m 0: these are data volumes, reserving blocks for root only hides capacity. MMP: a second
    // kernel (or loop device) cannot mount it read-write while it is mounted (`fence`).
    let mmp = crate::fence::mkfs_options();
    let mut args = vec!["-q", "-F", "-m", "0"];
    args.extend(mmp.iter().map(String::as_str));
    args.push(dev);
    run("mkfs.ext4", &args).await.map(|_| ())
}

/// XFS for node-local volumes (no multi-mount protection: `csi::caps::shared_refusal`). Its
/// smallest file system is 300 MiB (xfsprogs 5.19 and later).
pub async fn mkfs_xfs(dev: &str) -> Result<()> {
    run("mkfs.xfs", &["-q", dev]).await.map(|_| ())
}

/// Makes the file system `fs` (one of `csi::caps::FS_TYPES`) on a blank device.
pub async fn mkfs(fs: &str, dev: &str) -> Result<()> {
    match fs {
        crate::csi::caps::XFS => mkfs_xfs(dev).await,
        _ => mkfs_ext4(dev).await,
    }
}

/// Grows the XFS mounted at `mountpoint` to its device (XFS grows only while mounted; when the
/// sizes match it changes nothing).
pub async fn xfs_growfs(mountpoint: &Path) -> Result<()> {
    run("xfs_growfs", &[s(mountpoint)]).await.map(|_| ())
}

pub async fn mount_device(dev: &str, target: &Path, read_only: bool) -> Result<()> {
    mount_device_with(dev, target, read_only, &[]).await
}

/// Mounts `dev` at `target` with the caller's mount options after `ro`/`rw` (a CSI capability's
/// mount flags, a PV's mountOptions).
pub async fn mount_device_with(dev: &str, target: &Path, read_only: bool, flags: &[String]) -> Result<()> {
    let mut opts = String::from(if read_only { "ro" } else { "rw" });
    for f in flags {
        opts.push(',');
        opts.push_str(f);
    }
    match run("mount", &["-o", &opts, dev, s(target)]).await {
        Ok(_) => Ok(()),
        // Only a read-write mount goes through MMP.
        Err(e) if !read_only => Err(crate::fence::explain_mount_failure(dev, e).await),
        Err(e) => Err(e),
    }
}

pub async fn bind_mount(src: &Path, target: &Path, read_only: bool) -> Result<()> {
    run("mount", &["--bind", s(src), s(target)]).await?;
    if read_only {
        // A bind mount takes "ro" only through a remount.
        if let Err(e) = run("mount", &["-o", "remount,bind,ro", s(target)]).await {
            let _ = unmount(target, false).await;
            return Err(e);
        }
    }
    Ok(())
}

/// A forced check before an offline resize (resize2fs insists on it); exit 1 means "errors
/// fixed", still fine to go on.
pub async fn fsck_ext(dev: &str) -> Result<()> {
    let out = run_raw("e2fsck", &["-f", "-p", dev]).await?;
    fsck_verdict("e2fsck", dev, out)
}

/// [`fsck_ext`] run to its end ([`run_to_end`]) with the given `e2fsck` program.
pub async fn fsck_ext_to_end(e2fsck: &str, dev: &str) -> Result<()> {
    let out = run_to_end(e2fsck, &["-f", "-p", dev]).await?;
    fsck_verdict(e2fsck, dev, out)
}

fn fsck_verdict(e2fsck: &str, dev: &str, out: Output) -> Result<()> {
    match out.code {
        Some(0) | Some(1) => Ok(()),
        code => Err(SysError::Failed {
            tool: format!("{e2fsck} -f -p {dev}"),
            code,
            stderr: out.stderr,
        }),
    }
}

/// The size of the ext file system on `dev` (block count × block size, from its superblock).
pub async fn ext_fs_bytes(dev: &str) -> Result<u64> {
    let out = run("dumpe2fs", &["-h", dev]).await?;
    parse_ext_fs_bytes(&out)
        .ok_or_else(|| SysError::Io(format!("dumpe2fs -h {dev} printed no block count and size")))
}

fn parse_ext_fs_bytes(out: &str) -> Option<u64> {
    let field = |name: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    Some(field("Block count:")? * field("Block size:")?)
}

/// The size of a block device in bytes, from sysfs (`size` counts 512-byte sectors).
pub async fn device_bytes(devno: DevNo) -> Option<u64> {
    let p = format!("/sys/dev/block/{}:{}/size", devno.0, devno.1);
    let v = tokio::fs::read_to_string(p).await.ok()?;
    v.trim().parse::<u64>().ok().map(|s| s * 512)
}

pub async fn resize2fs(dev: &str) -> Result<()> {
    run("resize2fs", &[dev]).await.map(|_| ())
}

/// An offline `resize2fs` run to its end ([`run_to_end`]) with the given program.
pub async fn resize2fs_to_end(resize2fs: &str, dev: &str) -> Result<()> {
    let out = run_to_end(resize2fs, &[dev]).await?;
    checked(resize2fs, &[dev], out).map(|_| ())
}

/// Creates a block device node for `devno` at `path` (replacing whatever is there).
pub async fn mknod_block(path: &Path, devno: DevNo) -> Result<()> {
    match tokio::fs::remove_file(path).await {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(SysError::Io(format!("cannot replace {}: {e}", path.display()))),
    }
    let (maj, min) = (devno.0.to_string(), devno.1.to_string());
    run("mknod", &["-m", "0660", s(path), "b", &maj, &min])
        .await
        .map(|_| ())
}

/// Mount entries whose mount point is exactly `path`.
pub async fn mounts_at(path: &Path) -> Result<Vec<mountinfo::MountEntry>> {
    let all = mountinfo::read()
        .await
        .map_err(|e| SysError::Io(format!("cannot read the mount table: {e}")))?;
    Ok(all.into_iter().filter(|m| m.mount_point == path).collect())
}

/// Unmounts everything stacked on `path`. Success when nothing is (or was) mounted there. A
/// refused unmount (busy) is an error, retried later; only a mount already judged broken
/// (`lazy`: a corrupted-mount error or another device than the table's) is detached lazily,
/// never one that is merely slow.
pub async fn unmount(path: &Path, lazy: bool) -> Result<()> {
    for _ in 0..8 {
        if mounts_at(path).await?.is_empty() {
            return Ok(());
        }
        if let Err(e) = run("umount", &[s(path)]).await {
            if mounts_at(path).await?.is_empty() {
                return Ok(());
            }
            if !lazy {
                return Err(e);
            }
            run("umount", &["-l", s(path)]).await?;
        }
    }
    if mounts_at(path).await?.is_empty() {
        Ok(())
    } else {
        Err(SysError::Io(format!(
            "{} is still mounted after repeated unmounts",
            path.display()
        )))
    }
}

/// `st_dev` of a path, if `stat` answers in time. For paths the agent is about to use (a fresh
/// target, a device mount it just made); mounts already in place are judged by `probe::Prober`.
/// The `stat` runs on a detached thread: one stuck in the kernel never holds a runtime thread
/// or the agent's exit.
pub async fn stat_dev(path: &Path) -> Option<DevNo> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let owned = path.to_path_buf();
    std::thread::Builder::new()
        .name("stat".into())
        .spawn(move || {
            let _ = tx.send(std::fs::metadata(owned).map(|m| split_dev(m.dev())));
        })
        .ok()?;
    match tokio::time::timeout(STAT_TIMEOUT, rx).await {
        Ok(Ok(Ok(d))) => Some(d),
        _ => None,
    }
}

/// File-system usage of a mounted path, as `statvfs` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsUsage {
    pub bytes_total: u64,
    pub bytes_free: u64,
    pub bytes_available: u64,
    pub inodes_total: u64,
    pub inodes_free: u64,
}

/// `statvfs` of a path on a detached thread, like [`stat_dev`]: `Ok(None)` when it has not
/// answered in time (a hung mount), the error when it failed.
pub async fn statvfs(path: &Path) -> Result<Option<FsUsage>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let owned = path.to_path_buf();
    std::thread::Builder::new()
        .name("statvfs".into())
        .spawn(move || {
            let _ = tx.send(statvfs_now(&owned));
        })
        .map_err(|e| SysError::Io(format!("cannot start a statvfs thread: {e}")))?;
    match tokio::time::timeout(STAT_TIMEOUT, rx).await {
        Ok(Ok(r)) => r.map(Some),
        Ok(Err(_)) => Err(SysError::Io("statvfs thread ended without an answer".into())),
        Err(_) => Ok(None),
    }
}

fn statvfs_now(path: &Path) -> Result<FsUsage> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| SysError::Io(format!("{} contains NUL", path.display())))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `st` is a valid out-pointer for one statvfs.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(SysError::Io(format!(
            "statvfs {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: statvfs returned 0, so it filled the struct.
    let st = unsafe { st.assume_init() };
    let frsize = st.f_frsize;
    Ok(FsUsage {
        bytes_total: st.f_blocks * frsize,
        bytes_free: st.f_bfree * frsize,
        bytes_available: st.f_bavail * frsize,
        inodes_total: st.f_files,
        inodes_free: st.f_ffree,
    })
}

/// Removes a directory if it exists and is empty; other problems are reported.
pub async fn remove_dir_if_empty(path: &Path) -> Result<()> {
    match tokio::fs::remove_dir(path).await {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound || e.kind() == ErrorKind::DirectoryNotEmpty => Ok(()),
        Err(e) => Err(SysError::Io(format!("cannot remove {}: {e}", path.display()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_system_size_is_read_from_dumpe2fs() {
        let out = "Filesystem volume name:   <none>\nBlock count:              16384\nReserved block count:     0\nBlock size:               4096\n";
        assert_eq!(parse_ext_fs_bytes(out), Some(16384 * 4096));
        assert_eq!(parse_ext_fs_bytes("Block size: 4096\n"), None);
    }

    #[test]
    fn only_blkid_nothing_found_means_blank() {
        assert_eq!(decide_probe(Some(2), "", "").unwrap(), Probe::Blank);
        assert_eq!(
            decide_probe(Some(0), "DEVNAME=/dev/loop0\nTYPE=ext4\n", "").unwrap(),
            Probe::Found("ext4".into())
        );
        assert_eq!(
            decide_probe(Some(0), "PTTYPE=gpt\n", "").unwrap(),
            Probe::Found("gpt".into())
        );
        assert_eq!(
            decide_probe(Some(0), "", "").unwrap(),
            Probe::Found("unknown signature".into())
        );
        for code in [Some(1), Some(4), Some(8), None] {
            assert!(
                decide_probe(code, "", "I/O error").is_err(),
                "{code:?} must not count as blank"
            );
        }
    }
}
