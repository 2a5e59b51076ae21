//! The job's processes at the trigger (snapshot.json `stacks`): each thread's state, where it
//! waits in the kernel (wchan, kernel stack, syscall), I/O progress between two samples, the
//! rank its launcher gave it, and, when an administrator configured one, its Python stack by
//! py-spy. Taken at the trigger, while the job is alive: a hung rank is killed within seconds
//! of the others' timeouts, before anyone can run py-spy by hand.
//!
//! Two samples [`SAMPLE_GAP`] apart: a thread in D state in the same function in both, with
//! no I/O progress, is blocked (one sample could be a short wait). Read as root from /proc
//! (`stack` needs it); what cannot be read is said per field, never a silent gap. Everything
//! here is the job's own state or a user-controllable one (a user's FUSE daemon can hold a
//! thread in D state): it locates a hang, it is never machine evidence on its own.
//!
//! py-spy: `NANTRACE_PYSPY=/path/to/py-spy`, a root-owned file that only root can write, in
//! directories only root can write; run as `py-spy dump --pid P --nonblocking` (never
//! `--locals`: a frame's variables can hold secrets), [`PYSPY_TIMEOUT`] per process, on at
//! most [`PYSPY_PROCS`] rank processes, output bounded. Unset: said in the section.
use std::collections::BTreeSet;
use std::io::Read as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

pub const SAMPLE_GAP: Duration = Duration::from_millis(300);
const PROCESSES_MAX: usize = 64;
/// Threads kept per process: the main thread and those in D state first.
const THREADS_MAX: usize = 32;
/// Threads of one process looked at, at most.
const THREADS_SCAN_MAX: usize = 4096;
const STACK_FRAMES_MAX: usize = 24;
pub const PYSPY_TIMEOUT: Duration = Duration::from_secs(5);
pub const PYSPY_PROCS: usize = 8;
const PYSPY_OUT_MAX: usize = 64 << 10;

/// One thread at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Thread {
    state: String,
    wchan: String,
    syscall: String,
}

/// A small /proc file as text (a thread name cut mid-character is still read: lossy).
fn read_small(p: &Path, max: u64) -> std::io::Result<String> {
    let mut b = Vec::new();
    std::fs::File::open(p)?.take(max).read_to_end(&mut b)?;
    Ok(String::from_utf8_lossy(&b).into_owned())
}

/// A process's start time (clock ticks since boot, /proc/PID/stat field 22): the same pid
/// with another start time is another process (pid reuse).
fn starttime(pid: u64) -> Option<u64> {
    let stat = read_small(Path::new(&format!("/proc/{pid}/stat")), 4096).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The whole `stacks` section may take at most this long: reading a process's environ takes
/// its memory map's lock, which a thread stuck in the kernel can hold for ever; the section
/// then says so and the dump goes on without it.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// A thread's state letter from its stat line (after the comm's last `)`).
fn state_of(stat: &str) -> Option<String> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().next().map(String::from)
}

fn sample_thread(dir: &Path) -> Option<Thread> {
    let stat = read_small(&dir.join("stat"), 4096).ok()?;
    Some(Thread {
        state: state_of(&stat)?,
        wchan: read_small(&dir.join("wchan"), 256)
            .map(|w| clean(&w, 64))
            .unwrap_or_default(),
        // The syscall number it waits in (`running`, or -1 outside one).
        syscall: read_small(&dir.join("syscall"), 512)
            .ok()
            .and_then(|s| s.split_whitespace().next().map(String::from))
            .unwrap_or_default(),
    })
}

/// The function names of a kernel stack (`[<0>] submit_bio_wait+0x74/0xc0`).
pub fn frames(stack: &str) -> Vec<String> {
    stack
        .lines()
        .filter_map(|l| {
            let f = l.split_once("] ").map_or(l, |x| x.1);
            let f = f.split('+').next()?.trim();
            (!f.is_empty()).then(|| clean(f, 96))
        })
        .take(STACK_FRAMES_MAX)
        .collect()
}

/// Untrusted text (a comm, a wchan), one line, bounded.
fn clean(s: &str, max: usize) -> String {
    crate::term::clean(s.trim()).chars().take(max).collect()
}

