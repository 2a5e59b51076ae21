//! The suspect rules, as data: one row per signal, with its family, severity and threshold.
//! `report::analyze` evaluates each row's detector over the incident window and ranks what
//! fired by severity × closeness to the first NaN × whether it touches the job.
//! docs/report.md lists the same table.

/// Evidence families. GPU, PCIe, host memory, host kernel/CPU, storage and network are "the
/// machine"; the others are not (the job's processes, numerics, a GPU memory limit, software
/// or configuration) or not yet decided (a collective hang with no cause in view).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    Gpu,
    Pcie,
    Memory,
    Kernel,
    Storage,
    Network,
    Process,
    Numerics,
    GpuMemoryLimit,
    Software,
    Hang,
}

impl Family {
    pub fn is_machine(self) -> bool {
        matches!(
            self,
            Family::Gpu
                | Family::Pcie
                | Family::Memory
                | Family::Kernel
                | Family::Storage
                | Family::Network
        )
    }

    /// The family's name in the verdict.
    pub fn label(self) -> &'static str {
        match self {
            Family::Gpu => "GPU",
            Family::Pcie => "PCIe",
            Family::Memory => "host memory",
            Family::Kernel => "host kernel/CPU",
            Family::Storage => "storage",
            Family::Network => "network",
            Family::Process => "job processes",
            Family::Numerics => "numerics",
            Family::GpuMemoryLimit => "GPU memory limit",
            Family::Software => "software/configuration",
            Family::Hang => "collective hang",
        }
    }
}

/// Whether a signal is the job's own words (a line of its output), not the kernel's or NVML's.
/// `joblog_gpu_corroborated` is not: it fires only with a hardware Xid beside it.
pub fn is_job_words(signal: &str) -> bool {
    signal.starts_with("joblog_") && signal != "joblog_gpu_corroborated"
}

/// Signals the kernel saw but the job's user can cause (a thread held in D state by the
/// user's own FUSE daemon): never a drain, never lifting the job's words.
pub fn user_controllable(signal: &str) -> bool {
    signal.starts_with("rank_blocked_")
}

/// The machine-readable family of a verdict that rests on the job's words alone: the family
/// and this suffix, so that the webhook, `nantrace_incidents_total{family}` and a drain tell
/// it from the kernel's or NVML's evidence.
pub const JOB_WORDS_SUFFIX: &str = " (job's words only)";

/// One signal nantrace looks for.
#[derive(Clone, Copy, Debug)]
pub struct Signal {
    pub id: &'static str,
    pub family: Family,
    /// 0–100: how strongly this alone explains a NaN or a crash.
    pub severity: u32,
    /// The signal's threshold (meaning depends on the detector; documented in `what`).
    pub threshold: f64,
    pub what: &'static str,
}

