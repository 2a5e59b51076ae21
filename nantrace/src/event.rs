//! The userspace event: one thing that happened, from any source, on the monotonic clock.
use serde_json::{Map, Value};

use crate::classify::KmsgClass;
use crate::source::Source;

mod json;

/// A task name, interned: the recorder keeps 4 bytes per event instead of 16 (a machine has a
/// few hundred distinct comms; the table is capped, overflow maps to the empty name).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Comm(u16);

type Interner = (std::collections::HashMap<[u8; 16], u16>, Vec<[u8; 16]>);
static COMMS: std::sync::LazyLock<std::sync::Mutex<Interner>> = std::sync::LazyLock::new(|| {
    std::sync::Mutex::new((std::collections::HashMap::new(), vec![[0u8; 16]]))
});
const MAX_COMMS: usize = 1 << 16;

impl Comm {
    pub const NONE: Comm = Comm(0);

    pub fn from_bytes(b: [u8; 16]) -> Comm {
        if b[0] == 0 {
            return Comm::NONE;
        }
        let mut t = COMMS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(id) = t.0.get(&b) {
            return Comm(*id);
        }
        if t.1.len() >= MAX_COMMS {
            return Comm::NONE;
        }
        let id = t.1.len() as u16;
        t.1.push(b);
        t.0.insert(b, id);
        Comm(id)
    }

    pub fn bytes(self) -> [u8; 16] {
        let t = COMMS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        t.1.get(self.0 as usize).copied().unwrap_or([0; 16])
    }
}

pub fn comm_str(c: &Comm) -> String {
    cstr16(&c.bytes())
}

fn cstr16(c: &[u8]) -> String {
    let end = c.iter().position(|&b| b == 0).unwrap_or(c.len());
    String::from_utf8_lossy(&c[..end]).into_owned()
}

pub fn comm_from(s: &str) -> Comm {
    let mut c = [0u8; 16];
    let b = s.as_bytes();
    let n = b.len().min(15);
    c[..n].copy_from_slice(&b[..n]);
    Comm::from_bytes(c)
}

/// 48 bytes: the recorder holds hundreds of thousands. The thread id is kept where it says
/// something (a thread's exit, the forking or signalling thread: in those details); other
/// events are the process's (`tid()` is the pid).
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// CLOCK_MONOTONIC nanoseconds (kernel `bpf_ktime_get_ns`, a BTF fork's child `start_time`,
    /// or userspace arrival).
    pub mono_ns: u64,
    pub pid: u32,
    pub comm: Comm,
    flags: u16,
    pub detail: Detail,
}

/// A kernel log line, held inline in the event (24 bytes; the text is the only allocation of
/// an unclassified line). Whether the probe cut it is the event's `kmsg_truncated()`.
#[derive(Clone, Debug, PartialEq)]
pub struct Kmsg {
    pub text: Box<str>,
    /// Boxed: most kernel lines are not classified, and the class is large.
    pub classified: Option<Box<Classified>>,
}

/// A classified kernel line: its class, and its record's sequence number where it was read
/// from `/dev/kmsg` (the probe has none): a drain finds that record again, whatever the
/// clocks did since (`klog::who_wrote`).
#[derive(Clone, Debug, PartialEq)]
pub struct Classified {
    pub class: KmsgClass,
    pub seq: Option<u64>,
}

impl Kmsg {
    pub fn new(text: impl Into<Box<str>>, class: Option<KmsgClass>, seq: Option<u64>) -> Self {
        Kmsg {
            text: text.into(),
            classified: class.map(|class| Box::new(Classified { class, seq })),
        }
    }

    pub fn class(&self) -> Option<&KmsgClass> {
        self.classified.as_deref().map(|c| &c.class)
    }

