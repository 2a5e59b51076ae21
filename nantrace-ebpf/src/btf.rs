//! BTF-enabled tracepoints (`tp_btf`, tested on 6.18): the kernel hands the programs its own
//! structs (`struct request *`, `struct task_struct *`), so the hot paths read what they need
//! with plain loads at offsets userspace found in `/sys/kernel/btf/vmlinux`, instead of
//! probe_read calls on a tracefs record. Userspace loads these instead of the tracefs
//! programs when every offset was found and the kernel accepts them; otherwise the tracefs
//! programs (`block.rs`, `process.rs`) run, and `doctor` says which path each probe is on.
//!
//! - `blk_issue_btf`: for processes outside every watched job, a membership lookup and
//!   nothing else. A job's request is remembered (who issued it) in a set-associative
//!   array, `blkid.rs`: inlined loads and a store, no hash map.
//! - `blk_done_btf`: latency from the request's own `start_time_ns` (set by the block layer
//!   for I/O accounting, as iostat's await: queueing included), so the node-wide histogram
//!   needs no per-request state; two inlined loads of the issuer array tell a job's
//!   request, and the device's histogram slot is an inlined array load too.
//! - `fork_btf`: the child's pid and tgid come from the child's task, which tells threads
//!   from processes without `task_newtask` and its map.
//! - `exec_btf`: the old tid and the path come from the arguments, not a tracefs record.
//! - `exit_btf`: the exit status comes from the exiting task, without `exit_group`.
//! - fork, exec and exit read the current task's name from the task the tracepoint passes
//!   (two loads) instead of calling `bpf_get_current_comm`.
use aya_ebpf::{
    helpers::bpf_ktime_get_ns,
    macros::btf_tracepoint,
    programs::BtfTracePointContext,
};
use nantrace_common::{BlockEvent, EventKind, FLAG_JOB};

use crate::{
    blkid::{rq_dev, RqId},
    conf, count_drop, current_pid_tgid, is_job, set_job, EVENTS,
};

use crate::field::load;

#[btf_tracepoint(function = "block_rq_issue")]
pub fn blk_issue_btf(ctx: BtfTracePointContext) -> i32 {
    let (tgid, _) = current_pid_tgid();
    if !is_job(tgid) {
        // A request the job made (`block_getrq`, in its context) that a kworker (kblockd)
        // dispatches: looked up only while the job has requests waiting.
        return match crate::block::queued_window() {
            Some(now) => issue_queued(&ctx, now),
            None => 0,
        };
    }
    issue_of_job(&ctx, tgid)
}

#[inline(never)]
fn issue_queued(ctx: &BtfTracePointContext, now: u64) -> i32 {
    let rq: *const u8 = ctx.arg(0);
    let k = nantrace_common::BioKey { dev: rq_dev(rq), _pad: 0, sector: load(rq, conf!(btf.rq_sector)) };
    match crate::block::queued_take(&k, now) {
        Some(pid) => issue_of_job(ctx, pid),
        None => 0,
    }
}

#[inline(never)]
fn issue_of_job(ctx: &BtfTracePointContext, tgid: u32) -> i32 {
    let rq: *const u8 = ctx.arg(0);
    let id = RqId::of(rq);
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    crate::blkid::job_dev_issued(rq_dev(rq), now);
    if !id.valid() {
        // No tag (or no disk) at its issue: its completion cannot find it. Counted.
        crate::block::count_stat(nantrace_common::BlockStat::JobIssueNoIdentity);
        return 0;
    }
    // The completion measures from the request's own start time; the issue time only for a
    // queue that keeps none (I/O statistics off).
    let ts_ns = if id.start == 0 { now } else { 0 };
    id.remember(tgid, ts_ns);
    // Its entry from block_getrq is no longer needed (the job issued it itself).
    crate::block::queued_forget(&nantrace_common::BioKey { dev: id.dev, _pad: 0, sector: id.sector });
    0
}

/// blk_status_t to the errno the tracefs `error` field shows. Codes 1-10 have been stable
/// since 4.13; the higher ones were renumbered between releases, so they read as -EIO.
#[inline(always)]
fn blk_errno(status: u8) -> i32 {
    match status {
        0 => 0,
        1 => -95,  // NOTSUPP: EOPNOTSUPP
        2 => -110, // TIMEOUT: ETIMEDOUT
        3 => -28,  // NOSPC: ENOSPC
        4 => -67,  // TRANSPORT: ENOLINK
        5 => -121, // TARGET: EREMOTEIO
        6 => -52,  // NEXUS / RESV_CONFLICT: EBADE
        7 => -61,  // MEDIUM: ENODATA
        8 => -84,  // PROTECTION: EILSEQ
        9 => -12,  // RESOURCE: ENOMEM
        _ => -5,   // IOERR and the rest: EIO
    }
}

