//! The built-in driver's storage: sparse image files `<image-dir>/<volume-handle>.img`, and the
//! PV the built-in provisioner creates for a claim.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PersistentVolume,
    PersistentVolumeClaim, PersistentVolumeSpec, VolumeNodeAffinity,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;
use kube::api::ObjectMeta;

use crate::core::reference_to;
use crate::objects::*;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A handle that is not a plain file name could point outside the image dir; refuse it.
    #[error("volume handle {0:?} is not a plain file name")]
    BadHandle(String),
    #[error("image {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub fn image_path(dir: &Path, handle: &str) -> Result<PathBuf, ImageError> {
    if !plain_handle(handle) {
        return Err(ImageError::BadHandle(handle.into()));
    }
    Ok(dir.join(format!("{handle}.img")))
}

impl ImageError {
    /// Errors no retry can fix: a bad handle, a size the file system cannot hold (EFBIG, or
    /// beyond what a file offset can express), a name too long. Anything else (EIO, ENOSPC, a
    /// missing directory that may yet be mounted) may pass and is retried.
    pub fn permanent(&self) -> bool {
        match self {
            ImageError::BadHandle(_) => true,
            ImageError::Io { source, .. } => matches!(
                source.kind(),
                ErrorKind::FileTooLarge | ErrorKind::InvalidInput | ErrorKind::InvalidFilename
            ),
        }
    }
}

/// Creates the sparse image of `size` bytes, or grows an existing smaller one; never shrinks or
/// rewrites an existing image (it may hold data). Idempotent by name. When the size cannot be
/// set, an empty file (one this call or an earlier failed one made) is removed again, so a failed
/// creation leaves nothing behind; a file with content is never removed here.
pub fn ensure_image(dir: &Path, handle: &str, size: u64) -> Result<PathBuf, ImageError> {
    let path = image_path(dir, handle)?;
    let io = |source| ImageError::Io {
        path: path.clone(),
        source,
    };
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    if len < size {
        let grown = f.set_len(size).and_then(|()| f.sync_all());
        if let Err(e) = grown {
            if len == 0 {
                drop(f);
                let _ = std::fs::remove_file(&path);
            }
            return Err(io(e));
        }
    }
    Ok(path)
}

/// Removes the image; `Ok(false)` when it was already gone.
pub fn remove_image(dir: &Path, handle: &str) -> Result<bool, ImageError> {
    let path = image_path(dir, handle)?;
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(source) => Err(ImageError::Io { path, source }),
    }
}

/// The name of the PV provisioned for a claim (one per claim UID, so retries are idempotent).
pub fn provisioned_name(claim: &PersistentVolumeClaim) -> Option<String> {
    claim.metadata.uid.as_ref().map(|u| format!("pvc-{u}"))
}

/// The PV the built-in provisioner creates for `claim` of `class`: pre-bound to the claim, its
/// image still pending, the deleter finalizer in place before any storage exists.
pub fn provisioned_pv(claim: &PersistentVolumeClaim, class: &StorageClass) -> Option<PersistentVolume> {
    let name = provisioned_name(claim)?;
    let spec = claim.spec.as_ref()?;
    let request = spec
        .resources
        .as_ref()?
        .requests
        .as_ref()?
        .get("storage")?
        .clone();
    let policy = class.reclaim_policy.clone().unwrap_or_else(|| "Delete".into());
    let params = class.parameters.clone().unwrap_or_default();
    let fs_type = params
        .get("csi.storage.k8s.io/fstype")
        .or_else(|| params.get("fsType"))
        .cloned()
        .unwrap_or_else(|| "ext4".into());
    let node_affinity = class
        .allowed_topologies
        .as_ref()
        .filter(|t| !t.is_empty())
        .map(|terms| VolumeNodeAffinity {
            required: Some(NodeSelector {
                node_selector_terms: terms
                    .iter()
                    .map(|t| NodeSelectorTerm {
                        match_expressions: Some(
                            t.match_label_expressions
                                .iter()
                                .flatten()
                                .map(|e| NodeSelectorRequirement {
                                    key: e.key.clone(),
                                    operator: "In".into(),
                                    values: Some(e.values.clone()),
                                })
                                .collect(),
                        ),
                        match_fields: None,
                    })
                    .collect(),
            }),
        });
    let annotations = BTreeMap::from([
        (ANN_PROVISIONED_BY.to_string(), LOOP_DRIVER.to_string()),
        (ANN_BOUND_BY_CONTROLLER.to_string(), "yes".to_string()),
        (ANN_IMAGE_PENDING.to_string(), "true".to_string()),
    ]);
    Some(PersistentVolume {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            annotations: Some(annotations),
            finalizers: (policy == "Delete").then(|| vec![FINALIZER_LOOP_DELETER.to_string()]),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some(BTreeMap::from([("storage".to_string(), Quantity(request.0))])),
            access_modes: spec.access_modes.clone(),
            volume_mode: spec.volume_mode.clone(),
            storage_class_name: Some(class.name_any()),
            persistent_volume_reclaim_policy: Some(policy),
            mount_options: class.mount_options.clone(),
            csi: Some(CSIPersistentVolumeSource {
                driver: LOOP_DRIVER.into(),
                volume_handle: name,
                fs_type: Some(fs_type),
                ..Default::default()
            }),
            claim_ref: Some(reference_to(claim)),
            node_affinity,
            volume_attributes_class_name: spec.volume_attributes_class_name.clone(),
            ..Default::default()
        }),
        status: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_that_escape_the_dir_are_refused() {
        for h in ["", ".", "..", "../x", "a/b", "a\0b"] {
            assert!(image_path(Path::new("/images"), h).is_err(), "{h:?}");
        }
        assert_eq!(
            image_path(Path::new("/images"), "pvc-1").unwrap(),
            Path::new("/images/pvc-1.img")
        );
    }

    #[test]
    fn ensure_is_idempotent_grows_and_never_shrinks() {
        let dir = tempfile::tempdir().unwrap();
        let p = ensure_image(dir.path(), "v", 1 << 20).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 1 << 20);
        std::fs::write(&p, b"data").unwrap();
        ensure_image(dir.path(), "v", 2).unwrap();
        assert_eq!(
            std::fs::read(&p).unwrap(),
            b"data",
            "an existing image is never shrunk or rewritten"
        );
        ensure_image(dir.path(), "v", 2 << 20).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 2 << 20);
        assert_eq!(&std::fs::read(&p).unwrap()[..4], b"data");
        ensure_image(dir.path(), "v", 1 << 20).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 2 << 20);
        assert!(remove_image(dir.path(), "v").unwrap());
        assert!(!remove_image(dir.path(), "v").unwrap());
    }

    #[test]
    fn a_size_the_file_system_cannot_hold_is_permanent_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        // Beyond any off_t: refused before the file system is asked.
        let e = ensure_image(dir.path(), "huge", u64::MAX).unwrap_err();
        assert!(e.permanent(), "{e}");
        assert!(
            !dir.path().join("huge.img").exists(),
            "no empty image left behind"
        );
        // An existing image with content is never removed, even when growing it fails.
        std::fs::write(dir.path().join("kept.img"), b"data").unwrap();
        assert!(ensure_image(dir.path(), "kept", u64::MAX).is_err());
        assert_eq!(std::fs::read(dir.path().join("kept.img")).unwrap(), b"data");
        assert!(ImageError::BadHandle("../x".into()).permanent());
        let eio = ImageError::Io {
            path: PathBuf::new(),
            source: std::io::Error::other("EIO"),
        };
        assert!(!eio.permanent(), "I/O errors may pass: retried");
    }
}
