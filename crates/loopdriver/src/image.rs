//! The image store: one sparse file `<dir>/<volume-handle>.img` per volume. The one place that
//! decides which handles are acceptable and where their images live; the provisioner, the
//! resizer, the attacher and the CSI services all go through it.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};

/// Longest handle accepted: `<handle>.img` must fit one file name (NAME_MAX = 255 bytes).
pub const MAX_HANDLE_LEN: usize = 255 - ".img".len();

/// Why a handle is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandleError {
    #[error("volume handle is empty")]
    Empty,
    #[error("volume handle {0:?} names a directory")]
    Dots(String),
    /// `/` and NUL would leave the image dir; `\` is escaped in the mount table and in losetup's
    /// output, so a path with it could not be matched back to its image.
    #[error("volume handle {0:?} contains '/', '\\' or NUL")]
    Separator(String),
    #[error("volume handle is {0} bytes long, more than {MAX_HANDLE_LEN}")]
    TooLong(usize),
}

/// The single rule for volume handles of this driver.
pub fn check_handle(handle: &str) -> Result<(), HandleError> {
    if handle.is_empty() {
        Err(HandleError::Empty)
    } else if handle == "." || handle == ".." {
        Err(HandleError::Dots(handle.into()))
    } else if handle.contains(['/', '\\', '\0']) {
        Err(HandleError::Separator(handle.into()))
    } else if handle.len() > MAX_HANDLE_LEN {
        Err(HandleError::TooLong(handle.len()))
    } else {
        Ok(())
    }
}

pub fn valid_handle(handle: &str) -> bool {
    check_handle(handle).is_ok()
}

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A handle that is not a plain file name could point outside the image dir; refuse it.
    #[error(transparent)]
    BadHandle(#[from] HandleError),
    #[error("image {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
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

    pub fn not_found(&self) -> bool {
        matches!(self, ImageError::Io { source, .. } if source.kind() == ErrorKind::NotFound)
    }
}

/// What `ensure` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ensured {
    Created,
    Grown,
    /// Already at least the size asked for; left as it was.
    Kept,
}

/// A directory of images.
#[derive(Debug, Clone)]
pub struct ImageStore {
    dir: PathBuf,
}

impl ImageStore {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the image of `handle` lives.
    pub fn path(&self, handle: &str) -> Result<PathBuf, HandleError> {
        check_handle(handle)?;
        Ok(self.dir.join(format!("{handle}.img")))
    }

    fn io(path: &Path) -> impl Fn(std::io::Error) -> ImageError + '_ {
        move |source| ImageError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    /// The image's size in bytes; a `not_found()` error when there is none.
    pub fn size(&self, handle: &str) -> Result<u64, ImageError> {
        let path = self.path(handle)?;
        let m = std::fs::metadata(&path).map_err(Self::io(&path))?;
        Ok(m.len())
    }

