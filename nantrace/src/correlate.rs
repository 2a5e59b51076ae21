//! The job's process tree as seen from /proc (the kernel map follows it from then on).
use std::collections::{BTreeSet, HashMap};

/// `root` and all its live descendants, from /proc.
pub fn descendants(roots: &[u32]) -> BTreeSet<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    if let Ok(all) = procfs::process::all_processes() {
        for p in all.flatten() {
            if let Ok(stat) = p.stat() {
                children
                    .entry(stat.ppid as u32)
                    .or_default()
                    .push(stat.pid as u32);
            }
        }
    }
    let mut out = BTreeSet::new();
    let mut stack: Vec<u32> = roots.to_vec();
    while let Some(p) = stack.pop() {
        if out.insert(p) {
            if let Some(c) = children.get(&p) {
                stack.extend(c);
            }
        }
    }
    out
}

/// Threads of `pid` (their tids), so thread-directed signals are attributed too.
pub fn threads(pid: u32) -> Vec<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The process exists and is not a zombie (a zombie has exited; only its parent's wait is due).
pub fn alive(pid: u32) -> bool {
    // The state follows the parenthesised comm, which may itself hold spaces or ')'.
    let live = |stat: &str| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !matches!(rest.trim_start().chars().next(), Some('Z' | 'X')))
    };
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) if live(&s) => true,
        // A zombie leader whose other threads still run (the leader called pthread_exit,
        // redteam 1.10) is a live process: look at its threads.
        Ok(_) => std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|t| {
                t.file_name().to_str().is_some_and(|n| n != pid.to_string())
                    && std::fs::read_to_string(t.path().join("stat")).is_ok_and(|s| live(&s))
            }),
        // Gone. Any other error (EMFILE, EACCES) is not proof of death (review 3).
        Err(e) => !matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_child_of_this_process() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let me = std::process::id();
        let d = descendants(&[me]);
        let _ = child.kill();
        let _ = child.wait();
        assert!(d.contains(&me));
        assert!(d.contains(&child.id()), "{d:?} lacks {}", child.id());
        assert!(threads(me).contains(&me));
        assert!(alive(me));
        // Exited but not yet reaped: a zombie is not alive.
        let mut z = std::process::Command::new("true").spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!alive(z.id()));
        let _ = z.wait();
        assert!(!alive(z.id()));
    }
}
