//! Event structs shared by the nantrace eBPF probes and userspace.
//!
//! Every event starts with [`EventHeader`]; `kind` says which struct follows. Kind ids are
//! never reused. Structs are `#[repr(C)]`, have no implicit padding and no `bool`, so the
//! kernel and userspace agree on every byte.
#![no_std]

pub mod aer;
pub mod block;
pub mod config;
pub mod oom;
pub mod printk;
pub mod process;
pub mod tcp;

pub use aer::AerEvent;
pub use block::{
    BioHistSlot, BioIssuer, BioKey, BioStart, BlockEvent, BlockStat, BIO_HIST_BUCKETS,
    BIO_HIST_PROBES, BIO_HIST_SLOTS, BIO_ISSUER_SLOTS, BLOCK_JOB_DEV_SLOTS, BLOCK_JOB_DEV_WINDOW_NS,
    BLOCK_QUEUED_MAX_AGE_NS, BLOCK_STATS,
};
pub use config::{BtfOffsets, Config, TpOffsets, MISSING};
pub use oom::OomEvent;
pub use printk::{PrintkEvent, PRINTK_MSG_LEN};
pub use process::{ExecEvent, ExitEvent, ExitInfo, ForkEvent, SignalEvent, EXEC_FILENAME_LEN};
pub use tcp::TcpRetransmitEvent;

/// Kernel task comm length.
pub const COMM_LEN: usize = 16;

/// Event type ids. Values are stable and never reused.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Printk = 1,
    Aer = 2,
    Oom = 3,
    Block = 4,
    TcpRetransmit = 5,
    Fork = 6,
    Exec = 7,
    Exit = 8,
    Signal = 9,
}

/// Number of slots in the per-CPU drop counter map: index = kind id (0 unused).
pub const DROP_SLOTS: u32 = 16;

/// Pids the job membership map covers: the kernel's PID_MAX_LIMIT on 64-bit (pid_max can be
/// raised to it at any time, so the map is sized for it, not for today's pid_max).
pub const JOB_MAP_PIDS: u32 = 4 * 1024 * 1024;
/// Pids per element of the membership map (one byte each, in a `u64`).
pub const JOB_MAP_PIDS_PER_WORD: u32 = 8;
/// Elements of the membership map: 4 MiB in all.
pub const JOB_MAP_WORDS: u32 = JOB_MAP_PIDS / JOB_MAP_PIDS_PER_WORD;
/// `BPF_F_MMAPABLE`: userspace maps the membership map and writes single bytes, so its
/// writes never race the kernel side's writes to a neighbouring pid's byte.
pub const BPF_F_MMAPABLE: u32 = 1 << 10;

impl EventKind {
    pub const ALL: [EventKind; 9] = [
        EventKind::Printk,
        EventKind::Aer,
        EventKind::Oom,
        EventKind::Block,
        EventKind::TcpRetransmit,
        EventKind::Fork,
        EventKind::Exec,
        EventKind::Exit,
        EventKind::Signal,
    ];

    pub fn from_u32(v: u32) -> Option<Self> {
        Self::ALL.iter().copied().find(|k| *k as u32 == v)
    }

    /// Stable name used as the `source` of events in JSON.
    pub fn name(self) -> &'static str {
        match self {
            EventKind::Printk => "kmsg",
            EventKind::Aer => "aer",
            EventKind::Oom => "oom",
            EventKind::Block => "block",
            EventKind::TcpRetransmit => "tcp_retransmit",
            EventKind::Fork => "fork",
            EventKind::Exec => "exec",
            EventKind::Exit => "exit",
            EventKind::Signal => "signal",
        }
    }
}

/// Header flag: the current task belongs to the watched job.
pub const FLAG_JOB: u32 = 1;
/// Header flag: a string field was cut to fit.
pub const FLAG_TRUNCATED: u32 = 2;

/// Common header of every event (40 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventHeader {
    pub kind: u32,
    pub flags: u32,
    /// `bpf_ktime_get_ns()`: CLOCK_MONOTONIC nanoseconds.
    pub ts_ns: u64,
    /// Thread group id of the current task (what userspace calls pid).
    pub pid: u32,
    /// Thread id of the current task.
    pub tid: u32,
    pub comm: [u8; COMM_LEN],
}

impl EventHeader {
    pub const fn zeroed() -> Self {
        Self {
            kind: 0,
            flags: 0,
            ts_ns: 0,
            pid: 0,
            tid: 0,
            comm: [0; COMM_LEN],
        }
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all these types are `#[repr(C)]`, `Copy`, contain only integers and integer
    // arrays, and have no implicit padding (checked by the size tests in userspace).
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::BioHistSlot {}
    unsafe impl aya::Pod for super::ExitInfo {}
    unsafe impl aya::Pod for super::BioKey {}
    unsafe impl aya::Pod for super::BioStart {}
}
