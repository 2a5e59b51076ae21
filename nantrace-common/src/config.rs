//! Settings userspace writes into the probes' read-only global before loading.

/// Offset value meaning "this field is absent on the running kernel".
pub const MISSING: u32 = u32::MAX;

/// Byte offsets of tracepoint fields, read at startup from
/// `/sys/kernel/tracing/events/<group>/<name>/format` (they differ between kernels).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpOffsets {
    pub printk_msg: u32,
    pub oom_pid: u32,
    pub oom_comm: u32,
    pub oom_total_vm: u32,
    pub oom_anon_rss: u32,
    pub oom_file_rss: u32,
    pub oom_shmem_rss: u32,
    pub oom_uid: u32,
    pub oom_pgtables: u32,
    pub oom_score_adj: u32,
    pub bio_issue_dev: u32,
    pub bio_issue_sector: u32,
    /// `block:block_getrq` (a request allocated for a bio, in the submitter's context): where
    /// the tracefs path remembers the job's requests that a kworker may dispatch.
    pub bio_getrq_dev: u32,
    pub bio_getrq_sector: u32,
    pub bio_done_dev: u32,
    pub bio_done_sector: u32,
    pub bio_done_nr_sector: u32,
    pub bio_done_error: u32,
    pub bio_done_rwbs: u32,
    pub tcp_state: u32,
    pub tcp_sport: u32,
    pub tcp_dport: u32,
    pub tcp_family: u32,
    pub tcp_saddr: u32,
    pub tcp_daddr: u32,
    pub tcp_saddr_v6: u32,
    pub tcp_daddr_v6: u32,
    pub fork_parent_pid: u32,
    pub fork_child_pid: u32,
    pub fork_child_comm: u32,
    /// Non-zero when `child_comm` is a `__data_loc` string, zero when it is `char[16]`.
    pub fork_child_comm_loc: u32,
    pub exec_filename: u32,
    pub exec_pid: u32,
    /// The exec'ing thread's tid before exec: another thread than the leader took the
    /// process's pid, and its old tid is free.
    pub exec_old_pid: u32,
    pub exit_pid: u32,
    pub exit_group_dead: u32,
    pub sig_sig: u32,
    pub sig_code: u32,
    pub sig_comm: u32,
    pub sig_pid: u32,
    pub sig_result: u32,
    pub exit_group_code: u32,
    pub aer_dev_name: u32,
    pub aer_status: u32,
    pub aer_severity: u32,
    pub aer_tlp_valid: u32,
    pub aer_tlp: u32,
}

impl TpOffsets {
    pub const fn missing() -> Self {
        Self {
            printk_msg: MISSING,
            oom_pid: MISSING,
            oom_comm: MISSING,
            oom_total_vm: MISSING,
            oom_anon_rss: MISSING,
            oom_file_rss: MISSING,
            oom_shmem_rss: MISSING,
            oom_uid: MISSING,
            oom_pgtables: MISSING,
            oom_score_adj: MISSING,
            bio_issue_dev: MISSING,
            bio_issue_sector: MISSING,
            bio_getrq_dev: MISSING,
            bio_getrq_sector: MISSING,
            bio_done_dev: MISSING,
            bio_done_sector: MISSING,
            bio_done_nr_sector: MISSING,
            bio_done_error: MISSING,
            bio_done_rwbs: MISSING,
            tcp_state: MISSING,
            tcp_sport: MISSING,
            tcp_dport: MISSING,
            tcp_family: MISSING,
            tcp_saddr: MISSING,
            tcp_daddr: MISSING,
            tcp_saddr_v6: MISSING,
            tcp_daddr_v6: MISSING,
            fork_parent_pid: MISSING,
            fork_child_pid: MISSING,
            fork_child_comm: MISSING,
            fork_child_comm_loc: 0,
            exec_filename: MISSING,
            exec_pid: MISSING,
            exec_old_pid: MISSING,
            exit_pid: MISSING,
            exit_group_dead: MISSING,
            sig_sig: MISSING,
            sig_code: MISSING,
            sig_comm: MISSING,
            sig_pid: MISSING,
            sig_result: MISSING,
            exit_group_code: MISSING,
            aer_dev_name: MISSING,
            aer_status: MISSING,
            aer_severity: MISSING,
            aer_tlp_valid: MISSING,
            aer_tlp: MISSING,
        }
    }
}

