//! The image store: one sparse file `<dir>/<volume-handle>.img` per volume. The one place that
//! decides which handles are acceptable and where their images live; the provisioner, the
//! resizer, the attacher and the CSI services all go through it.
//!
//! A store is marked by a file (`MARKER`) written once, on purpose, by whoever set the store up
//! (`stowage-controller init-image-store DIR`). Everything that creates or deletes images asks
//! `ImageStore::ready` first: a directory without the marker may be the empty mount point of a
//! shared file system that is not mounted on this node, and images made there land on the wrong
//! disk, while images "missing" there are in fact on the store, not gone.

use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

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

/// The marker's file name. Not `*.img`, so no handle can name it.
pub const MARKER: &str = ".stowage-image-store";
/// The marker's first line; a file that does not start with it is not our marker.
const MARKER_HEADER: &str = "# stowage image store: the images of loop.stowage.dev volumes live here";
/// How long a found marker is trusted before it is read again: long enough that a burst of
/// provisioning reads it once, short enough that an unmount is noticed within seconds.
pub const RECHECK: Duration = Duration::from_secs(10);

/// What the marker says about the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marker {
    /// Random, made when the store was initialized: tells one store from another.
    pub id: String,
    /// When it was initialized (RFC 3339, UTC).
    pub created: String,
    /// The host that initialized it.
    pub created_on: String,
}

/// Why the store may not be used for creating or deleting images now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    #[error(
        "image store {dir} has no marker {MARKER}: the shared file system may not be mounted here \
         (mount it), or, on a new install, it was never marked (run `stowage-controller \
         init-image-store {dir}` once where it is mounted)"
    )]
    NoMarker { dir: String },
    #[error("image store {dir}: cannot read {MARKER}: {error}")]
    Unreadable { dir: String, error: String },
    #[error("image store {dir}: {MARKER} is not a stowage image store marker: {error}")]
    Malformed { dir: String, error: String },
}

/// A directory of images.
#[derive(Debug, Clone)]
pub struct ImageStore {
    dir: PathBuf,
    /// When the marker was last found, shared by clones (one cache per store a process uses).
    checked: Arc<Mutex<Option<(Instant, Marker)>>>,
}

impl ImageStore {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            checked: Arc::default(),
        }
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

    /// Whether images may be created or deleted here: the marker was found within `RECHECK`,
    /// else it is read now. Blocking (file I/O); call it where the image step runs.
    pub fn ready(&self) -> Result<Marker, NotReady> {
        if let Some((at, m)) = self.checked.lock().unwrap_or_else(|e| e.into_inner()).as_ref()
            && at.elapsed() < RECHECK
        {
            return Ok(m.clone());
        }
        self.ready_now()
    }

    /// Reads the marker now, whatever the cache holds (before acting on an image being missing:
    /// the store may have been unmounted a moment ago). Blocking.
    pub fn ready_now(&self) -> Result<Marker, NotReady> {
        let r = self.read_marker();
        let mut cached = self.checked.lock().unwrap_or_else(|e| e.into_inner());
        match &r {
            Ok(m) => {
                if let Some((_, old)) = cached.as_ref()
                    && old.id != m.id
                {
                    tracing::warn!(dir = %self.dir.display(), old = %old.id, new = %m.id, "the image store's marker changed: another store is mounted here");
                }
                *cached = Some((Instant::now(), m.clone()));
            }
            Err(_) => *cached = None,
        }
        r
    }

    fn read_marker(&self) -> Result<Marker, NotReady> {
        let dir = self.dir.display().to_string();
        let mut text = String::new();
        match std::fs::File::open(self.dir.join(MARKER)).and_then(|f| f.take(4096).read_to_string(&mut text))
        {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => return Err(NotReady::NoMarker { dir }),
            Err(e) => {
                return Err(NotReady::Unreadable {
                    dir,
                    error: e.to_string(),
                });
            }
        }
        parse_marker(&text).map_err(|error| NotReady::Malformed { dir, error })
    }

    /// Marks this directory as the image store: the install step, never done implicitly. The
    /// directory must exist (it is never created: a missing mount must not become a local
    /// directory). An existing valid marker is kept and returned with `false`; a file that is not
    /// one is refused. The marker appears whole or not at all (written aside, then linked).
    pub fn init(&self) -> Result<(Marker, bool), std::io::Error> {
        match self.read_marker() {
            Ok(m) => return Ok((m, false)),
            Err(NotReady::NoMarker { .. }) => {}
            Err(e) => return Err(std::io::Error::other(e.to_string())),
        }
        if !std::fs::metadata(&self.dir)?.is_dir() {
            return Err(std::io::Error::new(
                ErrorKind::NotADirectory,
                format!("{} is not a directory", self.dir.display()),
            ));
        }
        let mut id = [0u8; 16];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut id)?;
        let marker = Marker {
            id: id.iter().map(|b| format!("{b:02x}")).collect(),
            created: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
            created_on: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_default(),
        };
        let text = format!(
            "{MARKER_HEADER}\nid: {}\ncreated: {}\ncreated-on: {}\n",
            marker.id, marker.created, marker.created_on
        );
        let tmp = self.dir.join(format!("{MARKER}.{}.tmp", std::process::id()));
        let written = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            // A link never replaces: two concurrent inits keep the first marker.
            std::fs::hard_link(&tmp, self.dir.join(MARKER))
        })();
        let _ = std::fs::remove_file(&tmp);
        match written {
            Ok(()) => {
                std::fs::File::open(&self.dir)?.sync_all()?;
                Ok((marker, true))
            }
            Err(e) if e.kind() == ErrorKind::AlreadyExists => self
                .read_marker()
                .map(|m| (m, false))
                .map_err(|e| std::io::Error::other(e.to_string())),
            Err(e) => Err(e),
        }
    }

    /// Bytes the store's images may still take as they are written: each sparse image's size less
    /// what it already occupies. Free space minus this is what the store can promise without
    /// overcommitting (`promisable`). Blocking.
    pub fn unwritten(&self) -> std::io::Result<u64> {
        use std::os::unix::fs::MetadataExt;
        let mut total = 0u64;
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            if entry.path().extension().is_none_or(|e| e != "img") {
                continue;
            }
            // Gone between the listing and the stat (deleted meanwhile): nothing to promise.
            let Ok(m) = entry.metadata() else { continue };
            total = total.saturating_add(m.len().saturating_sub(m.blocks().saturating_mul(512)));
        }
        Ok(total)
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

