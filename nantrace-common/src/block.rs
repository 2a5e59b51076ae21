//! `block:block_rq_issue` + `block:block_rq_complete`: request latency measured in the kernel.
use crate::EventHeader;

/// log2(µs) latency buckets per device: bucket i counts requests with latency in [2^i, 2^(i+1)) µs.
pub const BIO_HIST_BUCKETS: u32 = 24;

/// In-flight request key (the tracepoints do not expose the request pointer).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BioKey {
    pub dev: u32,
    pub _pad: u32,
    pub sector: u64,
}

/// What the issue probe remembers about an in-flight request: the time and the issuing
/// process (its name is looked up by userspace for the rare request that becomes an event:
/// the issue path runs for every request, and copying the name there cost a helper call and
/// 16 bytes per request).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BioStart {
    pub ts_ns: u64,
    pub pid: u32,
    pub _pad: u32,
}

/// Slots of the per-CPU latency histogram array: one device per slot, found by a hash of its
/// dev_t and at most `BIO_HIST_PROBES` slots of linear probing. A device that finds no slot is
/// counted in `BlockStat::HistFull` and left out of the histograms.
pub const BIO_HIST_SLOTS: u32 = 256;
pub const BIO_HIST_PROBES: u32 = 8;

/// One device's log2(µs) latency histogram, in a per-CPU array (an array slot is found by an
/// inlined load; the per-CPU hash it replaced hashed a key at every completion on the node).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BioHistSlot {
    /// The device's dev_t (MKDEV: major << 20 | minor); 0 = a free slot.
    pub dev: u32,
    pub _pad: u32,
    pub counts: [u64; BIO_HIST_BUCKETS as usize],
}

/// Slots of the BTF path's in-flight table (a power of two), two ways per set.
pub const BIO_ISSUER_SLOTS: u32 = 16384;

/// A watched job's in-flight request on the BTF path (`BIO_ISSUERS`, two ways per set; see
/// `nantrace-ebpf/src/blkid.rs`): the request's identity, and who issued it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BioIssuer {
    pub sector: u64,
    /// `rq->start_time_ns` at issue (0 when the queue keeps no I/O statistics).
    pub start: u64,
    /// Issue time, only when `start` is 0; else 0.
    pub ts_ns: u64,
    pub dev: u32,
    /// The driver tag + 1; 0 = a free way.
    pub tag: u32,
    pub pid: u32,
    pub _pad: u32,
}

/// Per-CPU counters of the block probes (`BLOCK_STATS`, index = the variant).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockStat {
    /// A job's in-flight request was overwritten in `BIO_ISSUERS` by a newer one.
    IssuerEvicted = 0,
    /// A completion whose device found no histogram slot.
    HistFull = 1,
    /// A job's new request not remembered for its dispatch (`JOB_QUEUED` full): where a
    /// kworker dispatches it, it is measured but not attributed to the job.
    QueuedFull = 2,
    /// A job's request at its issue without an identity (no tag, or no disk) on the BTF
    /// path: it cannot be found again at its completion, so it is counted here instead.
    JobIssueNoIdentity = 3,
    /// A completion on the BTF path that found no issuer entry, on a device the job issued
    /// to in the last [`BLOCK_JOB_DEV_WINDOW_NS`]: possibly the job's (measured, not
    /// attributed), counted so that no job request goes unaccounted.
    NoIssuerOnJobDevice = 4,
}

pub const BLOCK_STATS: u32 = 5;

/// Devices the job issued to, remembered for [`BlockStat::NoIssuerOnJobDevice`]: two-way
/// sets of (dev, last issue time), a device's set the top bits of its Fibonacci hash.
pub const BLOCK_JOB_DEV_SLOTS: u32 = 8;
/// How long after the job's last issue on a device a completion there without an issuer
/// is counted as possibly the job's.
pub const BLOCK_JOB_DEV_WINDOW_NS: u64 = 2_000_000_000;

/// How long a job's request remembered at `block_getrq` may wait for its dispatch and still
/// be taken as the job's (mq-deadline's write deadline is 5 s). An older entry was merged
/// into another request, which is never dispatched itself; userspace sweeps those out.
pub const BLOCK_QUEUED_MAX_AGE_NS: u64 = 10_000_000_000;

/// A completed request that failed or was slower than the threshold. The header's pid/comm are
/// those of the task that issued it (completion runs in interrupt context).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockEvent {
    pub hdr: EventHeader,
    pub dev: u32,
    pub error: i32,
    pub sector: u64,
    pub latency_ns: u64,
    pub nr_sector: u32,
    pub _pad: u32,
    pub rwbs: [u8; 16],
}
