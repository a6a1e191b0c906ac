//! The mount table (`/proc/self/mountinfo`), parsed. It is the agent's source of truth for what is
//! mounted: reading it each pass means a restart (or an admin's manual umount) can never leave the
//! agent believing something that is not so.

use std::path::PathBuf;

/// Device numbers as the kernel reports them (`major:minor`).
pub type DevNo = (u32, u32);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub id: u64,
    pub devno: DevNo,
    /// Root of the mount inside its file system (`/` for a whole-device mount; a bind of a
    /// device node from devtmpfs shows the node's path here).
    pub root: String,
    pub mount_point: PathBuf,
    pub options: String,
    pub fstype: String,
    pub source: String,
}

impl MountEntry {
    pub fn read_only(&self) -> bool {
        self.options.split(',').any(|o| o == "ro")
    }
}

/// Undoes the octal escapes the kernel uses for space, tab, newline and backslash.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let v = (b[i + 1] - b'0') as u32 * 64 + (b[i + 2] - b'0') as u32 * 8 + (b[i + 3] - b'0') as u32;
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_line(line: &str) -> Option<MountEntry> {
    let mut fields = line.split(' ');
    let id = fields.next()?.parse().ok()?;
    let _parent = fields.next()?;
    let (maj, min) = fields.next()?.split_once(':')?;
    let devno = (maj.parse().ok()?, min.parse().ok()?);
    let root = unescape(fields.next()?);
    let mount_point = PathBuf::from(unescape(fields.next()?));
    let options = fields.next()?.to_string();
    // Optional fields end with a lone "-".
    for f in fields.by_ref() {
        if f == "-" {
            break;
        }
    }
    let fstype = fields.next()?.to_string();
    let source = unescape(fields.next()?);
    Some(MountEntry {
        id,
        devno,
        root,
        mount_point,
        options,
        fstype,
        source,
    })
}

/// Parses a whole table; malformed lines are skipped (the kernel never writes them, and one bad
/// line must not hide every other mount).
pub fn parse(text: &str) -> Vec<MountEntry> {
    text.lines().filter_map(parse_line).collect()
}

/// The mount table of this process's mount namespace.
pub const PROC_MOUNTINFO: &str = "/proc/self/mountinfo";

pub async fn read() -> std::io::Result<Vec<MountEntry>> {
    read_from(std::path::Path::new(PROC_MOUNTINFO)).await
}

/// Reads a mount table from `path` (the volume manager's source is configurable so a test can
/// make it fail). Any read error is returned, never an empty table.
pub async fn read_from(path: &std::path::Path) -> std::io::Result<Vec<MountEntry>> {
    Ok(parse(&tokio::fs::read_to_string(path).await?))
}

/// Splits a `dev_t` the way glibc's `major()`/`minor()` do.
pub fn split_dev(dev: u64) -> DevNo {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major as u32, minor as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kernel_lines() {
        let t = "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n\
                 512 30 7:3 / /var/lib/stowage/pods/u/volumes/kubernetes.io~csi/my\\040pv/mount ro,relatime shared:300 - ext4 /dev/loop3 rw\n\
                 garbage\n\
                 600 30 0:5 /loop4 /x rw - devtmpfs udev rw\n";
        let m = parse(t);
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].devno, (98, 0));
        assert_eq!(m[0].fstype, "ext3");
        assert_eq!(m[1].id, 512);
        assert_eq!(
            m[1].mount_point,
            PathBuf::from("/var/lib/stowage/pods/u/volumes/kubernetes.io~csi/my pv/mount")
        );
        assert!(m[1].read_only());
        assert_eq!(m[1].source, "/dev/loop3");
        assert_eq!(m[2].root, "/loop4");
    }

    #[test]
    fn splits_device_numbers() {
        assert_eq!(split_dev(0x0703), (7, 3));
        // loop devices above 255 use the extended minor bits.
        assert_eq!(split_dev((7 << 8) | (0x1 << 20) | 0x2c), (7, 0x12c));
    }
}
