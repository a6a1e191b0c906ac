//! The stage record: the one thing the node keeps besides the mount table, a small file per
//! staged volume naming its device and whether stage attached it, so unstage frees exactly what
//! stage took, across restarts.

use std::path::PathBuf;

use tonic::Status;

use super::{NodeService, io_status};

/// What stage did for a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staged {
    pub device: String,
    /// Stage made the loop device itself (no attacher in front); unstage frees it.
    pub attached_here: bool,
}

impl Staged {
    fn encode(&self) -> String {
        format!("device={}\nattached_here={}\n", self.device, self.attached_here)
    }

    fn decode(s: &str) -> Option<Self> {
        let mut device = None;
        let mut attached_here = None;
        for line in s.lines() {
            match line.split_once('=') {
                Some(("device", d)) if d.starts_with("/dev/") => device = Some(d.to_string()),
                Some(("attached_here", b)) => attached_here = b.parse().ok(),
                _ => {}
            }
        }
        Some(Self {
            device: device?,
            attached_here: attached_here?,
        })
    }
}

impl NodeService {
    fn record_path(&self, id: &str) -> PathBuf {
        // `id` passed the handle rules: a plain file name.
        self.state_dir.join("staged").join(id)
    }

    pub(super) async fn record(&self, id: &str) -> Option<Staged> {
        let s = tokio::fs::read_to_string(self.record_path(id)).await.ok()?;
        Staged::decode(&s)
    }

    pub(super) async fn save(&self, id: &str, staged: &Staged) -> Result<(), Status> {
        let path = self.record_path(id);
        let dir = path.parent().expect("record has a parent");
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|e| io_status("cannot create", dir, e))?;
        let tmp = path.with_extension("tmp");
        tokio::fs::write(&tmp, staged.encode())
            .await
            .map_err(|e| io_status("cannot write", &tmp, e))?;
        tokio::fs::rename(&tmp, &path)
            .await
            .map_err(|e| io_status("cannot write", &path, e))
    }

    pub(super) async fn forget(&self, id: &str) -> Result<(), Status> {
        let path = self.record_path(id);
        match tokio::fs::remove_file(&path).await {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_status("cannot remove", &path, e)),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_records_read_back_and_refuse_garbage() {
        let r = Staged {
            device: "/dev/loop3".into(),
            attached_here: true,
        };
        assert_eq!(Staged::decode(&r.encode()), Some(r));
        assert_eq!(Staged::decode("device=/etc/passwd\nattached_here=true\n"), None);
        assert_eq!(Staged::decode("device=/dev/loop1\n"), None);
    }
}
