//! Who wrote a kernel log line: the kernel, or a process through `/dev/kmsg` (what a drain
//! checks before it acts, `agent::drain::check_writer`).
use std::io::Read as _;

use super::{parse_record, Record};

/// Who wrote a kernel log line, as `/dev/kmsg` records it. A record's facility is 0 only when
/// the kernel logged it itself: every write into `/dev/kmsg` from user space gets a facility
/// of its own (LOG_USER when the writer gave none; `devkmsg_write` in kernel/printk), so a
/// relay of users' text (journald's `ForwardToKMsg`, `logger` through it) or a test's
/// injection is told apart from the driver's own line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Writer {
    Kernel,
    UserSpace {
        facility: u32,
    },
    /// No record starting with this text is left in the kernel's buffer (overwritten, or the
    /// line was never a record's start).
    NotFound,
}

impl Writer {
    pub fn describe(self) -> String {
        match self {
            Writer::Kernel => "written by the kernel".into(),
            Writer::UserSpace { facility } => format!(
                "written into /dev/kmsg from user space (facility {facility}), not by the kernel"
            ),
            Writer::NotFound => {
                "not found at a record's start in the kernel's buffer (/dev/kmsg) to check who wrote it"
                    .into()
            }
        }
    }
}

/// `\xNN` escapes of a `/dev/kmsg` record's text undone (the kernel escapes control bytes,
/// bytes above 0x7e and the backslash).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && b.get(i + 1) == Some(&b'x') {
            if let Some(v) = s
                .get(i + 2..i + 4)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether the record `r` starts with the kernel log line `line` as nantrace recorded it (the
/// probe's text, cut at its length, or `/dev/kmsg`'s escaped text): the record's first line,
/// never a line inside it (a user's text after a newline the kernel did not write).
fn record_is(r: &Record<'_>, line: &str) -> bool {
    let line = line.trim_end();
    if line.is_empty() {
        return false;
    }
    let raw = unescape(r.text);
    let first = raw.split('\n').next().unwrap_or("").trim_end();
    let cut = nantrace_common::PRINTK_MSG_LEN - 1;
    [r.text.trim_end(), first]
        .iter()
        .any(|t| *t == line || (line.len() >= cut.saturating_sub(8) && t.starts_with(line)))
}

/// Who wrote `line`, from the records `/dev/kmsg` yields (each `prio,seq,ts,flags;text`):
/// the kernel when any record starting with it has facility 0, else the first writer found.
pub fn who_wrote_in<I, S>(records: I, line: &str) -> Writer
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let mut found = Writer::NotFound;
    for rec in records {
        let Some(r) = parse_record(rec.as_ref()) else {
            continue;
        };
        if !record_is(&r, line) {
            continue;
        }
        if r.facility == 0 {
            return Writer::Kernel;
        }
        if found == Writer::NotFound {
            found = Writer::UserSpace {
                facility: r.facility,
            };
        }
    }
    found
}

/// Who wrote each of `lines`, read from `/dev/kmsg` from its oldest record (root; bounded: 2M
/// records, 256 MiB, 3 s).
pub fn who_wrote(lines: &[String]) -> std::io::Result<Vec<Writer>> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open("/dev/kmsg")?;
    let mut out = vec![Writer::NotFound; lines.len()];
    let mut buf = vec![0u8; 8192];
    let (mut n_rec, mut bytes) = (0u64, 0u64);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    while n_rec < 2_000_000 && bytes < 256 << 20 && std::time::Instant::now() < deadline {
        let n = match f.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            // Overwritten while read: go on at the oldest record left.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        n_rec += 1;
        bytes += n as u64;
        let rec = String::from_utf8_lossy(&buf[..n]);
        for (w, l) in out.iter_mut().zip(lines) {
            if *w != Writer::Kernel {
                match who_wrote_in([rec.as_ref()], l) {
                    Writer::NotFound => {}
                    Writer::Kernel => *w = Writer::Kernel,
                    u if *w == Writer::NotFound => *w = u,
                    _ => {}
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// redteam4 D-14: what a user-space writer put into /dev/kmsg (journald's ForwardToKMsg,
    /// `logger`, a test) is not the kernel's line, and a line after a newline inside another
    /// record (D-2's mount option) is not a record's start; a kernel record is, in either form
    /// nantrace recorded it (the probe's raw text, /dev/kmsg's escaped one).
    #[test]
    fn who_wrote_a_line_is_the_records_facility_at_the_records_start() {
        let xid =
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python3, GPU has fallen off the bus.";
        let user = format!("11,901,5000,-;{xid}");
        let kernel = format!("4,902,6000,-;{xid}\n SUBSYSTEM=pci");
        assert_eq!(
            who_wrote_in([user.as_str()], xid),
            Writer::UserSpace { facility: 1 }
        );
        assert_eq!(
            who_wrote_in([user.as_str(), kernel.as_str()], xid),
            Writer::Kernel
        );
        let inside = format!("3,903,7000,-;tmpfs: Unknown parameter 'x\\x0a{xid}'");
        assert_eq!(who_wrote_in([inside.as_str()], xid), Writer::NotFound);
        assert_eq!(
            who_wrote_in(["6,1,1,-;eth0: link up"], xid),
            Writer::NotFound
        );
        // A record with an escaped newline: its first line is the record's start.
        let two =
            "4,904,8000,-;NVRM: GPU at PCI:0000:3b:00: GPU-1\\x0aNVRM: GPU Board Serial Number: 1";
        assert_eq!(
            who_wrote_in([two], "NVRM: GPU at PCI:0000:3b:00: GPU-1"),
            Writer::Kernel
        );
        assert_eq!(
            who_wrote_in([two], "NVRM: GPU Board Serial Number: 1"),
            Writer::NotFound
        );
        assert_eq!(unescape("a\\x5cb\\x0ac"), "a\\b\nc");
    }
}
