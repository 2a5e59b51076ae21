//! Loading and attaching the probes; the maps userspace reads and writes.
//!
//! Each tracepoint name is written once, in [`PROBES`]. A probe that cannot attach (missing
//! tracepoint, kernel without the feature) is reported in [`ProbeStatus`] and the rest run.
use std::collections::BTreeMap;
use std::path::PathBuf;

use aya::maps::{MapData, PerCpuArray, RingBuf};
use aya::Ebpf;
use nantrace_common::{BioHistSlot, BlockStat, EventKind, DROP_SLOTS};
use serde::Serialize;

pub mod btf;
mod jobmap;
mod klog_source;
mod load;
mod marks;
mod micro;
mod offsets;
mod sweep;

pub use marks::Swept;
pub use micro::{membership_ab, microcost, MEMBERSHIP_AB, MICRO};
pub use offsets::{btf_offsets, offsets};

static BPF_OBJ: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/nantrace.bpf.o"));

mod table;
pub use table::{BtfNeeds, BtfSpec, ProbePath, ProbeSpec, BTF_ARGS, PROBES};

/// Bytes waiting in a ring of `ring_bytes` (rounded up to a power of two, as loaded) at
/// which the kernel side wakes the reader: 256 KiB, or a quarter of a smaller ring (a ring
/// that never holds 256 KiB would otherwise never wake it, and be drained only by the timer).
pub fn wake_bytes(ring_bytes: u32) -> u64 {
    (u64::from(ring_bytes.next_power_of_two()) / 4).min(256 * 1024)
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ProbeStatus {
    pub program: &'static str,
    pub tracepoint: String,
    pub path: ProbePath,
    /// Why a probe with a BTF program runs on the tracefs path (BTF absent, an offset not
    /// found, the verifier refused it, or `NANTRACE_PROBE_PATH=tracefs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub btf_fallback: Option<String>,
    pub attached: bool,
    pub reason: Option<String>,
    pub what: &'static str,
}

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("the eBPF object was not built into this binary: run `cargo xtask build` (it builds the probes, then the CLI)")]
    NotBuilt,
    #[error("{0}")]
    NoTracefs(String),
    #[error("loading the eBPF object failed (root or CAP_BPF+CAP_PERFMON needed): {0}")]
    Load(#[from] aya::EbpfError),
    #[error("map {0}: {1}")]
    Map(&'static str, String),
    /// No BPF ring buffer (Linux before 5.8, unless backported as in RHEL 8.2+): the probes
    /// send everything through one, so none is loaded (docs/kernel-matrix.md says why no
    /// perf-buffer fallback).
    #[error("this kernel ({0}) has no BPF ring buffer (BPF_MAP_TYPE_RINGBUF, Linux 5.8+; RHEL 8.2+ backports it): the kernel probes need it, so only the job's output, NVML and the system context are recorded")]
    NoRingBuf(String),
}

#[derive(Clone, Debug)]
pub struct Options {
    /// Block requests at least this slow are emitted as events.
    pub slow_io_ns: u64,
    /// No job given: report abnormal exits and fatal signals machine-wide.
    pub whole_machine: bool,
    pub ring_bytes: u32,
    /// The benchmark's programs (never set outside `bench-internal`).
    pub bench: BenchPrograms,
    /// Use the `tp_btf` programs where the kernel allows (`false`: tracefs programs only,
    /// from `NANTRACE_PROBE_PATH=tracefs`; the tests force the fallback with it).
    pub btf: bool,
}

/// What the benchmark attaches instead of, or beside, the real probes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BenchPrograms {
    #[default]
    None,
    /// Only the do-nothing `floor_*` programs, on the same tracepoints.
    FloorOnly,
    /// The real probes plus `bench_emit` (synthetic records on getppid from one process).
    Synthetic,
}

