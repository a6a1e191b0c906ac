//! Volume ownership for a pod's `fsGroup`, as the kubelet applies it: every file and directory
//! gets the group, group read/write (and execute where the owner has it), directories get setgid
//! so new files inherit the group. Stays on the volume's file system and never follows symlinks.

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt, lchown};
use std::path::Path;

const SETGID: u32 = 0o2000;

/// The mode bits `fsGroup` asks for.
pub fn wanted_mode(mode: u32, is_dir: bool) -> u32 {
    let owner_x = mode & 0o100 != 0;
    let mut m = mode | 0o060;
    if is_dir {
        m |= 0o010 | SETGID;
    } else if owner_x {
        m |= 0o010;
    }
    m
}

/// Applies `gid` below `root`. With `on_root_mismatch`, a root that already has the group and the
/// mode is taken as proof that the whole tree does (upstream's OnRootMismatch policy).
pub fn apply(root: &Path, gid: u32, on_root_mismatch: bool) -> io::Result<()> {
    let top = std::fs::symlink_metadata(root)?;
    if on_root_mismatch && top.gid() == gid && top.mode() & 0o7777 == wanted_mode(top.mode(), true) & 0o7777 {
        return Ok(());
    }
    let fs = top.dev();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = std::fs::symlink_metadata(&p)?;
        if m.dev() != fs {
            continue;
        }
        if m.file_type().is_symlink() {
            continue;
        }
        if m.gid() != gid {
            lchown(&p, None, Some(gid))?;
        }
        let want = wanted_mode(m.mode() & 0o7777, m.is_dir());
        if want != m.mode() & 0o7777 {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(want))?;
        }
        if m.is_dir() {
            for e in std::fs::read_dir(&p)? {
                stack.push(e?.path());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_follow_the_kubelet_rules() {
        assert_eq!(wanted_mode(0o755, true), 0o2775);
        assert_eq!(wanted_mode(0o644, false), 0o664);
        assert_eq!(wanted_mode(0o744, false), 0o774);
        assert_eq!(wanted_mode(0o600, false), 0o660);
    }

    #[test]
    fn applies_group_and_modes_to_a_tree() {
        let dir = std::env::temp_dir().join(format!("stowage-fsgroup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("sub/f"), b"x").unwrap();
        std::fs::set_permissions(dir.join("sub/f"), std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.join("link")).unwrap();
        let passwd_gid = std::fs::metadata("/etc/passwd").unwrap().gid();
        apply(&dir, 4242, false).unwrap();
        let f = std::fs::metadata(dir.join("sub/f")).unwrap();
        assert_eq!(f.gid(), 4242);
        assert_eq!(f.mode() & 0o7777, 0o660);
        let d = std::fs::metadata(dir.join("sub")).unwrap();
        assert_eq!(d.mode() & SETGID, SETGID);
        assert_eq!(
            std::fs::metadata("/etc/passwd").unwrap().gid(),
            passwd_gid,
            "symlinks are not followed"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
