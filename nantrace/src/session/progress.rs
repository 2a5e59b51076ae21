//! Whether a job that stopped printing steps is still working, for the stall trigger: the
//! I/O (/proc/PID/io: storage `read_bytes` + `write_bytes`, and `rchar` + `wchar` for
//! network filesystems, whose reads never reach the block layer) and CPU time of its processes
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

/// One process's counters: storage bytes (`read_bytes` + `write_bytes`), bytes through
/// read/write calls (`rchar` + `wchar`: a dataset read over NFS or Lustre never reaches
/// `read_bytes`), CPU ticks (utime + stime).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub storage: u64,
    pub calls: u64,
    pub cpu: u64,
}

/// The job's counters at one moment, per process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sample {
    /// Monotonic ns.
    pub at: u64,
    pub procs: std::collections::BTreeMap<u32, Counts>,
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
        let mut c = Counts::default();
        match p.io() {
            Ok(io) => {
                c.storage = io.read_bytes.saturating_add(io.write_bytes);
                c.calls = io.rchar.saturating_add(io.wchar);
            }
            // Left out (not counted as zero: read next time, its lifetime's bytes would look
            // like progress).
            Err(_) => {
                s.unread += 1;
                continue;
            }
        }
        if let Ok(st) = p.stat() {
            c.cpu = st.utime.saturating_add(st.stime);
        }
        s.procs.insert(pid, c);
    }
    s
}

/// A sample taken on a thread of its own: a read of /proc/PID/io waits on the process's
/// exec lock, which a task stuck in the kernel can hold for good (the very hang the stall
/// trigger is for), and the session's loop must not wait with it.
pub struct Pending {
    pub asked: u64,
    pub rx: std::sync::mpsc::Receiver<Sample>,
}

/// How long a sample may take before the stall is judged without it.
pub const SAMPLE_DEADLINE_NS: u64 = 5_000_000_000;

pub fn ask(root: u32, at: u64) -> Pending {
    let (tx, rx) = std::sync::mpsc::channel();
    let _ = std::thread::Builder::new()
        .name("nantrace-progress".into())
        .spawn(move || {
            let _ = tx.send(sample(root, at));
        });
    Pending { asked: at, rx }
}

/// What two samples of a silent job say.
#[derive(Clone, Debug, PartialEq)]
pub enum Reading {
    /// I/O at or above [`IO_PROGRESS_BPS`]: still working.
    Busy { bytes: u64, over: Duration },
    /// No I/O progress: a stall, with what the counters said for its reason.
    Still { bytes: u64, cpu_s: f64, over: Duration, procs: usize, unread: usize },
}

/// The reading of `first` then `now` (`ticks_per_s`: the kernel's USER_HZ): per process,
/// what moved since `first` (a process born since counts whole; one that exited takes its
/// counts along, so a finished copy's bytes are not seen: sampled again, the job is judged
/// on what it does then).
pub fn read(first: &Sample, now: &Sample, ticks_per_s: u64) -> Reading {
    let over = Duration::from_nanos(now.at.saturating_sub(first.at));
    let mut d = Counts::default();
    for (pid, c) in &now.procs {
        let b = first.procs.get(pid).copied().unwrap_or_default();
        d.storage = d.storage.saturating_add(c.storage.saturating_sub(b.storage));
        d.calls = d.calls.saturating_add(c.calls.saturating_sub(b.calls));
        d.cpu = d.cpu.saturating_add(c.cpu.saturating_sub(b.cpu));
    }
    let need = ((IO_PROGRESS_BPS as f64 * over.as_secs_f64()) as u64).max(1);
    let bytes = d.storage.max(d.calls);
    if bytes >= need {
        return Reading::Busy { bytes, over };
    }
    Reading::Still {
        bytes,
        cpu_s: d.cpu as f64 / ticks_per_s.max(1) as f64,
        over,
        procs: now.procs.len(),
        unread: now.unread,
    }
}

