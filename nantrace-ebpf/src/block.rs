//! `block:block_rq_issue` + `block:block_rq_complete` (tested on 6.18): per-request latency
//! measured in the kernel. Every completion lands in a per-device log2 histogram; only errors
//! and requests slower than `slow_io_ns` become events, so fast I/O cannot flood the ring.
use aya_ebpf::{
    helpers::bpf_ktime_get_ns,
    macros::{map, tracepoint},
    maps::{Array, HashMap, PerCpuArray},
    programs::TracePointContext,
};
use nantrace_common::{
    BioHistSlot, BioKey, BioStart, BlockEvent, BlockStat, EventKind, BIO_HIST_BUCKETS, BIO_HIST_PROBES,
    BIO_HIST_SLOTS, BLOCK_STATS, FLAG_JOB, MISSING,
};

use crate::{conf, count_drop, current_pid_tgid, is_job, EVENTS};

/// In-flight requests. A plain hash, not LRU: the benchmark measured the LRU insert at twice
/// the cost. Entries leave on completion; if lost completions ever filled it, new requests
/// would go unmeasured (inserts fail) rather than evict live ones.
#[map]
static BIO_START: HashMap<BioKey, BioStart> = HashMap::with_max_entries(16384, 0);

/// The job's requests (`block_getrq`), until their dispatch: the job's pid and the time it
/// was remembered. A plain hash, not an LRU (a 6.1 guest locked up with an LRU here, under
/// two writers on two loop devices). A request merged into another before its dispatch is
/// never issued and its entry stays: an entry older than `QUEUED_MAX_AGE_NS` is never taken
/// as the job's (another process's later request at the same device and sector stays its
/// own), and userspace sweeps such entries out (`Probes::sweep_block_queue`). When the map is
/// full a new request is counted (`BlockStat::QueuedFull`), not remembered. Only the job's
/// requests are inserted.
#[map]
static JOB_QUEUED: HashMap<BioKey, BioStart> = HashMap::with_max_entries(8192, 0);

/// How long a request remembered at `block_getrq` may wait for its dispatch and still be the
/// job's: mq-deadline's write deadline is 5 s; a request older than this was merged away.
pub const QUEUED_MAX_AGE_NS: u64 = nantrace_common::BLOCK_QUEUED_MAX_AGE_NS;

/// The time of the job's last `block_getrq` (0: never), so the dispatch of a request outside
/// the job looks `JOB_QUEUED` up only within `QUEUED_MAX_AGE_NS` of one. A time, not a count:
/// every writer stores a recent time, so a race loses nothing (a count of entries could be
/// undercounted to zero by racing increments and decrements, and then skip the lookup of a
/// request that is there).
#[map]
static QUEUED_LAST: Array<u64> = Array::with_max_entries(1, 0);

/// Whether the job made a request recently enough that one may be waiting for dispatch.
#[inline(always)]
pub(crate) fn queued_recent(now: u64) -> bool {
    // SAFETY: an aligned u64 of a map value, written whole.
    QUEUED_LAST.get_ptr(0).is_some_and(|p| {
        let last = unsafe { core::ptr::read_volatile(p) };
        // saturating: another CPU may have stored a time after this one's `now`.
        last != 0 && now.saturating_sub(last) < QUEUED_MAX_AGE_NS
    })
}

/// `Some(now)` when the job made a request within `QUEUED_MAX_AGE_NS` (the clock is read only
/// once the job has made one at all: the BTF issue path of every other request on the node
/// stays one array load).
#[inline(always)]
pub(crate) fn queued_window() -> Option<u64> {
    let p = QUEUED_LAST.get_ptr(0)?;
    // SAFETY: as in `queued_recent`.
    let last = unsafe { core::ptr::read_volatile(p) };
    if last == 0 {
        return None;
    }
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    (now.saturating_sub(last) < QUEUED_MAX_AGE_NS).then_some(now)
}

/// Forget the job's request at `k` (the job issued it itself), while any may be waiting.
#[inline(always)]
pub(crate) fn queued_forget(k: &BioKey) {
    if QUEUED_LAST.get_ptr(0).is_some_and(|p| unsafe { core::ptr::read_volatile(p) } != 0) {
        let _ = JOB_QUEUED.remove(k);
    }
}

