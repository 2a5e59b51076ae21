//! The job's output: passing it through, splitting it into lines, scanning each line, and
//! following log files like `tail -F` (attach mode).
use std::io::{Read as _, Seek as _, SeekFrom};
use std::os::unix::fs::MetadataExt as _;
use std::path::PathBuf;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::sync::mpsc;

use super::Input;
use crate::clock::monotonic_ns;
use crate::event::{comm_from, Detail, Event, LogLine};
use crate::nanscan::Scanner;

/// Split a byte stream into lines (`\n` or `\r`, so progress bars count), bounded in length.
#[derive(Default)]
pub struct LineSplitter {
    buf: Vec<u8>,
}

impl LineSplitter {
    pub const MAX: usize = 64 * 1024;

    pub fn push(&mut self, chunk: &[u8], mut out: impl FnMut(String)) {
        for &b in chunk {
            if b == b'\n' || b == b'\r' {
                if !self.buf.is_empty() {
                    out(String::from_utf8_lossy(&self.buf).into_owned());
                    self.buf.clear();
                }
            } else if self.buf.len() < Self::MAX {
                self.buf.push(b);
            }
        }
    }

    pub fn finish(&mut self, mut out: impl FnMut(String)) {
        if !self.buf.is_empty() {
            out(String::from_utf8_lossy(&self.buf).into_owned());
            self.buf.clear();
        }
    }
}

pub(super) fn log_event(scanner: &Scanner, line: String, stream: u8, pid: u32, comm: crate::event::Comm) -> Event {
    let s = scanner.scan(&line);
    Event {
        mono_ns: monotonic_ns(),
        pid,
        tid: pid,
        comm,
        job: true,
        detail: Detail::Log(Box::new(LogLine {
            // Scanned above; redacted before it is kept (it will leave the process, 4.5).
            text: crate::collect::redact::log_line(line).into(),
            stream,
            nonfinite: s.nonfinite.is_some(),
            step: s.step,
            loss: s.loss,
            loss_scale: s.loss_scale,
            overflow: s.overflow,
        })),
    }
}

/// Pass a child's output through unchanged, and scan it line by line.
pub(super) async fn pump<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    mut from: R,
    mut to: W,
    stream: u8,
    pid: u32,
    comm: crate::event::Comm,
    scanner: Scanner,
    tx: mpsc::Sender<Input>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut split = LineSplitter::default();
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        // The user sees the output first; scanning comes after.
        let _ = to.write_all(&buf[..n]).await;
        let _ = to.flush().await;
        let mut lines = Vec::new();
        split.push(&buf[..n], |l| lines.push(l));
        for l in lines {
            let _ = tx.send(Input::Log(log_event(&scanner, l, stream, pid, comm))).await;
        }
    }
    let mut last = None;
    split.finish(|l| last = Some(l));
    if let Some(l) = last {
        let _ = tx.send(Input::Log(log_event(&scanner, l, stream, pid, comm))).await;
    }
}

/// Follow a log file like `tail -F`: survives rotation (new inode) and truncation.
pub(super) fn follow_file(path: PathBuf, pid: u32, scanner: Scanner, tx: mpsc::Sender<Input>) {
    std::thread::spawn(move || {
        let comm = comm_of(pid);
        let mut file: Option<(std::fs::File, u64)> = None;
        let mut pos = 0u64;
        let mut split = LineSplitter::default();
        let mut first = true;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if tx.is_closed() {
                return;
            }
            // (Re)open on start, after rotation, or when the file appears.
            let meta = std::fs::metadata(&path).ok();
            let rotated = match (&file, &meta) {
                (Some((_, ino)), Some(m)) => m.ino() != *ino,
                (None, Some(_)) => true,
                _ => false,
            };
            if rotated {
                // Read what is left in the old file before switching.
                if let Some((f, _)) = file.as_mut() {
                    while let Ok(n) = f.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        split.push(&buf[..n], |l| { let _ = tx.blocking_send(Input::Log(log_event(&scanner, l, 0, pid, comm))); });
                    }
                    split.finish(|l| { let _ = tx.blocking_send(Input::Log(log_event(&scanner, l, 0, pid, comm))); });
                }
                if let (Ok(mut f), Some(m)) = (std::fs::File::open(&path), &meta) {
                    // On attach, start up to 256 KiB back so the bundle has the recent history.
                    pos = if first { m.len().saturating_sub(256 * 1024) } else { 0 };
                    let _ = f.seek(SeekFrom::Start(pos));
                    if first && pos > 0 {
                        split = LineSplitter::default();
                        let mut skip = [0u8; 1];
                        while let Ok(1) = f.read(&mut skip) {
                            pos += 1;
                            if skip[0] == b'\n' {
                                break;
                            }
                        }
                    }
                    first = false;
                    file = Some((f, m.ino()));
                }
            } else if let (Some((f, _)), Some(m)) = (file.as_mut(), &meta) {
                if m.len() < pos {
                    // Truncated (copytruncate rotation): start again from the top.
                    pos = 0;
                    let _ = f.seek(SeekFrom::Start(0));
                    split = LineSplitter::default();
                }
            }
            if let Some((f, _)) = file.as_mut() {
                while let Ok(n) = f.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    pos += n as u64;
                    split.push(&buf[..n], |l| { let _ = tx.blocking_send(Input::Log(log_event(&scanner, l, 0, pid, comm))); });
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
}

pub(super) fn comm_of(pid: u32) -> crate::event::Comm {
    comm_from(std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim())
}

#[cfg(test)]
mod tests {
    use super::LineSplitter;

    #[test]
    fn splits_on_newline_and_carriage_return() {
        let mut s = LineSplitter::default();
        let mut out = Vec::new();
        s.push(b"step 1 loss 2.0\nprogress 10%\rprogress 20%\r\nstep 2 lo", |l| out.push(l));
        s.push(b"ss nan\n", |l| out.push(l));
        s.push(b"tail without newline", |l| out.push(l));
        s.finish(|l| out.push(l));
        assert_eq!(out, ["step 1 loss 2.0", "progress 10%", "progress 20%", "step 2 loss nan", "tail without newline"]);
    }

    #[test]
    fn very_long_lines_are_bounded() {
        let mut s = LineSplitter::default();
        let mut out = Vec::new();
        s.push(&vec![b'x'; LineSplitter::MAX * 2], |l| out.push(l));
        s.push(b"\n", |l| out.push(l));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].len(), LineSplitter::MAX);
    }
}
