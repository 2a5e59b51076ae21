//! A job's file read with the job's rights: on a thread of its own whose filesystem identity
//! is the job's (setfsuid/setfsgid and, for that thread only, the raw setgroups system call:
//! root's access to other files is gone there, so a path through a directory the user
//! planted reaches nothing the user could not read), never through a link (O_NOFOLLOW, a
//! FIFO or a device refused before it is opened), owned by the job's user, bounded.
use std::io::Read as _;
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum Why {
    #[error("no file")]
    NoFile,
    #[error("refused: {0}")]
    Refused(String),
    #[error("{0} bytes: over the {1}-byte limit, not read")]
    TooBig(u64, u64),
}

impl Why {
    /// The status flight_recorder.json says.
    pub fn status(&self) -> &'static str {
        match self {
            Why::NoFile => "no_file",
            Why::Refused(_) => "refused",
            Why::TooBig(..) => "too_big",
        }
    }
}

/// Take the job's filesystem identity on this thread; false when it did not take.
fn become_job(uid: u32, gid: u32) -> bool {
    // SAFETY: these calls change the calling thread's credentials only (the raw setgroups
    // system call, unlike glibc's wrapper, is not broadcast to the other threads); the
    // thread ends after the read.
    unsafe {
        let groups = [gid];
        if libc::syscall(libc::SYS_setgroups, 1usize, groups.as_ptr()) != 0 {
            return false;
        }
        libc::setfsgid(gid);
        libc::setfsuid(uid);
        // setfsuid answers the previous id: asking with an invalid one reads the current.
        libc::setfsuid(u32::MAX) as u32 == uid && libc::setfsgid(u32::MAX) as u32 == gid
    }
}

fn read_here(path: &Path, owner: Option<u32>, max: u64) -> Result<(Vec<u8>, u64), Why> {
    let lm = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Why::NoFile),
        Err(e) => return Err(Why::Refused(e.to_string())),
        Ok(m) => m,
    };
    if !lm.file_type().is_file() {
        return Err(Why::Refused(
            "not a regular file (a link, a FIFO, a device or a directory is never read)".into(),
        ));
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Why::Refused(e.to_string()))?;
    let m = f.metadata().map_err(|e| Why::Refused(e.to_string()))?;
    if !m.is_file() {
        return Err(Why::Refused("not a regular file".into()));
    }
    if let Some(uid) = owner.filter(|u| m.uid() != *u) {
        return Err(Why::Refused(format!(
            "owned by uid {}, not by the job's user {uid}",
            m.uid()
        )));
    }
    if m.len() > max {
        return Err(Why::TooBig(m.len(), max));
    }
    let mut b = Vec::new();
    f.take(max + 1)
        .read_to_end(&mut b)
        .map_err(|e| Why::Refused(e.to_string()))?;
    if b.len() as u64 > max {
        return Err(Why::TooBig(b.len() as u64, max));
    }
    Ok((b, u64::try_from(m.mtime()).unwrap_or(0)))
}

/// Read `path` as the job's user `owner` (uid, gid): as that user when nantrace is root and
/// the job is not, else as nantrace itself (a job of nantrace's own user, or root's).
pub fn dump(path: &Path, owner: Option<(u32, u32)>, max: u64) -> Result<(Vec<u8>, u64), Why> {
    // SAFETY: no failure mode.
    let root = unsafe { libc::geteuid() } == 0;
    match owner {
        Some((uid, gid)) if root && uid != 0 => {
            let path = path.to_path_buf();
            std::thread::Builder::new()
                .name("nantrace-fr-read".into())
                .spawn(move || {
                    if !become_job(uid, gid) {
                        return Err(Why::Refused(format!(
                            "could not take uid {uid}'s rights to read it"
                        )));
                    }
                    read_here(&path, Some(uid), max)
                })
                .map_err(|e| Why::Refused(e.to_string()))?
                .join()
                .unwrap_or_else(|_| Err(Why::Refused("the reading thread panicked".into())))
        }
        _ => read_here(path, owner.map(|o| o.0), max),
    }
}
