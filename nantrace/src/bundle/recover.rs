//! Bundles whose writer died (redteam3 D-8): a dump killed halfway (`kill -9`, the unit's
//! `MemoryMax` OOM-killing the agent during a large dump) leaves its temporary directory,
//! `.nantrace-<host>-<stamp>.tmp-<pid>-<random>`, hidden from the spool's accounting and its
//! eviction. At start the agent (in its spool) and `run` (in its `--out`) find those whose
//! writer is gone and keep them as `nantrace-<host>-<stamp>-incomplete` bundles, with an
//! `INCOMPLETE.txt` that says so; `report` reads them as far as they go. A bundle whose files
//! could not all be written (a full disk, D-12) is kept under the same kind of name.
use std::path::{Path, PathBuf};

use crate::safefs;

/// The note inside an incomplete bundle.
pub const NOTE: &str = "INCOMPLETE.txt";
/// The suffix of an incomplete bundle's name.
pub const SUFFIX: &str = "-incomplete";

/// One temporary directory kept as an incomplete bundle.
#[derive(Debug, Clone)]
pub struct Recovered {
    pub dir: PathBuf,
    pub writer_pid: u32,
    pub bytes: u64,
}

/// True when a bundle's directory name says it is incomplete.
pub fn is_incomplete(name: &str) -> bool {
    name.starts_with("nantrace-")
        && (name.ends_with(SUFFIX)
            || name.rsplit_once(SUFFIX).is_some_and(|(_, n)| {
                n.starts_with('-') && n[1..].bytes().all(|b| b.is_ascii_digit())
            }))
}

/// `.nantrace-<base>.tmp-<pid>-<random>` -> (`nantrace-<base>`, pid).
fn parse_tmp(name: &str) -> Option<(String, u32)> {
    let rest = name.strip_prefix('.')?;
    let (base, tail) = rest.rsplit_once(".tmp-")?;
    if !base.starts_with("nantrace-") {
        return None;
    }
    let (pid, random) = tail.split_once('-')?;
    if random.is_empty() || !random.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some((base.to_string(), pid.parse().ok()?))
}

/// Whether the process that wrote a temporary directory is gone. A writer holds an exclusive
/// flock on its directory until it claims the bundle; the kernel lets go of it when the
/// writer dies, however it dies, in whatever pid namespace or host (NFS) it ran. A directory
/// of a nantrace that predates the lock is judged by its pid: gone, or another program now.
fn writer_gone(dir: &safefs::Dir, proc_root: &Path, pid: u32) -> bool {
    match dir.lock(false) {
        Ok(false) => false,
        Ok(true) => {
            // Got it: nobody holds it. A writer from before the lock existed holds none; its
            // pid says whether it still runs (this process's own old pid is dead: it just began).
            pid == std::process::id()
                || match std::fs::read_to_string(proc_root.join(pid.to_string()).join("comm")) {
                    Ok(comm) => !comm.trim_end().starts_with("nantrace"),
                    // Only "no such process" is proof; any other error (EMFILE, EACCES) is not.
                    Err(e) => matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH)),
                }
        }
        Err(_) => false,
    }
}

fn du(p: &Path) -> u64 {
    let Ok(m) = std::fs::symlink_metadata(p) else {
        return 0;
    };
    if !m.is_dir() {
        return m.len();
    }
    std::fs::read_dir(p)
        .into_iter()
        .flatten()
        .flatten()
        .take(10_000)
        .map(|e| du(&e.path()))
        .sum::<u64>()
        + m.len()
}

/// Keep the temporary directories of dead writers in `out` as incomplete bundles. Only real
/// directories that belong to us are touched (never a link, never another user's). What could
/// not be renamed is said in the second list, with the reason.
pub fn recover(out: &Path) -> (Vec<Recovered>, Vec<String>) {
    recover_in(out, Path::new("/proc"))
}

fn recover_in(out: &Path, proc_root: &Path) -> (Vec<Recovered>, Vec<String>) {
    use std::os::unix::fs::MetadataExt as _;
    let (mut kept, mut problems) = (Vec::new(), Vec::new());
    let Ok(rd) = std::fs::read_dir(out) else {
        return (kept, problems);
    };
    let Ok(d) = safefs::Dir::open(out) else {
        return (kept, problems);
    };
    // SAFETY: geteuid has no failure mode.
    let me = unsafe { libc::geteuid() };
    for e in rd.flatten().take(100_000) {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((base, pid)) = parse_tmp(&name) else {
            continue;
        };
        let Ok(m) = std::fs::symlink_metadata(e.path()) else {
            continue;
        };
        if !m.is_dir() || m.uid() != me {
            continue;
        }
        // Opened without following a link, relative to `out`, and ours: what is checked is
        // what is written into (a user's `--out` could swap the entry for a link meanwhile).
        let Ok(sub) = d.open_subdir(&name) else {
            continue;
        };
        if !writer_gone(&sub, proc_root, pid) {
            continue;
        }
        let bytes = du(&e.path());
        let note = format!(
            "This bundle is incomplete: its writer (nantrace, pid {pid}) stopped before it finished (killed, or out of memory), and it was found in {} at {} by pid {}.\nThe files here are as far as it went; `nantrace report` reads what there is and says what is missing.\n",
            crate::term::clean(&out.display().to_string()),
            crate::clock::rfc3339(crate::clock::realtime_ns()),
            std::process::id()
        );
        // The note, and the directory's time as it was: an old dump must not become the
        // spool's newest bundle (which eviction spares).
        let mtime = sub.modified();
        let _ = sub.write_new(NOTE, note.as_bytes());
        if let Ok(t) = mtime {
            let _ = sub.set_modified(t);
        }
        drop(sub);
        match claim(&d, &name, &format!("{base}{SUFFIX}")) {
            Ok(final_name) => kept.push(Recovered {
                dir: out.join(final_name),
                writer_pid: pid,
                bytes,
            }),
            Err(err) => problems.push(format!("{}: {err}", out.join(&name).display())),
        }
    }
    (kept, problems)
}