pub const SIGNALS: &[Signal] = &[
    Signal { id: "gpucheck_mismatch", family: Family::Gpu, severity: 98, threshold: 1.0, what: "nantrace gpucheck: a GPU gave results that differ run to run or from its same-model peers, or memory errors (silent data corruption)" },
    Signal { id: "gpu_fallen_off_bus", family: Family::Gpu, severity: 100, threshold: 1.0, what: "Xid 79 or an NVRM 'fallen off the bus' line" },
    Signal { id: "xid_critical", family: Family::Gpu, severity: 95, threshold: 1.0, what: "Xid of critical severity (48 DBE, 62, 64, 74, 95, 119, 120, 140...)" },
    Signal { id: "ecc_uncorrected", family: Family::Gpu, severity: 92, threshold: 1.0, what: "uncorrected (volatile) ECC count went up (NVML)" },
    Signal { id: "aer_fatal", family: Family::Pcie, severity: 90, threshold: 1.0, what: "PCIe AER uncorrected fatal error" },
    Signal { id: "oom_kill_job", family: Family::Memory, severity: 88, threshold: 1.0, what: "OOM kill of a job process" },
    Signal { id: "machine_check", family: Family::Kernel, severity: 85, threshold: 1.0, what: "machine check / EDAC error" },
    Signal { id: "xid_error", family: Family::Gpu, severity: 80, threshold: 1.0, what: "Xid of error severity that implicates the hardware or the driver (61, 94, ...)" },
    Signal { id: "aer_nonfatal", family: Family::Pcie, severity: 78, threshold: 1.0, what: "PCIe AER uncorrected non-fatal error" },
    Signal { id: "job_fatal_signal", family: Family::Process, severity: 50, threshold: 1.0, what: "SIGKILL/SIGBUS or another fatal signal sent to a job process from outside the job (who sent it is in the text)" },
    Signal { id: "block_io_error", family: Family::Storage, severity: 70, threshold: 1.0, what: "block request completed with an error" },
    Signal { id: "hung_task", family: Family::Kernel, severity: 65, threshold: 1.0, what: "kernel hung-task report" },
    Signal { id: "gpu_hw_slowdown", family: Family::Gpu, severity: 60, threshold: 1.0, what: "HW slowdown / HW thermal / power-brake throttling started (NVML)" },
    Signal { id: "ib_link_down", family: Family::Network, severity: 60, threshold: 1.0, what: "InfiniBand/RoCE or NIC link went down" },
    Signal { id: "sxid", family: Family::Gpu, severity: 55, threshold: 1.0, what: "NVSwitch SXid" },
    Signal { id: "disk_stall", family: Family::Storage, severity: 55, threshold: 10.0, what: "block latency (p99 of slow requests, or iostat await) in the minute before ≥ threshold × the minute earlier and ≥ 100 ms on a device of the job's own requests, ≥ 1 s on any other" },
    Signal { id: "worker_exit", family: Family::Process, severity: 20, threshold: 1.0, what: "a long-lived job process (not the root, alive ≥ threshold s) exited with a non-zero code" },
    Signal { id: "retransmit_storm", family: Family::Network, severity: 48, threshold: 10.0, what: "TCP retransmits in the minute before ≥ 20 and ≥ threshold × the minute earlier" },
    Signal { id: "swap_thrash", family: Family::Memory, severity: 45, threshold: 10_240.0, what: "swap-in rate ≥ threshold KiB/s" },
    Signal { id: "gpu_remap_failure", family: Family::Gpu, severity: 92, threshold: 1.0, what: "NVML remapped rows: a row remapping failed (the GPU's memory cannot hide its bad rows: hardware service)" },
    Signal { id: "gpu_remap_pending", family: Family::Gpu, severity: 62, threshold: 1.0, what: "NVML remapped rows: rows wait for a GPU reset to be remapped (uncorrectable memory errors happened)" },
    Signal { id: "nvlink_errors", family: Family::Gpu, severity: 40, threshold: 1.0, what: "NVML NVLink error counters rose during the window (CRC, replay, recovery)" },
    Signal { id: "xid_app_possible", family: Family::Gpu, severity: 55, threshold: 1.0, what: "Xid that NVIDIA's catalog lists as possibly the application's own fault (13, 31, 69...): the GPU faulted, the hardware or the job's code" },
    Signal { id: "xid_warning", family: Family::Gpu, severity: 45, threshold: 1.0, what: "Xid of warning severity (63 row remap, 92 high SBE rate...)" },
    Signal { id: "aer_corrected_burst", family: Family::Pcie, severity: 40, threshold: 5.0, what: "≥ threshold corrected PCIe AER errors" },
    Signal { id: "pcie_replay", family: Family::Pcie, severity: 40, threshold: 1.0, what: "PCIe replay counter went up (NVML)" },
    Signal { id: "memory_pressure", family: Family::Memory, severity: 40, threshold: 10.0, what: "PSI memory 'some' avg10 ≥ threshold %" },
    Signal { id: "link_errors", family: Family::Network, severity: 35, threshold: 1.0, what: "NIC/IB error counters went up" },
    Signal { id: "loss_scale_collapse", family: Family::Numerics, severity: 35, threshold: 1024.0, what: "fp16 loss scale fell by ≥ threshold× (or to ≤ 1) with overflow messages" },
    Signal { id: "gpu_power_cap", family: Family::Gpu, severity: 25, threshold: 1.0, what: "SW power cap / SW thermal throttling started (NVML)" },
    Signal { id: "ecc_corrected", family: Family::Gpu, severity: 25, threshold: 1.0, what: "corrected ECC count went up (NVML)" },
    Signal { id: "loss_spike", family: Family::Numerics, severity: 30, threshold: 100.0, what: "loss grew ≥ threshold× over the steps before the NaN" },
    Signal { id: "oom_kill_other", family: Family::Memory, severity: 30, threshold: 1.0, what: "OOM kill of a process outside the job" },
    // Kernel log classes beyond the GPU.
    Signal { id: "machine_check_corrected", family: Family::Kernel, severity: 30, threshold: 1.0, what: "corrected machine check / EDAC CE / CMCI storm" },
    Signal { id: "soft_lockup", family: Family::Kernel, severity: 65, threshold: 1.0, what: "kernel soft lockup (a CPU stuck in the kernel)" },
    Signal { id: "rcu_stall", family: Family::Kernel, severity: 55, threshold: 1.0, what: "RCU stall reported by the kernel" },
    Signal { id: "cpu_thermal", family: Family::Kernel, severity: 40, threshold: 1.0, what: "CPU core/package temperature above threshold, clock throttled" },
    Signal { id: "netfs_down", family: Family::Storage, severity: 68, threshold: 1.0, what: "NFS/Lustre/GPFS server not responding (data loading and checkpoints stall)" },
    Signal { id: "stale_handle", family: Family::Storage, severity: 50, threshold: 1.0, what: "stale file handle on a network filesystem (kernel log)" },
    Signal { id: "nic_error", family: Family::Network, severity: 70, threshold: 1.0, what: "mlx5/ConnectX CQE, health or firmware error" },
    Signal { id: "segfault_gpu_library", family: Family::Software, severity: 35, threshold: 1.0, what: "a job process crashed inside libcuda/libnvidia/libnccl (driver bug, version mismatch or the job; hardware only with an Xid)" },
    Signal { id: "job_crash", family: Family::Software, severity: 45, threshold: 1.0, what: "a job process crashed by itself (SIGSEGV/SIGABRT/SIGFPE/SIGILL it raised): software unless a hardware signal corroborates it" },
    // The job's own failure lines (joblog), by family.
    Signal { id: "joblog_gpu_corroborated", family: Family::Gpu, severity: 96, threshold: 30.0, what: "job output reports an ambiguous GPU fault and the kernel/NVML reports a hardware Xid on a job GPU within threshold s" },
    Signal { id: "joblog_gpu_hw", family: Family::Gpu, severity: 93, threshold: 1.0, what: "job output reports a GPU hardware/driver fault (uncorrectable ECC, GPU lost, unspecified launch failure, launch timeout, NVLink, unknown error)" },
    Signal { id: "joblog_host_memory", family: Family::Memory, severity: 82, threshold: 1.0, what: "job output reports host memory exhaustion (DataLoader worker killed, Killed, bus error / small /dev/shm, MemoryError, bad_alloc)" },
    Signal { id: "joblog_network", family: Family::Network, severity: 78, threshold: 1.0, what: "job output reports a network fault (IB/RoCE completion error with its status, ibv failures, UCX, NCCL NET, socket/TCPStore resets)" },
    Signal { id: "joblog_storage", family: Family::Storage, severity: 74, threshold: 1.0, what: "job output reports a storage fault (EIO, ESTALE, ENOSPC, EDQUOT, EROFS, lost network filesystem, object-store timeouts)" },
    Signal { id: "joblog_gpu_ambiguous", family: Family::Gpu, severity: 55, threshold: 1.0, what: "job output reports a GPU fault that hardware or software can cause (illegal address, misaligned address, cuBLAS/cuDNN execution failed), no hardware Xid near it" },
    Signal { id: "joblog_gpu_oom_not_limit", family: Family::Gpu, severity: 55, threshold: 1.0, what: "job output reports a GPU out-of-memory that was not a memory limit: the message says most of the GPU was free, or NVML read NCCL's GPU nearly empty just before (hardware or software)" },
    Signal { id: "joblog_network_generic", family: Family::Network, severity: 56, threshold: 10.0, what: "job output reports NCCL 'unhandled system error' / 'remote process exited or network error' with no more specific line within threshold s" },
    Signal { id: "joblog_hang", family: Family::Hang, severity: 50, threshold: 1.0, what: "job output reports a collective hang (NCCL watchdog / heartbeat timeout): the cause is elsewhere (another rank, the network)" },
    Signal { id: "rank_blocked_storage", family: Family::Storage, severity: 45, threshold: 2.0, what: "a job thread in D state in the filesystem or block layer in both samples of the trigger's stacks (threshold: samples), its process with no I/O progress between them (a user's FUSE daemon can do the same: never a drain)" },
    Signal { id: "nccl_ras_ranks", family: Family::Hang, severity: 46, threshold: 1.0, what: "NCCL RAS, asked at a hang's trigger, names ranks DEAD, INCOMPLETE, in ERROR or MISMATCHed (an operation count behind or ahead, another status) with their process, node and GPU: the job's own view, never machine evidence (a dead process is its job's or its node's), never a drain" },
    Signal { id: "flight_recorder_ranks", family: Family::Hang, severity: 47, threshold: 1.0, what: "the job's Flight Recorder dumps (torch's own record of its collectives, read at the dump) name the rank that never joined a collective the others entered, or one collective of different operations, sizes or dtypes across ranks (the job's code), or the ranks with no dump: the job's own view, never machine evidence, never a drain; the job's socket timeouts and resets are then its consequences" },
    Signal { id: "rank_blocked_gpu_driver", family: Family::Gpu, severity: 45, threshold: 2.0, what: "a job thread in D state inside the NVIDIA driver in both samples of the trigger's stacks (threshold: samples)" },
    Signal { id: "joblog_gpu_oom", family: Family::GpuMemoryLimit, severity: 42, threshold: 1.0, what: "job output reports GPU out of memory: a resource limit, not a fault" },
    Signal { id: "joblog_software_bug", family: Family::Software, severity: 41, threshold: 30.0, what: "job output reports a bug that makes a GPU fault (device-side assert, invalid CUDA call, shape/device/ordinal mismatch, no kernel image): it explains a possibly-application GPU fault (Xid 13/31/43, illegal address) within threshold s" },
    Signal { id: "joblog_software", family: Family::Software, severity: 40, threshold: 1.0, what: "job output reports a software or configuration error (device-side assert, shapes, versions, missing library, NCCL misuse, memlock)" },
];

pub fn signal(id: &str) -> &'static Signal {
    SIGNALS
        .iter()
        .find(|s| s.id == id)
        .unwrap_or_else(|| panic!("unknown signal {id}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_severities_bounded() {
        let mut ids: Vec<&str> = SIGNALS.iter().map(|s| s.id).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), SIGNALS.len());
        assert!(SIGNALS
            .iter()
            .all(|s| s.severity <= 100 && s.threshold > 0.0));
    }

    #[test]
    fn docs_report_md_lists_every_signal_as_in_the_table() {
        let doc = include_str!("../../../docs/report.md");
        let rows: Vec<&str> = doc
            .lines()
            .filter(|l| l.starts_with("| ") && !l.starts_with("| signal"))
            .collect();
        for s in SIGNALS {
            let want = format!(
                "| {} | {} | {} | {} |",
                s.id,
                s.family.label(),
                s.severity,
                s.threshold
            );
            assert!(
                rows.iter().any(|r| r.starts_with(&want)),
                "docs/report.md has no row starting {want:?}"
            );
        }
        assert_eq!(
            rows.len(),
            SIGNALS.len(),
            "docs/report.md lists signals the table does not have"
        );
    }
}