#[btf_tracepoint(function = "block_rq_complete")]
pub fn blk_done_btf(ctx: BtfTracePointContext) -> i32 {
    let rq: *const u8 = ctx.arg(0);
    let status: u8 = ctx.arg(1);
    let nr_bytes: u32 = ctx.arg(2);
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let id = RqId::of(rq);
    let issuer = id.take();
    let job = issuer.tag != 0;
    if !job {
        crate::blkid::no_issuer_on(if id.valid() { id.dev } else { rq_dev(rq) }, now);
    }
    let mut start: u64 = load(rq, conf!(btf.rq_start_time));
    if start == 0 {
        start = load(rq, conf!(btf.rq_io_start_time));
    }
    if start == 0 {
        start = issuer.ts_ns;
    }
    let latency = if start == 0 { 0 } else { now.saturating_sub(start) };
    let (dev, sector) = if id.valid() { (id.dev, id.sector) } else { (rq_dev(rq), load(rq, conf!(btf.rq_sector))) };
    if start != 0 && dev != 0 {
        crate::block::hist_add(dev, latency);
    }
    let slow = start != 0 && latency >= conf!(slow_io_ns);
    if status == 0 && !slow {
        return 0;
    }
    let Some(mut entry) = EVENTS.reserve::<BlockEvent>(0) else {
        count_drop(EventKind::Block);
        return 0;
    };
    let p = entry.as_mut_ptr();
    let flags: u32 = load(rq, conf!(btf.rq_cmd_flags));
    // SAFETY: fresh reservation.
    unsafe {
        (*p).hdr.kind = EventKind::Block as u32;
        (*p).hdr.ts_ns = now;
        let pid = issuer.pid;
        (*p).hdr.flags = if job { FLAG_JOB } else { 0 };
        (*p).hdr.pid = pid;
        (*p).hdr.tid = pid;
        (*p).hdr.comm = [0; 16];
        (*p).dev = dev;
        (*p).error = blk_errno(status);
        (*p).sector = sector;
        (*p).latency_ns = latency;
        (*p).nr_sector = nr_bytes >> 9;
        (*p)._pad = 0;
        (*p).rwbs = rwbs(flags);
    }
    crate::submit(entry);
    0
}

/// The operation letter of `cmd_flags` (REQ_OP_*, stable values), as the tracefs `rwbs`
/// field starts. The modifier letters (sync, FUA, meta) use flag bits whose numbers differ
/// between kernels, so this path does not show them.
#[inline(always)]
fn rwbs(flags: u32) -> [u8; 16] {
    let mut r = [0u8; 16];
    // As the kernel's blk_fill_rwbs: WRITE W, DISCARD D, SECURE_ERASE DE, FLUSH F, READ R,
    // anything else (zone append, write zeroes, driver ops) N.
    match flags & 0xff {
        0 => r[0] = b'R',
        1 => r[0] = b'W',
        2 => r[0] = b'F',
        3 => r[0] = b'D',
        5 => {
            r[0] = b'D';
            r[1] = b'E';
        }
        _ => r[0] = b'N',
    }
    r
}

/// The name of `task`, with two plain loads (the verifier allows 8-byte loads inside a
/// `char[16]` member). Used for the current task, as the tracepoints pass it. A name can be
/// rewritten while it is read (/proc/PID/task/TID/comm); `bpf_get_current_comm` copies it
/// without a lock too.
#[inline(always)]
fn task_comm(task: *const u8) -> [u8; 16] {
    let w: [u64; 2] = load(task, conf!(btf.task_comm));
    let mut c = [0u8; 16];
    c[..8].copy_from_slice(&w[0].to_ne_bytes());
    c[8..].copy_from_slice(&w[1].to_ne_bytes());
    c
}

#[btf_tracepoint(function = "sched_process_fork")]
pub fn fork_btf(ctx: BtfTracePointContext) -> i32 {
    let (tgid, tid) = current_pid_tgid();
    if !is_job(tgid) {
        return 0;
    }
    fork_of_job(&ctx, tgid, tid)
}

