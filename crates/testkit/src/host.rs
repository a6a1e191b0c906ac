//! Host state a test may leave behind (mounts, loop devices): removed by a guard, also when the
//! test fails half-way.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Mount points under `base`, deepest first (bind mounts before what they sit on).
pub fn mounts_under(base: &Path) -> Vec<PathBuf> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut points: Vec<PathBuf> = table
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| {
            PathBuf::from(
                p.replace("\\040", " ")
                    .replace("\\011", "\t")
                    .replace("\\134", "\\"),
            )
        })
        .filter(|p| p.starts_with(base))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points
}

/// On drop: lazily unmounts everything under `base`, detaches the loop devices backed by files
/// in `images`, and removes `base`. Declare it before the processes it cleans up after, so it
/// drops after they are stopped.
pub struct Cleanup {
    pub base: PathBuf,
    pub images: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in mounts_under(&self.base) {
            let _ = Command::new("umount").arg("-l").arg(&p).status();
        }
        if let Ok(rd) = std::fs::read_dir(&self.images) {
            for e in rd.flatten() {
                let out = Command::new("losetup").arg("-j").arg(e.path()).output();
                let text = out
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                    .unwrap_or_default();
                for dev in text.lines().filter_map(|l| l.split(':').next()) {
                    let _ = Command::new("losetup").arg("-d").arg(dev).status();
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.base);
    }
}