    pub fn seq(&self) -> Option<u64> {
        self.classified.as_deref().and_then(|c| c.seq)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Oom {
    pub victim_pid: u32,
    pub victim_comm: Comm,
    pub victim_job: bool,
    pub uid: u32,
    /// KiB (the unit is read from the tracepoint's format file at start; see decode).
    pub total_vm: u64,
    pub anon_rss: u64,
    pub file_rss: u64,
    pub shmem_rss: u64,
    pub pgtables: u64,
    pub oom_score_adj: i32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Tcp {
    pub state: i32,
    pub sport: u16,
    pub dport: u16,
    pub saddr: std::net::IpAddr,
    pub daddr: std::net::IpAddr,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Aer {
    pub device: String,
    pub status: u32,
    pub severity: u32,
    pub tlp_header: Option<[u32; 4]>,
}

/// The `ras:aer_event` severity code, named.
pub fn aer_severity_name(code: u32) -> &'static str {
    match code {
        0 => "uncorrected_nonfatal",
        1 => "uncorrected_fatal",
        2 => "corrected",
        _ => "unknown",
    }
}

/// A line of the job's output.
#[derive(Clone, Debug, PartialEq)]
pub struct LogLine {
    pub text: Box<str>,
    /// 1 = stdout, 2 = stderr, 3 = both through one pipe (nantrace's own were one file), 0 = a followed log file.
    pub stream: u8,
    pub nonfinite: bool,
    pub step: Option<u64>,
    pub loss: Option<f64>,
    pub loss_scale: Option<f64>,
    pub overflow: bool,
    /// A failure line of a known family (CUDA, NCCL, IB, storage...): see `joblog`.
    pub fault: Option<Box<crate::joblog::JobFault>>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Detail {
    Kmsg(Kmsg),
    Aer(Box<Aer>),
    Oom(Box<Oom>),
    /// Compact on purpose (the most frequent kernel event): latency in µs, rwbs in 6 bytes.
    Block {
        dev: u32,
        error: i16,
        sector: u64,
        latency_us: u32,
        nr_sector: u32,
        rwbs: [u8; 6],
    },
    Tcp(Box<Tcp>),
    /// `tid`: the forking thread.
    Fork {
        child_pid: u32,
        child_comm: Comm,
        tid: u32,
    },
    Exec {
        filename: Box<str>,
    },
    /// `tid`: the exiting thread (the process when it is the group leader); `core_dumped`:
    /// the kernel wrote a core (known on the BTF path only).
    Exit {
        code: i32,
        signal: i32,
        tid: u32,
        core_dumped: bool,
    },
    /// `tid`: the sending thread.
    Signal {
        sig: i32,
        code: i32,
        target_pid: u32,
        result: i32,
        target_comm: Comm,
        tid: u32,
    },
    Log(Box<LogLine>),
    /// A sample or notable change from a userspace collector (GPU, system, network...).
    Sample {
        source: Source,
        fields: Box<Map<String, Value>>,
    },
    /// A trigger fired.
    Trigger {
        kind: &'static str,
        reason: Box<String>,
    },
}

impl Detail {
    pub fn kind(&self) -> Source {
        match self {
            Detail::Kmsg(k) => match k.class() {
                Some(KmsgClass::Xid { .. }) => Source::Xid,
                Some(KmsgClass::Aer { .. }) => Source::Aer,
                _ => Source::Kmsg,
            },
            Detail::Aer(_) => Source::Aer,
            Detail::Oom(_) => Source::Oom,
            Detail::Block { .. } => Source::Block,
            Detail::Tcp(_) => Source::TcpRetransmit,
            Detail::Fork { .. } => Source::Fork,
            Detail::Exec { .. } => Source::Exec,
            Detail::Exit { .. } => Source::Exit,
            Detail::Signal { .. } => Source::Signal,
            Detail::Log(_) => Source::Log,
            Detail::Sample { source, .. } => *source,
            Detail::Trigger { .. } => Source::Trigger,
        }
    }

    pub fn source(&self) -> &'static str {
        self.kind().as_str()
    }
}

pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        15 => "SIGTERM",
        10 => "SIGUSR1",
        12 => "SIGUSR2",
        _ => "signal",
    }
}

fn dev_name(dev: u32) -> String {
    // Kernel-internal dev_t: major in the top 12 bits, minor in the low 20.
    format!("{}:{}", dev >> 20, dev & 0xfffff)
}

/// The block device's name (`nvme0n1`, `loop0`) from /sys/dev/block, cached per device.
pub fn disk_name(dev: u32) -> Option<String> {
    static CACHE: std::sync::LazyLock<
        std::sync::Mutex<std::collections::HashMap<u32, Option<String>>>,
    > = std::sync::LazyLock::new(Default::default);
    let mut c = CACHE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    c.entry(dev)
        .or_insert_with(|| {
            let uevent =
                std::fs::read_to_string(format!("/sys/dev/block/{}/uevent", dev_name(dev))).ok()?;
            uevent
                .lines()
                .find_map(|l| l.strip_prefix("DEVNAME=").map(String::from))
        })
        .clone()
}

impl Event {
    const JOB: u16 = 1;
    const TRUNCATED: u16 = 2;