impl Default for Options {
    fn default() -> Self {
        // NANTRACE_RING_BYTES: a smaller ring for the benchmark's overload run.
        let ring_bytes = std::env::var("NANTRACE_RING_BYTES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(8 << 20);
        let btf = std::env::var("NANTRACE_PROBE_PATH").map_or(true, |v| v != "tracefs");
        Self {
            slow_io_ns: 50_000_000,
            whole_machine: true,
            ring_bytes,
            bench: BenchPrograms::None,
            btf,
        }
    }
}

pub struct Probes {
    ebpf: Ebpf,
    pub status: Vec<ProbeStatus>,
    job_map: std::sync::Arc<jobmap::JobMap>,
    /// What the sweeps of the membership map did (`sweep_marks`).
    mark_state: std::sync::Arc<marks::MarkState>,
    drops: PerCpuArray<MapData, u64>,
    bio_hist: PerCpuArray<MapData, BioHistSlot>,
    block_stats: PerCpuArray<MapData, u64>,
    pub tracefs: PathBuf,
    /// Where the kernel log lines come from (`crate::klog`); `None` in the benchmark.
    pub klog: Option<crate::klog::KlogSource>,
    /// `/dev/kmsg`, when it is the kernel log's source, with the offset from its records'
    /// clock to the probes' (measured on the startup marker).
    kmsg: Option<(crate::klog::KmsgFile, i64)>,
    /// Events read while checking the kernel log source, for the reader to pass on first.
    pending: Vec<crate::event::Event>,
    /// The job's requests removed from `JOB_QUEUED` undispatched (`sweep`).
    queued_swept: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Probes {
    pub fn is_built() -> bool {
        !BPF_OBJ.is_empty()
    }

    /// The synthetic generator (`BenchPrograms::Synthetic`): records per getppid from `tgid`.
    pub fn set_bench(&mut self, tgid: u32, burst: u32) -> Result<(), ProbeError> {
        let m = self
            .ebpf
            .map_mut("BENCH")
            .ok_or_else(|| ProbeError::Map("BENCH", "missing from the object".into()))?;
        let mut a: aya::maps::Array<&mut MapData, u32> =
            aya::maps::Array::try_from(m).map_err(|e| ProbeError::Map("BENCH", e.to_string()))?;
        a.set(1, burst, 0)
            .map_err(|e| ProbeError::Map("BENCH", e.to_string()))?;
        a.set(0, tgid, 0)
            .map_err(|e| ProbeError::Map("BENCH", e.to_string()))
    }

    /// The ring buffer, for the reader task (can be taken once).
    pub fn take_ring(&mut self) -> Result<RingBuf<MapData>, ProbeError> {
        let m = self
            .ebpf
            .take_map("EVENTS")
            .ok_or_else(|| ProbeError::Map("EVENTS", "already taken".into()))?;
        RingBuf::try_from(m).map_err(|e| ProbeError::Map("EVENTS", e.to_string()))
    }

    /// Mark `pid` (and, through the fork probe, its future children) as the job's.
    /// Userspace's marks are the roots the sweep mends the job's trees from (`sweep_marks`).
    pub fn add_job_pid(&mut self, pid: u32) -> Result<(), ProbeError> {
        self.job_map.set(pid, true)?;
        self.mark_state.seed(pid);
        Ok(())
    }

    pub fn remove_job_pid(&mut self, pid: u32) -> Result<(), ProbeError> {
        self.mark_state.unseed(pid);
        self.job_map.set(pid, false)
    }

    /// Whether `pid` is marked as a job's now (the kernel side's view).
    pub fn is_job_pid(&self, pid: u32) -> bool {
        self.job_map.get(pid)
    }

    pub fn job_pid_count(&self) -> usize {
        self.job_map.count()
    }

    /// Ring-buffer reserve failures per event source, summed over CPUs.
    pub fn drops(&self) -> BTreeMap<&'static str, u64> {
        let mut out = BTreeMap::new();
        for kind in EventKind::ALL {
            if (kind as u32) < DROP_SLOTS {
                if let Ok(v) = self.drops.get(&(kind as u32), 0) {
                    out.insert(kind.name(), v.iter().sum());
                }
            }
        }
        out
    }

    /// Per-device block latency histograms (log2 µs buckets), summed over CPUs, by
    /// `major:minor`.
    pub fn io_histograms(&self) -> BTreeMap<String, Vec<u64>> {
        let by_dev = sum_histograms(
            self.bio_hist
                .iter()
                .flatten()
                .flat_map(|per_cpu| per_cpu.iter().copied().collect::<Vec<_>>()),
        );
        by_dev
            .into_iter()
            .map(|(d, h)| (format!("{}:{}", d >> 20, d & 0xfffff), h))
            .collect()
    }

