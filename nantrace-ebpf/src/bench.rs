//! Benchmark-only programs, never attached by `run`, `attach`, `watch` or the agent.
//!
//! - `floor_*`: a do-nothing program on each tracepoint nantrace uses. Run under the same
//!   workload, their ns/run is the floor (tracepoint dispatch + BPF run accounting) that the
//!   benchmark subtracts from each real program's cost.
//! - `bench_emit`: a synthetic event generator for the throughput test. On
//!   `syscalls:sys_enter_getppid` from the process whose tgid is in `BENCH[0]`, it writes
//!   `BURST` (32) fork records into the same ring buffer, with the same header and
//!   layout as real ones, so the same reader, decoder and recorder see them. The records say
//!   child pid = the record's index; the userspace benchmark labels the result synthetic.
use aya_ebpf::{
    macros::{map, tracepoint},
    maps::Array,
    programs::TracePointContext,
};
use nantrace_common::{EventKind, ForkEvent};

use crate::{count_drop, current_pid_tgid, fill_header_as, EVENTS};

/// [0]: the generator's tgid (0: off). [1]: unused (the burst is a constant: a loop bound
/// read from a map makes the verifier walk every count).
#[map]
static BENCH: Array<u32> = Array::with_max_entries(2, 0);

macro_rules! floor {
    ($f:ident, $cat:literal, $name:literal) => {
        #[tracepoint(category = $cat, name = $name)]
        pub fn $f(_ctx: TracePointContext) -> u32 {
            0
        }
    };
}

floor!(floor_printk, "printk", "console");
floor!(floor_aer, "ras", "aer_event");
floor!(floor_oom, "oom", "mark_victim");
floor!(floor_blk_getrq, "block", "block_getrq");
floor!(floor_blk_issue, "block", "block_rq_issue");
floor!(floor_blk_done, "block", "block_rq_complete");
floor!(floor_tcp, "tcp", "tcp_retransmit_skb");
floor!(floor_newtask, "task", "task_newtask");
floor!(floor_fork, "sched", "sched_process_fork");
floor!(floor_exec, "sched", "sched_process_exec");
floor!(floor_exit, "sched", "sched_process_exit");
floor!(floor_exit_grp, "syscalls", "sys_enter_exit_group");
floor!(floor_signal, "signal", "signal_generate");

const BURST: u32 = 32;

#[tracepoint(category = "syscalls", name = "sys_enter_getppid")]
pub fn bench_emit(_ctx: TracePointContext) -> u32 {
    let Some(&target) = BENCH.get(0) else { return 0 };
    if target == 0 {
        return 0;
    }
    let (tgid, _) = current_pid_tgid();
    if tgid != target {
        return 0;
    }
    for i in 0..BURST {
        let Some(mut entry) = EVENTS.reserve::<ForkEvent>(0) else {
            count_drop(EventKind::Fork);
            break;
        };
        let p = entry.as_mut_ptr();
        // SAFETY: fresh reservation.
        unsafe {
            fill_header_as(&raw mut (*p).hdr, EventKind::Fork, true);
            (*p).child_pid = i;
            (*p)._pad = 0;
            (*p).child_comm = [0; 16];
        }
        crate::submit(entry);
    }
    0
}

/// Building blocks, one per program, each alone on `syscalls:sys_enter_getppid` while
/// `bench-internal microcost` calls getppid: what one helper or map operation costs on the
/// machine (the floor of every real program is made of these).
mod micro {
    use aya_ebpf::{
        helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns},
        macros::{btf_tracepoint, map, raw_tracepoint, tracepoint},
        maps::{Array, HashMap, PerCpuArray},
        programs::{BtfTracePointContext, RawTracePointContext, TracePointContext},
    };

    use crate::EVENTS;

    /// Key 1 is present (userspace seeds it), every other key is absent.
    #[map]
    static MC_HASH: HashMap<u32, u32> = HashMap::with_max_entries(1024, 0);
    #[map]
    static MC_ARR: Array<u64> = Array::with_max_entries(1, 0);
    #[map]
    static MC_PCPU: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

    macro_rules! mc {
        ($f:ident, |$ctx:ident| $body:block) => {
            #[tracepoint(category = "syscalls", name = "sys_enter_getppid")]
            pub fn $f($ctx: TracePointContext) -> u32 {
                let _ = &$ctx;
                let () = $body;
                0
            }
        };
    }

    mc!(mc_empty, |_c| {});
    mc!(mc_pidtgid, |_c| {
        core::hint::black_box(bpf_get_current_pid_tgid());
    });
    mc!(mc_ktime, |_c| {
        // SAFETY: helper without arguments.
        core::hint::black_box(unsafe { bpf_ktime_get_ns() });
    });
    mc!(mc_comm, |_c| {
        core::hint::black_box(bpf_get_current_comm().unwrap_or([0; 16]));
    });
    mc!(mc_pread8, |c| {
        // SAFETY: probe_read of the tracepoint record.
        core::hint::black_box(unsafe { c.read_at::<u64>(8) }.unwrap_or(0));
    });
    mc!(mc_hash_miss, |_c| {
        // SAFETY: presence only.
        core::hint::black_box(unsafe { MC_HASH.get(&7) }.is_some());
    });
    mc!(mc_hash_hit, |_c| {
        // SAFETY: presence only.
        core::hint::black_box(unsafe { MC_HASH.get(&1) }.is_some());
    });
    mc!(mc_hash_insdel, |_c| {
        let _ = MC_HASH.insert(&2, &2, 0);
        let _ = MC_HASH.remove(&2);
    });
    mc!(mc_array, |_c| {
        if let Some(p) = MC_ARR.get_ptr_mut(0) {
            // SAFETY: a counter; races only lose counts.
            unsafe { *p += 1 };
        }
    });
    mc!(mc_jobmap, |_c| {
        // black_box: the pid is not a constant the compiler could fold the index and offset of.
        core::hint::black_box(crate::is_job(core::hint::black_box(7)));
    });
    mc!(mc_pcpu, |_c| {
        if let Some(p) = MC_PCPU.get_ptr_mut(0) {
            // SAFETY: per-CPU slot.
            unsafe { *p += 1 };
        }
    });
    mc!(mc_rb_discard, |_c| {
        if let Some(e) = EVENTS.reserve::<[u8; 48]>(0) {
            e.discard(0);
        }
    });
    mc!(mc_rb_query, |_c| {
        core::hint::black_box(EVENTS.query(0));
    });

    #[raw_tracepoint(tracepoint = "sys_enter")]
    pub fn mc_raw_empty(_ctx: RawTracePointContext) -> i32 {
        0
    }

    #[btf_tracepoint(function = "sys_enter")]
    pub fn mc_btf_empty(_ctx: BtfTracePointContext) -> i32 {
        0
    }
}

