//! nantrace's kernel side: thin tracepoint programs that copy what matters into one ring buffer.
//!
//! Field offsets are not compiled in: userspace reads them from the tracefs `format` files and
//! writes them into `NANTRACE_CONFIG` before loading. A missing field has offset `MISSING`.
//! Every ring-buffer reserve failure is counted per CPU and per event kind in `DROPS`.
#![no_std]
#![no_main]

mod aer;
mod bench;
mod blkid;
mod block;
mod btf;
mod field;
mod oom;
mod printk;
mod process;
mod tcp;

use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::map,
    maps::{Array, PerCpuArray, RingBuf},
};
use nantrace_common::{
    Config, EventHeader, EventKind, BPF_F_MMAPABLE, DROP_SLOTS, FLAG_JOB, JOB_MAP_PIDS_PER_WORD, JOB_MAP_WORDS,
};

#[unsafe(no_mangle)]
static NANTRACE_CONFIG: Config = Config::zeroed();

/// Read one field of `NANTRACE_CONFIG` (volatile, so the compiler keeps the load that the
/// loader's rewrite of the global feeds).
macro_rules! conf {
    ($($f:tt)+) => {
        {
            #[allow(unused_unsafe, reason = "the macro is used inside and outside unsafe blocks")]
            // SAFETY: a plain read of an initialised static.
            let v = unsafe { core::ptr::read_volatile(&$crate::NANTRACE_CONFIG.$($f)+) };
            v
        }
    };
}
pub(crate) use conf;

#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(8 * 1024 * 1024, 0);

/// Reserve failures, per CPU, index = event kind.
#[map]
static DROPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(DROP_SLOTS, 0);

/// The watched jobs' pids and tids, one byte each (1 = the job's): seeded by userspace through
/// a shared mapping, grown by fork, shrunk by exit. The membership test runs first in every
/// process and block program, for every process on the node; an array lookup is inlined by
/// the verifier into a bounds check and a load (a hash lookup hashes the key and walks a
/// bucket: 140-290 ns cold in the session 10 benchmark). Bytes, not bits: a byte store never
/// disturbs a neighbouring pid's byte, so neither side needs atomics (BPF atomic OR/AND need
/// 5.12; the ring buffer already needs 5.8).
#[map]
static JOB_MAP: Array<u64> = Array::with_max_entries(JOB_MAP_WORDS, BPF_F_MMAPABLE);

// The reader is woken only when `wake_bytes` are waiting (`Config`): a wakeup per event
// costs an irq_work (a VM exit on virtual machines; measured ~200 µs of workload time per
// fork/exec/exit iteration). Userspace also drains on a 25 ms timer, so nothing waits longer
// than that. Each CPU asks every 16th record, so a burst overshoots the mark by at most 16
// records per CPU before the wakeup.
const BPF_RB_AVAIL_DATA: u64 = 0;
const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;

/// Records submitted on this CPU, so the ring's fill level is asked only every
/// `WAKE_CHECK_EVERY`th record (the query is a helper call, ~27 ns hot in `microcost`).
#[map]
static SUBMITS: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);
const WAKE_CHECK_EVERY: u64 = 16;

#[inline(always)]
fn submit<T: 'static>(entry: aya_ebpf::maps::ring_buf::RingBufEntry<T>) {
    // SAFETY: this CPU's counter; no other writer while the program runs on this CPU.
    let check = SUBMITS.get_ptr_mut(0).is_none_or(|n| unsafe {
        *n += 1;
        *n % WAKE_CHECK_EVERY == 0
    });
    let flags = if check && EVENTS.query(BPF_RB_AVAIL_DATA) >= conf!(wake_bytes) { BPF_RB_FORCE_WAKEUP } else { BPF_RB_NO_WAKEUP };
    entry.submit(flags);
}

#[inline(always)]
fn count_drop(kind: EventKind) {
    if let Some(p) = DROPS.get_ptr_mut(kind as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU while the program runs.
        unsafe { *p += 1 };
    }
}

