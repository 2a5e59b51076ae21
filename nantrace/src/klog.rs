//! Where the kernel log comes from: the `printk:console` probe, or `/dev/kmsg`.
//!
//! `printk:console` fires where the kernel emits a record. On 6.1 and later that is when the
//! record is stored, whatever the console loglevel; on 5.10 it is when a console prints it, so
//! after `dmesg -n 1` (a quiet console, common on servers) an Xid at level 4 never reaches the
//! probe. At startup nantrace writes a marker at level 7 (debug: below every console loglevel
//! but 8) and looks for it in the ring. Where it does not arrive, or the console prints every
//! level (so the check cannot tell), the probe is unloaded and the log is read from
//! `/dev/kmsg`, which every kernel since 3.5 has: one record per read, the same decoding
//! ([`crate::classify`]), the record's own timestamp on the probes' clock. Only one source is
//! used at a time, so no line arrives twice. `doctor` and every bundle's accounting say which.
use std::io::Read as _;
use std::os::fd::AsRawFd as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::Serialize;

use crate::event::{Comm, Detail, Event, Kmsg};

/// The marker's text; a line with it is nantrace's own check, kept in the log as written.
pub const MARKER: &str = "nantrace: kernel log source check";

/// Which source the kernel log lines come from, and why.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct KlogSource {
    /// "printk:console" or "/dev/kmsg".
    pub source: &'static str,
    pub why: String,
}

impl KlogSource {
    pub const TRACEPOINT: &'static str = "printk:console";
    pub const DEV_KMSG: &'static str = "/dev/kmsg";

    pub fn is_kmsg(&self) -> bool {
        self.source == Self::DEV_KMSG
    }
}

/// What the startup check saw: the console's settings and whether the marker came through.
#[derive(Clone, Copy, Debug)]
pub struct Check {
    /// The first field of /proc/sys/kernel/printk; `None` when unreadable.
    pub console_loglevel: Option<u32>,
    pub ignore_loglevel: bool,
    /// The level-7 marker arrived through the probe.
    pub seen_by_probe: bool,
    /// The marker could be written (root, /dev/kmsg present).
    pub written: bool,
}

/// The decision, from what the check saw; `forced` is `NANTRACE_KLOG` (`kmsg` or `console`).
pub fn decide(c: &Check, forced: Option<&str>) -> KlogSource {
    let kmsg = |why: String| KlogSource {
        source: KlogSource::DEV_KMSG,
        why,
    };
    let tp = |why: String| KlogSource {
        source: KlogSource::TRACEPOINT,
        why,
    };
    match forced {
        Some("kmsg") => return kmsg("NANTRACE_KLOG=kmsg".into()),
        Some("console") => return tp("NANTRACE_KLOG=console".into()),
        _ => {}
    }
    let level = c
        .console_loglevel
        .map_or_else(|| "unknown".to_string(), |l| l.to_string());
    if !c.written {
        return tp(
            "the check marker could not be written to /dev/kmsg; the probe is kept unchecked"
                .into(),
        );
    }
    if !c.seen_by_probe {
        return kmsg(format!(
            "printk:console did not see a level-7 record the console did not print (console loglevel {level}): on this kernel the tracepoint fires only for records printed on a console, so a line below the console loglevel (an Xid after `dmesg -n 1`) would be missed"
        ));
    }
    if c.ignore_loglevel || c.console_loglevel.is_none_or(|l| l > 7) {
        return kmsg(format!(
            "the console prints every level (console loglevel {level}{}): whether printk:console sees records no console prints cannot be told here, and a later `dmesg -n` could hide lines from it",
            if c.ignore_loglevel { ", ignore_loglevel" } else { "" }
        ));
    }
    tp(format!(
        "printk:console saw a level-7 record the console did not print (console loglevel {level})"
    ))
}

pub fn console_loglevel() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/printk")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

