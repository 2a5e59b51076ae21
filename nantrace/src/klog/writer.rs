//! Who wrote a kernel log line: the kernel, or a process through `/dev/kmsg` (what a drain
//! checks before it acts, `agent::trust::check_writer`).
use std::io::Read as _;

use super::{parse_record, Record};

/// A kernel log line as nantrace recorded it (the probe's text or `/dev/kmsg`'s escaped one),
/// its time on the monotonic clock, and its record's sequence number where it was read from
/// `/dev/kmsg` (then the record itself is found, whatever the clocks did since).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Line {
    pub text: String,
    pub mono_ns: u64,
    pub seq: Option<u64>,
}

impl Line {
    pub fn new(text: impl Into<String>, mono_ns: u64, seq: Option<u64>) -> Self {
        Line {
            text: text.into(),
            mono_ns,
            seq,
        }
    }
}

/// Records of one line's text kept while the buffer is read: the newest.
const CANDIDATES_PER_LINE: usize = 64;

/// How far (ns) a record's time may be from the line's for the record to be that line: the
/// probe's time and the record's stamp are taken microseconds apart, 5.10's console path may
/// print late.
const NEAR_NS: u64 = 10_000_000_000;

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
    /// Records of this text are in the buffer, but none near the line's time (an earlier
    /// record of the same text vouches for nothing: a replay).
    OtherTime,
    /// No record starting with this text is left in the kernel's buffer (overwritten, or the
    /// line was never a record's start).
    NotFound,
    /// The kernel log's clock could not be fitted to the probes' (the check's marker was not
    /// read back), so no record could be tied to the line's time.
    NoClock,
}

impl Writer {
    pub fn describe(self) -> String {
        match self {
            Writer::Kernel => "written by the kernel".into(),
            Writer::UserSpace { facility } => format!(
                "written into /dev/kmsg from user space (facility {facility}), not by the kernel"
            ),
            Writer::OtherTime => "in the kernel's buffer (/dev/kmsg) only at other times than this line's, so not checked".into(),
            Writer::NoClock => "not checked: the kernel log's clock could not be fitted to the probes' (no marker read back from /dev/kmsg)".into(),
            Writer::NotFound => {
                "not found at a record's start in the kernel's buffer (/dev/kmsg) to check who wrote it"
                    .into()
            }
        }
    }
}

/// `\xNN` escapes of a `/dev/kmsg` record's text undone (the kernel escapes control bytes,
/// bytes above 0x7e and the backslash).
pub fn unescape(s: &str) -> String {
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

/// A line as the kernel logged it: each line of the probe's text without the console's
/// prefixes (`[   15.330000] `, `[T123] `, 5.10's console path), trailing blanks gone.
fn bare(text: &str) -> String {
    let one = |mut l: &str| -> String {
        for _ in 0..2 {
            let t = l.trim_start();
            let Some((inside, rest)) = t.strip_prefix('[').and_then(|r| r.split_once(']')) else {
                break;
            };
            let inside = inside.trim();
            let stamp = inside.parse::<f64>().is_ok()
                || (inside.len() > 1
                    && inside.starts_with(['T', 'C'])
                    && inside[1..].bytes().all(|c| c.is_ascii_digit()));
            if !stamp {
                break;
            }
            l = rest.strip_prefix(' ').unwrap_or(rest);
        }
        l.trim_end().to_string()
    };
    text.trim_end()
        .split('\n')
        .map(one)
        .collect::<Vec<_>>()
        .join("\n")
}

/// A line to look for: its text as the kernel logged it (`bare`), and whether the probe may
/// have cut it (then a record that starts with it is it).
struct Wanted {
    bare: String,
    cut: bool,
}

impl Wanted {
    fn of(l: &Line) -> Self {
        let cut = nantrace_common::PRINTK_MSG_LEN - 1;
        Wanted {
            bare: bare(&l.text),
            // The probe's text before the console's prefixes were taken off.
            cut: l.text.trim_end().len() >= cut.saturating_sub(8),
        }
    }
}

/// Whether the record `r` starts with the wanted line: the whole record or its first line,
/// never a line inside it (a user's text after a newline the kernel did not write).
fn record_is(r: &Record<'_>, w: &Wanted) -> bool {
    if w.bare.is_empty() {
        return false;
    }
    let raw = unescape(r.text);
    let whole = raw.trim_end();
    let first = raw.split('\n').next().unwrap_or("").trim_end();
    [r.text.trim_end(), whole, first]
        .iter()
        .any(|t| *t == w.bare || (w.cut && t.starts_with(&w.bare)))
}

/// A record that starts with a wanted line: its sequence number, facility and time (ns, on
/// the records' clock).
#[derive(Clone, Copy)]
struct Found {
    seq: u64,
    facility: u32,
    ts_ns: u64,
}

/// Who wrote each line, from the records that start with it (`found[i]`, the newest kept).
/// A line read from `/dev/kmsg` is its own record (its sequence number); a line from the
/// probe is the record within `NEAR_NS` of its time, with `offset_ns` taking the records'
/// clock to the monotonic one (None: the clocks could not be fitted).
fn judge(lines: &[Line], found: &[Vec<Found>], offset_ns: Option<i64>) -> Vec<Writer> {
    lines
        .iter()
        .zip(found)
        .map(|(l, f)| {
            let writer = |r: &Found| {
                if r.facility == 0 {
                    Writer::Kernel
                } else {
                    Writer::UserSpace {
                        facility: r.facility,
                    }
                }
            };
            if let Some(q) = l.seq {
                return f
                    .iter()
                    .find(|r| r.seq == q)
                    .map_or(Writer::NotFound, writer);
            }
            if f.is_empty() {
                return Writer::NotFound;
            }
            let Some(o) = offset_ns else {
                return Writer::NoClock;
            };
            let near: Vec<&Found> = f
                .iter()
                .filter(|r| {
                    (r.ts_ns as i64)
                        .saturating_add(o)
                        .abs_diff(l.mono_ns as i64)
                        <= NEAR_NS
                })
                .collect();
            if near.iter().any(|r| r.facility == 0) {
                Writer::Kernel
            } else {
                near.first().map_or(Writer::OtherTime, |r| writer(r))
            }
        })
        .collect()
}

/// The records of `rec` that start with one of `wanted`, into `found` (the newest
/// `CANDIDATES_PER_LINE` of each).
fn collect(r: &Record<'_>, wanted: &[Wanted], found: &mut [Vec<Found>]) {
    for (w, f) in wanted.iter().zip(found.iter_mut()) {
        if record_is(r, w) {
            if f.len() == CANDIDATES_PER_LINE {
                f.remove(0);
            }
            f.push(Found {
                seq: r.seq,
                facility: r.facility,
                ts_ns: r.ts_usec.saturating_mul(1000),
            });
        }
    }
}

/// Who wrote each of `lines`, from the records `/dev/kmsg` yields (each
/// `prio,seq,ts,flags;text`), with `offset_ns` as in `judge`.
pub fn who_wrote_in<I, S>(records: I, lines: &[Line], offset_ns: Option<i64>) -> Vec<Writer>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let wanted: Vec<Wanted> = lines.iter().map(Wanted::of).collect();
    let mut found = vec![Vec::new(); lines.len()];
    for rec in records {
        if let Some(r) = parse_record(rec.as_ref()) {
            collect(&r, &wanted, &mut found);
        }
    }
    judge(lines, &found, offset_ns)
}