/// The job's part of each program below is a function of its own (a BPF-to-BPF call, not
/// inlined): the path every other process on the node takes, the membership test, then
/// saves only the few registers it uses (signal_btf: ~15 ns less per run).
#[inline(never)]
fn fork_of_job(ctx: &BtfTracePointContext, tgid: u32, tid: u32) -> i32 {
    let parent: *const u8 = ctx.arg(0);
    let child: *const u8 = ctx.arg(1);
    let cpid: i32 = load(child, conf!(btf.task_pid));
    let ctgid: i32 = load(child, conf!(btf.task_tgid));
    let cpid = cpid as u32;
    set_job(cpid, true);
    if cpid != ctgid as u32 {
        // A new thread of an existing process: followed, not an event.
        return 0;
    }
    // The child's creation time (copy_process's ktime_get_ns, microseconds ago): a load
    // instead of a clock read (~100-150 ns cold on the benchmark's VM).
    let born: u64 = load(child, conf!(btf.task_start_time));
    crate::process::emit_fork(cpid, tgid, tid, task_comm(parent), born);
    0
}

/// `sched_process_exec(struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)`:
/// the old tid is an argument and the path a pointer in `bprm`, so no tracefs record field
/// (`__data_loc`) is read through probe_read; one string copy remains.
#[btf_tracepoint(function = "sched_process_exec")]
pub fn exec_btf(ctx: BtfTracePointContext) -> i32 {
    let (tgid, tid) = current_pid_tgid();
    if !is_job(tgid) {
        return 0;
    }
    exec_of_job(&ctx, tgid, tid)
}

#[inline(never)]
fn exec_of_job(ctx: &BtfTracePointContext, tgid: u32, tid: u32) -> i32 {
    let task: *const u8 = ctx.arg(0);
    let old: i32 = ctx.arg(1);
    let bprm: *const u8 = ctx.arg(2);
    crate::process::exec_unmark(tgid, old as u32);
    let name: *const u8 = load(bprm, conf!(btf.binprm_filename));
    crate::process::emit_exec(tgid, tid, task_comm(task), |f| {
        if !name.is_null() {
            // SAFETY: probe_read of a kernel string, bounded by the buffer.
            let _ = unsafe { aya_ebpf::helpers::bpf_probe_read_kernel_str_bytes(name, f) };
        }
    });
    0
}

/// `sched_process_exit(struct task_struct *p, bool group_dead)` (the flag since 6.x; older
/// kernels run the tracefs program): the status is read from the kernel's own record, as
/// wait(2) computes it (`wait_status`), so no `exit_group` program runs on every process's
/// exit and no exit code is remembered per pid. It is exact where the remembered one
/// guessed: a fatal signal sent but caught, a last thread that ended with the exit syscall.
#[btf_tracepoint(function = "sched_process_exit")]
pub fn exit_btf(ctx: BtfTracePointContext) -> i32 {
    let (tgid, tid) = current_pid_tgid();
    let job = is_job(tgid) || is_job(tid);
    if !job && conf!(whole_machine) == 0 {
        return 0;
    }
    exit_watched(&ctx, tgid, tid, job)
}

#[inline(never)]
fn exit_watched(ctx: &BtfTracePointContext, tgid: u32, tid: u32, job: bool) -> i32 {
    let task: *const u8 = ctx.arg(0);
    let group_dead = ctx.arg::<u8>(1) != 0;
    let status = if group_dead { wait_status(task) } else { 0 };
    crate::process::finish_exit(tgid, tid, job, group_dead, Some(status), || task_comm(task));
    0
}

/// `sched_process_exit(struct task_struct *p)`, before 6.x: no `group_dead` argument, so the
/// group is dead when its live-thread count (decremented by do_exit before the tracepoint)
/// is 0. Two threads ending at the same instant can both find 0; for a job only the one
/// that finds the process still marked ends it (`crate::process::group_dead_by_live`).
#[btf_tracepoint(function = "sched_process_exit")]
pub fn exit_live_btf(ctx: BtfTracePointContext) -> i32 {
    let (tgid, tid) = current_pid_tgid();
    let job = is_job(tgid) || is_job(tid);
    if !job && conf!(whole_machine) == 0 {
        return 0;
    }
    exit_live_watched(&ctx, tgid, tid, job)
}

