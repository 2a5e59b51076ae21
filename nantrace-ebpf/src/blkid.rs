//! The BTF block path's table of a watched job's in-flight requests (`BIO_ISSUERS`): who
//! issued a request, found again at its completion without a hash map.
//!
//! A request is identified by its device, start sector, tag and start time (`start_time_ns`,
//! set when the request was allocated, so it tells a reused `struct request` from the one
//! that was remembered, and two requests of different hardware queues that share a tag and a
//! sector). The tag is the scheduler tag (`internal_tag`) when the queue has an I/O
//! scheduler, else the driver tag: both are held from allocation to free, so the identity
//! survives a requeue (the driver tag under a scheduler is given back before a requeue and a
//! new one taken at the next dispatch, which runs from kblockd, not the job). The
//! `struct request *` itself cannot be hashed (the verifier forbids arithmetic on it).
//!
//! The table is an array of two-way sets. A request's set is its device's base (a Fibonacci
//! hash of dev_t) plus its hardware queue's number times 1024 plus its tag: the tags in use
//! on a queue are a small range (the queue depth), so the sets a device's requests land in
//! stay in a few cache lines and pages that every completion on the node, the job's or not,
//! reads again. The session 12 table hashed the sector too, which scattered the lookups over
//! the 640 KiB table: the completion of a request outside the job then cost ~190-300 ns
//! more (cache and TLB misses on a VM; docs/performance-notes.md, "Session 13"). On a
//! multi-queue device the windows of 8 queues share the table's range (8192 sets / 1024),
//! so locality holds per queue; the load factor, hence the eviction rate, is as before.
//! When both ways hold other live requests, the first is given up and counted
//! (`BlockStat::IssuerEvicted`): its completion is measured but not attributed to the job.
//!
//! Races, accepted and rare: the table is written by the issuing CPU and cleared by the
//! completing one without locks. Two CPUs issuing into the same empty set at once may both
//! take the first way (one request is then not attributed), and an eviction can land between
//! a completion's copy of a way and its clearing (the newer request is then not attributed).
use aya_ebpf::{macros::map, maps::Array};
use nantrace_common::{
    BioIssuer, BlockStat, BIO_ISSUER_SLOTS, BLOCK_JOB_DEV_SLOTS, BLOCK_JOB_DEV_WINDOW_NS,
};

use crate::{conf, field::load};

#[map]
static BIO_ISSUERS: Array<BioIssuer> = Array::with_max_entries(BIO_ISSUER_SLOTS, 0);

/// The devices the job issued to lately, in two-way sets: a set's ways at `4s` and
/// `4s + 2`, each a dev_t then its last issue time (`BlockStat::NoIssuerOnJobDevice`). Racy
/// by design (plain stores): a miss costs one count, never an attribution.
#[map]
static JOB_DEVS: Array<u64> = Array::with_max_entries(BLOCK_JOB_DEV_SLOTS * 4, 0);

#[inline(always)]
fn job_dev_set(dev: u32) -> u32 {
    crate::block::spread(u64::from(dev), BLOCK_JOB_DEV_SLOTS.trailing_zeros()) * 4
}

/// The job issued a request on `dev` at `now`: its way refreshed (at most every 100 ms: one
/// shared cache line), else the older way taken.
#[inline(always)]
pub(crate) fn job_dev_issued(dev: u32, now: u64) {
    if dev == 0 {
        return;
    }
    let s = job_dev_set(dev);
    let (Some(d0), Some(t0), Some(d1), Some(t1)) = (
        JOB_DEVS.get_ptr_mut(s),
        JOB_DEVS.get_ptr_mut(s + 1),
        JOB_DEVS.get_ptr_mut(s + 2),
        JOB_DEVS.get_ptr_mut(s + 3),
    ) else {
        return;
    };
    // SAFETY: slots of the array, checked non-null.
    unsafe {
        let (d, t) = if *d0 == u64::from(dev) {
            (d0, t0)
        } else if *d1 == u64::from(dev) {
            (d1, t1)
        } else if *t0 <= *t1 {
            (d0, t0)
        } else {
            (d1, t1)
        };
        if *d != u64::from(dev) || now.saturating_sub(*t) > 100_000_000 {
            *d = u64::from(dev);
            *t = now;
        }
    }
}

/// A completion on `dev` at `now` found no issuer: counted when the job issued to that
/// device within the window (possibly the job's request, not attributed).
#[inline(always)]
pub(crate) fn no_issuer_on(dev: u32, now: u64) {
    if dev == 0 {
        return;
    }
    let s = job_dev_set(dev);
    for w in [s, s + 2] {
        if let (Some(d), Some(t)) = (JOB_DEVS.get(w), JOB_DEVS.get(w + 1)) {
            if *d == u64::from(dev) && now.saturating_sub(*t) < BLOCK_JOB_DEV_WINDOW_NS {
                crate::block::count_stat(BlockStat::NoIssuerOnJobDevice);
                return;
            }
        }
    }
}