/// `pid`'s byte in `JOB_MAP` (None above PID_MAX_LIMIT, which no pid reaches).
#[inline(always)]
fn job_byte(pid: u32) -> Option<*mut u8> {
    let w = JOB_MAP.get_ptr_mut(pid / JOB_MAP_PIDS_PER_WORD)?;
    // SAFETY: the byte index is below 8, inside the element.
    Some(unsafe { (w as *mut u8).add((pid % JOB_MAP_PIDS_PER_WORD) as usize) })
}

#[inline(always)]
fn is_job(pid: u32) -> bool {
    // SAFETY: a byte of a map value.
    job_byte(pid).is_some_and(|b| unsafe { core::ptr::read_volatile(b) } != 0)
}

/// Mark `pid` as a job's (`on`) or not.
#[inline(always)]
fn set_job(pid: u32, on: bool) {
    if let Some(b) = job_byte(pid) {
        // SAFETY: a byte of a map value; a byte store leaves the neighbouring pids' bytes alone.
        unsafe { core::ptr::write_volatile(b, u8::from(on)) };
    }
}

#[inline(always)]
fn current_pid_tgid() -> (u32, u32) {
    let v = bpf_get_current_pid_tgid();
    ((v >> 32) as u32, v as u32)
}

/// Fill the common header from the current task, looking up whether it is the job's.
///
/// # Safety
/// `h` must point to writable memory of an `EventHeader` (a ring-buffer reservation).
#[inline(always)]
unsafe fn fill_header(h: *mut EventHeader, kind: EventKind) -> (u32, bool) {
    let (tgid, _) = current_pid_tgid();
    // SAFETY: forwarded from the caller.
    unsafe { fill_header_as(h, kind, is_job(tgid)) }
}

/// Fill the common header when the caller already knows the job flag (no second map lookup).
///
/// # Safety
/// As [`fill_header`].
#[inline(always)]
unsafe fn fill_header_as(h: *mut EventHeader, kind: EventKind, job: bool) -> (u32, bool) {
    let (tgid, tid) = current_pid_tgid();
    // SAFETY: forwarded from the caller.
    unsafe { fill_header_with(h, kind, job, tgid, tid, bpf_get_current_comm().unwrap_or([0; 16]), bpf_ktime_get_ns()) };
    (tgid, job)
}

/// Fill the common header from values the caller already has: the BTF programs read the
/// name from the task the tracepoint passes (two loads instead of `bpf_get_current_comm`),
/// and the ids from their membership check. `ts_ns`: `bpf_ktime_get_ns()`, or a
/// CLOCK_MONOTONIC time the kernel already took (a new task's `start_time`).
///
/// # Safety
/// As [`fill_header`].
#[inline(always)]
unsafe fn fill_header_with(h: *mut EventHeader, kind: EventKind, job: bool, tgid: u32, tid: u32, comm: [u8; 16], ts_ns: u64) {
    unsafe {
        (*h).kind = kind as u32;
        (*h).flags = if job { FLAG_JOB } else { 0 };
        (*h).ts_ns = ts_ns;
        (*h).pid = tgid;
        (*h).tid = tid;
        (*h).comm = comm;
    }
}

/// Read a `__data_loc` string field at `off` into `dst`; returns the bytes copied (no NUL).
#[inline(always)]
fn read_data_loc(ctx: &aya_ebpf::programs::TracePointContext, off: u32, dst: &mut [u8]) -> usize {
    use aya_ebpf::EbpfContext as _;
    // SAFETY: the offset comes from the tracepoint's format file; probe_read tolerates faults.
    let Ok(loc) = (unsafe { ctx.read_at::<u32>(off as usize) }) else {
        return 0;
    };
    let str_off = (loc & 0xffff) as usize;
    // SAFETY: as above; the helper bounds the copy by dst.len().
    match unsafe {
        aya_ebpf::helpers::bpf_probe_read_kernel_str_bytes(
            (ctx.as_ptr() as *const u8).add(str_off),
            dst,
        )
    } {
        Ok(s) => s.len(),
        Err(_) => 0,
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
