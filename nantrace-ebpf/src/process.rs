//! The job's process tree (tested on 6.18): `sched:sched_process_fork` follows forks from the
//! root pids in `JOB_MAP`; `task:task_newtask` tells threads from processes; `exec`, `exit`
//! (with `group_dead`), `syscalls:sys_enter_exit_group` (the exit code) and
//! `signal:signal_generate` (fatal signals) complete the story. On the BTF path (`btf.rs`)
//! the fork, exec and exit programs read the tasks and arguments themselves, and neither
//! `task_newtask` nor `exit_group` is attached.
use aya_ebpf::{
    macros::{map, tracepoint},
    maps::{Array, HashMap},
    programs::TracePointContext,
};
use nantrace_common::{
    EventKind, ExecEvent, ExitEvent, ExitInfo, ForkEvent, SignalEvent, FLAG_JOB, MISSING,
};

use aya_ebpf::helpers::{bpf_get_current_comm, bpf_ktime_get_ns};

use crate::{conf, count_drop, current_pid_tgid, fill_header, fill_header_with, is_job, read_data_loc, set_job, EVENTS};

const CLONE_THREAD: u64 = 0x0001_0000;

/// Children created with CLONE_THREAD, between task_newtask and sched_process_fork (which
/// always follows and removes the entry). A plain hash: the LRU's bookkeeping cost more per
/// fork than the lookup itself.
#[map]
static NEW_THREADS: HashMap<u32, u32> = HashMap::with_max_entries(4096, 0);

/// Last exit code / fatal signal per pid, consumed when the process is gone (tracefs path
/// only: the BTF exit program reads the status from the task).
#[map]
static EXIT_INFO: HashMap<u32, ExitInfo> = HashMap::with_max_entries(16384, 0);

/// Set by userspace after attaching: index 0 = 1 when the exit program on
/// `sched_process_exit` is the BTF one, so the signal programs need not remember exit
/// causes. A map, not the read-only config: which exit program runs is known only after the
/// verifier accepted it, and the config is fixed before.
#[map]
static SETTINGS: Array<u32> = Array::with_max_entries(1, 0);

#[inline(always)]
fn exit_status_from_task() -> bool {
    // SAFETY: a u32 of a map value.
    SETTINGS.get_ptr(0).is_some_and(|p| unsafe { core::ptr::read_volatile(p) } != 0)
}

#[inline(always)]
fn read_i32(ctx: &TracePointContext, off: u32) -> Option<i32> {
    if off == MISSING {
        return None;
    }
    // SAFETY: offset from the format file; probe_read tolerates faults.
    unsafe { ctx.read_at::<i32>(off as usize) }.ok()
}

#[tracepoint(category = "task", name = "task_newtask")]
pub fn task_newtask(ctx: TracePointContext) -> u32 {
    let (tgid, _) = current_pid_tgid();
    if !is_job(tgid) {
        return 0;
    }
    // Fixed layout since 3.x: pid at 8, clone_flags at 32 (checked by userspace at load).
    // SAFETY: probe_read.
    let flags = unsafe { ctx.read_at::<u64>(32) }.unwrap_or(0);
    if flags & CLONE_THREAD != 0 {
        if let Some(child) = read_i32(&ctx, 8) {
            let _ = NEW_THREADS.insert(&(child as u32), &1, 0);
        }
    }
    0
}

#[tracepoint(category = "sched", name = "sched_process_fork")]
pub fn sched_fork(ctx: TracePointContext) -> u32 {
    let (tgid, tid) = current_pid_tgid();
    if !is_job(tgid) {
        return 0;
    }
    let Some(child) = read_i32(&ctx, conf!(off.fork_child_pid)) else {
        return 0;
    };
    let child = child as u32;
    set_job(child, true);
    // SAFETY: presence check only.
    if unsafe { NEW_THREADS.get(&child) }.is_some() {
        let _ = NEW_THREADS.remove(&child);
        return 0;
    }
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    emit_fork(child, tgid, tid, bpf_get_current_comm().unwrap_or([0; 16]), now);
    0
}

/// The fork event of a job process (the current task, `tgid`/`tid`, named `comm`) that
/// made process `child` at `ts_ns`.
#[inline(always)]
pub(crate) fn emit_fork(child: u32, tgid: u32, tid: u32, comm: [u8; 16], ts_ns: u64) {
    let Some(mut entry) = EVENTS.reserve::<ForkEvent>(0) else {
        count_drop(EventKind::Fork);
        return;
    };
    let p = entry.as_mut_ptr();
    // SAFETY: fresh reservation.
    unsafe {
        fill_header_with(&raw mut (*p).hdr, EventKind::Fork, true, tgid, tid, comm, ts_ns);
        (*p).child_pid = child;
        (*p)._pad = 0;
        // A child is born with its parent's name (copy_process copies comm): the parent's,
        // already read, instead of a second read through the tracepoint's `child_comm`.
        (*p).child_comm = comm;
    }
    crate::submit(entry);
}