/// Byte offsets of kernel struct members, from the kernel's BTF, for the `tp_btf` programs
/// (which get the structs themselves, not a tracefs record). `MISSING` when not found; a
/// `tp_btf` program is only loaded when every offset it reads was found.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BtfOffsets {
    pub task_pid: u32,
    pub task_tgid: u32,
    pub task_comm: u32,
    /// `struct task_struct.exit_code`: the wait status do_exit was given (code << 8, or the
    /// signal number with 0x80 for a core dump), set before `sched_process_exit` fires.
    pub task_exit_code: u32,
    /// `struct task_struct.signal`, `.group_leader`; `struct signal_struct.flags`,
    /// `.group_exit_code`: what wait(2) reports for a dead group (`wait_task_zombie`).
    pub task_signal: u32,
    pub task_group_leader: u32,
    pub signal_flags: u32,
    pub signal_group_exit_code: u32,
    /// `struct kernel_siginfo.si_code`.
    pub siginfo_code: u32,
    /// `struct request`: `q`, `__sector`, `start_time_ns`, `io_start_time_ns`, `cmd_flags`.
    pub rq_q: u32,
    pub rq_sector: u32,
    pub rq_start_time: u32,
    pub rq_io_start_time: u32,
    pub rq_cmd_flags: u32,
    /// `struct request.tag` (the driver tag) and `.internal_tag` (the scheduler tag, held
    /// from allocation to free when the queue has an I/O scheduler).
    pub rq_tag: u32,
    pub rq_internal_tag: u32,
    /// `struct request_queue.disk`, `struct gendisk.major` / `.first_minor`.
    pub q_disk: u32,
    pub disk_major: u32,
    pub disk_first_minor: u32,
    /// `struct linux_binprm.filename`: the path exec was given, as the tracefs record's.
    pub binprm_filename: u32,
    /// `struct request.mq_hctx`, `struct blk_mq_hw_ctx.queue_num`: the hardware queue, whose
    /// tags are the request's (each queue has its own tag space).
    pub rq_mq_hctx: u32,
    pub hctx_queue_num: u32,
    /// `struct task_struct.start_time`: CLOCK_MONOTONIC ns of the task's creation (set in
    /// copy_process just before `sched_process_fork`), the clock `bpf_ktime_get_ns` reads.
    pub task_start_time: u32,
    /// `struct signal_struct.live`: the group's threads not yet past do_exit's decrement;
    /// 0 at `sched_process_exit` means the group is dead (for kernels whose tracepoint does
    /// not say `group_dead`: before 6.x on the BTF path, any without the record field).
    pub signal_live: u32,
    /// 1: `sched_process_exit` passes `group_dead` as its second argument (6.x); otherwise
    /// the BTF exit program finds it from `signal_live` (`exit_live_btf`).
    pub exit_group_dead_arg: u32,
}

impl BtfOffsets {
    pub const fn missing() -> Self {
        Self {
            task_pid: MISSING,
            task_tgid: MISSING,
            task_comm: MISSING,
            task_exit_code: MISSING,
            task_signal: MISSING,
            task_group_leader: MISSING,
            signal_flags: MISSING,
            signal_group_exit_code: MISSING,
            siginfo_code: MISSING,
            rq_q: MISSING,
            rq_sector: MISSING,
            rq_start_time: MISSING,
            rq_io_start_time: MISSING,
            rq_cmd_flags: MISSING,
            rq_tag: MISSING,
            rq_internal_tag: MISSING,
            q_disk: MISSING,
            disk_major: MISSING,
            disk_first_minor: MISSING,
            binprm_filename: MISSING,
            rq_mq_hctx: MISSING,
            hctx_queue_num: MISSING,
            task_start_time: MISSING,
            signal_live: MISSING,
            exit_group_dead_arg: MISSING,
        }
    }
}

/// The probes' configuration (global `NANTRACE_CONFIG`, read-only after load).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Block requests slower than this are emitted as events (errors always are).
    pub slow_io_ns: u64,
    /// Bytes waiting in the ring buffer at which the reader is woken (a quarter of a small
    /// ring, at most 256 KiB): below it the reader drains on its 25 ms timer.
    pub wake_bytes: u64,
    /// 1: no job given, report abnormal exits and fatal signals machine-wide.
    pub whole_machine: u32,
    /// Our own tgid, so nantrace does not trace itself.
    pub self_pid: u32,
    pub off: TpOffsets,
    pub btf: BtfOffsets,
}

impl Config {
    pub const fn zeroed() -> Self {
        Self {
            slow_io_ns: 0,
            wake_bytes: 0,
            whole_machine: 0,
            self_pid: 0,
            off: TpOffsets::missing(),
            btf: BtfOffsets::missing(),
        }
    }
}
