//! Where an event came from. The one owner of the source names that appear in `timeline.json`
//! (`"source": "xid"`), and of how each source is grouped in the Perfetto trace and the HTML
//! timeline. The names never change (bundles are read back by `report` and `merge`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    /// A kernel log line nantrace did not classify as one of the sources below.
    Kmsg,
    /// An NVRM Xid line.
    Xid,
    /// PCIe AER: the tracepoint, or a kernel log line.
    Aer,
    Oom,
    Block,
    TcpRetransmit,
    Fork,
    Exec,
    Exit,
    Signal,
    /// A line of the job's output.
    Log,
    Trigger,
    /// NVML readings, changes and Xid events.
    Gpu,
    GpuChange,
    NvmlXid,
    System,
    Disk,
    Net,
    NetChange,
    JobProcs,
    CollectorGap,
    SchedulerChange,
}

impl Source {
    pub const ALL: [Source; 22] = [
        Source::Kmsg,
        Source::Xid,
        Source::Aer,
        Source::Oom,
        Source::Block,
        Source::TcpRetransmit,
        Source::Fork,
        Source::Exec,
        Source::Exit,
        Source::Signal,
        Source::Log,
        Source::Trigger,
        Source::Gpu,
        Source::GpuChange,
        Source::NvmlXid,
        Source::System,
        Source::Disk,
        Source::Net,
        Source::NetChange,
        Source::JobProcs,
        Source::CollectorGap,
        Source::SchedulerChange,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Source::Kmsg => "kmsg",
            Source::Xid => "xid",
            Source::Aer => "aer",
            Source::Oom => "oom",
            Source::Block => "block",
            Source::TcpRetransmit => "tcp_retransmit",
            Source::Fork => "fork",
            Source::Exec => "exec",
            Source::Exit => "exit",
            Source::Signal => "signal",
            Source::Log => "log",
            Source::Trigger => "trigger",
            Source::Gpu => "gpu",
            Source::GpuChange => "gpu_change",
            Source::NvmlXid => "nvml_xid",
            Source::System => "system",
            Source::Disk => "disk",
            Source::Net => "net",
            Source::NetChange => "net_change",
            Source::JobProcs => "job_procs",
            Source::CollectorGap => "collector_gap",
            Source::SchedulerChange => "scheduler_change",
        }
    }

    pub fn parse(s: &str) -> Option<Source> {
        Source::ALL.into_iter().find(|x| x.as_str() == s)
    }

    /// The Perfetto "process" a source's events go to: (id, name).
    pub fn trace_family(self) -> (u64, &'static str) {
        match self {
            Source::Kmsg | Source::Xid | Source::Aer => (1, "kernel log"),
            Source::Gpu | Source::GpuChange | Source::NvmlXid => (2, "GPU"),
            Source::System | Source::JobProcs | Source::CollectorGap => (3, "system"),
            Source::Fork | Source::Exec | Source::Exit | Source::Signal | Source::Oom => {
                (4, "job processes")
            }
            Source::Log => (5, "training log"),
            Source::TcpRetransmit | Source::Net | Source::NetChange => (6, "network"),
            Source::Block | Source::Disk => (7, "storage"),
            Source::Trigger | Source::SchedulerChange => (8, "incident"),
        }
    }

    /// The report.html timeline lane (index into [`Source::LANES`]); counters have none.
    pub fn lane(self) -> Option<usize> {
        Some(match self {
            Source::Xid | Source::NvmlXid | Source::GpuChange => 0,
            Source::Aer | Source::Kmsg => 1,
            Source::Oom => 2,
            Source::Block => 3,
            Source::TcpRetransmit | Source::NetChange => 4,
            Source::Fork
            | Source::Exec
            | Source::Exit
            | Source::Signal
            | Source::SchedulerChange => 5,
            Source::Log => 6,
            Source::Trigger => 7,
            Source::Gpu
            | Source::System
            | Source::Disk
            | Source::Net
            | Source::JobProcs
            | Source::CollectorGap => return None,
        })
    }

    pub const LANES: [&'static str; 8] = [
        "GPU / Xid",
        "kernel log, AER",
        "memory, OOM",
        "block I/O",
        "network",
        "job processes",
        "training log",
        "triggers",
    ];
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_unique() {
        let mut names: Vec<&str> = Source::ALL.iter().map(|s| s.as_str()).collect();
        for s in Source::ALL {
            assert_eq!(Source::parse(s.as_str()), Some(s));
        }
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Source::ALL.len());
        assert_eq!(Source::parse("nope"), None);
    }
}
