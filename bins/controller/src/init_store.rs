//! `stowage-controller init-image-store DIR`: the install step that marks DIR as the built-in
//! driver's image store. The controller and the agents create and delete images only in a
//! directory with the marker, so that an empty mount point (the shared file system not mounted on
//! that node) is never taken for the store. It is run on purpose, by whoever can tell that DIR is
//! the shared file system, never by a controller on its own.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use clap::Parser;
use stowage_loopdriver::ImageStore;
use stowage_loopdriver::mountinfo::{self, MountEntry};

/// The subcommand's name, as the first argument.
pub const NAME: &str = "init-image-store";

#[derive(Debug, Parser)]
#[command(
    name = "stowage-controller init-image-store",
    about = "Mark DIR as the image store of loop.stowage.dev (once, at install, where the shared file system is mounted)."
)]
pub struct InitArgs {
    /// The image store: the directory of the shared file system every node mounts. Never created.
    pub dir: PathBuf,
    /// Only report the marker (exit status 1 when DIR has none); write nothing.
    #[arg(long)]
    pub check: bool,
}

/// Runs the subcommand on `argv` (its name first); returns the exit status.
pub fn main(argv: &[std::ffi::OsString]) -> i32 {
    // Usage and errors name the whole command, not the subcommand alone.
    let argv =
        std::iter::once(format!("stowage-controller {NAME}").into()).chain(argv.iter().skip(1).cloned());
    let args = InitArgs::parse_from(argv);
    let store = ImageStore::new(&args.dir);
    let on = file_system(&args.dir);
    let r = if args.check {
        store.ready_now().map(|m| (m, false)).map_err(|e| e.to_string())
    } else {
        store
            .init()
            .map_err(|e| format!("cannot mark {}: {e}", args.dir.display()))
    };
    match r {
        Ok((m, made)) => {
            let what = if made { "marked as" } else { "is already" };
            println!(
                "{} {what} the image store: id {}, created {} on {}; {on}",
                args.dir.display(),
                m.id,
                m.created,
                if m.created_on.is_empty() {
                    "an unknown host"
                } else {
                    &m.created_on
                },
            );
            0
        }
        Err(e) => {
            eprintln!("stowage-controller {NAME}: {e}; {on}");
            1
        }
    }
}

/// Which mounted file system holds `dir`, in words, so whoever runs the step sees whether it is
/// the shared one or the node's own disk.
fn file_system(dir: &Path) -> String {
    let (Ok(meta), Ok(canon)) = (std::fs::metadata(dir), std::fs::canonicalize(dir)) else {
        return format!("{} cannot be read", dir.display());
    };
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let dev = mountinfo::split_dev(meta.dev());
    let holder: Option<MountEntry> = mountinfo::parse(&table)
        .into_iter()
        .filter(|m| m.devno == dev && canon.starts_with(&m.mount_point))
        .max_by_key(|m| m.mount_point.components().count());
    match holder {
        Some(m) => format!(
            "it is on {} ({}) mounted at {}",
            m.source,
            m.fstype,
            m.mount_point.display()
        ),
        None => "its file system is not in the mount table".into(),
    }
}