#[tracepoint(category = "sched", name = "sched_process_exec")]
pub fn sched_exec(ctx: TracePointContext) -> u32 {
    let (tgid, tid) = current_pid_tgid();
    if !is_job(tgid) {
        return 0;
    }
    if let Some(old) = read_i32(&ctx, conf!(off.exec_old_pid)) {
        exec_unmark(tgid, old as u32);
    }
    let off = conf!(off.exec_filename);
    emit_exec(tgid, tid, bpf_get_current_comm().unwrap_or([0; 16]), |f| {
        if off != MISSING {
            read_data_loc(&ctx, off, f);
        }
    });
    0
}

/// A thread other than the leader exec'd (`old`, its tid before, is not `tgid`): it now
/// runs under the process's pid, and its old tid is free without an exit of its own (the
/// old leader's task took it away and is released without passing the exit tracepoint
/// again). Unmarked, or the next process given that pid would count as the job's.
#[inline(always)]
pub(crate) fn exec_unmark(tgid: u32, old: u32) {
    if old != tgid {
        set_job(old, false);
    }
}

/// The exec event of job process `tgid` (thread `tid`, now named `comm`); `filename` fills
/// in the path exec was given.
#[inline(always)]
pub(crate) fn emit_exec(tgid: u32, tid: u32, comm: [u8; 16], filename: impl FnOnce(&mut [u8; 128])) {
    let Some(mut entry) = EVENTS.reserve::<ExecEvent>(0) else {
        count_drop(EventKind::Exec);
        return;
    };
    let p = entry.as_mut_ptr();
    // SAFETY: fresh reservation.
    unsafe {
        fill_header_with(&raw mut (*p).hdr, EventKind::Exec, true, tgid, tid, comm, bpf_ktime_get_ns());
        (*p).filename = [0; 128];
        filename(&mut (*p).filename);
    }
    crate::submit(entry);
}

#[tracepoint(category = "syscalls", name = "sys_enter_exit_group")]
pub fn exit_group(ctx: TracePointContext) -> u32 {
    let (tgid, _) = current_pid_tgid();
    if conf!(whole_machine) == 0 && !is_job(tgid) {
        return 0;
    }
    let Some(code) = read_i32(&ctx, conf!(off.exit_group_code)) else {
        return 0;
    };
    let info = ExitInfo { code: code & 0xff, signal: 0 };
    let _ = EXIT_INFO.insert(&tgid, &info, 0);
    0
}

#[tracepoint(category = "sched", name = "sched_process_exit")]
pub fn sched_exit(ctx: TracePointContext) -> u32 {
    let (tgid, tid) = current_pid_tgid();
    let job = is_job(tgid) || is_job(tid);
    if !job && conf!(whole_machine) == 0 {
        return 0;
    }
    let off = conf!(off.exit_group_dead);
    let group_dead = if off == MISSING {
        group_dead_of_current(tgid, tid)
    } else {
        // SAFETY: probe_read.
        unsafe { ctx.read_at::<u8>(off as usize) }.unwrap_or(0) != 0
    };
    finish_exit(tgid, tid, job, group_dead, None, || bpf_get_current_comm().unwrap_or([0; 16]));
    0
}

/// Where the record has no `group_dead` (before 6.x): the group's live-thread count read
/// with probe_read at BTF offsets; without BTF, the leader's exit is taken as the group's
/// (a main thread that ended before the others then ends the process for nantrace).
#[inline(always)]
fn group_dead_of_current(tgid: u32, tid: u32) -> bool {
    let (so, lo) = (conf!(btf.task_signal), conf!(btf.signal_live));
    if so == MISSING || lo == MISSING {
        return tid == tgid;
    }
    // SAFETY: helper without arguments; the reads below are probe_reads, which tolerate faults.
    let task = unsafe { aya_ebpf::helpers::bpf_get_current_task() } as *const u8;
    let signal = unsafe { aya_ebpf::helpers::bpf_probe_read_kernel(task.wrapping_add(so as usize) as *const u64) }.unwrap_or(0);
    if signal == 0 {
        return tid == tgid;
    }
    let live = unsafe { aya_ebpf::helpers::bpf_probe_read_kernel((signal as *const u8).wrapping_add(lo as usize) as *const i32) }.unwrap_or(-1);
    group_dead_by_live(live, tgid, tid)
}

/// The group is dead when its live count is 0 (`live` < 0: unreadable, then the leader's
/// exit counts). A job's process ends once: a second thread that also finds 0 (two threads
/// ending together) finds the process no longer marked and ends only itself.
#[inline(always)]
pub(crate) fn group_dead_by_live(live: i32, tgid: u32, tid: u32) -> bool {
    if live < 0 {
        return tid == tgid;
    }
    live == 0 && (conf!(whole_machine) != 0 && !is_job(tid) || is_job(tgid))
}