/// Rename `from` to `name` (or `name-2`, `name-3`, ...: never over anything).
pub fn claim(d: &safefs::Dir, from: &str, name: &str) -> std::io::Result<String> {
    let mut candidate = name.to_string();
    for n in 2..10_000 {
        match d.rename_noreplace(from, &candidate) {
            Ok(()) => return Ok(candidate),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                candidate = format!("{name}-{n}")
            }
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other("no free name"))
}

/// What `recover` did, for stderr: one line per bundle kept and per problem.
pub fn say(kept: &[Recovered], problems: &[String]) {
    for r in kept {
        crate::say!("nantrace: kept {} ({} KiB) as an incomplete bundle: its writer, pid {}, died before it finished", r.dir.display(), r.bytes >> 10, r.writer_pid);
    }
    for p in problems {
        crate::say!("nantrace: WARNING: a dead writer's temporary bundle could not be kept: {p}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(
            parse_tmp(".nantrace-h-20261201T200549Z.tmp-4242-a1b2c3"),
            Some(("nantrace-h-20261201T200549Z".into(), 4242))
        );
        assert_eq!(parse_tmp(".nantrace-writable-abc"), None);
        assert_eq!(
            parse_tmp(".n1.tmp-abc"),
            None,
            "the job directory's temporary names are not bundles"
        );
        assert!(
            is_incomplete("nantrace-h-20261201T200549Z-incomplete")
                && is_incomplete("nantrace-h-x-incomplete-3")
        );
        assert!(
            !is_incomplete("nantrace-h-20261201T200549Z-2")
                && !is_incomplete("nantrace-incomplete-x")
        );
    }

    /// A dead writer's directory becomes an incomplete bundle with its note; a live writer's
    /// (a running process named nantrace) and a link are left alone.
    #[test]
    fn a_dead_writers_directory_is_kept_as_an_incomplete_bundle() {
        let d = std::env::temp_dir().join(format!("nantrace-recover-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        // A pid that does not exist (above pid_max's largest value).
        let dead = d.join(".nantrace-h-20261201T000000Z.tmp-4194305-abcdef");
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join("app.log"), "step 1 loss nan\n").unwrap();
        std::fs::create_dir(d.join("nantrace-h-20261201T000000Z-incomplete")).unwrap();
        std::os::unix::fs::symlink("/etc", d.join(".nantrace-h-x.tmp-4194306-abcdef")).unwrap();
        // A /proc where pid 4194300 is a running nantrace and 4194301 another program.
        let proc =
            std::env::temp_dir().join(format!("nantrace-recover-proc-{}", std::process::id()));
        for (pid, comm) in [(4194300, "nantrace\n"), (4194301, "python3\n")] {
            std::fs::create_dir_all(proc.join(pid.to_string())).unwrap();
            std::fs::write(proc.join(pid.to_string()).join("comm"), comm).unwrap();
        }
        let busy = d.join(".nantrace-h-y.tmp-4194300-abcdef");
        std::fs::create_dir(&busy).unwrap();
        let reused = d.join(".nantrace-h-z.tmp-4194301-abcdef");
        std::fs::create_dir(&reused).unwrap();
        // A writer that holds its directory's lock is alive, whatever its pid says (another
        // pid namespace, another host on NFS).
        let locked = d.join(".nantrace-h-w.tmp-4194307-abcdef");
        std::fs::create_dir(&locked).unwrap();
        let holder = safefs::Dir::open(&locked).unwrap();
        assert!(holder.lock(false).unwrap());
        let before = std::fs::metadata(&dead).unwrap().modified().unwrap();
        let (mut kept, problems) = recover_in(&d, &proc);
        assert!(locked.is_dir(), "a locked writer's directory was taken");
        drop(holder);
        let _ = std::fs::remove_dir_all(&proc);
        assert!(busy.is_dir(), "a live writer's directory was taken");
        assert!(
            !reused.exists() && d.join("nantrace-h-z-incomplete").is_dir(),
            "a pid reused by another program is a dead writer"
        );
        kept.retain(|k| k.writer_pid != 4194301);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(kept.len(), 1, "{kept:?}");
        assert_eq!(
            kept[0].dir,
            d.join("nantrace-h-20261201T000000Z-incomplete-2"),
            "never over an existing name"
        );
        assert_eq!(kept[0].writer_pid, 4194305);
        let note = std::fs::read_to_string(kept[0].dir.join(NOTE)).unwrap();
        assert!(
            note.contains("pid 4194305") && note.contains("incomplete"),
            "{note}"
        );
        assert_eq!(
            std::fs::read_to_string(kept[0].dir.join("app.log")).unwrap(),
            "step 1 loss nan\n"
        );
        assert_eq!(
            std::fs::metadata(&kept[0].dir).unwrap().modified().unwrap(),
            before,
            "the note did not make it the newest bundle"
        );
        assert!(
            std::fs::symlink_metadata(d.join(".nantrace-h-x.tmp-4194306-abcdef"))
                .unwrap()
                .file_type()
                .is_symlink(),
            "a link is never renamed"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