/// The job's pid for the request at `k` made in the job (`block_getrq`) and not older than
/// `QUEUED_MAX_AGE_NS`; the entry is removed either way.
#[inline(always)]
pub(crate) fn queued_take(k: &BioKey, now: u64) -> Option<u32> {
    // SAFETY: value copied out before the removal.
    let q = unsafe { JOB_QUEUED.get(k) }.copied()?;
    let _ = JOB_QUEUED.remove(k);
    (now.saturating_sub(q.ts_ns) < QUEUED_MAX_AGE_NS).then_some(q.pid)
}

/// Per-device latency histograms, per CPU (see `BioHistSlot`).
#[map]
static BIO_HIST: PerCpuArray<BioHistSlot> = PerCpuArray::with_max_entries(BIO_HIST_SLOTS, 0);

/// Per-CPU counters of what the block probes could not keep (see `BlockStat`).
#[map]
static BLOCK_STATS_MAP: PerCpuArray<u64> = PerCpuArray::with_max_entries(BLOCK_STATS, 0);

#[inline(always)]
pub(crate) fn count_stat(s: BlockStat) {
    if let Some(p) = BLOCK_STATS_MAP.get_ptr_mut(s as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU while the program runs.
        unsafe { *p += 1 };
    }
}

/// Fibonacci hashing: the top `bits` bits of `v` times 2^64/phi, spread for pointers and
/// dev_t values alike.
#[inline(always)]
pub(crate) fn spread(v: u64, bits: u32) -> u32 {
    (v.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - bits)) as u32
}

#[inline(always)]
fn key(ctx: &TracePointContext, dev_off: u32, sector_off: u32) -> Option<BioKey> {
    if dev_off == MISSING || sector_off == MISSING {
        return None;
    }
    // One read when `sector` follows `dev` (u32 + padding, as on every kernel seen), else two.
    // SAFETY: offsets from the format file; probe_read tolerates faults.
    if sector_off == dev_off + 8 {
        let w = unsafe { ctx.read_at::<[u64; 2]>(dev_off as usize) }.ok()?;
        return Some(BioKey { dev: w[0] as u32, _pad: 0, sector: w[1] });
    }
    let dev = unsafe { ctx.read_at::<u32>(dev_off as usize) }.ok()?;
    let sector = unsafe { ctx.read_at::<u64>(sector_off as usize) }.ok()?;
    Some(BioKey { dev, _pad: 0, sector })
}

