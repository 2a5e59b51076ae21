//! Following a log file like `tail -F` (attach mode, the agent): rotation, truncation,
//! container log formats, and the checks that make reading a job's chosen path as root safe.
use std::io::{Read as _, Seek as _, SeekFrom};
use std::os::unix::fs::MetadataExt as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
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
    behind: Arc<AtomicU64>,
) {
    std::thread::spawn(move || {
        let behind = Behind {
            count: behind,
            am: false,
        };
        let comm = comm_of(pid);
        let sink = Sink {
            format,
            reader: LineReader::new(scanner),
            cri: super::cri::CriJoiner::default(),
            pid,
            comm,
            tx,
        };
        Follower {
            owner,
            sink,
            behind,
            file: None,
            pos: 0,
            split: LineSplitter::default(),
            first: true,
            refused: false,
            refused_id: None,
            refused_at: std::time::Instant::now(),
            buf: vec![0u8; 64 * 1024],
            lines: Vec::new(),
            wake: DirWatch::new(&path),
            path,
        }
        .run();
    });
}

/// Whether this follower is one of the session's followers behind their file's end.
struct Behind {
    count: Arc<AtomicU64>,
    am: bool,
}

impl Behind {
    fn set(&mut self, b: bool) {
        if b != self.am {
            self.am = b;
            if b {
                self.count.fetch_add(1, Ordering::SeqCst)
            } else {
                self.count.fetch_sub(1, Ordering::SeqCst)
            };
        }
    }
}

/// Where a followed file's lines go: container records joined into lines, each line scanned
/// and sent to the session.
struct Sink {
    format: LogFormat,
    reader: LineReader,
    cri: super::cri::CriJoiner,
    pid: u32,
    comm: crate::event::Comm,
    tx: mpsc::Sender<Input>,
}

impl Sink {
    /// Send (and empty) `lines`; false when the session is gone.
    fn send(&mut self, lines: &mut Vec<String>) -> bool {
        for l in lines.drain(..) {
            let (stream, text) = match self.format {
                LogFormat::Plain => (0, l),
                LogFormat::Cri => match self.cri.push(&l) {
                    Some(x) => x,
                    None => continue,
                },
            };
            if self
                .tx
                .blocking_send(Input::Log(log_event(
                    &mut self.reader,
                    text,
                    stream,
                    self.pid,
                    self.comm,
                )))
                .is_err()
            {
                return false;
            }
        }
        true
    }
}

/// A file's identity as last refused: device, inode, type and change time.
type FileId = (u64, u64, u32, i64, i64);

/// One followed file: the file open now and where in it, and what was refused.
struct Follower {
    path: PathBuf,
    owner: Option<u32>,
    sink: Sink,
    behind: Behind,
    /// The file open now, and its inode.
    file: Option<(std::fs::File, u64)>,
    pos: u64,
    split: LineSplitter,
    first: bool,
    refused: bool,
    /// The file last refused (device, inode): not opened again until it changes, so a FIFO
    /// planted there is not opened every 100 ms (review 8).
    refused_id: Option<FileId>,
    refused_at: std::time::Instant,
    buf: Vec<u8>,
    lines: Vec<String>,
    wake: Option<DirWatch>,
}