/// The exit of thread `tid` of process `tgid`, a job's (`job`) or any (machine-wide mode):
/// membership (and on the tracefs path remembered exit causes) is cleaned up, and when the
/// whole group is dead an exit event is emitted. `status`: the group's wait status, read
/// from the kernel (the BTF path); `None`: from what `exit_group` and `signal_generate`
/// remembered (the tracefs path). `comm`: the exiting task's name, read only for an event.
#[inline(always)]
pub(crate) fn finish_exit(tgid: u32, tid: u32, job: bool, group_dead: bool, status: Option<i32>, comm: impl FnOnce() -> [u8; 16]) {
    // A thread-directed fatal signal (SIGSEGV from a fault) is keyed by tid: move it to tgid.
    if tid != tgid && status.is_none() {
        // SAFETY: value copied out before removal.
        if let Some(i) = unsafe { EXIT_INFO.get(&tid) }.copied() {
            let _ = EXIT_INFO.remove(&tid);
            if i.signal != 0 {
                let _ = EXIT_INFO.insert(&tgid, &i, 0);
            }
        }
    }
    // A thread leaves the job. Not the leader while the group lives on (a main thread that
    // called pthread_exit, or the old leader when another thread execs): its pid is the
    // process's, which the other threads still run under.
    if tid != tgid {
        set_job(tid, false);
    }
    if !group_dead {
        return;
    }
    set_job(tgid, false);
    let info = match status {
        // As wait(2) decodes it: a signal number in the low 7 bits (0x80: a core was
        // dumped), else the code above them.
        Some(s) if s & 0x7f != 0 => ExitInfo { code: -1, signal: s & 0x7f },
        Some(s) => ExitInfo { code: (s >> 8) & 0xff, signal: 0 },
        None => {
            // SAFETY: value copied out before removal.
            let remembered = unsafe { EXIT_INFO.get(&tgid) }.copied();
            if remembered.is_some() {
                let _ = EXIT_INFO.remove(&tgid);
            }
            remembered.unwrap_or(ExitInfo { code: -1, signal: 0 })
        }
    };
    if !job && info.signal == 0 && info.code <= 0 {
        return;
    }
    let Some(mut entry) = EVENTS.reserve::<ExitEvent>(0) else {
        count_drop(EventKind::Exit);
        return;
    };
    let p = entry.as_mut_ptr();
    // SAFETY: fresh reservation.
    unsafe {
        fill_header_with(&raw mut (*p).hdr, EventKind::Exit, job, tgid, tid, comm(), bpf_ktime_get_ns());
        (*p).code = info.code;
        (*p).signal = info.signal;
        (*p).core_dumped = u32::from(status.is_some_and(|s| s & 0x7f != 0 && s & 0x80 != 0));
        (*p)._pad = 0;
    }
    crate::submit(entry);
}

/// SIGKILL, SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGTERM, SIGILL: one shift and mask (runs for
/// every signal on the node, SIGCHLD at each child exit first of all).
#[inline(always)]
pub(crate) fn fatal(sig: i32) -> bool {
    const FATAL: u32 = 1 << 9 | 1 << 11 | 1 << 7 | 1 << 6 | 1 << 8 | 1 << 15 | 1 << 4;
    (sig as u32) < 32 && FATAL >> sig as u32 & 1 != 0
}

#[tracepoint(category = "signal", name = "signal_generate")]
pub fn signal_generate(ctx: TracePointContext) -> u32 {
    let Some(sig) = read_i32(&ctx, conf!(off.sig_sig)) else {
        return 0;
    };
    if !fatal(sig) {
        return 0;
    }
    let Some(target) = read_i32(&ctx, conf!(off.sig_pid)) else {
        return 0;
    };
    let result = read_i32(&ctx, conf!(off.sig_result)).unwrap_or(0);
    let code = read_i32(&ctx, conf!(off.sig_code)).unwrap_or(0);
    let comm_off = conf!(off.sig_comm);
    // SAFETY: probe_read of the record.
    let comm = if comm_off == MISSING { [0; 16] } else { unsafe { ctx.read_at::<[u8; 16]>(comm_off as usize) }.unwrap_or([0; 16]) };
    emit_signal(sig, code, target as u32, result, comm);
    0
}

/// A fatal signal `sig` generated for `target` (a tid): remembered as the exit cause when
/// delivered, and a `signal` event when the target is the job's (or machine-wide is on).
#[inline(always)]
pub(crate) fn emit_signal(sig: i32, code: i32, target: u32, result: i32, target_comm: [u8; 16]) {
    let job = is_job(target);
    if !job && conf!(whole_machine) == 0 {
        return;
    }
    // TRACE_SIGNAL_DELIVERED = 0: the signal was queued; an unhandled one ends the process.
    if result == 0 && !exit_status_from_task() {
        let _ = EXIT_INFO.insert(&target, &ExitInfo { code: -1, signal: sig }, 0);
    }
    let Some(mut entry) = EVENTS.reserve::<SignalEvent>(0) else {
        count_drop(EventKind::Signal);
        return;
    };
    let p = entry.as_mut_ptr();
    // SAFETY: fresh reservation.
    unsafe {
        fill_header(&raw mut (*p).hdr, EventKind::Signal);
        if job {
            (*p).hdr.flags |= FLAG_JOB;
        }
        (*p).sig = sig;
        (*p).code = code;
        (*p).target_pid = target;
        (*p).result = result;
        (*p).target_comm = target_comm;
    }
    crate::submit(entry);
}
