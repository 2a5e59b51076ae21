//! Ring-buffer bytes to [`Event`]. Pure: no I/O, every length checked.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use nantrace_common::{
    AerEvent, BlockEvent, EventHeader, EventKind, ExecEvent, ExitEvent, ForkEvent, OomEvent,
    PrintkEvent, SignalEvent, TcpRetransmitEvent, FLAG_JOB, FLAG_TRUNCATED,
};

/// KiB per unit of the oom:mark_victim memory fields on this kernel (see
/// `tracefs::Format::oom_kb_per_unit`); kB on every kernel that has the fields.
static OOM_KB_PER_UNIT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

pub fn set_oom_kb_per_unit(kb: u64) {
    OOM_KB_PER_UNIT.store(kb, std::sync::atomic::Ordering::Relaxed);
}

use crate::event::{Aer, Comm, Detail, Event, Kmsg, Oom, Tcp};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("record of {got} bytes is shorter than the {need} bytes of its kind {kind}")]
    Short { kind: u32, need: usize, got: usize },
    #[error("unknown event kind {0}")]
    UnknownKind(u32),
}

fn read<T: Copy>(buf: &[u8], kind: u32) -> Result<T, DecodeError> {
    let need = std::mem::size_of::<T>();
    if buf.len() < need {
        return Err(DecodeError::Short {
            kind,
            need,
            got: buf.len(),
        });
    }
    // SAFETY: length checked; T is a plain-old-data #[repr(C)] struct from nantrace-common,
    // valid for any bit pattern; read_unaligned copes with the buffer's alignment.
    Ok(unsafe { std::ptr::read_unaligned(buf.as_ptr().cast::<T>()) })
}

fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn base(h: &EventHeader, detail: Detail) -> Event {
    Event::new(
        h.ts_ns,
        h.pid,
        h.tid,
        Comm::from_bytes(h.comm),
        h.flags & FLAG_JOB != 0,
        detail,
    )
}

/// Decode one ring-buffer record.
pub fn decode(buf: &[u8]) -> Result<Event, DecodeError> {
    let h: EventHeader = read(buf, 0)?;
    let kind = EventKind::from_u32(h.kind).ok_or(DecodeError::UnknownKind(h.kind))?;
    match kind {
        EventKind::Printk => printk(&h, buf),
        EventKind::Aer => aer(&h, buf),
        EventKind::Oom => oom(&h, buf),
        EventKind::Block => block(&h, buf),
        EventKind::TcpRetransmit => tcp_retransmit(&h, buf),
        EventKind::Fork => fork(&h, buf),
        EventKind::Exec => exec(&h, buf),
        EventKind::Exit => exit(&h, buf),
        EventKind::Signal => signal(&h, buf),
    }
}

/// A kernel log record, classified.
fn printk(h: &EventHeader, buf: &[u8]) -> Result<Event, DecodeError> {
    let e: PrintkEvent = read(buf, h.kind)?;
    let n = (e.len as usize).min(e.msg.len());
    let text = cstr(&e.msg[..n]);
    let text = text.trim_end_matches('\n').to_string();
    let class = crate::classify::classify_record(&text, false);
    let mut e = base(h, Detail::Kmsg(Kmsg::new(text, class, None)));
    if h.flags & FLAG_TRUNCATED != 0 {
        e.set_kmsg_truncated();
    }
    Ok(e)
}

/// A PCIe AER error from the tracepoint.
fn aer(h: &EventHeader, buf: &[u8]) -> Result<Event, DecodeError> {
    let e: AerEvent = read(buf, h.kind)?;
    Ok(base(
        h,
        Detail::Aer(Box::new(Aer {
            device: cstr(&e.dev_name),
            status: e.status,
            severity: e.severity,
            tlp_header: (e.tlp_header_valid != 0).then_some(e.tlp_header),
        })),
    ))
}

/// An OOM kill, its sizes in KiB (the tracepoint's unit, read at start).
fn oom(h: &EventHeader, buf: &[u8]) -> Result<Event, DecodeError> {
    let e: OomEvent = read(buf, h.kind)?;
    let kb = OOM_KB_PER_UNIT.load(std::sync::atomic::Ordering::Relaxed);
    Ok(base(
        h,
        Detail::Oom(Box::new(Oom {
            victim_pid: e.victim_pid,
            victim_comm: Comm::from_bytes(e.victim_comm),
            victim_job: e.victim_job != 0,
            uid: e.uid,
            total_vm: e.total_vm.saturating_mul(kb),
            anon_rss: e.anon_rss.saturating_mul(kb),
            file_rss: e.file_rss.saturating_mul(kb),
            shmem_rss: e.shmem_rss.saturating_mul(kb),
            pgtables: e.pgtables.saturating_mul(kb),
            oom_score_adj: e.oom_score_adj,
        })),
    ))
}

