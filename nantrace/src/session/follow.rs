//! Following a log file like `tail -F` (attach mode, the agent): rotation, truncation,
//! container log formats, and the checks that make reading a job's chosen path as root safe.
use std::io::{Read as _, Seek as _, SeekFrom};
use std::os::unix::fs::MetadataExt as _;
use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::mpsc;

use super::logs::{log_event, LineReader, LineSplitter};
use super::Input;
use crate::event::comm_from;
use crate::nanscan::Scanner;

/// How a followed file holds the job's lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// The job's output as it printed it.
    Plain,
    /// A container runtime's log file (CRI or Docker json-file): records joined into lines.
    Cri,
}

/// Follow a log file like `tail -F`: survives rotation (new inode) and truncation.
/// `owner`: the file is read only while it belongs to this uid and is not a symlink
/// (the agent follows paths a job chose: a link to a root-only file is not read as root).
/// `behind`: how many followers of the session have not yet read their file to its end (the
/// job's end waits for them, so the last lines of a flood are not lost).
pub fn follow_file(
    path: PathBuf,
    pid: u32,
    format: LogFormat,
    owner: Option<u32>,
    scanner: Scanner,
    tx: mpsc::Sender<Input>,
    behind: std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    use std::sync::atomic::Ordering;
    std::thread::spawn(move || {
        let mut am_behind = false;
        let mut set_behind = |b: bool| {
            if b != am_behind {
                am_behind = b;
                if b {
                    behind.fetch_add(1, Ordering::SeqCst)
                } else {
                    behind.fetch_sub(1, Ordering::SeqCst)
                };
            }
        };
        let comm = comm_of(pid);
        let mut reader = LineReader::new(scanner);
        let mut cri = super::cri::CriJoiner::default();
        let mut file: Option<(std::fs::File, u64)> = None;
        let mut pos = 0u64;
        let mut split = LineSplitter::default();
        let mut first = true;
        let mut refused = false;
        // The file last refused (device, inode): not opened again until it changes, so a FIFO
        // planted there is not opened every 100 ms (review 8).
        let mut refused_id: Option<(u64, u64, u32, i64, i64)> = None;
        let mut refused_at = std::time::Instant::now();
        let mut buf = vec![0u8; 64 * 1024];
        let mut lines: Vec<String> = Vec::new();
        let wake = DirWatch::new(&path);
        let mut send = |lines: &mut Vec<String>| -> bool {
            for l in lines.drain(..) {
                let (stream, text) = match format {
                    LogFormat::Plain => (0, l),
                    LogFormat::Cri => match cri.push(&l) {
                        Some(x) => x,
                        None => continue,
                    },
                };
                if tx
                    .blocking_send(Input::Log(log_event(&mut reader, text, stream, pid, comm)))
                    .is_err()
                {
                    return false;
                }
            }
            true
        };
        loop {
            if tx.is_closed() {
                set_behind(false);
                return;
            }
            // (Re)open on start, after rotation, or when the file appears.
            let meta = std::fs::metadata(&path).ok();
            // What was refused is known by device, inode, type and change time (an inode number
            // is reused at once: a FIFO then a regular file at the same number, re-review D3),
            // and tried again every 5 s anyway.
            let id = std::fs::symlink_metadata(&path)
                .ok()
                .map(|m| (m.dev(), m.ino(), m.mode(), m.ctime(), m.ctime_nsec()));
            let rotated = match (&file, &meta) {
                (Some((_, ino)), Some(m)) => m.ino() != *ino,
                (None, Some(_)) => {
                    refused_id.is_none()
                        || refused_id != id
                        || refused_at.elapsed() > Duration::from_secs(5)
                }
                _ => false,
            };
            if rotated {
                // Read what is left in the old file before switching.
                if let Some((f, _)) = file.as_mut() {
                    while let Ok(n) = f.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        split.push(&buf[..n], |l| lines.push(l));
                    }
                    split.finish(|l| lines.push(l));
                    if !send(&mut lines) {
                        return;
                    }
                }
                file = None;
                match open_log(&path, owner) {
                    Ok((mut f, m)) => {
                        refused = false;
                        refused_id = None;
                        // On attach, start up to 256 KiB back so the bundle has the recent
                        // history; a new file that is already long (a 1 TiB sparse file put
                        // in the log's place, review 7) likewise.
                        pos = if first || m.len() > 256 * 1024 {
                            m.len().saturating_sub(256 * 1024)
                        } else {
                            0
                        };
                        let _ = f.seek(SeekFrom::Start(pos));
                        // The first line read from there may be a fragment: it is kept (its
                        // end can be the line that matters, after a sparse run of zeros).
                        split = LineSplitter::default();
                        first = false;
                        file = Some((f, m.ino()));
                    }
                    Err(e) if !refused => {
                        refused = true;
                        refused_id = id;
                        refused_at = std::time::Instant::now();
                        crate::say!(
                            "nantrace: WARNING: not reading {}: {e}",
                            crate::term::clean(&path.display().to_string())
                        );
                    }
                    Err(_) => {
                        refused_id = id;
                        refused_at = std::time::Instant::now();
                    }
                }
            } else if let (Some((f, _)), Some(m)) = (file.as_mut(), &meta) {
                if m.len() < pos {
                    // Truncated (copytruncate rotation): start again from the top (or 256 KiB
                    // before the end when it is already long again).
                    pos = m.len().saturating_sub(256 * 1024);
                    let _ = f.seek(SeekFrom::Start(pos));
                    split = LineSplitter::default();
                }
            }
            // At most 16 MiB per round: the session's end and a closed channel are seen
            // between rounds, whatever the file does.
            let mut budget = 16usize << 20;
            if let Some((f, _)) = file.as_mut() {
                while let Ok(n) = f.read(&mut buf) {
                    if n == 0 || tx.is_closed() {
                        break;
                    }
                    set_behind(true);
                    budget = budget.saturating_sub(n);
                    pos += n as u64;
                    split.push(&buf[..n], |l| lines.push(l));
                    if !send(&mut lines) {
                        set_behind(false);
                        return;
                    }
                    if budget == 0 {
                        break;
                    }
                }
            }
            if budget == 0 {
                continue;
            }
            set_behind(false);
            // Woken by any change in the log's directory (a write, a rotation), else every
            // 100 ms: a line is read right after it is written, before a copytruncate can
            // remove it (redteam 2.13).
            match &wake {
                Some(w) => w.wait(Duration::from_millis(100)),
                None => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    });
}

/// Open a log to follow; with `owner`, only a regular file (not a link) owned by that uid,
/// opened without following a link.
fn open_log(
    path: &std::path::Path,
    owner: Option<u32>,
) -> std::io::Result<(std::fs::File, std::fs::Metadata)> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let Some(uid) = owner else {
        let f = std::fs::File::open(path)?;
        let m = f.metadata()?;
        return Ok((f, m));
    };
    // Looked at before it is opened: a FIFO is never opened (its writer would be woken and get
    // SIGPIPE, review 8), a link never followed.
    let lm = std::fs::symlink_metadata(path)?;
    if !lm.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    let m = f.metadata()?;
    if !m.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    // Exactly the job's user: a root-owned file reached through a directory link the user
    // planted (`~/logs -> /etc`) is not read as root.
    if m.uid() != uid {
        return Err(std::io::Error::other(format!(
            "owned by uid {}, not by the job's user {uid}",
            m.uid()
        )));
    }
    Ok((f, m))
}