fn io_of(pid: u32) -> Option<(u64, u64)> {
    let s = read_small(Path::new(&format!("/proc/{pid}/io")), 4096).ok()?;
    let field = |k: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    Some((field("read_bytes:")?, field("write_bytes:")?))
}

fn threads_of(pid: u32) -> Vec<u32> {
    let mut t: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|rd| {
            rd.flatten()
                .take(THREADS_SCAN_MAX)
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    t.sort_unstable();
    t
}

type Sample = Vec<(u32, Vec<(u32, Thread)>, Option<(u64, u64)>)>;

fn sample(pids: &[u32]) -> Sample {
    pids.iter()
        .map(|&pid| {
            let th = threads_of(pid)
                .into_iter()
                .filter_map(|tid| {
                    sample_thread(Path::new(&format!("/proc/{pid}/task/{tid}"))).map(|t| (tid, t))
                })
                .collect();
            (pid, th, io_of(pid))
        })
        .collect()
}

/// The rank each process's launcher gave it, and whether it is its rank's main process (a
/// DataLoader worker inherits its rank's variables: the lowest pid of a rank is the rank).
fn ranks_of(pids: &[u32]) -> Vec<Option<(u32, bool)>> {
    let ranks: Vec<Option<u32>> = pids
        .iter()
        .map(|p| {
            std::fs::read(format!("/proc/{p}/environ"))
                .ok()
                .and_then(|e| super::ranks::from_environ(&e))
                .map(|r| r.rank)
        })
        .collect();
    ranks
        .iter()
        .zip(pids)
        .map(|(r, p)| {
            r.map(|r| {
                let first = pids
                    .iter()
                    .zip(&ranks)
                    .filter(|(_, x)| **x == Some(r))
                    .map(|(q, _)| *q)
                    .min()
                    == Some(*p);
                (r, first)
            })
        })
        .collect()
}

/// The `stacks` section for the job's processes `job`, within [`DEADLINE`].
pub fn snapshot(job: &BTreeSet<u32>) -> Value {
    let job = job.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("nantrace-stacks".into())
        .spawn(move || {
            let _ = tx.send(snapshot_with(&job, pyspy_from_env().as_ref()));
        });
    if let Err(e) = spawned {
        return json!({ "error": format!("no thread for the stacks: {e}") });
    }
    rx.recv_timeout(DEADLINE).unwrap_or_else(|_| {
        json!({ "error": format!("the stacks took longer than {} s (a process's memory map locked, or py-spy stuck): left out", DEADLINE.as_secs()) })
    })
}

/// The configured py-spy, or why there is none.
fn pyspy_from_env() -> Result<PathBuf, String> {
    let p = std::env::var_os("NANTRACE_PYSPY")
        .ok_or_else(|| "not configured (NANTRACE_PYSPY=/path/to/py-spy, root-owned)".to_string())?;
    trusted_tool(Path::new(&p))
}

/// `p` when it is an absolute path to a plain file that root owns and only root can write,
/// in directories of the same kind (root runs it).
pub fn trusted_tool(p: &Path) -> Result<PathBuf, String> {
    if !p.is_absolute() {
        return Err(format!("{}: not an absolute path", p.display()));
    }
    // Resolved first: every directory on the real path is checked, not one a link passes by.
    let p = &std::fs::canonicalize(p).map_err(|e| format!("{}: {e}", p.display()))?;
    let m = std::fs::symlink_metadata(p).map_err(|e| format!("{}: {e}", p.display()))?;
    if !m.file_type().is_file() || m.uid() != 0 || m.mode() & 0o022 != 0 {
        return Err(format!(
            "{}: not a plain file that root owns and only root can write (a link is not followed)",
            p.display()
        ));
    }
    for a in p.ancestors().skip(1) {
        let m = std::fs::metadata(a).map_err(|e| format!("{}: {e}", a.display()))?;
        if m.uid() != 0 || (m.mode() & 0o022 != 0 && m.mode() & 0o1000 == 0) {
            return Err(format!(
                "{}: a directory on the way to py-spy that others can write",
                a.display()
            ));
        }
    }
    Ok(p.to_path_buf())
}

pub fn snapshot_with(job: &BTreeSet<u32>, pyspy: Result<&PathBuf, &String>) -> Value {
    let t0 = Instant::now();
    let all: Vec<u32> = job.iter().copied().collect();
    let ranks_all = ranks_of(&all);
    // Rank processes first, then the rest, at most PROCESSES_MAX.
    let mut order: Vec<usize> = (0..all.len()).collect();
    order.sort_by_key(|&i| (ranks_all[i].is_none(), ranks_all[i].map(|r| (!r.1, r.0))));
    let chosen: Vec<usize> = order.into_iter().take(PROCESSES_MAX).collect();
    let pids: Vec<u32> = chosen.iter().map(|&i| all[i]).collect();
    let ta = Instant::now();
    let a = sample(&pids);
    std::thread::sleep(SAMPLE_GAP);
    let tb = Instant::now();
    let b = sample(&pids);
    // The samples' real distance (many threads take long to read).
    let gap_ms = tb.duration_since(ta).as_millis() as u64;
    let mut procs = Vec::new();
    for (k, &i) in chosen.iter().enumerate() {
        let pid = all[i];
        let (_, ta, ioa) = &a[k];
        let (_, tb, iob) = &b[k];
        if ta.is_empty() && tb.is_empty() {
            continue; // gone before the first sample
        }
        let mut states: Map<String, Value> = Map::new();
        for (_, t) in tb
            .iter()
            .chain(if tb.is_empty() { ta.iter() } else { [].iter() })
        {
            let n = states.entry(t.state.clone()).or_insert(json!(0));
            *n = json!(n.as_u64().unwrap_or(0) + 1);
        }
        let mut keep: Vec<u32> = ta.iter().map(|x| x.0).collect();
        keep.sort_by_key(|tid| {
            let d = ta.iter().chain(tb).any(|(t, s)| t == tid && s.state == "D");
            (*tid != pid, !d, *tid)
        });
        keep.truncate(THREADS_MAX);
        let threads: Vec<Value> = keep
            .iter()
            .map(|tid| {
                let at = |s: &[(u32, Thread)]| s.iter().find(|x| x.0 == *tid).map(|x| x.1.clone());
                let (sa, sb) = (at(ta), at(tb));
                let dir = format!("/proc/{pid}/task/{tid}");
                let stack = read_small(&Path::new(&dir).join("stack"), 16 << 10);
                let mut t = json!({
                    "tid": tid,
                    "comm": read_small(&Path::new(&dir).join("comm"), 64).map(|c| clean(&c, 16)).unwrap_or_default(),
                    "state": [sa.as_ref().map(|s| s.state.clone()), sb.as_ref().map(|s| s.state.clone())],
                    "wchan": [sa.as_ref().map(|s| s.wchan.clone()), sb.as_ref().map(|s| s.wchan.clone())],
                    "syscall": sb.or(sa).map(|s| s.syscall),
                });
                match stack {
                    Ok(s) => t["kernel_stack"] = json!(frames(&s)),
                    Err(e) => t["kernel_stack_error"] = json!(e.to_string()),
                }
                t
            })
            .collect();
        let mut p = json!({
            "pid": pid,
            "comm": read_small(Path::new(&format!("/proc/{pid}/comm")), 64).map(|c| clean(&c, 16)).unwrap_or_default(),
            "threads_total": tb.len().max(ta.len()),
            "threads_capped": tb.len().max(ta.len()) >= THREADS_SCAN_MAX,
            "thread_states": states,
            "threads": threads,
        });
        if let Some((r, main)) = ranks_all[i] {
            p["rank"] = json!(r);
            p["rank_main"] = json!(main);
        }
        match (ioa, iob) {
            (Some(x), Some(y)) => {
                p["io"] = json!({ "read_bytes": [x.0, y.0], "write_bytes": [x.1, y.1] });
            }
            _ => p["io_error"] = json!("/proc/PID/io not readable"),
        }
        procs.push(p);
    }
    let mut out = json!({
        "samples": 2,
        "gap_ms": gap_ms,
        "processes": procs,
    });
    if all.len() > PROCESSES_MAX {
        out["processes_not_taken"] = json!(all.len() - PROCESSES_MAX);
    }
    match pyspy {
        Ok(tool) => {
            let mut py = Map::new();
            let rank_mains = out["processes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["rank_main"] == true)
                .filter_map(|p| p["pid"].as_u64())
                .take(PYSPY_PROCS)
                .map(|p| (p, starttime(p)))
                .collect::<Vec<_>>();
            for (pid, started) in rank_mains {
                // The rank may have been killed since the samples and its pid reused: root
                // never dumps another process's Python.
                let dump = if started.is_some() && starttime(pid) == started {
                    pyspy_dump(tool, pid)
                } else {
                    json!({ "error": "the process was gone before py-spy" })
                };
                py.insert(pid.to_string(), dump);
            }
            out["python"] = json!({ "tool": tool.display().to_string(), "dumps": py });
        }
        Err(why) => out["python"] = json!({ "unavailable": why }),
    }
    out["took_ms"] = json!(t0.elapsed().as_millis() as u64);
    out
}

/// `py-spy dump --pid P --nonblocking`, bounded in time and output.
fn pyspy_dump(tool: &Path, pid: u64) -> Value {
    let child = std::process::Command::new(tool)
        .args(["dump", "--pid", &pid.to_string(), "--nonblocking"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return json!({ "error": format!("{}: {e}", tool.display()) }),
    };
    let mut out = child.stdout.take();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(o) = out.as_mut() {
            let _ = o.take(PYSPY_OUT_MAX as u64).read_to_end(&mut buf);
        }
        buf
    });
    let t0 = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if t0.elapsed() >= PYSPY_TIMEOUT => {
                let _ = child.kill();
                // Reaped if it dies within a second; a py-spy stuck in the kernel is left.
                let t1 = Instant::now();
                while t1.elapsed() < Duration::from_secs(1) {
                    if child.try_wait().ok().flatten().is_some() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(_) => break None,
        }
    };
    // The reader ends with py-spy's stdout; one that is still open after the kill is left.
    let t2 = Instant::now();
    while !reader.is_finished() && t2.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let text = if reader.is_finished() {
        reader.join().unwrap_or_default()
    } else {
        Vec::new()
    };
    let text: Vec<String> = String::from_utf8_lossy(&text)
        .lines()
        .map(|l| crate::term::clean(l).chars().take(300).collect())
        .take(400)
        .collect();
    match status {
        Some(s) if s.success() => json!({ "lines": text }),
        Some(s) => json!({ "error": format!("py-spy exited with {s}"), "lines": text }),
        None => {
            json!({ "error": format!("py-spy did not answer in {} s: killed", PYSPY_TIMEOUT.as_secs()) })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_stacks_read_as_function_names() {
        let s = "[<0>] submit_bio_wait+0x74/0xc0\n[<0>] __blkdev_direct_IO_simple+0x1c4/0x2b0\n[<0>] blkdev_read_iter+0xe2/0x180\n";
        assert_eq!(
            frames(s),
            vec![
                "submit_bio_wait",
                "__blkdev_direct_IO_simple",
                "blkdev_read_iter"
            ]
        );
        assert_eq!(state_of("4121 (py) thon) D 1 2 3"), Some("D".into()));
    }

    /// This test's own process, sampled: its main thread is there with a state, and a
    /// process that is gone is left out, not an error.
    #[test]
    fn a_live_process_is_sampled_and_a_gone_one_left_out() {
        let me = std::process::id();
        let job: BTreeSet<u32> = [me, u32::MAX - 1].into_iter().collect();
        let v = snapshot_with(&job, Err(&"not configured".to_string()));
        let procs = v["processes"].as_array().unwrap();
        assert_eq!(procs.len(), 1, "{v:#}");
        assert_eq!(procs[0]["pid"], me);
        let main = &procs[0]["threads"][0];
        assert_eq!(main["tid"], me);
        assert!(main["state"][0].is_string(), "{main}");
        assert_eq!(v["python"]["unavailable"], "not configured");
    }

    #[test]
    fn a_tool_others_can_write_is_refused() {
        assert!(trusted_tool(Path::new("relative/py-spy")).is_err());
        let d = std::env::temp_dir().join(format!("nantrace-pyspy-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let f = d.join("py-spy");
        std::fs::write(&f, "#!/bin/sh\n").unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(trusted_tool(&f).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }
}