/// Makes the ext4 file system of a new image that no node will ever format (a ReadOnlyMany
/// volume: every node stages it read-only), with the node's own step (`sys::mkfs_ext4`, same
/// options). Only a blank image is formatted (`blkid -p`): a retry after a crash finds the ext4 it
/// made and leaves it, and an image that holds anything else is never overwritten. Every failure
/// may pass (a missing tool, an I/O error) or waits for an admin (a foreign file system).
pub async fn format_new_image(path: &Path, fs: &str) -> Result<(), ImageError> {
    use crate::sys::{self, Probe};
    let fail = |what: String| ImageError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(what),
    };
    let p = path
        .to_str()
        .ok_or_else(|| fail("the image path is not UTF-8".into()))?;
    match sys::probe(p).await {
        Ok(Probe::Blank) => {
            tracing::info!(image = %p, fs, "making the file system of a ReadOnlyMany volume");
            sys::mkfs(fs, p)
                .await
                .map_err(|e| fail(format!("cannot make its {fs} file system: {e}")))
        }
        Ok(Probe::Found(t)) if t == fs => Ok(()),
        Ok(Probe::Found(t)) => Err(fail(format!(
            "it holds {t}, not {fs}, and is never reformatted; remove the file or delete the claim"
        ))),
        Err(e) => Err(fail(format!("cannot probe it for a file system: {e}"))),
    }
}

/// What a store can still promise to new volumes: the bytes its file system has available, less
/// what existing sparse images may still take (`ImageStore::unwritten`), never below zero.
pub fn promisable(available: u64, unwritten: u64) -> u64 {
    available.saturating_sub(unwritten)
}

fn parse_marker(text: &str) -> Result<Marker, String> {
    let mut lines = text.lines();
    if lines.next() != Some(MARKER_HEADER) {
        return Err("its first line is not the marker's".into());
    }
    let mut m = Marker {
        id: String::new(),
        created: String::new(),
        created_on: String::new(),
    };
    for line in lines {
        match line.split_once(": ") {
            Some(("id", v)) => m.id = v.trim().to_string(),
            Some(("created", v)) => m.created = v.trim().to_string(),
            Some(("created-on", v)) => m.created_on = v.trim().to_string(),
            _ => {} // room for later fields
        }
    }
    if m.id.is_empty() {
        return Err("it has no id".into());
    }
    Ok(m)
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
    fn a_store_is_ready_only_with_its_marker_which_init_writes_once() {
        let dir = tempfile::tempdir().unwrap();
        let s = ImageStore::new(dir.path());
        assert!(matches!(s.ready(), Err(NotReady::NoMarker { .. })));
        let (m, made) = s.init().unwrap();
        assert!(made);
        assert_eq!(m.id.len(), 32);
        assert_eq!(s.ready().unwrap(), m);
        assert_eq!(s.init().unwrap(), (m.clone(), false), "init keeps the marker");
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, [MARKER], "no temporary file left");
        // Cached: a removal is seen by the next uncached read, at the latest after RECHECK.
        std::fs::remove_file(dir.path().join(MARKER)).unwrap();
        assert!(s.ready().is_ok());
        assert!(matches!(s.ready_now(), Err(NotReady::NoMarker { .. })));
        assert!(s.ready().is_err(), "a failed check empties the cache");
        std::fs::write(dir.path().join(MARKER), "something else\n").unwrap();
        assert!(matches!(s.ready(), Err(NotReady::Malformed { .. })));
        assert!(s.init().is_err(), "a foreign file is never overwritten");
        assert!(
            ImageStore::new(dir.path().join("absent")).init().is_err(),
            "init never creates the directory"
        );
    }

    #[test]
    fn unwritten_counts_what_sparse_images_may_still_take() {
        let dir = tempfile::tempdir().unwrap();
        let s = ImageStore::new(dir.path());
        assert_eq!(s.unwritten().unwrap(), 0);
        s.ensure("a", 8 << 20).unwrap();
        let (p, _) = s.ensure("b", 4 << 20).unwrap();
        std::fs::write(dir.path().join("notes.txt"), vec![0u8; 1 << 20]).unwrap();
        assert_eq!(
            s.unwritten().unwrap(),
            12 << 20,
            "two empty sparse images, other files ignored"
        );
        // Written data occupies blocks: it is no longer a promise but used space.
        let mut f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        std::io::Write::write_all(&mut f, &vec![1u8; 1 << 20]).unwrap();
        f.sync_all().unwrap();
        assert_eq!(s.unwritten().unwrap(), 11 << 20);
        assert_eq!(promisable(20 << 20, 11 << 20), 9 << 20);
        assert_eq!(promisable(1 << 20, 11 << 20), 0, "never below zero");
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
