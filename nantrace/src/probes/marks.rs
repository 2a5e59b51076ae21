//! Upkeep of the job membership map (`JOB_MAP`) from /proc, for what the kernel side could
//! not follow: a run of the exit or fork program the kernel skipped as nested (its
//! `recursion_misses`; seen on 7.3, whose tracepoint programs can be preempted by another
//! task's run of the same program on the CPU). A skipped exit leaves the mark of a task gone,
//! which a task given the pid later would inherit: removed. A skipped fork leaves a child of
//! the job unmarked, and with it every process it starts (the fork program follows marked
//! parents only): marked, with its threads. The sweep thread runs this every 5 s; what it
//! did is counted (`accounting.membership_losses`).
//!
//! Only the trees of the processes userspace itself marked (the job's roots: `seed`) are
//! followed, never a process merely marked: a stale mark's pid given to another user's
//! process would otherwise bring that process's children and threads in.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use super::jobmap::JobMap;

/// Marks looked at per sweep at most (a job of thousands of processes and threads).
const MARKS_SWEPT_MAX: usize = 1 << 16;
/// Tasks marked per sweep at most.
const MARKED_MAX: usize = 1 << 14;
/// Roots kept at most (the agent marks every process and thread of its jobs).
const SEEDED_MAX: usize = 1 << 16;
/// How long an unmarked task of the job must stay unmarked before the sweep marks it: a
/// task is in its parent's thread group or children from `copy_process`, a moment before
/// the fork program marks it; such a task is not a loss.
const SETTLE: Duration = Duration::from_millis(50);
/// `PF_EXITING` of /proc/PID/stat's flags: the task is in `do_exit` (the exit program may
/// have unmarked it already).
const PF_EXITING: u32 = 0x4;

/// What the sweeps did, and the roots they follow; shared by the probes and the sweep thread.
#[derive(Debug, Default)]
pub struct MarkState {
    /// Marks of tasks that no longer exist, removed (a skipped exit).
    pub stale_removed: AtomicU64,
    /// Processes of the job found unmarked and marked (a skipped fork).
    pub children_marked: AtomicU64,
    /// Threads of the job's processes found unmarked and marked (a skipped thread creation).
    pub threads_marked: AtomicU64,
    /// Roots not kept: more than `SEEDED_MAX` (their trees are not mended).
    pub roots_not_kept: AtomicU64,
    /// The pids userspace marked, with their start time (ticks after boot) and when they were
    /// marked (monotonic ns): the process at that pid is the root only while its start time
    /// is the same.
    seeded: Mutex<HashMap<u32, (u64, u64)>>,
}

impl MarkState {
    /// Userspace marked `pid`: a root of the job's trees, while it is the same process.
    pub fn seed(&self, pid: u32) {
        // Processes only: a thread's id is never a root (the agent and `watch` mark every
        // thread too; they would take roots' places until the next sweep).
        let tgid = procfs::process::Process::new(pid as i32)
            .and_then(|p| p.status())
            .map(|s| s.tgid);
        if tgid.ok() != Some(pid as i32) {
            return;
        }
        let Some(start) = stat(&format!("/proc/{pid}/stat")).map(|t| t.start) else {
            return;
        };
        let mut s = self
            .seeded
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if s.len() < SEEDED_MAX || s.contains_key(&pid) {
            s.insert(pid, (start, crate::clock::monotonic_ns()));
        } else {
            self.roots_not_kept.fetch_add(1, Relaxed);
        }
    }

    pub fn unseed(&self, pid: u32) {
        self.seeded
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&pid);
    }

    /// The roots that are still the processes marked: the others (gone, a pid given to
    /// another process, a thread's id) are forgotten, unless marked after `listed` (the
    /// process listing may predate them).
    fn roots(&self, map: &JobMap, procs: &BTreeMap<u32, Task>, listed: u64, me: u32) -> Vec<u32> {
        let mut s = self
            .seeded
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.retain(|pid, (start, at)| {
            *at >= listed || procs.get(pid).is_some_and(|t| t.start == *start)
        });
        let mut roots: Vec<u32> = s
            .iter()
            .filter(|(pid, (start, _))| {
                // Still marked: the exit program clears a root's mark, so a pid given to
                // another process within one tick of the start time is not taken.
                **pid != me && map.get(**pid) && procs.get(pid).is_some_and(|t| t.start == *start)
            })
            .map(|(pid, _)| *pid)
            .collect();
        roots.sort_unstable();
        roots
    }
}

/// One sweep's work.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    pub removed: u64,
    pub children: u64,
    pub threads: u64,
}