/// A block request completed: device, error, latency.
fn block(h: &EventHeader, buf: &[u8]) -> Result<Event, DecodeError> {
    let e: BlockEvent = read(buf, h.kind)?;
    let mut rwbs = [0u8; 6];
    rwbs.copy_from_slice(&e.rwbs[..6]);
    let error = e.error.clamp(i32::from(i16::MIN), i32::from(i16::MAX)) as i16;
    let latency_us = u32::try_from(e.latency_ns / 1000).unwrap_or(u32::MAX);
    Ok(base(
        h,
        Detail::Block {
            dev: e.dev,
            error,
            sector: e.sector,
            latency_us,
            nr_sector: e.nr_sector,
            rwbs,
        },
    ))
}

/// A TCP retransmission, IPv4 or IPv6.
fn tcp_retransmit(h: &EventHeader, buf: &[u8]) -> Result<Event, DecodeError> {
    let e: TcpRetransmitEvent = read(buf, h.kind)?;
    let (saddr, daddr) = if e.family == 2 {
        (
            IpAddr::V4(Ipv4Addr::new(
                e.saddr[0], e.saddr[1], e.saddr[2], e.saddr[3],
            )),
            IpAddr::V4(Ipv4Addr::new(
                e.daddr[0], e.daddr[1], e.daddr[2], e.daddr[3],
            )),
        )
    } else {
        (
            IpAddr::V6(Ipv6Addr::from(e.saddr)),
            IpAddr::V6(Ipv6Addr::from(e.daddr)),
        )
    };
    Ok(base(
        h,
        Detail::Tcp(Box::new(Tcp {
            state: e.state,
            sport: e.sport,
            dport: e.dport,
            saddr,
            daddr,
        })),
    ))
}

/// A fork in the job.
fn fork(h: &EventHeader, buf: &[u8]) -> Result<Event, DecodeError> {
    let e: ForkEvent = read(buf, h.kind)?;
    Ok(base(
        h,
        Detail::Fork {
            child_pid: e.child_pid,
            child_comm: Comm::from_bytes(e.child_comm),
            tid: 0,
        },
    ))
}

/// An exec in the job.
fn exec(h: &EventHeader, buf: &[u8]) -> Result<Event, DecodeError> {
    let e: ExecEvent = read(buf, h.kind)?;
    Ok(base(
        h,
        Detail::Exec {
            filename: cstr(&e.filename).into(),
        },
    ))
}

/// A job process's exit.
fn exit(h: &EventHeader, buf: &[u8]) -> Result<Event, DecodeError> {
    let e: ExitEvent = read(buf, h.kind)?;
    Ok(base(
        h,
        Detail::Exit {
            code: e.code,
            signal: e.signal,
            tid: 0,
            core_dumped: e.core_dumped != 0,
        },
    ))
}