/// The kernel's dev_t of a request's disk (through `rq->q->disk`): MKDEV(major, minor) =
/// major << 20 | minor; 0 without a disk.
#[inline(always)]
pub(crate) fn rq_dev(rq: *const u8) -> u32 {
    let q: *const u8 = load(rq, conf!(btf.rq_q));
    let disk: *const u8 = load(q, conf!(btf.q_disk));
    let major: i32 = load(disk, conf!(btf.disk_major));
    let minor: i32 = load(disk, conf!(btf.disk_first_minor));
    ((major as u32) << 20) | (minor as u32 & 0xfffff)
}

/// A request's identity and its set's two ways.
pub(crate) struct RqId {
    pub dev: u32,
    pub sector: u64,
    /// The tag + 1 (0 marks a free way).
    tag: u32,
    /// `rq->start_time_ns` (0 when the queue keeps no I/O statistics).
    pub start: u64,
    a: *mut BioIssuer,
    b: *mut BioIssuer,
}

impl RqId {
    /// No request: every field set (the 6.1 verifier refuses a read of a stack slot that one
    /// path left unwritten, which an `Option`'s payload is when `None`).
    const NONE: Self = Self { dev: 0, sector: 0, tag: 0, start: 0, a: core::ptr::null_mut(), b: core::ptr::null_mut() };

    /// The request's identity; [`RqId::valid`] is false for a request without a tag (it
    /// cannot be told from others) or a disk.
    #[inline(always)]
    pub(crate) fn of(rq: *const u8) -> Self {
        let mut tag: i32 = load(rq, conf!(btf.rq_internal_tag));
        if tag < 0 {
            tag = load(rq, conf!(btf.rq_tag));
        }
        if tag < 0 {
            return Self::NONE;
        }
        let dev = rq_dev(rq);
        if dev == 0 {
            return Self::NONE;
        }
        let sector: u64 = load(rq, conf!(btf.rq_sector));
        let start: u64 = load(rq, conf!(btf.rq_start_time));
        let hctx: *const u8 = load(rq, conf!(btf.rq_mq_hctx));
        let queue: u32 = load(hctx, conf!(btf.hctx_queue_num));
        let tag = tag as u32 + 1;
        let sets = BIO_ISSUER_SLOTS / 2;
        let base = crate::block::spread(u64::from(dev), sets.trailing_zeros());
        let set = (base.wrapping_add(queue << 10).wrapping_add(tag) & (sets - 1)) * 2;
        match (BIO_ISSUERS.get_ptr_mut(set), BIO_ISSUERS.get_ptr_mut(set + 1)) {
            (Some(a), Some(b)) => Self { dev, sector, tag, start, a, b },
            _ => Self::NONE,
        }
    }

    #[inline(always)]
    pub(crate) fn valid(&self) -> bool {
        !self.a.is_null() && !self.b.is_null()
    }

    /// Whether way `w` holds this request.
    #[inline(always)]
    fn holds(&self, w: *mut BioIssuer) -> bool {
        // SAFETY: a way of the array (a map value), checked non-null.
        !w.is_null() && unsafe { (*w).tag == self.tag && (*w).dev == self.dev && (*w).sector == self.sector && (*w).start == self.start }
    }

    /// Remember that process `pid` issued this request (`ts_ns`: the issue time when the
    /// request has no start time of its own).
    #[inline(always)]
    pub(crate) fn remember(&self, pid: u32, ts_ns: u64) {
        if !self.valid() {
            return;
        }
        // A re-issue finds its own way first; then a free one; then the first is given up.
        // SAFETY: ways of the array (map values), checked non-null.
        let way = unsafe {
            if self.holds(self.a) {
                self.a
            } else if self.holds(self.b) {
                self.b
            } else if (*self.a).tag == 0 {
                self.a
            } else if (*self.b).tag == 0 {
                self.b
            } else {
                crate::block::count_stat(BlockStat::IssuerEvicted);
                self.a
            }
        };
        let v = BioIssuer { sector: self.sector, start: self.start, ts_ns, dev: self.dev, tag: self.tag, pid, _pad: 0 };
        // SAFETY: as above.
        unsafe { *way = v };
    }

    /// The entry of this request, removed from the table; `tag` 0: not a watched job's.
    #[inline(always)]
    pub(crate) fn take(&self) -> BioIssuer {
        let empty = BioIssuer { sector: 0, start: 0, ts_ns: 0, dev: 0, tag: 0, pid: 0, _pad: 0 };
        let way = if self.holds(self.a) {
            self.a
        } else if self.holds(self.b) {
            self.b
        } else {
            return empty;
        };
        // SAFETY: as above; copied out, then the whole way is cleared.
        unsafe {
            let v = *way;
            *way = empty;
            v
        }
    }
}
