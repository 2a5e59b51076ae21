//! The probes, each written once: its program, its tracepoint, its `tp_btf` twin and the
//! struct offsets that needs, and what it records; which way a probe reads the kernel.
use serde::Serialize;

/// One program and the tracepoint it attaches to.
#[derive(Clone, Copy, Debug)]
pub struct ProbeSpec {
    /// The program's name (at most 15 characters: the kernel's name for it, in `bpftool` and
    /// the benchmark's per-program table).
    pub program: &'static str,
    /// The do-nothing program on the same tracepoint (the benchmark's floor).
    pub floor: &'static str,
    pub group: &'static str,
    pub name: &'static str,
    pub what: &'static str,
    /// The `tp_btf` program on the same tracepoint, its floor, and the struct offsets it
    /// needs; `None`: tracefs only.
    pub btf: Option<BtfSpec>,
}

#[derive(Clone, Copy, Debug)]
pub struct BtfSpec {
    pub program: &'static str,
    pub floor: &'static str,
    pub needs: BtfNeeds,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum BtfNeeds {
    Block,
    Task,
    Exec,
    Exit,
    Signal,
}

/// Which way a probe reads the kernel's data.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ProbePath {
    /// A `tp_btf` program reading the kernel's structs at offsets from its BTF.
    Btf,
    /// A classic tracepoint reading the tracefs record at offsets from its `format` file.
    Tracefs,
    /// Not a program: the kernel log read from `/dev/kmsg` in userspace (`crate::klog`).
    Kmsg,
}

const BLOCK_BTF: BtfNeeds = BtfNeeds::Block;

/// What each `tp_btf` program reads from its tracepoint's arguments, in order (the leading
/// ones; a kernel may pass more). Older kernels differ: `block_rq_issue` took
/// `(q, rq)` before 5.11, and `block_rq_complete`'s error was an errno `int` on 5.15; those
/// run on the tracefs path.
pub const BTF_ARGS: &[(&str, &[&str])] = &[
    ("block_rq_issue", &["struct request *"]),
    (
        "block_rq_complete",
        &["struct request *", "blk_status_t", "unsigned int"],
    ),
    (
        "sched_process_fork",
        &["struct task_struct *", "struct task_struct *"],
    ),
    (
        "sched_process_exec",
        &["struct task_struct *", "pid_t", "struct linux_binprm *"],
    ),
    ("sched_process_exit", &["struct task_struct *", "bool"]),
    (
        "signal_generate",
        &[
            "int",
            "struct kernel_siginfo *",
            "struct task_struct *",
            "int",
            "int",
        ],
    ),
];

pub const PROBES: &[ProbeSpec] = &[
    ProbeSpec {
        program: "printk_console",
        floor: "floor_printk",
        group: "printk",
        name: "console",
        what: "kernel log lines (Xid, AER text, OOM, link, MCE)",
        btf: None,
    },
    ProbeSpec {
        program: "ras_aer_event",
        floor: "floor_aer",
        group: "ras",
        name: "aer_event",
        what: "decoded PCIe AER errors",
        btf: None,
    },
    ProbeSpec {
        program: "oom_mark_victim",
        floor: "floor_oom",
        group: "oom",
        name: "mark_victim",
        what: "OOM killer victims",
        btf: None,
    },
    // Who made a block request that a kworker (kblockd) may dispatch: the job's new requests,
    // in the submitter's context, by device and sector, for both issue programs.
    ProbeSpec {
        program: "block_getrq",
        floor: "floor_blk_getrq",
        group: "block",
        name: "block_getrq",
        what: "the job's new block requests (their dispatch may run in a kworker)",
        btf: None,
    },
    ProbeSpec {
        program: "block_rq_issue",
        floor: "floor_blk_issue",
        group: "block",
        name: "block_rq_issue",
        what: "block request start",
        btf: Some(BtfSpec {
            program: "blk_issue_btf",
            floor: "floor_issue_btf",
            needs: BLOCK_BTF,
        }),
    },
    ProbeSpec {
        program: "block_rq_done",
        floor: "floor_blk_done",
        group: "block",
        name: "block_rq_complete",
        what: "block latency, errors, slow requests",
        btf: Some(BtfSpec {
            program: "blk_done_btf",
            floor: "floor_done_btf",
            needs: BLOCK_BTF,
        }),
    },
    ProbeSpec {
        program: "tcp_retransmit",
        floor: "floor_tcp",
        group: "tcp",
        name: "tcp_retransmit_skb",
        what: "TCP retransmits",
        btf: None,
    },
    ProbeSpec {
        program: "sched_fork",
        floor: "floor_fork",
        group: "sched",
        name: "sched_process_fork",
        what: "job process tree (fork)",
        btf: Some(BtfSpec {
            program: "fork_btf",
            floor: "floor_fork_btf",
            needs: BtfNeeds::Task,
        }),
    },
    ProbeSpec {
        program: "task_newtask",
        floor: "floor_newtask",
        group: "task",
        name: "task_newtask",
        what: "thread vs process creation",
        btf: None,
    },
    ProbeSpec {
        program: "sched_exec",
        floor: "floor_exec",
        group: "sched",
        name: "sched_process_exec",
        what: "job process exec",
        btf: Some(BtfSpec {
            program: "exec_btf",
            floor: "floor_exec_btf",
            needs: BtfNeeds::Exec,
        }),
    },
    ProbeSpec {
        program: "sched_exit",
        floor: "floor_exit",
        group: "sched",
        name: "sched_process_exit",
        what: "process exits",
        btf: Some(BtfSpec {
            program: "exit_btf",
            floor: "floor_exit_btf",
            needs: BtfNeeds::Exit,
        }),
    },
    ProbeSpec {
        program: "exit_group",
        floor: "floor_exit_grp",
        group: "syscalls",
        name: "sys_enter_exit_group",
        what: "exit codes",
        btf: None,
    },
    ProbeSpec {
        program: "signal_generate",
        floor: "floor_signal",
        group: "signal",
        name: "signal_generate",
        what: "fatal signals",
        btf: Some(BtfSpec {
            program: "signal_btf",
            floor: "floor_sig_btf",
            needs: BtfNeeds::Signal,
        }),
    },
];
