//! A job's log files, found without being told: Slurm's StdOut/StdErr (`scontrol show job`),
//! a pod's container logs under the kubelet's directory, else the job's own stdout/stderr
//! when they are regular files.
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::discover::Found;
use crate::session::LogFormat;

/// A job's log files: Slurm's StdOut/StdErr, a pod's container logs, else the root's stdout
/// and stderr when they are regular files.
pub(super) async fn find_logs(
    f: &Found,
    pod_dir: &Path,
    proc_root: &Path,
    host: &str,
) -> Vec<(PathBuf, LogFormat)> {
    if let Some(s) = &f.slurm {
        let out = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::process::Command::new("scontrol")
                .args(["show", "job", "-o", &s.job_id])
                .output(),
        )
        .await;
        if let Ok(Ok(o)) = out {
            let logs = slurm_logs(&String::from_utf8_lossy(&o.stdout), host);
            if !logs.is_empty() {
                return logs.into_iter().map(|p| (p, LogFormat::Plain)).collect();
            }
        }
    }
    if let Some(p) = &f.pod {
        let (logs, _) = pod_logs(pod_dir, &p.uid);
        if !logs.is_empty() {
            return logs.into_iter().map(|p| (p, LogFormat::Cri)).collect();
        }
    }
    let mut v: Vec<(PathBuf, LogFormat)> = Vec::new();
    for pid in std::iter::once(f.root)
        .chain(f.pids.iter().copied())
        .take(16)
    {
        for p in fd_logs(proc_root, pid) {
            if !v.iter().any(|x| x.0 == p) {
                v.push((p, LogFormat::Plain));
            }
        }
    }
    v
}

/// The job's log files from Slurm: `scontrol show job -o` gives StdOut/StdErr (with the
/// filename patterns Slurm may leave unexpanded: %j %u %x %A %a %N %%).
pub fn slurm_logs(scontrol_line: &str, host: &str) -> Vec<PathBuf> {
    let field = |k: &str| {
        scontrol_line
            .split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .map(str::to_string)
    };
    let job = field("JobId=").unwrap_or_default();
    let user = field("UserId=")
        .map(|u| u.split('(').next().unwrap_or("").to_string())
        .unwrap_or_default();
    let name = field("JobName=").unwrap_or_default();
    let array_job = field("ArrayJobId=").unwrap_or_else(|| job.clone());
    let array_task = field("ArrayTaskId=").unwrap_or_default();
    let expand = |p: String| {
        let mut out = String::new();
        let mut it = p.chars().peekable();
        while let Some(c) = it.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            // An optional zero-padding width (`%4j`) is read and ignored.
            while it.peek().is_some_and(char::is_ascii_digit) {
                it.next();
            }
            match it.next() {
                Some('j') => out.push_str(&job),
                Some('u') => out.push_str(&user),
                Some('x') => out.push_str(&name),
                Some('A') => out.push_str(&array_job),
                Some('a') => out.push_str(&array_task),
                Some('N') => out.push_str(host),
                Some('%') => out.push('%'),
                Some(o) => {
                    out.push('%');
                    out.push(o);
                }
                None => out.push('%'),
            }
        }
        PathBuf::from(out)
    };
    let mut v: Vec<PathBuf> = Vec::new();
    for k in ["StdOut=", "StdErr="] {
        if let Some(p) = field(k).filter(|p| p.starts_with('/')).map(expand) {
            if !v.contains(&p) {
                v.push(p);
            }
        }
    }
    v
}