/// The floor of the `tp_btf` programs, on the same BTF tracepoints.
mod btf_floor {
    use aya_ebpf::{macros::btf_tracepoint, programs::BtfTracePointContext};

    #[btf_tracepoint(function = "block_rq_issue")]
    pub fn floor_issue_btf(_ctx: BtfTracePointContext) -> i32 {
        0
    }

    #[btf_tracepoint(function = "block_rq_complete")]
    pub fn floor_done_btf(_ctx: BtfTracePointContext) -> i32 {
        0
    }

    #[btf_tracepoint(function = "sched_process_fork")]
    pub fn floor_fork_btf(_ctx: BtfTracePointContext) -> i32 {
        0
    }

    #[btf_tracepoint(function = "sched_process_exec")]
    pub fn floor_exec_btf(_ctx: BtfTracePointContext) -> i32 {
        0
    }

    #[btf_tracepoint(function = "sched_process_exit")]
    pub fn floor_exit_btf(_ctx: BtfTracePointContext) -> i32 {
        0
    }

    #[btf_tracepoint(function = "signal_generate")]
    pub fn floor_sig_btf(_ctx: BtfTracePointContext) -> i32 {
        0
    }
}

/// `bench-internal membership`: the membership test of a process outside every job, as the
/// hash of pids did it before session 11 (`ab_hash_*`) and as `JOB_MAP` does it now
/// (`ab_byte_*`), attached side by side on the tracepoints where such a process pays for it,
/// under the same workload: the same cold caches for both.
mod membership {
    use aya_ebpf::{
        macros::{btf_tracepoint, map, tracepoint},
        maps::HashMap,
        programs::{BtfTracePointContext, TracePointContext},
    };

    use crate::{current_pid_tgid, is_job};

    /// Seeded by userspace with pids of a large imaginary job; the workload is not in it.
    #[map]
    static AB_HASH: HashMap<u32, u32> = HashMap::with_max_entries(65536, 0);

    #[inline(always)]
    fn hash_test() {
        let (tgid, _) = current_pid_tgid();
        // SAFETY: presence only.
        core::hint::black_box(unsafe { AB_HASH.get(&tgid) }.is_some());
    }

    #[inline(always)]
    fn byte_test() {
        let (tgid, _) = current_pid_tgid();
        core::hint::black_box(is_job(tgid));
    }

    #[tracepoint(category = "sched", name = "sched_process_exec")]
    pub fn ab_hash_exec(_c: TracePointContext) -> u32 {
        hash_test();
        0
    }

    #[tracepoint(category = "sched", name = "sched_process_exec")]
    pub fn ab_byte_exec(_c: TracePointContext) -> u32 {
        byte_test();
        0
    }

    #[tracepoint(category = "syscalls", name = "sys_enter_exit_group")]
    pub fn ab_hash_exitg(_c: TracePointContext) -> u32 {
        hash_test();
        0
    }

    #[tracepoint(category = "syscalls", name = "sys_enter_exit_group")]
    pub fn ab_byte_exitg(_c: TracePointContext) -> u32 {
        byte_test();
        0
    }

    #[btf_tracepoint(function = "block_rq_issue")]
    pub fn ab_hash_issue(_c: BtfTracePointContext) -> i32 {
        hash_test();
        0
    }

    #[btf_tracepoint(function = "block_rq_issue")]
    pub fn ab_byte_issue(_c: BtfTracePointContext) -> i32 {
        byte_test();
        0
    }
}