/// `block:block_getrq`: a request allocated for the job's bio, in the submitter's context.
/// Its dispatch (`block_rq_issue`) can run in a kworker: kblockd runs the queue when a direct
/// issue was refused or the plug was flushed asynchronously (a loop device on 5.10 and 6.1),
/// so the job is remembered here, by device and start sector.
#[tracepoint(category = "block", name = "block_getrq")]
pub fn block_getrq(ctx: TracePointContext) -> u32 {
    let (tgid, _) = current_pid_tgid();
    if !is_job(tgid) {
        return 0;
    }
    let Some(k) = key(&ctx, conf!(off.bio_getrq_dev), conf!(off.bio_getrq_sector)) else {
        return 0;
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    // An older entry at the same key (a request merged away) is replaced.
    if JOB_QUEUED.insert(&k, &BioStart { ts_ns: now, pid: tgid, _pad: 0 }, 0).is_ok() {
        if let Some(p) = QUEUED_LAST.get_ptr_mut(0) {
            // SAFETY: an aligned u64 of a map value; every writer stores a recent time.
            unsafe { core::ptr::write_volatile(p, now) };
        }
    } else {
        count_stat(BlockStat::QueuedFull);
    }
    0
}

#[tracepoint(category = "block", name = "block_rq_issue")]
pub fn block_rq_issue(ctx: TracePointContext) -> u32 {
    let Some(k) = key(&ctx, conf!(off.bio_issue_dev), conf!(off.bio_issue_sector)) else {
        return 0;
    };
    let (mut tgid, _) = current_pid_tgid();
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    // The job lookup is left to the completion, and only for requests that become events:
    // the issue path runs for every request. A request the job made (block_getrq) and a
    // kworker dispatches keeps the job as its issuer: one more lookup, only within
    // QUEUED_MAX_AGE_NS of the job's last request.
    if queued_recent(now) {
        match queued_take(&k, now) {
            Some(pid) if !is_job(tgid) => tgid = pid,
            _ => {}
        }
    }
    let start = BioStart { ts_ns: now, pid: tgid, _pad: 0 };
    let _ = BIO_START.insert(&k, &start, 0);
    0
}

/// floor(log2(v)) for v > 0, without a loop (the verifier dislikes unbounded ones).
#[inline(always)]
fn log2(mut v: u64) -> u32 {
    let mut r = 0;
    if v >= 1 << 32 { v >>= 32; r += 32; }
    if v >= 1 << 16 { v >>= 16; r += 16; }
    if v >= 1 << 8 { v >>= 8; r += 8; }
    if v >= 1 << 4 { v >>= 4; r += 4; }
    if v >= 1 << 2 { v >>= 2; r += 2; }
    if v >= 1 << 1 { r += 1; }
    r
}

/// Count one completion in the log2(µs) histogram of device `dev` (not 0).
#[inline(always)]
pub(crate) fn hist_add(dev: u32, latency_ns: u64) {
    let us = latency_ns / 1000;
    let mut bucket = if us == 0 { 0 } else { log2(us) };
    if bucket >= BIO_HIST_BUCKETS {
        bucket = BIO_HIST_BUCKETS - 1;
    }
    let first = spread(u64::from(dev), BIO_HIST_SLOTS.trailing_zeros());
    for i in 0..BIO_HIST_PROBES {
        let Some(slot) = BIO_HIST.get_ptr_mut((first + i) % BIO_HIST_SLOTS) else {
            return;
        };
        // SAFETY: this CPU's copy of the slot. The kernel does not nest a program inside
        // itself on one CPU: a completion in hard irq that interrupts this program is skipped
        // (counted in the program's `recursion_misses`, not here).
        unsafe {
            if (*slot).dev == 0 {
                (*slot).dev = dev;
            } else if (*slot).dev != dev {
                continue;
            }
            if let Some(c) = (*slot).counts.get_mut(bucket as usize) {
                *c += 1;
            }
        }
        return;
    }
    count_stat(BlockStat::HistFull);
}

#[tracepoint(category = "block", name = "block_rq_complete")]
pub fn block_rq_done(ctx: TracePointContext) -> u32 {
    let Some(k) = key(&ctx, conf!(off.bio_done_dev), conf!(off.bio_done_sector)) else {
        return 0;
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: the value is copied out before the entry is removed.
    let start = unsafe { BIO_START.get(&k) }.copied();
    if start.is_some() {
        let _ = BIO_START.remove(&k);
    }
    let err_off = conf!(off.bio_done_error);
    // SAFETY: offset from the format file.
    let error = if err_off == MISSING { 0 } else { unsafe { ctx.read_at::<i32>(err_off as usize) }.unwrap_or(0) };
    let latency = match start {
        Some(s) => now.saturating_sub(s.ts_ns),
        None => 0,
    };
    // dev 0 (a request without a disk) would read as a free slot.
    if start.is_some() && k.dev != 0 {
        hist_add(k.dev, latency);
    }
    let slow = start.is_some() && latency >= conf!(slow_io_ns);
    if error == 0 && !slow {
        return 0;
    }
    let Some(mut entry) = EVENTS.reserve::<BlockEvent>(0) else {
        count_drop(EventKind::Block);
        return 0;
    };
    let p = entry.as_mut_ptr();
    // SAFETY: fresh reservation.
    unsafe {
        (*p).hdr.kind = EventKind::Block as u32;
        (*p).hdr.ts_ns = now;
        match start {
            Some(s) => {
                (*p).hdr.flags = if is_job(s.pid) { FLAG_JOB } else { 0 };
                (*p).hdr.pid = s.pid;
                (*p).hdr.tid = s.pid;
                (*p).hdr.comm = [0; 16];
            }
            None => {
                (*p).hdr.flags = 0;
                (*p).hdr.pid = 0;
                (*p).hdr.tid = 0;
                (*p).hdr.comm = [0; 16];
            }
        }
        (*p).dev = k.dev;
        (*p).error = error;
        (*p).sector = k.sector;
        (*p).latency_ns = latency;
        let nr_off = conf!(off.bio_done_nr_sector);
        (*p).nr_sector = if nr_off == MISSING { 0 } else { ctx.read_at::<u32>(nr_off as usize).unwrap_or(0) };
        (*p)._pad = 0;
        (*p).rwbs = [0; 16];
        let rwbs_off = conf!(off.bio_done_rwbs);
        if rwbs_off != MISSING {
            let r = ctx.read_at::<[u8; 8]>(rwbs_off as usize).unwrap_or([0; 8]);
            let mut r16 = [0u8; 16];
            r16[..8].copy_from_slice(&r);
            (*p).rwbs = r16;
        }
    }
    crate::submit(entry);
    0
}