/// A pod's container logs under the kubelet's directory (`<ns>_<pod>_<uid>/<container>/N.log`):
/// the newest file per container. Also returns the namespace and pod name from the directory.
pub fn pod_logs(dir: &Path, pod_uid: &str) -> (Vec<PathBuf>, Option<(String, String)>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return (Vec::new(), None);
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.ends_with(&format!("_{pod_uid}")) {
            continue;
        }
        let mut parts = name.splitn(3, '_');
        let ns_pod = match (parts.next(), parts.next()) {
            (Some(ns), Some(pod)) => Some((ns.to_string(), pod.to_string())),
            _ => None,
        };
        let mut logs = Vec::new();
        for c in std::fs::read_dir(e.path()).into_iter().flatten().flatten() {
            // Not through a link: the kubelet writes real directories here.
            if !c.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let newest = std::fs::read_dir(c.path())
                .into_iter()
                .flatten()
                .flatten()
                .filter(|f| {
                    f.file_name().to_string_lossy().ends_with(".log")
                        && f.file_type().is_ok_and(|t| t.is_file())
                })
                .max_by_key(|f| f.metadata().and_then(|m| m.modified()).ok());
            logs.extend(newest.map(|f| f.path()));
        }
        logs.sort();
        return (logs, ns_pod);
    }
    (Vec::new(), None)
}

/// stdout/stderr of a process when they are regular files (not a pipe, a terminal, a socket).
/// The path is the job's own view: for a process in another mount namespace than the agent's
/// (a rootless container, `unshare -m`, enroot or apptainer with private mounts), the same
/// path on the host can be another file or none (D-5 of the third adversarial test), so it is
/// read through the process's root, `/proc/PID/root/<path>`, which resolves in the job's
/// namespace. The follower's checks (a regular file of the job's user, no link at the end)
/// apply to that path as to any other.
pub fn fd_logs(root: &Path, pid: u32) -> Vec<PathBuf> {
    let proc = super::discover::proc_dir(root, pid);
    let own_ns = match (
        std::fs::read_link(proc.join("ns/mnt")),
        std::fs::read_link(root.join("self/ns/mnt")),
    ) {
        (Ok(job), Ok(me)) => job == me,
        // Unknown (a test's /proc, a process gone): the host's view.
        _ => true,
    };
    let mut v: Vec<PathBuf> = Vec::new();
    for fd in [1, 2] {
        let Ok(t) = std::fs::read_link(proc.join("fd").join(fd.to_string())) else {
            continue;
        };
        if !t.is_absolute() || t.to_string_lossy().ends_with(" (deleted)") {
            continue;
        }
        let p = if own_ns {
            t
        } else {
            proc.join("root").join(t.strip_prefix("/").unwrap_or(&t))
        };
        if std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_file()) && !v.contains(&p) {
            v.push(p);
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_log_paths_are_expanded() {
        let line = "JobId=31 JobName=train UserId=alice(1000) GroupId=alice(1000) JobState=RUNNING StdErr=/home/alice/%x-%j.err StdIn=/dev/null StdOut=/home/alice/slurm-%j.out WorkDir=/home/alice";
        assert_eq!(
            slurm_logs(line, "n1"),
            vec![
                PathBuf::from("/home/alice/slurm-31.out"),
                PathBuf::from("/home/alice/train-31.err")
            ]
        );
        let line = "JobId=32 StdErr=/w/slurm-32.out StdOut=/w/slurm-32.out";
        assert_eq!(
            slurm_logs(line, "n1"),
            vec![PathBuf::from("/w/slurm-32.out")]
        );
        assert!(slurm_logs("JobId=33 StdOut=relative.out", "n1").is_empty());
    }

    #[test]
    fn pod_logs_are_found_by_uid() {
        let dir = std::env::temp_dir().join(format!("nantrace-podlogs-{}", std::process::id()));
        let c = dir.join("ml_trainer-0_1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718/trainer");
        std::fs::create_dir_all(&c).unwrap();
        std::fs::write(c.join("0.log"), "x").unwrap();
        let (logs, names) = pod_logs(&dir, "1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718");
        assert_eq!(logs, vec![c.join("0.log")]);
        assert_eq!(names, Some(("ml".into(), "trainer-0".into())));
        assert!(pod_logs(&dir, "00000000-0000-0000-0000-000000000000")
            .0
            .is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