pub fn ignore_loglevel() -> bool {
    std::fs::read_to_string("/sys/module/printk/parameters/ignore_loglevel")
        .is_ok_and(|v| v.trim() == "Y")
}

/// One `/dev/kmsg` record: `prio,seq,ts_usec,flags[,caller=T123];text` and optional ` KEY=value`
/// lines. The kernel escapes every byte below 0x20 and above 0x7e in the text as `\xNN`, so a
/// newline inside a record stays inside it.
#[derive(Debug, PartialEq, Eq)]
pub struct Record<'a> {
    pub facility: u32,
    pub level: u32,
    pub seq: u64,
    pub ts_usec: u64,
    /// `flags` is `c` for a continuation the kernel could not merge (older kernels).
    pub cont: bool,
    pub caller_pid: Option<u32>,
    pub text: &'a str,
}

pub fn parse_record(buf: &str) -> Option<Record<'_>> {
    let (head, rest) = buf.split_once(';')?;
    let text = rest.split('\n').next().unwrap_or("");
    let mut f = head.split(',');
    let prio: u32 = f.next()?.parse().ok()?;
    let seq = f.next()?.parse().ok()?;
    let ts_usec = f.next()?.parse().ok()?;
    let flags = f.next().unwrap_or("-");
    let caller_pid = f
        .find_map(|x| x.strip_prefix("caller=T"))
        .and_then(|p| p.parse().ok());
    Some(Record {
        facility: prio >> 3,
        level: prio & 7,
        seq,
        ts_usec,
        cont: flags.contains('c'),
        caller_pid,
        text,
    })
}

/// A record as the probe's event: the same classification, the text cut at the probe's length.
pub fn to_event(r: &Record<'_>, offset_ns: i64) -> Event {
    let max = nantrace_common::PRINTK_MSG_LEN - 1;
    let mut text = r.text;
    let truncated = text.len() > max;
    if truncated {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text = &text[..end];
    }
    let class = crate::classify::classify_record(text, r.cont);
    let mono = (r.ts_usec.saturating_mul(1000) as i64)
        .saturating_add(offset_ns)
        .max(0) as u64;
    let pid = r.caller_pid.unwrap_or(0);
    let mut e = Event::new(
        mono,
        pid,
        pid,
        Comm::NONE,
        false,
        Detail::Kmsg(Kmsg::new(text, class, Some(r.seq))),
    );
    if truncated {
        e.set_kmsg_truncated();
    }
    e
}

/// `/dev/kmsg`, opened non-blocking and placed at its end before the marker is written, so
/// the reader starts exactly where the check did.
pub struct KmsgFile {
    file: std::fs::File,
}