impl Follower {
    fn run(mut self) {
        loop {
            if self.sink.tx.is_closed() {
                self.behind.set(false);
                return;
            }
            // (Re)open on start, after rotation, or when the file appears.
            let meta = std::fs::metadata(&self.path).ok();
            // What was refused is known by device, inode, type and change time (an inode number
            // is reused at once: a FIFO then a regular file at the same number, re-review D3),
            // and tried again every 5 s anyway.
            let id = std::fs::symlink_metadata(&self.path)
                .ok()
                .map(|m| (m.dev(), m.ino(), m.mode(), m.ctime(), m.ctime_nsec()));
            if self.rotated(meta.as_ref(), id) {
                if !self.reopen(id) {
                    return;
                }
            } else if let Some(m) = &meta {
                self.check_truncated(m);
            }
            let Some(budget) = self.read_new() else {
                return;
            };
            if budget == 0 {
                continue;
            }
            self.behind.set(false);
            // Woken by any change in the log's directory (a write, a rotation), else every
            // 100 ms: a line is read right after it is written, before a copytruncate can
            // remove it (redteam 2.13).
            match &self.wake {
                Some(w) => w.wait(Duration::from_millis(100)),
                None => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// Whether to (re)open: the path is another inode than the open file, or a file appeared
    /// that is not the one last refused (or was refused more than 5 s ago).
    fn rotated(&self, meta: Option<&std::fs::Metadata>, id: Option<FileId>) -> bool {
        match (&self.file, meta) {
            (Some((_, ino)), Some(m)) => m.ino() != *ino,
            (None, Some(_)) => {
                self.refused_id.is_none()
                    || self.refused_id != id
                    || self.refused_at.elapsed() > Duration::from_secs(5)
            }
            _ => false,
        }
    }

    /// Read what is left in the old file, then open the path again; false when the session
    /// is gone.
    fn reopen(&mut self, id: Option<FileId>) -> bool {
        if let Some((f, _)) = self.file.as_mut() {
            while let Ok(n) = f.read(&mut self.buf) {
                if n == 0 {
                    break;
                }
                self.split.push(&self.buf[..n], |l| self.lines.push(l));
            }
            self.split.finish(|l| self.lines.push(l));
            if !self.sink.send(&mut self.lines) {
                return false;
            }
        }
        self.file = None;
        match open_log(&self.path, self.owner) {
            Ok((mut f, m)) => {
                self.refused = false;
                self.refused_id = None;
                // On attach, start up to 256 KiB back so the bundle has the recent
                // history; a new file that is already long (a 1 TiB sparse file put
                // in the log's place, review 7) likewise.
                self.pos = if self.first || m.len() > 256 * 1024 {
                    m.len().saturating_sub(256 * 1024)
                } else {
                    0
                };
                let _ = f.seek(SeekFrom::Start(self.pos));
                // The first line read from there may be a fragment: it is kept (its
                // end can be the line that matters, after a sparse run of zeros).
                self.split = LineSplitter::default();
                self.first = false;
                self.file = Some((f, m.ino()));
            }
            Err(e) if !self.refused => {
                self.refused = true;
                self.refused_id = id;
                self.refused_at = std::time::Instant::now();
                crate::say!(
                    "nantrace: WARNING: not reading {}: {e}",
                    crate::term::clean(&self.path.display().to_string())
                );
            }
            Err(_) => {
                self.refused_id = id;
                self.refused_at = std::time::Instant::now();
            }
        }
        true
    }

    /// Truncated (copytruncate rotation): start again from the top (or 256 KiB before the
    /// end when it is already long again).
    fn check_truncated(&mut self, m: &std::fs::Metadata) {
        if let Some((f, _)) = self.file.as_mut() {
            if m.len() < self.pos {
                self.pos = m.len().saturating_sub(256 * 1024);
                let _ = f.seek(SeekFrom::Start(self.pos));
                self.split = LineSplitter::default();
            }
        }
    }

    /// Read and send what was written since the last round, at most 16 MiB: the session's
    /// end and a closed channel are seen between rounds, whatever the file does. The budget
    /// left (0: there is more to read at once); None when the session is gone.
    fn read_new(&mut self) -> Option<usize> {
        let mut budget = 16usize << 20;
        if let Some((f, _)) = self.file.as_mut() {
            while let Ok(n) = f.read(&mut self.buf) {
                if n == 0 || self.sink.tx.is_closed() {
                    break;
                }
                self.behind.set(true);
                budget = budget.saturating_sub(n);
                self.pos += n as u64;
                self.split.push(&self.buf[..n], |l| self.lines.push(l));
                if !self.sink.send(&mut self.lines) {
                    self.behind.set(false);
                    return None;
                }
                if budget == 0 {
                    break;
                }
            }
        }
        Some(budget)
    }
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