    /// `tid` is kept in the details that have a slot for it (exit, fork, signal).
    pub fn new(
        mono_ns: u64,
        pid: u32,
        tid: u32,
        comm: Comm,
        job: bool,
        mut detail: Detail,
    ) -> Self {
        match &mut detail {
            Detail::Exit { tid: t, .. }
            | Detail::Fork { tid: t, .. }
            | Detail::Signal { tid: t, .. } => *t = tid,
            _ => {}
        }
        Event {
            mono_ns,
            pid,
            comm,
            flags: if job { Self::JOB } else { 0 },
            detail,
        }
    }

    /// The event belongs to the watched job (the kernel's job map said so, or nantrace read
    /// it from the job's output).
    pub fn job(&self) -> bool {
        self.flags & Self::JOB != 0
    }

    /// A kernel log line longer than the probe's buffer (its end is missing).
    pub fn kmsg_truncated(&self) -> bool {
        self.flags & Self::TRUNCATED != 0
    }

    pub fn set_kmsg_truncated(&mut self) {
        self.flags |= Self::TRUNCATED;
    }

    /// The thread: from the details that keep it, else the process.
    pub fn tid(&self) -> u32 {
        match &self.detail {
            Detail::Exit { tid, .. } | Detail::Fork { tid, .. } | Detail::Signal { tid, .. }
                if *tid != 0 =>
            {
                *tid
            }
            _ => self.pid,
        }
    }

    pub fn source(&self) -> &'static str {
        self.detail.source()
    }

    /// Approximate bytes this event holds (inline + heap), for the recorder's memory cap.
    /// What the allocator really spends on this event's heap parts: each allocation rounded
    /// to glibc's chunk (size + 8, 16-aligned, at least 32 bytes).
    pub fn heap_bytes(&self) -> usize {
        fn a(n: usize) -> usize {
            if n == 0 {
                0
            } else {
                ((n + 8 + 15) & !15).max(32)
            }
        }
        match &self.detail {
            Detail::Kmsg(k) => {
                a(k.text.len())
                    + k.classified
                        .as_ref()
                        .map_or(0, |_| a(std::mem::size_of::<Classified>()) + 64)
            }
            Detail::Aer(a_) => a(std::mem::size_of::<Aer>()) + a(a_.device.len()),
            Detail::Oom(_) => a(std::mem::size_of::<Oom>()),
            Detail::Tcp(_) => a(std::mem::size_of::<Tcp>()),
            Detail::Exec { filename } => a(filename.len()),
            Detail::Log(l) => {
                a(std::mem::size_of::<LogLine>())
                    + a(l.text.len())
                    + l.fault.as_ref().map_or(0, |f| {
                        a(std::mem::size_of::<crate::joblog::JobFault>())
                            + f.code.as_ref().map_or(0, |c| a(c.len()))
                    })
            }
            Detail::Sample { fields, .. } => 64 + fields.len() * 96,
            Detail::Trigger { reason, .. } => a(std::mem::size_of::<String>()) + a(reason.len()),
            _ => 0,
        }
    }

    pub fn bytes(&self) -> usize {
        std::mem::size_of::<Event>() + self.heap_bytes()
    }
}

pub fn tcp_state(s: i32) -> &'static str {
    match s {
        1 => "ESTABLISHED",
        2 => "SYN_SENT",
        3 => "SYN_RECV",
        4 => "FIN_WAIT1",
        5 => "FIN_WAIT2",
        6 => "TIME_WAIT",
        7 => "CLOSE",
        8 => "CLOSE_WAIT",
        9 => "LAST_ACK",
        10 => "LISTEN",
        11 => "CLOSING",
        12 => "NEW_SYN_RECV",
        _ => "UNKNOWN",
    }
}