/// A signal to a job process.
fn signal(h: &EventHeader, buf: &[u8]) -> Result<Event, DecodeError> {
    let e: SignalEvent = read(buf, h.kind)?;
    Ok(base(
        h,
        Detail::Signal {
            sig: e.sig,
            code: e.code,
            target_pid: e.target_pid,
            result: e.result,
            target_comm: Comm::from_bytes(e.target_comm),
            tid: 0,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::comm_str;
    use nantrace_common::*;

    fn bytes<T>(v: &T) -> Vec<u8> {
        // SAFETY: T is a padding-free #[repr(C)] struct; viewing it as bytes is sound.
        unsafe {
            std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>())
        }
        .to_vec()
    }

    fn hdr(kind: EventKind) -> EventHeader {
        let mut comm = [0u8; 16];
        comm[..7].copy_from_slice(b"python3");
        EventHeader {
            kind: kind as u32,
            flags: FLAG_JOB,
            ts_ns: 123_456_789,
            pid: 4242,
            tid: 4243,
            comm,
        }
    }

    #[test]
    fn structs_have_no_padding() {
        assert_eq!(std::mem::size_of::<EventHeader>(), 40);
        assert_eq!(std::mem::size_of::<PrintkEvent>(), 40 + 8 + PRINTK_MSG_LEN);
        assert_eq!(std::mem::size_of::<OomEvent>(), 112);
        assert_eq!(std::mem::size_of::<BlockEvent>(), 88);
        assert_eq!(std::mem::size_of::<TcpRetransmitEvent>(), 88);
        assert_eq!(std::mem::size_of::<ForkEvent>(), 64);
        assert_eq!(std::mem::size_of::<ExitEvent>(), 56);
        assert_eq!(std::mem::size_of::<SignalEvent>(), 72);
        assert_eq!(std::mem::size_of::<AerEvent>(), 104);
        assert_eq!(std::mem::size_of::<Config>(), 24 + 4 * 47 + 4 * 25);
        assert_eq!(
            std::mem::size_of::<nantrace_common::BioHistSlot>(),
            8 + 8 * nantrace_common::BIO_HIST_BUCKETS as usize
        );
        assert_eq!(std::mem::size_of::<nantrace_common::BioIssuer>(), 40);
    }

    #[test]
    fn printk_round_trip_classifies_xid() {
        let line = b"NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.\n";
        let mut e = PrintkEvent {
            hdr: hdr(EventKind::Printk),
            len: line.len() as u32,
            _pad: 0,
            msg: [0; PRINTK_MSG_LEN],
        };
        e.msg[..line.len()].copy_from_slice(line);
        let ev = decode(&bytes(&e)).unwrap();
        // A kernel log line is the process's (no thread slot): tid() is the pid.
        assert_eq!(
            (ev.pid, ev.tid(), ev.job(), ev.mono_ns),
            (4242, 4242, true, 123_456_789)
        );
        assert_eq!(comm_str(&ev.comm), "python3");
        assert_eq!(ev.source(), "xid");
        let j = ev.to_json(&crate::clock::ClockMap {
            offset_ns: 0,
            error_ns: 0,
            sampled_at_mono_ns: 0,
        });
        assert_eq!(j["xid"], 79);
        assert_eq!(j["pci"], "0000:3b:00.0");
        assert_eq!(j["severity"], "critical");
        assert_eq!(j["time"], "1970-01-01T00:00:00.123456789Z");
    }

    #[test]
    fn printk_len_beyond_buffer_is_clamped() {
        let mut e = PrintkEvent {
            hdr: hdr(EventKind::Printk),
            len: 10_000,
            _pad: 0,
            msg: [b'a'; PRINTK_MSG_LEN],
        };
        e.hdr.flags |= FLAG_TRUNCATED;
        let ev = decode(&bytes(&e)).unwrap();
        match &ev.detail {
            Detail::Kmsg(k) => {
                assert_eq!((k.text.len(), ev.kmsg_truncated()), (PRINTK_MSG_LEN, true))
            }
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn tcp_v4_and_v6_round_trip() {
        let mut e = TcpRetransmitEvent {
            hdr: hdr(EventKind::TcpRetransmit),
            state: 1,
            sport: 40000,
            dport: 29500,
            family: 2,
            _pad: [0; 3],
            saddr: [0; 16],
            daddr: [0; 16],
        };
        e.saddr[..4].copy_from_slice(&[10, 0, 0, 1]);
        e.daddr[..4].copy_from_slice(&[10, 0, 0, 7]);
        let ev = decode(&bytes(&e)).unwrap();
        let j = ev.to_json(&crate::clock::ClockMap::sample());
        assert_eq!(
            (
                j["saddr"].as_str(),
                j["daddr"].as_str(),
                j["dport"].as_u64(),
                j["state"].as_str()
            ),
            (
                Some("10.0.0.1"),
                Some("10.0.0.7"),
                Some(29500),
                Some("ESTABLISHED")
            )
        );
        e.family = 10;
        e.daddr = Ipv6Addr::LOCALHOST.octets();
        let j = decode(&bytes(&e))
            .unwrap()
            .to_json(&crate::clock::ClockMap::sample());
        assert_eq!(j["daddr"], "::1");
    }

    #[test]
    fn process_events_round_trip() {
        let ex = ExitEvent {
            hdr: hdr(EventKind::Exit),
            code: 3,
            signal: 0,
            core_dumped: 0,
            _pad: 0,
        };
        assert_eq!(
            decode(&bytes(&ex)).unwrap().detail,
            Detail::Exit {
                code: 3,
                signal: 0,
                tid: 4243,
                core_dumped: false
            }
        );
        let segv = ExitEvent {
            hdr: hdr(EventKind::Exit),
            code: -1,
            signal: 11,
            core_dumped: 1,
            _pad: 0,
        };
        let j = decode(&bytes(&segv))
            .unwrap()
            .to_json(&crate::clock::ClockMap::sample());
        assert_eq!(
            (
                j["signal"].as_str(),
                j["core_dumped"].as_bool(),
                j["exit_code"].is_null()
            ),
            (Some("SIGSEGV"), Some(true), true)
        );
        let j = decode(&bytes(&ex))
            .unwrap()
            .to_json(&crate::clock::ClockMap::sample());
        assert!(
            j.get("core_dumped").is_none(),
            "only a dumped core is said: {j}"
        );
        let mut c = [0u8; 16];
        c[..6].copy_from_slice(b"worker");
        let f = ForkEvent {
            hdr: hdr(EventKind::Fork),
            child_pid: 77,
            _pad: 0,
            child_comm: c,
        };
        assert_eq!(
            decode(&bytes(&f)).unwrap().detail,
            Detail::Fork {
                child_pid: 77,
                child_comm: Comm::from_bytes(c),
                tid: 4243
            }
        );
        let s = SignalEvent {
            hdr: hdr(EventKind::Signal),
            sig: 9,
            code: 0,
            target_pid: 77,
            result: 0,
            target_comm: c,
        };
        let j = decode(&bytes(&s))
            .unwrap()
            .to_json(&crate::clock::ClockMap::sample());
        assert_eq!(
            (j["signal"].as_str(), j["target_pid"].as_u64()),
            (Some("SIGKILL"), Some(77))
        );
        let b = BlockEvent {
            hdr: hdr(EventKind::Block),
            dev: (8 << 20) | 16,
            error: -5,
            sector: 2048,
            latency_ns: 1_500_000,
            nr_sector: 8,
            _pad: 0,
            rwbs: *b"WS\0\0\0\0\0\0\0\0\0\0\0\0\0\0",
        };
        let j = decode(&bytes(&b))
            .unwrap()
            .to_json(&crate::clock::ClockMap::sample());
        assert_eq!(
            (
                j["dev"].as_str(),
                j["error"].as_i64(),
                j["latency_ms"].as_f64(),
                j["bytes"].as_u64(),
                j["rwbs"].as_str()
            ),
            (Some("8:16"), Some(-5), Some(1.5), Some(4096), Some("WS"))
        );
    }

    #[test]
    fn aer_tracepoint_record_round_trip() {
        // The ras:aer_event layout as the probe fills it (the test kernel lacks the tracepoint).
        let mut dev = [0u8; 32];
        dev[..12].copy_from_slice(b"0000:3b:00.0");
        let e = AerEvent {
            hdr: hdr(EventKind::Aer),
            status: 0x0000_4000,
            severity: 1,
            tlp_header_valid: 1,
            tlp_header: [0x4a00_0001, 0x0100_000f, 0xfe00_0000, 0],
            _pad: 0,
            dev_name: dev,
        };
        let ev = decode(&bytes(&e)).unwrap();
        assert_eq!(ev.source(), "aer");
        let j = ev.to_json(&crate::clock::ClockMap::sample());
        assert_eq!(j["device"], "0000:3b:00.0");
        assert_eq!(j["aer_severity"], "uncorrected_fatal");
        assert_eq!(j["severity"], "critical");
        assert_eq!(j["status"], "0x00004000");
        assert_eq!(j["tlp_header"][0], "4a000001");
        let corrected = AerEvent {
            severity: 2,
            tlp_header_valid: 0,
            ..e
        };
        let j = decode(&bytes(&corrected))
            .unwrap()
            .to_json(&crate::clock::ClockMap::sample());
        assert_eq!(
            (j["aer_severity"].as_str(), j["tlp_header"].is_null()),
            (Some("corrected"), true)
        );
    }

    #[test]
    fn truncated_and_unknown_records_are_errors() {
        let ex = bytes(&ExitEvent {
            hdr: hdr(EventKind::Exit),
            code: 3,
            signal: 0,
            core_dumped: 0,
            _pad: 0,
        });
        assert_eq!(
            decode(&ex[..55]),
            Err(DecodeError::Short {
                kind: 8,
                need: 56,
                got: 55
            })
        );
        assert!(matches!(
            decode(&ex[..10]),
            Err(DecodeError::Short { kind: 0, .. })
        ));
        assert_eq!(
            decode(&[]),
            Err(DecodeError::Short {
                kind: 0,
                need: 40,
                got: 0
            })
        );
        let mut h = hdr(EventKind::Exit);
        h.kind = 99;
        assert_eq!(decode(&bytes(&h)), Err(DecodeError::UnknownKind(99)));
        for kind in EventKind::ALL {
            let h = hdr(kind);
            // A header alone is shorter than every event body.
            assert!(
                matches!(decode(&bytes(&h)), Err(DecodeError::Short { .. })),
                "{kind:?}"
            );
        }
    }
}