    /// What the block probes could not keep, summed over CPUs: a job's in-flight request
    /// given up for a newer one (its completion is measured, not attributed to the job), a
    /// job's request issued without an identity (BTF path: no tag), completions on the BTF
    /// path that found no issuer on a device the job issued to in the last 2 s (possibly the
    /// job's, not attributed),
    /// completions of a device that found no histogram slot, and runs of the block programs
    /// the kernel skipped because the same program was already running on that CPU (a
    /// completion in hard irq interrupting one in soft irq: `recursion_misses`).
    pub fn block_losses(&self) -> BTreeMap<&'static str, u64> {
        let mut out: BTreeMap<&'static str, u64> = [
            (BlockStat::IssuerEvicted, "job_requests_not_attributed"),
            (BlockStat::HistFull, "completions_not_in_histograms"),
            (
                BlockStat::QueuedFull,
                "job_requests_not_remembered_for_dispatch",
            ),
            (
                BlockStat::JobIssueNoIdentity,
                "job_requests_without_identity",
            ),
            (
                BlockStat::NoIssuerOnJobDevice,
                "completions_without_issuer_on_job_devices",
            ),
        ]
        .into_iter()
        .map(|(s, name)| {
            (
                name,
                self.block_stats
                    .get(&(s as u32), 0)
                    .map_or(0, |v| v.iter().sum()),
            )
        })
        .collect();
        out.insert(
            "job_requests_never_dispatched",
            self.queued_swept.load(std::sync::atomic::Ordering::Relaxed),
        );
        let nested = [
            "blk_issue_btf",
            "blk_done_btf",
            "block_getrq",
            "block_rq_issue",
            "block_rq_done",
        ]
        .iter()
        .filter_map(|p| self.recursion_misses(p))
        .sum();
        out.insert("runs_skipped_nested", nested);
        out
    }

    /// The kernel's count of runs of `program` skipped as nested (`recursion_misses` in the
    /// program fd's fdinfo, 5.12+; aya's `ProgramInfo` does not expose it). `None` when the
    /// program is not loaded or the kernel does not count.
    fn recursion_misses(&self, program: &str) -> Option<u64> {
        use std::os::fd::{AsFd as _, AsRawFd as _};
        let fd = self.ebpf.program(program)?.fd().ok()?.as_fd().as_raw_fd();
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
        info.lines()
            .find_map(|l| l.strip_prefix("recursion_misses:"))
            .and_then(|v| v.trim().parse().ok())
    }

    /// What the job membership map could not follow, and what the sweep mended: runs of the
    /// exit and fork programs the kernel skipped as nested (`recursion_misses`: measured on
    /// 7.3, whose tracepoint programs can be preempted by another task's run of the same
    /// program on the CPU, a thread's exit was skipped once in 60 runs of three threads ending
    /// together); the marks of tasks that no longer exist the sweep removed (what a skipped
    /// exit left), and the job's processes and threads it found unmarked and marked (what a
    /// skipped fork left).
    pub fn membership_losses(&self) -> BTreeMap<&'static str, u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let sum = |ps: &[&str]| ps.iter().filter_map(|p| self.recursion_misses(p)).sum();
        let c = &self.mark_state;
        BTreeMap::from([
            (
                "exit_runs_skipped_nested",
                sum(&["exit_btf", "exit_live_btf", "sched_exit"]),
            ),
            (
                "fork_runs_skipped_nested",
                sum(&["fork_btf", "sched_fork", "task_newtask"]),
            ),
            ("stale_marks_removed", c.stale_removed.load(Relaxed)),
            ("unmarked_children_marked", c.children_marked.load(Relaxed)),
            ("unmarked_threads_marked", c.threads_marked.load(Relaxed)),
            ("roots_not_followed", c.roots_not_kept.load(Relaxed)),
        ])
    }

    /// Mend the membership map from /proc (`marks::sweep`): remove the marks of tasks that no
    /// longer exist (their exit program did not run), so that a task given the pid later is
    /// not taken as the job's, and mark the processes and threads of the trees of the pids
    /// marked here (`add_job_pid`) the fork program did not. The sweep thread runs it every
    /// few seconds.
    pub fn sweep_marks(&self) -> marks::Swept {
        marks::sweep(&self.job_map, &self.mark_state)
    }

    pub fn attached(&self) -> usize {
        self.status.iter().filter(|s| s.attached).count()
    }
}

/// Histogram slots of every CPU, summed by device (a device may sit in different slots on
/// different CPUs); free slots are skipped.
fn sum_histograms(slots: impl Iterator<Item = BioHistSlot>) -> BTreeMap<u32, Vec<u64>> {
    let mut out: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for slot in slots.filter(|s| s.dev != 0) {
        let row = out
            .entry(slot.dev)
            .or_insert_with(|| vec![0; nantrace_common::BIO_HIST_BUCKETS as usize]);
        for (r, c) in row.iter_mut().zip(slot.counts) {
            *r += c;
        }
    }
    out
}

pub(crate) fn verifier_msg(e: &aya::programs::ProgramError) -> String {
    excerpt_verifier_log(&format!("load: {e:#}"))
}