/// Remove the marks of tasks gone, then mark the processes and threads of the job's trees the
/// fork program missed. nantrace's own process is marked only while it starts a job (so that
/// the kernel marks the job from its first instruction) and is never followed here: its
/// threads and helpers are not the job's.
pub fn sweep(map: &JobMap, state: &MarkState) -> Swept {
    let gone: Vec<u32> = map
        .marked(MARKS_SWEPT_MAX)
        .into_iter()
        .filter(|p| {
            // /proc/<tid> answers for a thread too (not listed, but there).
            matches!(
                std::fs::symlink_metadata(format!("/proc/{p}")),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound
            )
        })
        .collect();
    let removed = gone.iter().filter(|p| map.set(**p, false).is_ok()).count() as u64;
    state.stale_removed.fetch_add(removed, Relaxed);
    let mut swept = Swept {
        removed,
        ..Swept::default()
    };
    // No roots (no job, or an idle agent): no listing of /proc.
    if state
        .seeded
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .is_empty()
    {
        return swept;
    }
    let me = std::process::id();
    let listed = crate::clock::monotonic_ns();
    let procs = processes();
    let roots = state.roots(map, &procs, listed, me);
    let first = unmarked(map, &procs, &roots, me);
    if first.is_empty() {
        return swept;
    }
    std::thread::sleep(SETTLE);
    // Still unmarked after the settle (the fork program had its moment), still the job's.
    let again: BTreeSet<(u32, Kind)> = unmarked(map, &processes(), &roots, me)
        .into_iter()
        .map(|(t, k, _)| (t, k))
        .collect();
    // Parents before children: a child is kept only under a parent marked by now.
    for (task, kind, start) in first {
        if !again.contains(&(task, kind)) || map.set(task, true).is_err() {
            continue;
        }
        // The task may have begun its exit, or its pid been given to another task, since the
        // listing: kept only while it is the same live task under a marked parent. A task
        // found live here is unmarked by its exit program later, as any other.
        if !still_the_jobs(map, task, kind, start) {
            let _ = map.set(task, false);
            continue;
        }
        match kind {
            Kind::Child => swept.children += 1,
            Kind::Thread(_) => swept.threads += 1,
        }
    }
    state.children_marked.fetch_add(swept.children, Relaxed);
    state.threads_marked.fetch_add(swept.threads, Relaxed);
    swept
}

/// How an unmarked task belongs to the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// A descendant process of a root.
    Child,
    /// A thread of a root or descendant process (its tgid).
    Thread(u32),
}

/// A process or thread as /proc/PID/stat shows it.
#[derive(Debug, Clone, Copy)]
struct Task {
    ppid: u32,
    start: u64,
    /// Neither exiting nor a zombie.
    live: bool,
}

fn stat(path: &str) -> Option<Task> {
    use procfs::FromRead as _;
    let s = procfs::process::Stat::from_read(std::fs::File::open(path).ok()?).ok()?;
    Some(Task {
        ppid: u32::try_from(s.ppid).unwrap_or(0),
        start: s.starttime,
        live: !matches!(s.state, 'Z' | 'X' | 'x') && s.flags & PF_EXITING == 0,
    })
}

/// Every process on the node (the /proc listing holds processes, not threads).
fn processes() -> BTreeMap<u32, Task> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return BTreeMap::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|p| Some((p, stat(&format!("/proc/{p}/stat"))?)))
        .collect()
}

/// The job's tasks not marked now, parents before children: the live descendant processes of
/// `roots` (never through `me`) and the live threads of the roots and those processes, each
/// with its start time.
fn unmarked(
    map: &JobMap,
    procs: &BTreeMap<u32, Task>,
    roots: &[u32],
    me: u32,
) -> Vec<(u32, Kind, u64)> {
    let mut children: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for (pid, t) in procs {
        children.entry(t.ppid).or_default().push(*pid);
    }
    let mut out = Vec::new();
    let mut seen: BTreeSet<u32> = BTreeSet::new();
    let mut queue: std::collections::VecDeque<(u32, bool)> =
        roots.iter().map(|r| (*r, true)).collect();
    while let Some((p, root)) = queue.pop_front() {
        if p == me || !seen.insert(p) || out.len() >= MARKED_MAX {
            continue;
        }
        let Some(task) = procs.get(&p).filter(|t| t.live) else {
            continue;
        };
        if !root && !map.get(p) {
            out.push((p, Kind::Child, task.start));
        }
        for t in crate::correlate::threads(p) {
            if t != p && !map.get(t) {
                if let Some(th) = stat(&format!("/proc/{p}/task/{t}/stat")).filter(|th| th.live) {
                    out.push((t, Kind::Thread(p), th.start));
                }
            }
        }
        queue.extend(children.get(&p).into_iter().flatten().map(|c| (*c, false)));
    }
    out
}

/// After marking `task`: it is the same live task (its start time), and its parent process (a
/// child's) or its process (a thread's) is marked.
fn still_the_jobs(map: &JobMap, task: u32, kind: Kind, start: u64) -> bool {
    match kind {
        Kind::Thread(tgid) => {
            map.get(tgid)
                && stat(&format!("/proc/{tgid}/task/{task}/stat"))
                    .is_some_and(|t| t.live && t.start == start)
        }
        Kind::Child => stat(&format!("/proc/{task}/stat"))
            .is_some_and(|t| t.live && t.start == start && t.ppid > 0 && map.get(t.ppid)),
    }
}
