//! What the real-device tests share: a scratch dir whose mounts and loop devices are released
//! however the test ends.

use std::path::{Path, PathBuf};
use std::process::Command;

use stowage_loopdriver::ImageStore;

pub struct Scratch {
    pub base: PathBuf,
}

impl Scratch {
    /// `<tmp>/stowage-<kind>-<name>-<pid>`, with an image store marked as an install marks it, so
    /// the controller service creates and deletes there.
    pub fn new(kind: &str, name: &str) -> Self {
        let base = std::env::temp_dir().join(format!("stowage-{kind}-{name}-{}", std::process::id()));
        std::fs::create_dir_all(base.join("images")).unwrap();
        ImageStore::new(base.join("images")).init().unwrap();
        Self {
            base: std::fs::canonicalize(&base).unwrap(),
        }
    }

    /// Mounts under the scratch dir, deepest first (the order they unmount in).
    pub fn mounts(&self) -> Vec<PathBuf> {
        let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let mut v: Vec<PathBuf> = table
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .map(PathBuf::from)
            .filter(|p| p.starts_with(&self.base))
            .collect();
        v.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        v
    }

    /// Loop devices backed by files under the scratch dir.
    pub fn loops(&self) -> Vec<String> {
        let out = Command::new("losetup").arg("-a").output().unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains(self.base.to_str().unwrap()))
            .filter_map(|l| l.split(':').next().map(String::from))
            .collect()
    }

    /// Another loop device of the image, as a second node's attacher would make.
    #[allow(dead_code)] // used by one of the two test crates
    pub fn attach(&self, image: &Path) -> String {
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(image)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for m in self.mounts() {
            let _ = Command::new("umount").arg("-l").arg(&m).status();
        }
        for d in self.loops() {
            let _ = Command::new("losetup").arg("-d").arg(&d).status();
        }
        let _ = std::fs::remove_dir_all(&self.base);
    }
}
