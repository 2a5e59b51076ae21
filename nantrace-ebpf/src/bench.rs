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