    pub fn exists(&self, handle: &str) -> Result<bool, ImageError> {
        match self.size(handle) {
            Ok(_) => Ok(true),
            Err(e) if e.not_found() => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Creates the sparse image of `size` bytes, or grows an existing smaller one; never shrinks
    /// or rewrites an existing image (it may hold data). Idempotent by name. When the size cannot
    /// be set, an empty file (one this call or an earlier failed one made) is removed again, so a
    /// failed creation leaves nothing behind; a file with content is never removed here.
    pub fn ensure(&self, handle: &str, size: u64) -> Result<(PathBuf, Ensured), ImageError> {
        let path = self.path(handle)?;
        let io = Self::io(&path);
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(&io)?;
        let len = f.metadata().map_err(&io)?.len();
        if len >= size {
            // A zero-sized request on a fresh file still leaves a (zero-length) image; say so.
            return Ok((
                path.clone(),
                if len == 0 { Ensured::Created } else { Ensured::Kept },
            ));
        }
        if let Err(e) = f.set_len(size).and_then(|()| f.sync_all()) {
            if len == 0 {
                drop(f);
                let _ = std::fs::remove_file(&path);
            }
            return Err(io(e));
        }
        Ok((
            path.clone(),
            if len == 0 {
                Ensured::Created
            } else {
                Ensured::Grown
            },
        ))
    }

    /// Grows an existing image to at least `size`; a missing image is `not_found()`, never made.
    pub fn grow(&self, handle: &str, size: u64) -> Result<u64, ImageError> {
        let path = self.path(handle)?;
        let io = Self::io(&path);
        let f = std::fs::OpenOptions::new().write(true).open(&path).map_err(&io)?;
        let len = f.metadata().map_err(&io)?.len();
        if len < size {
            f.set_len(size).and_then(|()| f.sync_all()).map_err(&io)?;
            return Ok(size);
        }
        Ok(len)
    }

    /// Removes the image; `Ok(false)` when it was already gone.
    pub fn remove(&self, handle: &str) -> Result<bool, ImageError> {
        let path = self.path(handle)?;
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
            Err(source) => Err(ImageError::Io { path, source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn handles_that_escape_the_dir_or_the_name_limit_are_refused() {
        let s = ImageStore::new("/images");
        for h in ["", ".", "..", "../x", "a/b", "a\0b", "a\\b"] {
            assert!(s.path(h).is_err(), "{h:?}");
        }
        assert!(s.path(&"x".repeat(MAX_HANDLE_LEN + 1)).is_err());
        let longest = "x".repeat(MAX_HANDLE_LEN);
        assert_eq!(s.path(&longest).unwrap().file_name().unwrap().len(), 255);
        assert_eq!(s.path("pvc-1").unwrap(), Path::new("/images/pvc-1.img"));
    }

    proptest! {
        /// Whatever the handle, an accepted one stays a direct child of the image dir.
        #[test]
        fn accepted_handles_stay_in_the_dir(h in "\\PC{0,300}") {
            let s = ImageStore::new("/images");
            if let Ok(p) = s.path(&h) {
                prop_assert_eq!(p.parent(), Some(Path::new("/images")));
                prop_assert!(p.file_name().unwrap().len() <= 255);
            }
        }
    }

    #[test]
    fn the_longest_handle_makes_a_real_file() {
        let dir = tempfile::tempdir().unwrap();
        let s = ImageStore::new(dir.path());
        s.ensure(&"x".repeat(MAX_HANDLE_LEN), 4096).unwrap();
    }

    #[test]
    fn ensure_is_idempotent_grows_and_never_shrinks() {
        let dir = tempfile::tempdir().unwrap();
        let s = ImageStore::new(dir.path());
        let (p, how) = s.ensure("v", 1 << 20).unwrap();
        assert_eq!(how, Ensured::Created);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 1 << 20);
        std::fs::write(&p, b"data").unwrap();
        assert_eq!(s.ensure("v", 2).unwrap().1, Ensured::Kept);
        assert_eq!(
            std::fs::read(&p).unwrap(),
            b"data",
            "an existing image is never shrunk or rewritten"
        );
        assert_eq!(s.ensure("v", 2 << 20).unwrap().1, Ensured::Grown);
        assert_eq!(s.size("v").unwrap(), 2 << 20);
        assert_eq!(&std::fs::read(&p).unwrap()[..4], b"data");
        s.ensure("v", 1 << 20).unwrap();
        assert_eq!(s.size("v").unwrap(), 2 << 20);
        assert_eq!(s.grow("v", 3 << 20).unwrap(), 3 << 20);
        assert_eq!(s.grow("v", 1).unwrap(), 3 << 20, "grow never shrinks");
        assert!(s.remove("v").unwrap());
        assert!(!s.remove("v").unwrap());
        assert!(s.grow("v", 1).unwrap_err().not_found(), "grow never creates");
        assert!(!s.exists("v").unwrap());
    }

    #[test]
    fn a_size_the_file_system_cannot_hold_is_permanent_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let s = ImageStore::new(dir.path());
        // Beyond any off_t: refused before the file system is asked.
        let e = s.ensure("huge", u64::MAX).unwrap_err();
        assert!(e.permanent(), "{e}");
        assert!(
            !dir.path().join("huge.img").exists(),
            "no empty image left behind"
        );
        // An existing image with content is never removed, even when growing it fails.
        std::fs::write(dir.path().join("kept.img"), b"data").unwrap();
        assert!(s.ensure("kept", u64::MAX).is_err());
        assert_eq!(std::fs::read(dir.path().join("kept.img")).unwrap(), b"data");
        assert!(ImageError::BadHandle(HandleError::Empty).permanent());
        let eio = ImageError::Io {
            path: PathBuf::new(),
            source: std::io::Error::other("EIO"),
        };
        assert!(!eio.permanent(), "I/O errors may pass: retried");
    }
}