impl KmsgFile {
    pub fn open_at_end() -> std::io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/kmsg")?;
        // SAFETY: lseek on an fd we own; SEEK_END on /dev/kmsg moves past the last record.
        unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_END) };
        Ok(Self { file })
    }

    /// The next record, `Ok(None)` when none is waiting. Records overwritten before they were
    /// read (EPIPE) are counted in `missed` and reading goes on at the oldest one left.
    pub fn next_record(
        &mut self,
        buf: &mut [u8],
        missed: &AtomicU64,
    ) -> std::io::Result<Option<usize>> {
        loop {
            match self.file.read(buf) {
                Ok(n) => return Ok(Some(n)),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
                    missed.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// Write the level-7 marker with `nonce`; returns the monotonic time of the write.
pub fn write_marker(nonce: u64) -> std::io::Result<u64> {
    use std::io::Write as _;
    let mut f = std::fs::OpenOptions::new().write(true).open("/dev/kmsg")?;
    let t0 = crate::clock::monotonic_ns();
    f.write_all(format!("<7>{MARKER} {nonce:016x} (a debug-level line: does printk:console see what no console prints?)\n").as_bytes())?;
    let t1 = crate::clock::monotonic_ns();
    Ok(t0 / 2 + t1 / 2)
}

/// Find the marker among the records waiting in `k`: the records before it are returned as
/// events (the reader would have given them), and the offset from the records' clock to the
/// probes' monotonic clock, from the marker's timestamp and the time it was written.
pub fn read_until_marker(
    k: &mut KmsgFile,
    nonce: u64,
    written_ns: u64,
    missed: &AtomicU64,
) -> (Vec<Event>, Option<i64>) {
    let want = format!("{MARKER} {nonce:016x}");
    let mut buf = vec![0u8; 8192];
    let mut before = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(500);
    while std::time::Instant::now() < deadline && before.len() < 10_000 {
        match k.next_record(&mut buf, missed) {
            Ok(Some(n)) => {
                let s = String::from_utf8_lossy(&buf[..n]);
                let Some(r) = parse_record(&s) else { continue };
                if r.text.starts_with(&want) {
                    return (before, Some(written_ns as i64 - (r.ts_usec as i64) * 1000));
                }
                before.push(to_event(&r, 0));
            }
            Ok(None) => std::thread::sleep(std::time::Duration::from_millis(5)),
            Err(_) => break,
        }
    }
    (before, None)
}

/// The reader of `/dev/kmsg` for a session whose kernel log comes from it: batches of events
/// into `tx`, like the ring reader. `missed` counts records overwritten before they were read.
pub fn spawn_reader(
    k: KmsgFile,
    offset_ns: i64,
    tx: tokio::sync::mpsc::Sender<Vec<Event>>,
    stats: Arc<crate::stream::ReaderStats>,
) -> tokio::task::JoinHandle<std::io::Result<()>> {
    tokio::spawn(async move {
        // SAFETY: the file owns its fd for as long as the AsyncFd holds it.
        let mut afd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(k, tokio::io::Interest::READABLE)
        }
        .map_err(|e| std::io::Error::other(format!("registering /dev/kmsg: {e:?}")))?;
        let mut buf = vec![0u8; 8192];
        loop {
            let mut g = afd.readable_mut().await?;
            let mut batch = Vec::new();
            loop {
                match g.get_inner_mut().next_record(&mut buf, &stats.kmsg_missed) {
                    Ok(Some(n)) => {
                        let s = String::from_utf8_lossy(&buf[..n]);
                        if let Some(r) = parse_record(&s) {
                            batch.push(to_event(&r, offset_ns));
                        }
                        if batch.len() >= 4096 {
                            break;
                        }
                    }
                    Ok(None) => {
                        g.clear_ready();
                        break;
                    }
                    Err(e) => {
                        crate::say!("nantrace: WARNING: reading /dev/kmsg failed, no more kernel log lines: {e}");
                        return Err(e);
                    }
                }
            }
            drop(g);
            if !batch.is_empty() && tx.send(batch).await.is_err() {
                return Ok(());
            }
        }
    })
}

mod writer;
pub use writer::{each_record, readable, unescape, who_wrote, who_wrote_in, Line, Writer};

impl std::os::fd::AsRawFd for KmsgFile {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records as /dev/kmsg gives them (5.10 and 6.18 shapes; the caller field with
    /// CONFIG_PRINTK_CALLER).
    #[test]
    fn records_parse_with_their_level_time_and_escaped_text() {
        let r = parse_record("4,1234,15330000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n").unwrap();
        assert_eq!(
            (r.facility, r.level, r.seq, r.ts_usec, r.cont, r.caller_pid),
            (0, 4, 1234, 15_330_000, false, None)
        );
        assert!(r.text.starts_with("NVRM: Xid"));
        let r = parse_record("12,77,99,c,caller=T4242;a.out[4242]: segfault in x\\x0aNVRM: Xid (PCI:0000:3b:00): 79\n SUBSYSTEM=pci\n").unwrap();
        assert_eq!(
            (r.facility, r.level, r.cont, r.caller_pid),
            (1, 4, true, Some(4242))
        );
        // The newline the kernel escaped stays in the one record's text.
        assert_eq!(
            r.text,
            "a.out[4242]: segfault in x\\x0aNVRM: Xid (PCI:0000:3b:00): 79"
        );
        assert!(parse_record("garbage").is_none());
        assert!(parse_record("x,1,2,-;t").is_none());
    }

    #[test]
    fn a_record_becomes_the_probes_event_with_the_same_classification() {
        let r = parse_record(
            "4,1,2000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.",
        )
        .unwrap();
        let e = to_event(&r, 500);
        assert_eq!(e.mono_ns, 2_000_000_500);
        let Detail::Kmsg(k) = &e.detail else {
            panic!("{e:?}")
        };
        assert!(
            matches!(k.class(), Some(crate::classify::KmsgClass::Xid { .. })),
            "{k:?}"
        );
        let long = format!("4,1,2,-;{}", "é".repeat(600));
        let e = to_event(&parse_record(&long).unwrap(), 0);
        assert!(e.kmsg_truncated());
    }

    /// D-1 of the third adversarial test: a file name with a newline and a fake Xid, printed
    /// by the kernel as the continuation of a segfault report, is never an Xid.
    #[test]
    fn a_forged_line_in_a_continuation_is_not_evidence() {
        // /dev/kmsg on 6.x: merged into the segfault record, the newline escaped.
        let merged = "4,9,100,-,caller=T77;x[77]: segfault at 0 ip 0000000000401000 sp 00007ffc00000000 error 4 in x\\x0aNVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.\\x0a[401000+1000]";
        let e = to_event(&parse_record(merged).unwrap(), 0);
        let Detail::Kmsg(k) = &e.detail else { panic!() };
        assert!(
            !matches!(k.class(), Some(crate::classify::KmsgClass::Xid { .. })),
            "{k:?}"
        );
        // An unmerged continuation record (the `c` flag of older kernels).
        let cont = "4,10,100,c;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.";
        let e = to_event(&parse_record(cont).unwrap(), 0);
        let Detail::Kmsg(k) = &e.detail else { panic!() };
        assert!(k.class().is_none(), "{k:?}");
        // The probe's record of the continuation: ` in <name>`, with real newlines.
        assert!(crate::classify::classify_record(" in x\nNVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n[401000+1000]", false).is_none());
        assert!(crate::classify::classify_record("[   15.330000]  in x\nNVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.", false).is_none());
        // The kernel's own line still is one.
        assert!(crate::classify::classify_record(
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.",
            false
        )
        .is_some());
        assert!(crate::classify::classify_record(
            "[   15.330000] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.",
            false
        )
        .is_some());
    }

    #[test]
    fn the_source_follows_what_the_check_saw() {
        let c = |level, seen| Check {
            console_loglevel: Some(level),
            ignore_loglevel: false,
            seen_by_probe: seen,
            written: true,
        };
        assert_eq!(decide(&c(7, true), None).source, KlogSource::TRACEPOINT);
        assert_eq!(decide(&c(1, true), None).source, KlogSource::TRACEPOINT);
        // 5.10 with a quiet console: the probe never saw the marker.
        let d = decide(&c(1, false), None);
        assert!(d.is_kmsg() && d.why.contains("console loglevel 1"), "{d:?}");
        // Everything printed: the check cannot tell.
        assert!(decide(&c(8, true), None).is_kmsg());
        assert!(decide(
            &Check {
                ignore_loglevel: true,
                ..c(4, true)
            },
            None
        )
        .is_kmsg());
        assert!(decide(&c(7, true), Some("kmsg")).is_kmsg());
        assert!(!decide(&c(1, false), Some("console")).is_kmsg());
        assert!(!decide(
            &Check {
                written: false,
                ..c(1, false)
            },
            None
        )
        .is_kmsg());
    }
}