impl Reading {
    /// The clause the stall's reason carries.
    pub fn clause(&self) -> String {
        match self {
            Reading::Busy { bytes, over } => format!(
                "{} read or written in the last {:.0} s",
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
                    "no I/O progress by the job's {procs} process{} in the last {:.0} s ({} read or written{unread}; {cpu_s:.1} CPU s, which a rank waiting on its GPU spends too)",
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

    fn s(at_s: f64, procs: &[(u32, u64, u64, u64)]) -> Sample {
        Sample {
            at: (at_s * 1e9) as u64,
            procs: procs
                .iter()
                .map(|&(p, storage, calls, cpu)| (p, Counts { storage, calls, cpu }))
                .collect(),
            unread: 0,
        }
    }

    #[test]
    fn a_checkpoint_being_written_is_progress_and_a_spinning_wait_is_not() {
        // 40 MiB in 10 s: 4 MiB/s.
        let r = read(&s(10.0, &[(1, 0, 0, 0)]), &s(20.0, &[(1, 40 << 20, 40 << 20, 100)]), 100);
        assert_eq!(
            r,
            Reading::Busy {
                bytes: 40 << 20,
                over: Duration::from_secs(10)
            }
        );
        assert_eq!(r.clause(), "40.0 MiB read or written in the last 10 s");
        // Three ranks spinning on their GPUs (30 CPU s in 10 s) and a log line's bytes.
        let a = s(10.0, &[(1, 5 << 20, 5 << 20, 0), (2, 0, 0, 0), (3, 0, 0, 0)]);
        let b = s(20.0, &[(1, (5 << 20) + 4096, (5 << 20) + 4096, 1000), (2, 0, 0, 1000), (3, 0, 0, 1000)]);
        let r = read(&a, &b, 100);
        let Reading::Still { bytes, cpu_s, .. } = r.clone() else {
            panic!("{r:?}")
        };
        assert_eq!((bytes, cpu_s), (4096, 30.0));
        assert_eq!(r.clause(), "no I/O progress by the job's 3 processes in the last 10 s (4 KiB read or written; 30.0 CPU s, which a rank waiting on its GPU spends too)");
    }

    #[test]
    fn a_dataset_read_over_a_network_filesystem_is_progress() {
        // rchar moves, read_bytes does not (NFS, Lustre: not the block layer).
        let r = read(&s(0.0, &[(1, 0, 0, 0)]), &s(2.0, &[(1, 0, 8 << 20, 10)]), 100);
        assert!(matches!(r, Reading::Busy { .. }), "{r:?}");
    }

    #[test]
    fn a_process_that_exits_or_starts_is_counted_by_itself() {
        // A copy that wrote 90 MiB exited between the samples; the parent waits: its own
        // counts did not move (before: the sum went down and hid everything).
        let r = read(&s(10.0, &[(1, 1 << 20, 1 << 20, 50), (7, 90 << 20, 90 << 20, 10)]), &s(20.0, &[(1, 1 << 20, 1 << 20, 60)]), 100);
        assert!(matches!(r, Reading::Still { bytes: 0, .. }), "{r:?}");
        // A process born since writes 30 MiB: counted whole.
        let r = read(&s(10.0, &[(1, 0, 0, 0)]), &s(20.0, &[(1, 0, 0, 0), (9, 30 << 20, 30 << 20, 5)]), 100);
        assert!(matches!(r, Reading::Busy { .. }), "{r:?}");
        // The same instant twice: nothing moved, nothing divided by zero.
        let r = read(&s(10.0, &[(1, 7, 7, 1)]), &s(10.0, &[(1, 7, 7, 1)]), 0);
        assert!(matches!(r, Reading::Still { bytes: 0, .. }), "{r:?}");
    }

    #[test]
    fn this_process_is_sampled_with_its_own_io_on_a_thread() {
        let me = std::process::id();
        let p = ask(me, 1);
        let a = p
            .rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("a sample");
        assert!(a.procs.contains_key(&me), "{a:?}");
        assert_eq!(a.unread, 0, "{a:?}");
        let gone = sample(u32::MAX - 1, 2);
        assert!(gone.procs.is_empty());
    }
}