/// A verifier log cut to what says why the program was refused: the first line (aya's error),
/// the last instruction the verifier looked at and the lines right after it (the error, e.g.
/// `R1 invalid mem access 'scalar'`), wherever they are, and the last lines. Newer kernels end
/// the log with per-subprogram statistics, so the tail alone can miss the error (7.x).
pub(crate) fn excerpt_verifier_log(s: &str) -> String {
    let lines: Vec<&str> = s
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty())
        .collect();
    if lines.len() <= 12 {
        return lines.join("\n");
    }
    let is_insn = |l: &str| {
        let l = l.trim_start();
        let digits = l.bytes().take_while(u8::is_ascii_digit).count();
        digits > 0 && l[digits..].starts_with(": (")
    };
    let tail_from = lines.len() - 6;
    let mut keep: Vec<usize> = vec![0];
    if let Some(i) = lines.iter().rposition(|l| is_insn(l)) {
        // The instruction, the two lines before it (the register state it ran in) and the
        // error lines after it up to the next instruction or the statistics.
        keep.extend(i.saturating_sub(2).max(1)..=i);
        keep.extend((i + 1..lines.len().min(i + 4)).take_while(|&j| !is_insn(lines[j])));
    }
    keep.extend(tail_from..lines.len());
    keep.sort_unstable();
    keep.dedup();
    let mut out = String::new();
    let mut prev = None;
    for i in keep {
        if !out.is_empty() {
            out.push_str(if prev.is_some_and(|p| p + 1 == i) {
                " | "
            } else {
                " ... "
            });
        }
        out.push_str(lines[i]);
        prev = Some(i);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use nantrace_common::BIO_HIST_BUCKETS;

    /// The verifier's own error line is kept wherever it is: a 7.x log ends with statistics
    /// after it (the 7.3 refusal of the signal program once lost its error line that way).
    #[test]
    fn the_verifier_error_line_is_kept_before_trailing_statistics() {
        let mut log = String::from(
            "load: the BPF_PROG_LOAD syscall failed. Verifier output: 0: R1=ctx() R10=fp0\n",
        );
        for i in 0..30 {
            log.push_str(&format!("{i}: (bf) r6 = r1 ; R1=ctx() R6_w=ctx()\n"));
        }
        log.push_str("40: (0f) r1 += r2 ; frame1: R1=scalar() R2=8\n41: (61) r9 = *(u32 *)(r1 +0)\nR1 invalid mem access 'scalar'\n");
        log.push_str("processed 36 insns (limit 1000000) max_states_per_insn 0 total_states 3\n");
        for i in 0..8 {
            log.push_str(&format!("func#{i} stack depth 0 ... arithmetic, helper calls, or other operations that can invalidate it.\n"));
        }
        let m = excerpt_verifier_log(&log);
        assert!(
            m.contains("41: (61) r9 = *(u32 *)(r1 +0) | R1 invalid mem access 'scalar'"),
            "{m}"
        );
        assert!(m.starts_with("load: the BPF_PROG_LOAD"), "{m}");
        assert!(m.contains("func#7"), "{m}");
        assert!(m.len() < 1500, "{m}");
        // A short log is kept whole.
        assert_eq!(excerpt_verifier_log("load: a\nb"), "load: a\nb");
    }

    fn slot(dev: u32, counts: &[(usize, u64)]) -> BioHistSlot {
        let mut s = BioHistSlot {
            dev,
            _pad: 0,
            counts: [0; BIO_HIST_BUCKETS as usize],
        };
        for &(b, n) in counts {
            s.counts[b] = n;
        }
        s
    }

    /// A device can sit in different slots on different CPUs (each CPU claims slots in its
    /// own order); free slots hold nothing.
    #[test]
    fn histogram_slots_are_summed_by_device_across_cpus() {
        let dev = (7 << 20) | 3;
        let slots = vec![
            slot(dev, &[(0, 2), (5, 1)]),
            slot(0, &[(1, 9)]),
            slot(8 << 20, &[(3, 4)]),
            slot(dev, &[(5, 10), (23, 1)]),
        ];
        let h = sum_histograms(slots.into_iter());
        assert_eq!(h.len(), 2);
        let mut want = vec![0; BIO_HIST_BUCKETS as usize];
        want[0] = 2;
        want[5] = 11;
        want[23] = 1;
        assert_eq!(h[&dev], want);
        assert_eq!(h[&(8 << 20)].iter().sum::<u64>(), 4);
    }

    /// The default ring wakes the reader at 256 KiB; a ring too small to hold that, at a
    /// quarter of its size (as loaded: a power of two).
    #[test]
    fn the_wakeup_mark_fits_the_ring() {
        assert_eq!(wake_bytes(8 << 20), 256 * 1024);
        assert_eq!(wake_bytes(1 << 20), 256 * 1024);
        assert_eq!(wake_bytes(256 * 1024), 64 * 1024);
        assert_eq!(wake_bytes(4096), 1024);
    }
}
