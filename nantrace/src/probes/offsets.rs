//! Where the probes read the kernel's data: tracepoint record offsets from the tracefs
//! format files, and struct member offsets from the kernel's BTF for the `tp_btf` programs,
//! with, per group of BTF programs, whether everything they read was found.
use std::collections::BTreeMap;
use std::path::Path;

use nantrace_common::{BtfOffsets, TpOffsets, MISSING};

use super::{btf, BtfNeeds, BTF_ARGS};
use crate::tracefs::{self, Format};

/// Tracepoint offsets from the running kernel's format files.
pub fn offsets(root: &Path) -> (TpOffsets, BTreeMap<String, String>) {
    let mut missing = BTreeMap::new();
    let mut fmt = |g: &str, n: &str| match tracefs::read_format(root, g, n) {
        Ok(f) => f,
        Err(e) => {
            missing.insert(format!("{g}:{n}"), e.to_string());
            Format::default()
        }
    };
    let printk = fmt("printk", "console");
    let oom = fmt("oom", "mark_victim");
    crate::decode::set_oom_kb_per_unit(oom.oom_kb_per_unit());
    let issue = fmt("block", "block_rq_issue");
    let getrq = fmt("block", "block_getrq");
    let done = fmt("block", "block_rq_complete");
    let tcp = fmt("tcp", "tcp_retransmit_skb");
    let fork = fmt("sched", "sched_process_fork");
    let exec = fmt("sched", "sched_process_exec");
    let exit = fmt("sched", "sched_process_exit");
    let sig = fmt("signal", "signal_generate");
    let eg = fmt("syscalls", "sys_enter_exit_group");
    let aer = fmt("ras", "aer_event");
    let o = TpOffsets {
        printk_msg: printk.offset("msg"),
        oom_pid: oom.offset("pid"),
        oom_comm: oom
            .field("comm")
            .filter(|f| f.data_loc)
            .map_or(nantrace_common::MISSING, |f| f.offset),
        oom_total_vm: oom.offset("total_vm"),
        oom_anon_rss: oom.offset("anon_rss"),
        oom_file_rss: oom.offset("file_rss"),
        oom_shmem_rss: oom.offset("shmem_rss"),
        oom_uid: oom.offset("uid"),
        oom_pgtables: oom.offset("pgtables"),
        oom_score_adj: oom.offset("oom_score_adj"),
        bio_issue_dev: issue.offset("dev"),
        bio_issue_sector: issue.offset("sector"),
        bio_getrq_dev: getrq.offset("dev"),
        bio_getrq_sector: getrq.offset("sector"),
        bio_done_dev: done.offset("dev"),
        bio_done_sector: done.offset("sector"),
        bio_done_nr_sector: done.offset("nr_sector"),
        bio_done_error: done.offset("error"),
        bio_done_rwbs: done.offset("rwbs"),
        tcp_state: tcp.offset("state"),
        tcp_sport: tcp.offset("sport"),
        tcp_dport: tcp.offset("dport"),
        tcp_family: tcp.offset("family"),
        tcp_saddr: tcp.offset("saddr"),
        tcp_daddr: tcp.offset("daddr"),
        tcp_saddr_v6: tcp.offset("saddr_v6"),
        tcp_daddr_v6: tcp.offset("daddr_v6"),
        fork_parent_pid: fork.offset("parent_pid"),
        fork_child_pid: fork.offset("child_pid"),
        fork_child_comm: fork.offset("child_comm"),
        fork_child_comm_loc: u32::from(fork.field("child_comm").is_some_and(|f| f.data_loc)),
        exec_filename: exec.offset("filename"),
        exec_pid: exec.offset("pid"),
        exec_old_pid: exec.offset("old_pid"),
        exit_pid: exit.offset("pid"),
        exit_group_dead: exit.offset("group_dead"),
        sig_sig: sig.offset("sig"),
        sig_code: sig.offset("code"),
        sig_comm: sig.offset("comm"),
        sig_pid: sig.offset("pid"),
        sig_result: sig.offset("result"),
        exit_group_code: eg.offset("error_code"),
        aer_dev_name: aer.offset("dev_name"),
        aer_status: aer.offset("status"),
        aer_severity: aer.offset("severity"),
        aer_tlp_valid: aer.offset("tlp_header_valid"),
        aer_tlp: aer.offset("tlp_header"),
    };
    (o, missing)
}

pub type NeedResult = BTreeMap<BtfNeeds, Result<(), String>>;

pub(super) fn all_needs(why: &str) -> NeedResult {
    [
        BtfNeeds::Block,
        BtfNeeds::Task,
        BtfNeeds::Exec,
        BtfNeeds::Exit,
        BtfNeeds::Signal,
    ]
    .into_iter()
    .map(|n| (n, Err(why.to_string())))
    .collect()
}

