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
pub const BIO_HIST_SLOTS: u32 = 128;
pub const BIO_HIST_PROBES: u32 = 4;

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

/// A watched job's in-flight request on the BTF path, by the request's start sector and
/// driver tag (no two in-flight requests share both; the `struct request *` cannot be
/// hashed: the verifier forbids arithmetic on it), in a two-way set-associative array (the hash it replaced cost a hash insert at every issue by
/// the job and a hash lookup at every completion on the node). When both ways of a set hold
/// other live requests, the first way is overwritten and counted (`BlockStat::IssuerEvicted`):
/// its completion is measured but not attributed to the job.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BioIssuer {
    /// The request's start sector.
    pub sector: u64,
    /// The request's driver tag + 1; 0 = a free slot.
    pub tag: u32,
    pub pid: u32,
    /// Issue time, only when the request carries no start time of its own (I/O statistics
    /// off for its queue); else 0.
    pub ts_ns: u64,
}

/// Per-CPU counters of the block probes (`BLOCK_STATS`, index = the variant).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockStat {
    /// A job's in-flight request was overwritten in `BIO_ISSUERS` by a newer one.
    IssuerEvicted = 0,
    /// A completion whose device found no histogram slot.
    HistFull = 1,
}

pub const BLOCK_STATS: u32 = 2;

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
