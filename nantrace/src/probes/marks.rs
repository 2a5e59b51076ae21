//! Upkeep of the job membership map (`JOB_MAP`) from /proc, for what the kernel side could
//! not follow: a run of the exit or fork program the kernel skipped as nested (its
//! `recursion_misses`; seen on 7.3, whose tracepoint programs can be preempted by another
//! task's run of the same program on the CPU). A skipped exit leaves the mark of a task gone,
//! which a task given the pid later would inherit: removed. A skipped fork leaves a child of
//! the job unmarked, and with it every process it starts (the fork program follows marked
//! parents only): marked, with its threads. The sweep thread runs this every 5 s; what it
//! did is counted (`accounting.membership_losses`).
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use super::jobmap::JobMap;

/// Marks looked at per sweep at most (a job of thousands of processes and threads).
const MARKS_SWEPT_MAX: usize = 1 << 16;
/// Tasks marked per sweep at most.
const MARKED_MAX: usize = 1 << 14;
/// How long an unmarked task of the job must stay unmarked before the sweep marks it: a
/// task is in its parent's thread group or children from `copy_process`, a moment before
/// the fork program marks it; such a task is not a loss.
const SETTLE: Duration = Duration::from_millis(50);

/// What the sweeps did, shared by the sweep thread and the probes' accounting.
#[derive(Debug, Default)]
pub struct MarkCounts {
    /// Marks of tasks that no longer exist, removed (a skipped exit).
    pub stale_removed: AtomicU64,
    /// Processes of the job found unmarked and marked (a skipped fork), with their threads.
    pub children_marked: AtomicU64,
    /// Threads of a marked process found unmarked and marked (a skipped thread creation).
    pub threads_marked: AtomicU64,
}

/// One sweep's work.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    pub removed: u64,
    pub children: u64,
    pub threads: u64,
}

/// Remove the marks of tasks gone, then mark the job's processes and threads the fork
/// program missed. nantrace's own process is marked only while it starts a job (so that the
/// kernel marks the job from its first instruction) and is never followed here: its threads
/// and helpers are not the job's.
pub fn sweep(map: &JobMap, counts: &MarkCounts) -> Swept {
    let marked = map.marked(MARKS_SWEPT_MAX);
    let (gone, live): (Vec<u32>, Vec<u32>) = marked.into_iter().partition(|p| {
        // /proc/<tid> answers for a thread too (not listed, but there).
        matches!(
            std::fs::symlink_metadata(format!("/proc/{p}")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound
        )
    });
    let removed = gone.iter().filter(|p| map.set(**p, false).is_ok()).count() as u64;
    counts.stale_removed.fetch_add(removed, Relaxed);
    let me = std::process::id();
    // Followed from marked processes only: a marked thread whose process is not marked
    // (a stale mark's pid given to a thread) does not bring its process in.
    let roots: Vec<u32> = live
        .into_iter()
        .filter(|p| *p != me && is_process(*p))
        .collect();
    let first = unmarked(map, &roots, me);
    if first.is_empty() {
        return Swept {
            removed,
            ..Swept::default()
        };
    }
    std::thread::sleep(SETTLE);
    // Still unmarked after the settle (the fork program had its moment), and still the job's.
    let again = unmarked(map, &roots, me);
    let (mut children, mut threads) = (0, 0);
    for (task, kind) in first.iter().take(MARKED_MAX) {
        if again.get(task) != Some(kind) || map.set(*task, true).is_err() {
            continue;
        }
        // The pid may have been given to another task since the listing: kept only while it
        // is there and its parent process is the job's.
        if !still_the_jobs(map, *task, *kind) {
            let _ = map.set(*task, false);
            continue;
        }
        match kind {
            Kind::Child => children += 1,
            Kind::Thread(_) => threads += 1,
        }
    }
    counts.children_marked.fetch_add(children, Relaxed);
    counts.threads_marked.fetch_add(threads, Relaxed);
    Swept {
        removed,
        children,
        threads,
    }
}

/// How an unmarked task belongs to the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A descendant process of a marked one.
    Child,
    /// A thread of the marked or descendant process (its tgid).
    Thread(u32),
}

/// The job's tasks not marked now: descendants of the marked processes (not through `me`)
/// and the threads of those processes.
fn unmarked(map: &JobMap, roots: &[u32], me: u32) -> BTreeMap<u32, Kind> {
    let tree = crate::correlate::descendants(roots);
    let mut out = BTreeMap::new();
    let roots: BTreeSet<u32> = roots.iter().copied().collect();
    for p in tree.into_iter().filter(|p| *p != me) {
        if !roots.contains(&p) && !map.get(p) {
            out.insert(p, Kind::Child);
        }
        for t in crate::correlate::threads(p) {
            if t != p && !map.get(t) && !out.contains_key(&t) {
                out.insert(t, Kind::Thread(p));
            }
        }
        if out.len() >= MARKED_MAX {
            break;
        }
    }
    out
}

/// `pid` is a process (its thread group's leader), not another thread.
fn is_process(pid: u32) -> bool {
    procfs::process::Process::new(pid as i32)
        .and_then(|p| p.status())
        .is_ok_and(|s| s.tgid == pid as i32)
}

/// After marking `task`: it still exists, and its parent process (a child's) or its process
/// (a thread's) is marked.
fn still_the_jobs(map: &JobMap, task: u32, kind: Kind) -> bool {
    match kind {
        Kind::Thread(tgid) => {
            map.get(tgid) && std::path::Path::new(&format!("/proc/{tgid}/task/{task}")).exists()
        }
        Kind::Child => procfs::process::Process::new(task as i32)
            .and_then(|p| p.stat())
            .is_ok_and(|s| s.ppid > 0 && map.get(s.ppid as u32)),
    }
}