/// Every record `/dev/kmsg` still holds, oldest first, as read (`prio,seq,ts,flags;text`), to
/// `f` (root; bounded: 2M records, 256 MiB, 3 s).
pub fn each_record(mut f: impl FnMut(&str)) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open("/dev/kmsg")?;
    let mut buf = vec![0u8; 8192];
    let (mut n_rec, mut bytes) = (0u64, 0u64);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    while n_rec < 2_000_000 && bytes < 256 << 20 && std::time::Instant::now() < deadline {
        let n = match file.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            // Overwritten while read: go on at the oldest record left.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        n_rec += 1;
        bytes += n as u64;
        f(&String::from_utf8_lossy(&buf[..n]));
    }
    Ok(())
}

/// Whether `/dev/kmsg` can be read here (one record, or none waiting): what every check of a
/// kernel log line's writer needs (`doctor` says so; a container without it, or without
/// CAP_SYSLOG under `dmesg_restrict`, cannot check).
pub fn readable() -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open("/dev/kmsg")?;
    let mut buf = vec![0u8; 8192];
    match file.read(&mut buf) {
        Ok(_) => Ok(()),
        Err(e)
            if e.kind() == std::io::ErrorKind::WouldBlock
                || e.raw_os_error() == Some(libc::EPIPE) =>
        {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Who wrote each of `lines`, from the records `/dev/kmsg` still holds, in one pass. A
/// marker written first (at level 7, as at startup) fits the records' clock to the monotonic
/// one, for the lines the probe read (those read from `/dev/kmsg` carry their record's number).
pub fn who_wrote(lines: &[Line]) -> std::io::Result<Vec<Writer>> {
    let nonce = (u64::from(std::process::id()) << 32) ^ crate::clock::monotonic_ns() ^ 0x5eed;
    let written = super::write_marker(nonce).ok();
    let want = format!("{} {nonce:016x}", super::MARKER);
    let wanted: Vec<Wanted> = lines.iter().map(Wanted::of).collect();
    let mut found = vec![Vec::new(); lines.len()];
    let mut marker_ts = None;
    each_record(|rec| {
        let Some(r) = parse_record(rec) else { return };
        if r.text.starts_with(&want) {
            marker_ts = Some(r.ts_usec.saturating_mul(1000));
        }
        collect(&r, &wanted, &mut found);
    })?;
    let offset = match (written, marker_ts) {
        (Some(w), Some(ts)) => Some(w as i64 - ts as i64),
        _ => None,
    };
    Ok(judge(lines, &found, offset))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(t: &str, mono: u64) -> Vec<Line> {
        vec![Line::new(t, mono, None)]
    }

    /// redteam4 D-14: what a user-space writer put into /dev/kmsg (journald's ForwardToKMsg,
    /// `logger`, a test) is not the kernel's line, and a line after a newline inside another
    /// record (D-2's mount option) is not a record's start; a kernel record is, in every form
    /// nantrace records it (the probe's raw text, with a console's prefixes, /dev/kmsg's
    /// escaped one, a multi-line record whole).
    #[test]
    fn who_wrote_a_line_is_the_records_facility_at_the_records_start() {
        let xid =
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python3, GPU has fallen off the bus.";
        let user = format!("11,901,5000,-;{xid}");
        let kernel = format!("4,902,6000,-;{xid}\n SUBSYSTEM=pci");
        assert_eq!(
            who_wrote_in([user.as_str()], &l(xid, 0), Some(0)),
            [Writer::UserSpace { facility: 1 }]
        );
        assert_eq!(
            who_wrote_in([user.as_str(), kernel.as_str()], &l(xid, 0), Some(0)),
            [Writer::Kernel]
        );
        let inside = format!("3,903,7000,-;tmpfs: Unknown parameter 'x\\x0a{xid}'");
        assert_eq!(
            who_wrote_in([inside.as_str()], &l(xid, 0), Some(0)),
            [Writer::NotFound]
        );
        assert_eq!(
            who_wrote_in(["6,1,1,-;eth0: link up"], &l(xid, 0), Some(0)),
            [Writer::NotFound]
        );
        // A record with an escaped newline: its first line is the record's start, and so is
        // the whole record (the probe's text of one printk call, raw newlines and all).
        let two = "4,904,8000,-;NVRM: GPU at PCI:0000:3b:00: GPU-1\\x0aNVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.";
        assert_eq!(
            who_wrote_in([two], &l("NVRM: GPU at PCI:0000:3b:00: GPU-1", 0), Some(0)),
            [Writer::Kernel]
        );
        assert_eq!(
            who_wrote_in(
                [two],
                &l(
                    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.",
                    0
                ),
                None
            ),
            [Writer::NotFound]
        );
        let raw = "NVRM: GPU at PCI:0000:3b:00: GPU-1\nNVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.\n";
        assert_eq!(who_wrote_in([two], &l(raw, 0), Some(0)), [Writer::Kernel]);
        // 5.10's console path: each line with the console's time (and caller) in front.
        let console = format!("[   15.330000] [T812] {xid}");
        assert_eq!(
            who_wrote_in([kernel.as_str()], &l(&console, 0), Some(0)),
            [Writer::Kernel]
        );
        assert_eq!(unescape("a\\x5cb\\x0ac"), "a\\b\nc");
    }

    /// redteam4 D-14 (review): an earlier kernel record of the same text vouches only for a
    /// line at its own time: a user's copy of a real Xid written later is not the kernel's.
    #[test]
    fn only_a_record_at_the_lines_time_vouches_for_it() {
        let xid = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.";
        // The records' clock is 2 s behind the monotonic one; the kernel wrote it at 100 s,
        // a relay copied it at 5000 s.
        let off = Some(2_000_000_000);
        let old = format!("3,10,98000000,-;{xid}");
        let copy = format!("11,90,4998000000,-;{xid}");
        assert_eq!(
            who_wrote_in([old.as_str()], &l(xid, 100_000_000_000), off),
            [Writer::Kernel]
        );
        assert_eq!(
            who_wrote_in([old.as_str()], &l(xid, 5_000_000_000_000), off),
            [Writer::OtherTime]
        );
        assert_eq!(
            who_wrote_in(
                [old.as_str(), copy.as_str()],
                &l(xid, 5_000_000_000_000),
                off
            ),
            [Writer::UserSpace { facility: 1 }]
        );
        // The clocks not fitted: nothing ties a record to the line.
        assert_eq!(
            who_wrote_in([old.as_str()], &l(xid, 5_000_000_000_000), None),
            [Writer::NoClock]
        );
        // A line read from /dev/kmsg is its own record, however far the clocks drifted since
        // the session fitted them (10 ppm over a month is 26 s).
        let both = [old.as_str(), copy.as_str()];
        assert_eq!(
            who_wrote_in(both, &[Line::new(xid, 1, Some(10))], off),
            [Writer::Kernel]
        );
        assert_eq!(
            who_wrote_in(both, &[Line::new(xid, 1, Some(90))], off),
            [Writer::UserSpace { facility: 1 }]
        );
        assert_eq!(
            who_wrote_in([copy.as_str()], &[Line::new(xid, 1, Some(10))], off),
            [Writer::NotFound]
        );
    }
}