/// inotify on a log file's directory: reports writes to the file, and its rotation.
struct DirWatch(std::os::fd::OwnedFd);

impl DirWatch {
    fn new(path: &std::path::Path) -> Option<Self> {
        use std::os::fd::FromRawFd as _;
        use std::os::unix::ffi::OsStrExt as _;
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(std::path::Path::new("."));
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
        // SAFETY: inotify_init1 returns a new descriptor we own (or -1).
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        if fd < 0 {
            return None;
        }
        // SAFETY: fd is fresh and owned here.
        let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let mask = libc::IN_MODIFY
            | libc::IN_CREATE
            | libc::IN_MOVED_TO
            | libc::IN_MOVED_FROM
            | libc::IN_DELETE
            | libc::IN_ATTRIB
            | libc::IN_CLOSE_WRITE;
        // SAFETY: valid inotify fd and NUL-terminated path.
        (unsafe { libc::inotify_add_watch(fd, c.as_ptr(), mask) } >= 0).then_some(DirWatch(owned))
    }

    /// Wait for a change or the timeout, then drain the pending events.
    fn wait(&self, timeout: Duration) {
        use std::os::fd::AsRawFd as _;
        let fd = self.0.as_raw_fd();
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, i32::try_from(timeout.as_millis()).unwrap_or(100)) };
        let mut b = [0u8; 4096];
        // SAFETY: reading into our buffer from our non-blocking descriptor.
        while unsafe { libc::read(fd, b.as_mut_ptr().cast(), b.len()) } > 0 {}
    }
}

pub(super) fn comm_of(pid: u32) -> crate::event::Comm {
    comm_from(
        std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .unwrap_or_default()
            .trim(),
    )
}
