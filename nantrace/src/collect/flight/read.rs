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

/// How long one file's read may take (a dump on a hung NFS or Lustre mount blocks in read).
pub const READ_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// Read `path` as the job's user `owner` (uid, gid), on a thread of its own with that user's
/// filesystem rights, within [`READ_DEADLINE`] (past it the thread is abandoned and the read
/// said `refused`). Never as root: a job whose user is unknown (its process gone, a setuid
/// helper's mixed ids) or is root (a root container's paths are the host's here) is not read.
/// Without root (nantrace as a user) only that user's own files are read.
pub fn dump(path: &Path, owner: Option<(u32, u32)>, max: u64) -> Result<(Vec<u8>, u64), Why> {
    // SAFETY: no failure mode.
    let root = unsafe { libc::geteuid() } == 0;
    let Some((uid, gid)) = owner else {
        return Err(Why::Refused("the job's user is not known (its process is gone, or its ids differ: a setuid program): not read".into()));
    };
    if uid == 0 {
        return Err(Why::Refused(
            "a job of root's: its paths are not read as root".into(),
        ));
    }
    if !root {
        // SAFETY: no failure mode.
        if unsafe { libc::geteuid() } != uid {
            return Err(Why::Refused(format!(
                "nantrace runs as another user than the job's ({uid})"
            )));
        }
        return read_here(path, Some(uid), max);
    }
    let path = path.to_path_buf();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("nantrace-fr-read".into())
        .spawn(move || {
            let r = if become_job(uid, gid) {
                read_here(&path, Some(uid), max)
            } else {
                Err(Why::Refused(format!(
                    "could not take uid {uid}'s rights to read it"
                )))
            };
            let _ = tx.send(r);
        })
        .map_err(|e| Why::Refused(e.to_string()))?;
    rx.recv_timeout(READ_DEADLINE).unwrap_or_else(|e| {
        Err(Why::Refused(match e {
            std::sync::mpsc::RecvTimeoutError::Timeout => format!(
                "the read took over {} s (a hung filesystem?): abandoned",
                READ_DEADLINE.as_secs()
            ),
            std::sync::mpsc::RecvTimeoutError::Disconnected => {
                "the reading thread ended without an answer".into()
            }
        }))
    })
}
