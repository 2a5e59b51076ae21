//! Whether a job that stopped printing steps is still working, for the stall trigger: the
//! storage I/O (`read_bytes` + `write_bytes` of /proc/PID/io) and CPU time of its processes
//! over the second half of the silent window. A job writing a checkpoint or reading a shard
//! for minutes prints nothing and is not hung; a job whose ranks wait in a collective or
//! sit in D state on a dead filesystem moves no bytes. CPU time is said but never decides:
//! a rank waiting on its GPU spins (CUDA's default synchronisation busy-waits), so a hung
//! job can burn a core per rank.
use std::time::Duration;

/// Storage I/O per second of the compared interval that counts as progress (a checkpoint
/// or a data shard; far above what a hung job's logging writes).
pub const IO_PROGRESS_BPS: u64 = 1 << 20;
/// Processes of one job read at most per sample.
const PROCS_MAX: usize = 1024;

/// The job's counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sample {
    /// Monotonic ns.
    pub at: u64,
    /// Storage bytes read and written, summed over the processes alive at both samples
    /// (a process that exits takes its counts along; one that starts brings its own).
    pub io_bytes: u64,
    /// utime + stime, clock ticks.
    pub cpu_ticks: u64,
    pub procs: usize,
    /// Processes whose /proc/PID/io could not be read (gone, or no permission).
    pub unread: usize,
}

/// Reads the counters of `root` and its descendants (at most [`PROCS_MAX`]).
pub fn sample(root: u32, at: u64) -> Sample {
    let mut s = Sample {
        at,
        ..Sample::default()
    };
    for pid in crate::correlate::descendants(&[root])
        .into_iter()
        .take(PROCS_MAX)
    {
        let Ok(p) = procfs::process::Process::new(pid as i32) else {
            continue;
        };
        match p.io() {
            Ok(io) => s.io_bytes = s.io_bytes.saturating_add(io.read_bytes + io.write_bytes),
            Err(_) => s.unread += 1,
        }
        if let Ok(st) = p.stat() {
            s.cpu_ticks = s.cpu_ticks.saturating_add(st.utime + st.stime);
        }
        s.procs += 1;
    }
    s
}

/// What two samples of a silent job say.
#[derive(Clone, Debug, PartialEq)]
pub enum Reading {
    /// Storage I/O at or above [`IO_PROGRESS_BPS`]: still working.
    Busy { bytes: u64, over: Duration },
    /// No storage progress: a stall, with what the counters said for its reason.
    Still { bytes: u64, cpu_s: f64, over: Duration, procs: usize, unread: usize },
}

/// The reading of `first` then `now` (`ticks_per_s`: the kernel's USER_HZ).
pub fn read(first: &Sample, now: &Sample, ticks_per_s: u64) -> Reading {
    let over = Duration::from_nanos(now.at.saturating_sub(first.at));
    let bytes = now.io_bytes.saturating_sub(first.io_bytes);
    let need = (IO_PROGRESS_BPS as f64 * over.as_secs_f64()) as u64;
    if bytes >= need.max(1) {
        return Reading::Busy { bytes, over };
    }
    Reading::Still {
        bytes,
        cpu_s: now.cpu_ticks.saturating_sub(first.cpu_ticks) as f64 / ticks_per_s.max(1) as f64,
        over,
        procs: now.procs,
        unread: now.unread,
    }
}

impl Reading {
    /// The clause the stall's reason carries.
    pub fn clause(&self) -> String {
        match self {
            Reading::Busy { bytes, over } => format!(
                "{} of storage I/O in the last {:.0} s",
                mib(*bytes),
                over.as_secs_f64()
            ),
            Reading::Still {
                bytes,
                cpu_s,
                over,
                procs,
                unread,
            } => {
                let unread = if *unread > 0 {
                    format!(", {unread} of them unreadable")
                } else {
                    String::new()
                };
                format!(
                    "no storage progress by the job's {procs} process{} in the last {:.0} s ({} read or written{unread}; {cpu_s:.1} CPU s, which a rank waiting on its GPU spends too)",
                    if *procs == 1 { "" } else { "es" },
                    over.as_secs_f64(),
                    mib(*bytes),
                )
            }
        }
    }
}

fn mib(b: u64) -> String {
    if b < 1 << 20 {
        format!("{} KiB", b >> 10)
    } else {
        format!("{:.1} MiB", b as f64 / f64::from(1 << 20))
    }
}

/// USER_HZ, the unit of /proc/PID/stat's times.
pub fn ticks_per_s() -> u64 {
    procfs::ticks_per_second()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(at_s: f64, io: u64, cpu: u64) -> Sample {
        Sample {
            at: (at_s * 1e9) as u64,
            io_bytes: io,
            cpu_ticks: cpu,
            procs: 3,
            unread: 0,
        }
    }

    #[test]
    fn a_checkpoint_being_written_is_progress_and_a_spinning_wait_is_not() {
        // 40 MiB in 10 s: 4 MiB/s.
        let r = read(&s(10.0, 0, 0), &s(20.0, 40 << 20, 100), 100);
        assert_eq!(
            r,
            Reading::Busy {
                bytes: 40 << 20,
                over: Duration::from_secs(10)
            }
        );
        assert_eq!(r.clause(), "40.0 MiB of storage I/O in the last 10 s");
        // Three ranks spinning on their GPUs (30 CPU s in 10 s) and a log line's bytes.
        let r = read(&s(10.0, 5 << 20, 0), &s(20.0, (5 << 20) + 4096, 3000), 100);
        let Reading::Still { bytes, cpu_s, .. } = r.clone() else {
            panic!("{r:?}")
        };
        assert_eq!((bytes, cpu_s), (4096, 30.0));
        assert_eq!(r.clause(), "no storage progress by the job's 3 processes in the last 10 s (4 KiB read or written; 30.0 CPU s, which a rank waiting on its GPU spends too)");
    }

    #[test]
    fn counters_that_go_back_and_an_empty_interval_are_no_progress() {
        // A process with big counters exited between the samples: the sum went down.
        let r = read(&s(10.0, 90 << 20, 50), &s(20.0, 1 << 20, 10), 100);
        assert!(matches!(r, Reading::Still { bytes: 0, .. }), "{r:?}");
        // The same instant twice: nothing moved, nothing divided by zero.
        let r = read(&s(10.0, 7, 1), &s(10.0, 7, 1), 0);
        assert!(matches!(r, Reading::Still { bytes: 0, .. }), "{r:?}");
    }

    #[test]
    fn this_process_is_sampled_with_its_own_io() {
        let me = std::process::id();
        let a = sample(me, 1);
        assert!(a.procs >= 1, "{a:?}");
        assert_eq!(a.unread, 0, "{a:?}");
        let gone = sample(u32::MAX - 1, 2);
        assert_eq!((gone.procs, gone.io_bytes), (0, 0));
    }
}