#[inline(never)]
fn exit_live_watched(ctx: &BtfTracePointContext, tgid: u32, tid: u32, job: bool) -> i32 {
    let task: *const u8 = ctx.arg(0);
    let signal: *const u8 = load(task, conf!(btf.task_signal));
    let live: i32 = if signal.is_null() { -1 } else { load(signal, conf!(btf.signal_live)) };
    let group_dead = crate::process::group_dead_by_live(live, tgid, tid);
    let status = if group_dead { wait_status(task) } else { 0 };
    crate::process::finish_exit(tgid, tid, job, group_dead, Some(status), || task_comm(task));
    0
}

/// `SIGNAL_GROUP_EXIT` in `signal_struct.flags` (4 since 2.6.27 at least; 5.x to 6.18 checked).
const SIGNAL_GROUP_EXIT: u32 = 4;

/// The status wait(2) returns for the group of `task`, whose last thread is exiting: as the
/// kernel's `wait_task_zombie`, the group's exit code when a group exit (exit_group, a fatal
/// signal) is in progress, else the leader's own. Not the exiting thread's own code: an
/// io_uring worker thread ends with do_exit(0) when its process is killed, and a last thread
/// may end with the exit syscall after the leader.
#[inline(always)]
fn wait_status(task: *const u8) -> i32 {
    let signal: *const u8 = load(task, conf!(btf.task_signal));
    let flags: u32 = load(signal, conf!(btf.signal_flags));
    if flags & SIGNAL_GROUP_EXIT != 0 {
        return load(signal, conf!(btf.signal_group_exit_code));
    }
    let leader: *const u8 = load(task, conf!(btf.task_group_leader));
    load(leader, conf!(btf.task_exit_code))
}

/// `signal_generate(int sig, struct kernel_siginfo *info, struct task_struct *task, int group,
/// int result)`: the signal number is the first argument, so the common case (a non-fatal
/// signal: SIGCHLD on every child exit) costs one context load and nothing else.
#[btf_tracepoint(function = "signal_generate")]
pub fn signal_btf(ctx: BtfTracePointContext) -> i32 {
    let sig: i32 = ctx.arg(0);
    if !crate::process::fatal(sig) {
        return 0;
    }
    signal_fatal(&ctx, sig)
}

/// The rare path of `signal_btf` in a function of its own (a BPF-to-BPF call), so the
/// common path, a non-fatal signal, does not pay for the registers the rest uses.
#[inline(never)]
fn signal_fatal(ctx: &BtfTracePointContext, sig: i32) -> i32 {
    let info: *const u8 = ctx.arg(1);
    let task: *const u8 = ctx.arg(2);
    let result: i32 = ctx.arg(4);
    let target: i32 = load(task, conf!(btf.task_pid));
    // The tracefs record's `code`: SEND_SIG_NOINFO (0) is SI_USER, SEND_SIG_PRIV (1) SI_KERNEL.
    // `info` is not always a pointer, and kernels that know it (btf.c's raw_tp_null_args,
    // 6.12 and some 6.18 builds) type the argument as a scalar: a plain load of it is refused
    // (`R1 invalid mem access 'scalar'`). A probe_read takes any value on every kernel, and
    // this path runs for fatal signals only.
    let code = match info as u64 {
        0 => 0,
        1 => 0x80,
        _ => siginfo_code(info),
    };
    let comm_off = conf!(btf.task_comm);
    let comm = if comm_off == nantrace_common::MISSING || task.is_null() {
        [0; 16]
    } else {
        // SAFETY: probe_read of the target's name (only for fatal signals).
        unsafe { aya_ebpf::helpers::bpf_probe_read_kernel(task.add(comm_off as usize) as *const [u8; 16]) }.unwrap_or([0; 16])
    };
    crate::process::emit_signal(sig, code, target as u32, result, comm);
    0
}

/// `info->si_code` through probe_read (see `signal_fatal`); 0 when the offset is unknown or
/// the read faults.
#[inline(always)]
fn siginfo_code(info: *const u8) -> i32 {
    let off = conf!(btf.siginfo_code);
    if off == nantrace_common::MISSING {
        return 0;
    }
    // SAFETY: probe_read of a kernel address the tracepoint passed; a fault returns an error.
    unsafe { aya_ebpf::helpers::bpf_probe_read_kernel(info.add(off as usize) as *const i32) }.unwrap_or(0)
}