/// The struct members the `tp_btf` programs read, from the kernel's BTF; per group of
/// programs, `Err` names the first member that is missing or not the expected size.
pub fn btf_offsets(b: &btf::Btf) -> (BtfOffsets, NeedResult) {
    let mut o = BtfOffsets::missing();
    let get = |s: &str, m: &str, size: u32| b.offset(s, m, size).map_err(|e| e.to_string());
    let task = (|| -> Result<(u32, u32), String> {
        Ok((
            get("task_struct", "pid", 4)?,
            get("task_struct", "tgid", 4)?,
        ))
    })();
    if let Ok((pid, tgid)) = task {
        o.task_pid = pid;
        o.task_tgid = tgid;
    }
    // Every task program reads a name from a task: the current task's (fork, exec, exit) or
    // the signal's target's. Each program needs only the members it reads, so a kernel that
    // changes one falls back for those programs alone.
    let comm = get("task_struct", "comm", 16);
    if let Ok(c) = comm {
        o.task_comm = c;
    }
    let fork = task
        .clone()
        .and_then(|_| comm.clone())
        .and_then(|_| get("task_struct", "start_time", 8));
    if let Ok(start) = fork {
        o.task_start_time = start;
    }
    let exec = comm
        .clone()
        .and_then(|_| get("linux_binprm", "filename", 8));
    if let Ok(f) = exec {
        o.binprm_filename = f;
    }
    let block = (|| -> Result<[u32; 11], String> {
        Ok([
            get("request", "mq_hctx", 8)?,
            get("blk_mq_hw_ctx", "queue_num", 4)?,
            get("request", "q", 8)?,
            get("request", "tag", 4)?,
            get("request", "internal_tag", 4)?,
            get("request", "__sector", 8)?,
            get("request", "start_time_ns", 8)?,
            get("request", "cmd_flags", 4)?,
            get("request_queue", "disk", 8)?,
            get("gendisk", "major", 4)?,
            get("gendisk", "first_minor", 4)?,
        ])
    })();
    if let Ok([hctx, queue_num, q, tag, internal_tag, sector, start, flags, disk, major, minor]) =
        block
    {
        o.rq_mq_hctx = hctx;
        o.hctx_queue_num = queue_num;
        o.rq_q = q;
        o.rq_tag = tag;
        o.rq_internal_tag = internal_tag;
        o.rq_sector = sector;
        o.rq_start_time = start;
        o.rq_cmd_flags = flags;
        o.q_disk = disk;
        o.disk_major = major;
        o.disk_first_minor = minor;
        // Optional: set only when the queue keeps I/O statistics.
        o.rq_io_start_time = get("request", "io_start_time_ns", 8).unwrap_or(MISSING);
    }
    let exit = comm.clone().and_then(|_| {
        Ok([
            get("task_struct", "exit_code", 4)?,
            get("task_struct", "signal", 8)?,
            get("task_struct", "group_leader", 8)?,
            get("signal_struct", "flags", 4)?,
            get("signal_struct", "group_exit_code", 4)?,
        ])
    });
    if let Ok([code, signal, leader, flags, group_code]) = exit {
        o.task_exit_code = code;
        o.task_signal = signal;
        o.task_group_leader = leader;
        o.signal_flags = flags;
        o.signal_group_exit_code = group_code;
    }
    // For the group's death where the exit tracepoint does not pass it (the BTF program on
    // kernels before 6.x, and the tracefs program where the record lacks `group_dead`).
    if let (Ok(sig), Ok(live)) = (
        get("task_struct", "signal", 8),
        get("signal_struct", "live", 4),
    ) {
        o.task_signal = sig;
        o.signal_live = live;
    }
    let signal = task
        .clone()
        .and_then(|_| comm.clone())
        .and_then(|_| get("kernel_siginfo", "si_code", 4));
    if let Ok(code) = signal {
        o.siginfo_code = code;
    }
    let args = |tps: &[&str]| -> Result<(), String> {
        for tp in tps {
            let want = BTF_ARGS
                .iter()
                .find(|a| a.0 == *tp)
                .map_or(&[][..], |a| a.1);
            b.check_args(tp, want)?;
        }
        Ok(())
    };
    let ok = [
        (
            BtfNeeds::Task,
            fork.map(|_| ())
                .and_then(|()| args(&["sched_process_fork"])),
        ),
        (
            BtfNeeds::Exec,
            exec.map(|_| ())
                .and_then(|()| args(&["sched_process_exec"])),
        ),
        (
            BtfNeeds::Exit,
            exit.map(|_| ())
                .and_then(|()| match args(&["sched_process_exit"]) {
                    Ok(()) => {
                        o.exit_group_dead_arg = 1;
                        Ok(())
                    }
                    // (task) alone, before 6.x: exit_live_btf reads the group's live count.
                    Err(e)
                        if o.signal_live != MISSING
                            && b.check_args("sched_process_exit", &["struct task_struct *"])
                                .is_ok() =>
                    {
                        let _ = e;
                        Ok(())
                    }
                    Err(e) => Err(e),
                }),
        ),
        (
            BtfNeeds::Block,
            block
                .map(|_| ())
                .and_then(|()| args(&["block_rq_issue", "block_rq_complete"])),
        ),
        (
            BtfNeeds::Signal,
            signal.map(|_| ()).and_then(|()| args(&["signal_generate"])),
        ),
    ]
    .into_iter()
    .collect();
    (o, ok)
}
