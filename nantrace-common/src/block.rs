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

/// Key of the per-device latency histogram map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BioHistKey {
    pub dev: u32,
    pub bucket: u32,
}

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
