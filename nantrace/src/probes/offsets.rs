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
    let mut l = Lookup {
        b,
        o: BtfOffsets::missing(),
    };
    let task = l.task();
    // Every task program reads a name from a task: the current task's (fork, exec, exit) or
    // the signal's target's. Each program needs only the members it reads, so a kernel that
    // changes one falls back for those programs alone.
    let comm = l.comm();
    let fork = l.fork(&task, &comm);
    let exec = l.exec(&comm);
    let block = l.block();
    let exit = l.exit(&comm);
    l.group_death();
    let signal = l.signal(&task, &comm);
    let ok = [
        (
            BtfNeeds::Task,
            fork.and_then(|()| l.args(&["sched_process_fork"])),
        ),
        (
            BtfNeeds::Exec,
            exec.and_then(|()| l.args(&["sched_process_exec"])),
        ),
        (BtfNeeds::Exit, exit.and_then(|()| l.exit_args())),
        (
            BtfNeeds::Block,
            block.and_then(|()| l.args(&["block_rq_issue", "block_rq_complete"])),
        ),
        (
            BtfNeeds::Signal,
            signal.and_then(|()| l.args(&["signal_generate"])),
        ),
    ]
    .into_iter()
    .collect();
    (l.o, ok)
}

/// The BTF lookups of [`btf_offsets`], one group of programs' members at a time: each fills
/// its offsets when all of them were found, and says whether they were.
struct Lookup<'a> {
    b: &'a btf::Btf,
    o: BtfOffsets,
}

impl Lookup<'_> {
    fn get(&self, s: &str, m: &str, size: u32) -> Result<u32, String> {
        self.b.offset(s, m, size).map_err(|e| e.to_string())
    }

    /// The task's pid and tgid.
    fn task(&mut self) -> Result<(), String> {
        let task = (|| -> Result<(u32, u32), String> {
            Ok((
                self.get("task_struct", "pid", 4)?,
                self.get("task_struct", "tgid", 4)?,
            ))
        })();
        if let Ok((pid, tgid)) = task {
            self.o.task_pid = pid;
            self.o.task_tgid = tgid;
        }
        task.map(|_| ())
    }

    /// The task's name.
    fn comm(&mut self) -> Result<(), String> {
        let comm = self.get("task_struct", "comm", 16);
        if let Ok(c) = comm {
            self.o.task_comm = c;
        }
        comm.map(|_| ())
    }

    /// The fork program: a task, its name, its start time.
    fn fork(&mut self, task: &Result<(), String>, comm: &Result<(), String>) -> Result<(), String> {
        let fork = task
            .clone()
            .and_then(|()| comm.clone())
            .and_then(|()| self.get("task_struct", "start_time", 8));
        if let Ok(start) = fork {
            self.o.task_start_time = start;
        }
        fork.map(|_| ())
    }

    /// The exec program: the task's name and the file executed.
    fn exec(&mut self, comm: &Result<(), String>) -> Result<(), String> {
        let exec = comm
            .clone()
            .and_then(|()| self.get("linux_binprm", "filename", 8));
        if let Ok(f) = exec {
            self.o.binprm_filename = f;
        }
        exec.map(|_| ())
    }

    /// The block programs: a request, its queue and its disk.
    fn block(&mut self) -> Result<(), String> {
        let block = (|| -> Result<[u32; 11], String> {
            Ok([
                self.get("request", "mq_hctx", 8)?,
                self.get("blk_mq_hw_ctx", "queue_num", 4)?,
                self.get("request", "q", 8)?,
                self.get("request", "tag", 4)?,
                self.get("request", "internal_tag", 4)?,
                self.get("request", "__sector", 8)?,
                self.get("request", "start_time_ns", 8)?,
                self.get("request", "cmd_flags", 4)?,
                self.get("request_queue", "disk", 8)?,
                self.get("gendisk", "major", 4)?,
                self.get("gendisk", "first_minor", 4)?,
            ])
        })();
        if let Ok(
            [hctx, queue_num, q, tag, internal_tag, sector, start, flags, disk, major, minor],
        ) = block
        {
            let o = &mut self.o;
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
            self.o.rq_io_start_time = self
                .get("request", "io_start_time_ns", 8)
                .unwrap_or(MISSING);
        }
        block.map(|_| ())
    }

    /// The exit program: the task's name, its exit code, its group's.
    fn exit(&mut self, comm: &Result<(), String>) -> Result<(), String> {
        let exit = comm.clone().and_then(|()| {
            Ok([
                self.get("task_struct", "exit_code", 4)?,
                self.get("task_struct", "signal", 8)?,
                self.get("task_struct", "group_leader", 8)?,
                self.get("signal_struct", "flags", 4)?,
                self.get("signal_struct", "group_exit_code", 4)?,
            ])
        });
        if let Ok([code, signal, leader, flags, group_code]) = exit {
            self.o.task_exit_code = code;
            self.o.task_signal = signal;
            self.o.task_group_leader = leader;
            self.o.signal_flags = flags;
            self.o.signal_group_exit_code = group_code;
        }
        exit.map(|_| ())
    }

    /// For the group's death where the exit tracepoint does not pass it (the BTF program on
    /// kernels before 6.x, and the tracefs program where the record lacks `group_dead`).
    fn group_death(&mut self) {
        if let (Ok(sig), Ok(live)) = (
            self.get("task_struct", "signal", 8),
            self.get("signal_struct", "live", 4),
        ) {
            self.o.task_signal = sig;
            self.o.signal_live = live;
        }
    }

    /// The signal program: a task, its name, the signal's code.
    fn signal(
        &mut self,
        task: &Result<(), String>,
        comm: &Result<(), String>,
    ) -> Result<(), String> {
        let signal = task
            .clone()
            .and_then(|()| comm.clone())
            .and_then(|()| self.get("kernel_siginfo", "si_code", 4));
        if let Ok(code) = signal {
            self.o.siginfo_code = code;
        }
        signal.map(|_| ())
    }

    /// The tracepoints' arguments as the programs take them.
    fn args(&self, tps: &[&str]) -> Result<(), String> {
        for tp in tps {
            let want = BTF_ARGS
                .iter()
                .find(|a| a.0 == *tp)
                .map_or(&[][..], |a| a.1);
            self.b.check_args(tp, want)?;
        }
        Ok(())
    }

    /// The exit tracepoint's arguments: (task, group_dead) since 6.x, else (task) alone, when
    /// the group's live count can be read instead.
    fn exit_args(&mut self) -> Result<(), String> {
        match self.args(&["sched_process_exit"]) {
            Ok(()) => {
                self.o.exit_group_dead_arg = 1;
                Ok(())
            }
            // (task) alone, before 6.x: exit_live_btf reads the group's live count.
            Err(e)
                if self.o.signal_live != MISSING
                    && self
                        .b
                        .check_args("sched_process_exit", &["struct task_struct *"])
                        .is_ok() =>
            {
                let _ = e;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}
