//! Finding training jobs in /proc without being told: processes that hold a GPU device open
//! (or match a configured command line), grouped into jobs by Slurm job id (environment or
//! cgroup), Kubernetes pod (cgroup), or process group otherwise.
//!
//! Everything reads from a `/proc`-shaped root so the tests can use recorded contents.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use regex::Regex;
use serde::Serialize;
use serde_json::{json, Value};

/// What the agent keeps of one process (never its environment: only the scheduler's ids).
#[derive(Clone, Debug, Default)]
pub struct Proc {
    pub pid: u32,
    pub ppid: u32,
    pub pgid: u32,
    pub uid: u32,
    pub starttime: u64,
    pub cmdline: String,
    /// The name in /proc/PID/stat: it changes at exec, the start time does not.
    pub comm: String,
    pub slurm: Option<SlurmRef>,
    pub pod: Option<PodRef>,
    /// The rank its launcher's variables give it (`agent::ranks`).
    pub rank: Option<super::ranks::RankRef>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SlurmRef {
    pub job_id: String,
    pub step_id: Option<String>,
    pub user: Option<String>,
    /// From Slurm's own cgroup path (not the process's environment, which its user controls).
    #[serde(skip)]
    pub from_cgroup: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PodRef {
    pub uid: String,
    pub container_id: Option<String>,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

/// Distributed launchers: their workers are one job.
static LAUNCHER: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?:^|/|\s)(?:torchrun|torch\.distributed\.(?:run|launch)|deepspeed|accelerate(?:\s+launch)?|mpirun|mpiexec|horovodrun|srun|composer|lightning)(?:\s|$)").unwrap()
});

/// Slurm's own cgroup locations only (`/slurm[_node]/uid_U/job_J/step_S` for cgroup v1,
/// `/system.slice/slurmstepd.scope/job_J/step_S` for v2): a path a user can create under
/// their own delegated subtree (`.../user@U.service/slurm/job_J`) does not count.
static SLURM_CG: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^/(?:slurm(?:_[^/]+)?/uid_\d+|system\.slice/slurmstepd\.scope)/job_(\d+)(?:/step_([A-Za-z0-9_]+))?").unwrap()
});

/// The Slurm job of a process: `SLURM_JOB_ID` in its environment (any proctrack), or the
/// cgroup path `.../slurm/uid_U/job_J/step_S` (proctrack/cgroup).
pub fn slurm_from(environ: &[u8], cgroup: &str) -> Option<SlurmRef> {
    let mut r = SlurmRef::default();
    for kv in environ.split(|&b| b == 0) {
        let Some(eq) = kv.iter().position(|&b| b == b'=') else {
            continue;
        };
        let (k, v) = (
            &kv[..eq],
            String::from_utf8_lossy(&kv[eq + 1..]).into_owned(),
        );
        match k {
            b"SLURM_JOB_ID" | b"SLURM_JOBID" if r.job_id.is_empty() => r.job_id = v,
            b"SLURM_STEP_ID" | b"SLURM_STEPID" => r.step_id = Some(v),
            b"SLURM_JOB_USER" => r.user = Some(v),
            // A prolog or epilog (and what it runs, e.g. `nantrace ctl`) is not the job.
            b"SLURM_SCRIPT_CONTEXT" => return None,
            _ => {}
        }
    }
    if r.job_id.is_empty() {
        for l in crate::collect::scheduler::parse_cgroup_file(cgroup) {
            if l.2.contains("slurm") {
                if let Some(c) = SLURM_CG.captures(&l.2) {
                    r.job_id = c[1].to_string();
                    r.step_id = c.get(2).map(|m| m.as_str().to_string());
                    r.from_cgroup = true;
                    break;
                }
            }
        }
    }
    (!r.job_id.is_empty() && r.job_id.bytes().all(|b| b.is_ascii_digit() || b == b'_')).then_some(r)
}

/// The Kubernetes pod of a process, from its cgroup; names from the downward-API variables
/// when the pod sets them.
pub fn pod_from(environ: &[u8], cgroup: &str) -> Option<PodRef> {
    let k = crate::collect::scheduler::parse_cgroup_file(cgroup)
        .iter()
        .find_map(|l| crate::collect::scheduler::kubernetes_from_cgroup(&l.2))?;
    let mut p = PodRef {
        uid: k["pod_uid"].as_str()?.to_string(),
        container_id: k["container_id"].as_str().map(str::to_string),
        ..PodRef::default()
    };
    for kv in environ.split(|&b| b == 0) {
        if let Some(v) = kv.strip_prefix(b"POD_NAMESPACE=") {
            p.namespace = Some(String::from_utf8_lossy(v).into_owned());
        } else if let Some(v) = kv.strip_prefix(b"POD_NAME=") {
            p.name = Some(String::from_utf8_lossy(v).into_owned());
        }
    }
    Some(p)
}

/// The most of a command line kept (and matched against `match_commands`).
pub const CMDLINE_MAX: usize = 4096;

/// ppid, pgid and start time from /proc/PID/stat. comm may hold spaces and parentheses: the
/// fields start after the last ')'.
fn stat_fields(stat: &str) -> Option<(u32, u32, u64)> {
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let f: Vec<&str> = rest.split(' ').collect();
    Some((
        f.get(1)?.parse().ok()?,
        f.get(2)?.parse().ok()?,
        f.get(19)?.parse().ok()?,
    ))
}

/// The process name in a stat line (between the first `(` and the last `)`).
fn stat_comm(stat: &str) -> &str {
    match (stat.find('('), stat.rfind(')')) {
        (Some(a), Some(b)) if b > a => &stat[a + 1..b],
        _ => "",
    }
}

/// One process from a `/proc`-shaped directory (None: gone, or a kernel thread).
/// Where a process's command line, environment and descriptors are read: `/proc/PID`, or,
/// when its main thread has exited and the process lives on in other threads (a zombie
/// leader: `/proc/PID/cmdline` reads empty), one of those threads' `/proc/PID/task/TID`
/// (redteam3 D-13: such a job was invisible).
pub fn proc_dir(root: &Path, pid: u32) -> PathBuf {
    let d = root.join(pid.to_string());
    let nonempty = |p: &Path| {
        std::fs::File::open(p.join("cmdline"))
            .is_ok_and(|mut f| std::io::Read::read(&mut f, &mut [0u8; 1]).is_ok_and(|n| n > 0))
    };
    if nonempty(&d) {
        return d;
    }
    let Ok(tasks) = std::fs::read_dir(d.join("task")) else {
        return d;
    };
    tasks
        .flatten()
        .take(64)
        .map(|t| t.path())
        .find(|t| t.file_name().is_some_and(|n| n != pid.to_string().as_str()) && nonempty(t))
        .unwrap_or(d)
}

pub fn read_proc(root: &Path, pid: u32) -> Option<Proc> {
    let stat = std::fs::read_to_string(root.join(pid.to_string()).join("stat")).ok()?;
    let d = proc_dir(root, pid);
    let (ppid, pgid, starttime) = stat_fields(&stat)?;
    let comm = stat_comm(&stat).to_string();
    // Bounded reads: a process may carry megabytes of arguments or environment (review 5).
    let read_max = |name: &str, max: u64| -> Vec<u8> {
        use std::io::Read as _;
        let mut v = Vec::new();
        if let Ok(f) = std::fs::File::open(d.join(name)) {
            let _ = f.take(max).read_to_end(&mut v);
        }
        v
    };
    let cmd = read_max("cmdline", CMDLINE_MAX as u64);
    if cmd.is_empty() {
        return None; // kernel thread or zombie
    }
    let status = std::fs::read_to_string(d.join("status")).unwrap_or_default();
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let environ = read_max("environ", 1 << 20);
    let cgroup = String::from_utf8_lossy(&read_max("cgroup", 64 << 10)).into_owned();
    let cmdline = String::from_utf8_lossy(&cmd)
        .split('\0')
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    let mut slurm = slurm_from(&environ, &cgroup);
    // A batch script (slurmstepd runs `<spool>/jobNNN/slurm_script`) has no SLURM_STEP_ID.
    if let Some(s) = slurm.as_mut().filter(|s| s.step_id.is_none()) {
        if cmdline.contains("/slurm_script") {
            s.step_id = Some("batch".into());
        }
    }
    Some(Proc {
        pid,
        ppid,
        pgid,
        uid,
        starttime,
        cmdline,
        comm,
        slurm,
        pod: pod_from(&environ, &cgroup),
        rank: super::ranks::from_environ(&environ),
    })
}

/// The device paths among a process's open descriptors that start with one of `prefixes`
/// (at most 4096 descriptors are looked at).
pub fn devices_held(root: &Path, pid: u32, prefixes: &[String]) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(proc_dir(root, pid).join("fd")) else {
        return Vec::new();
    };
    let mut out = BTreeSet::new();
    for e in rd.flatten().take(4096) {
        if let Ok(t) = std::fs::read_link(e.path()) {
            let t = t.to_string_lossy();
            if prefixes.iter().any(|p| t.starts_with(p.as_str())) {
                out.insert(t.into_owned());
            }
        }
    }
    out.into_iter().collect()
}

/// Xid's PCI address -> the GPU's minor number (`/dev/nvidiaN`), from the driver's procfs.
pub fn gpu_minor_of(pci: &str) -> Option<u32> {
    let base = Path::new("/proc/driver/nvidia/gpus");
    for name in [pci.to_string(), format!("{pci}.0")] {
        if let Ok(t) =
            std::fs::read_to_string(base.join(name.to_ascii_lowercase()).join("information"))
        {
            return t
                .lines()
                .find_map(|l| l.strip_prefix("Device Minor:"))
                .and_then(|v| v.trim().parse().ok());
        }
    }
    None
}

/// GPU minor numbers from device paths (`/dev/nvidia3` -> 3; `nvidiactl`, `nvidia-uvm`: none).
pub fn gpu_minors(devices: &[String]) -> BTreeSet<u32> {
    devices
        .iter()
        .filter_map(|d| d.rsplit('/').next()?.strip_prefix("nvidia")?.parse().ok())
        .collect()
}

/// A job as discovery sees it.
#[derive(Clone, Debug, Serialize)]
pub struct Found {
    /// `slurm-42`, `pod-<uid>`, `pid-1234`.
    pub key: String,
    pub root: u32,
    pub pids: BTreeSet<u32>,
    pub uid: u32,
    pub gpus: BTreeSet<u32>,
    pub devices: BTreeSet<String>,
    pub slurm: Option<SlurmRef>,
    pub pod: Option<PodRef>,
    pub command: String,
    /// Why it is a job: "gpu", "command", "slurm".
    pub reason: &'static str,
    /// Its ranks on this node, by process (at most `ranks::MAX_RANKS`).
    pub ranks: BTreeMap<u32, super::ranks::RankRef>,
}

impl Found {
    /// What every bundle of this job records about it.
    pub fn identity(&self) -> Value {
        let user = user_name(self.uid);
        let mut id = match (&self.slurm, &self.pod) {
            // The user from the job's uid, not from SLURM_JOB_USER (the process's own word).
            (Some(s), _) => {
                json!({ "kind": "slurm", "job_id": s.job_id, "step_id": s.step_id, "user": user.or_else(|| s.user.clone()), "uid": self.uid })
            }
            (None, Some(p)) => {
                json!({ "kind": "kubernetes", "pod_uid": p.uid, "namespace": p.namespace, "pod": p.name, "container_id": p.container_id, "uid": self.uid })
            }
            _ => json!({ "kind": "process", "root_pid": self.root, "user": user, "uid": self.uid }),
        };
        // Which ranks of a distributed job run here (the launcher's words, as the job set them).
        if let Some(d) = super::ranks::identity(&self.ranks) {
            id["distributed"] = d;
        }
        id
    }
}

fn user_name(uid: u32) -> Option<String> {
    let text = std::fs::read_to_string("/etc/passwd").ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.get(2)? == &uid.to_string().as_str()).then(|| f[0].to_string())
    })
}

struct Seen {
    proc: Proc,
    devices: Vec<String>,
    /// When the descriptors are looked at next (ns), and the current back-off.
    next_fd_check: u64,
    backoff_ns: u64,
}

/// Incremental /proc scanning: each new process is read once; its descriptors are looked at
/// again with a back-off (0.5 s doubling to 30 s), since CUDA opens the device seconds after
/// the process starts.
pub struct Discovery {
    pub root: PathBuf,
    seen: HashMap<u32, Seen>,
    pub devices: Vec<String>,
    pub patterns: Vec<Regex>,
    pub slurm_all: bool,
    /// Processes never reported as jobs (nantrace itself).
    pub ignore: BTreeSet<u32>,
    /// Slurm jobs a prolog announced: watched whatever their GPU use.
    pub slurm_wanted: BTreeSet<String>,
}

impl Discovery {
    pub fn new(root: PathBuf, cfg: &super::config::Config) -> Self {
        let mut d = Self {
            root,
            seen: HashMap::new(),
            devices: Vec::new(),
            patterns: Vec::new(),
            slurm_all: false,
            ignore: BTreeSet::from([std::process::id()]),
            slurm_wanted: BTreeSet::new(),
        };
        d.configure(cfg);
        d
    }

    pub fn configure(&mut self, cfg: &super::config::Config) {
        self.devices = cfg.gpu_devices.clone();
        self.patterns = cfg
            .match_commands
            .iter()
            .filter_map(|p| Regex::new(p).ok())
            .collect();
        self.slurm_all = cfg.slurm_jobs == "all";
    }

    pub fn processes(&self) -> usize {
        self.seen.len()
    }

    /// Look at /proc now; returns the jobs it holds.
    pub fn scan(&mut self, now_ns: u64) -> Vec<Found> {
        let mut alive = BTreeSet::new();
        // /proc unreadable (out of descriptors): keep what is known rather than forget every job.
        let Ok(rd) = std::fs::read_dir(&self.root) else {
            return self.group();
        };
        {
            for e in rd.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                    continue;
                };
                alive.insert(pid);
                let fresh = match self.seen.get(&pid) {
                    Some(s) => {
                        // A reused pid is a new process; an exec (the same start time, a new
                        // name: slurmd's fork becoming slurmstepd, `env` becoming the job) a
                        // new command line and environment.
                        let st =
                            std::fs::read_to_string(self.root.join(pid.to_string()).join("stat"))
                                .ok();
                        // slurmstepd sets its title (`slurmstepd: [J.S]`) after its exec.
                        let untitled = s.proc.comm == "slurmstepd"
                            && !s.proc.cmdline.starts_with("slurmstepd: [");
                        untitled
                            || st.as_deref().and_then(stat_fields).map(|f| f.2)
                                != Some(s.proc.starttime)
                            || st.as_deref().map(stat_comm) != Some(s.proc.comm.as_str())
                    }
                    None => true,
                };
                if fresh {
                    match read_proc(&self.root, pid) {
                        Some(p) => {
                            self.seen.insert(
                                pid,
                                Seen {
                                    proc: p,
                                    devices: Vec::new(),
                                    next_fd_check: 0,
                                    backoff_ns: 500_000_000,
                                },
                            );
                        }
                        None => {
                            self.seen.remove(&pid);
                        }
                    }
                }
            }
        }
        self.seen.retain(|pid, _| alive.contains(pid));
        // Descriptors: with the back-off, and only for processes that are not jobs' already.
        for (pid, s) in &mut self.seen {
            if now_ns >= s.next_fd_check && !self.devices.is_empty() {
                s.devices = devices_held(&self.root, *pid, &self.devices);
                s.next_fd_check = now_ns + s.backoff_ns;
                s.backoff_ns = (s.backoff_ns * 2).min(30_000_000_000);
            }
        }
        self.group()
    }

    fn reason(&self, s: &Seen) -> Option<&'static str> {
        if self.ignore.contains(&s.proc.pid) || self.ignore.contains(&s.proc.ppid) {
            return None;
        }
        // slurmstepd's own forks carry the job's environment for a moment before they become
        // the job (as root): the job is what they exec.
        if s.proc.cmdline.starts_with("slurmstepd") {
            return None;
        }
        if !s.devices.is_empty() {
            Some("gpu")
        } else if self.patterns.iter().any(|r| r.is_match(&s.proc.cmdline)) {
            Some("command")
        } else if self
            .slurm_of(&s.proc)
            .is_some_and(|sl| self.slurm_all || self.slurm_wanted.contains(&sl.job_id))
        {
            Some("slurm")
        } else {
            None
        }
    }

    /// Walk up from `pid` while the parent belongs to the same job.
    fn top(&self, pid: u32, same: impl Fn(&Proc, &Proc) -> bool) -> u32 {
        let mut cur = pid;
        for _ in 0..64 {
            let Some(me) = self.seen.get(&cur) else { break };
            match self.seen.get(&me.proc.ppid) {
                Some(parent) if parent.proc.pid > 1 && same(&me.proc, &parent.proc) => {
                    cur = parent.proc.pid
                }
                _ => break,
            }
        }
        cur
    }

    /// The process's Slurm job, when Slurm vouches for it: a job cgroup, or a `slurmstepd:
    /// [<job>.<step>]` ancestor for the same job. `SLURM_JOB_ID` alone is the process's own
    /// word: any user can set it to join (and blame) another user's job (review 2).
    fn slurm_of<'a>(&self, p: &'a Proc) -> Option<&'a SlurmRef> {
        let s = p.slurm.as_ref()?;
        if s.from_cgroup {
            return Some(s);
        }
        let mut cur = p.ppid;
        for _ in 0..64 {
            let a = self.seen.get(&cur)?;
            // slurmstepd runs as root: a user's process renamed to look like it is not Slurm.
            if let Some(rest) = a.proc.cmdline.strip_prefix("slurmstepd: [") {
                let job = rest.split(['.', ']']).next().unwrap_or("");
                return (a.proc.uid == 0 && job == s.job_id).then_some(s);
            }
            cur = a.proc.ppid;
        }
        None
    }

    fn group(&self) -> Vec<Found> {
        let mut jobs: BTreeMap<String, Found> = BTreeMap::new();
        for s in self.seen.values() {
            let Some(reason) = self.reason(s) else {
                continue;
            };
            let p = &s.proc;
            let (key, root) = if let Some(sl) = self.slurm_of(p) {
                (
                    format!("slurm-{}", sl.job_id),
                    self.top(p.pid, |a, b| {
                        b.slurm.as_ref().is_some_and(|x| {
                            x.job_id == a.slurm.as_ref().map_or("", |y| y.job_id.as_str())
                        })
                    }),
                )
            } else if let Some(pod) = &p.pod {
                (
                    format!("pod-{}", pod.uid),
                    self.top(p.pid, |a, b| {
                        b.pod.as_ref().map(|x| &x.uid) == a.pod.as_ref().map(|y| &y.uid)
                    }),
                )
            } else {
                // Up through parents that are jobs' processes themselves, then one more step
                // to a distributed launcher (torchrun's workers hold the GPUs, not torchrun).
                let mut r = self.top(p.pid, |a, b| {
                    a.uid == b.uid
                        && self
                            .seen
                            .get(&b.pid)
                            .is_some_and(|s| self.reason(s).is_some())
                });
                if let Some(parent) = self
                    .seen
                    .get(&r)
                    .and_then(|me| self.seen.get(&me.proc.ppid))
                {
                    if parent.proc.pid > 1
                        && parent.proc.uid == p.uid
                        && LAUNCHER.is_match(&parent.proc.cmdline)
                    {
                        r = parent.proc.pid;
                    }
                }
                (format!("pid-{r}"), r)
            };
            let j = jobs.entry(key.clone()).or_insert_with(|| Found {
                key,
                root,
                pids: BTreeSet::new(),
                uid: p.uid,
                gpus: BTreeSet::new(),
                devices: BTreeSet::new(),
                slurm: self.slurm_of(p).cloned(),
                pod: p.pod.clone(),
                command: String::new(),
                reason,
                ranks: BTreeMap::new(),
            });
            if let Some(r) = p
                .rank
                .as_ref()
                .filter(|_| j.ranks.len() < super::ranks::MAX_RANKS)
            {
                let mut r = r.clone();
                r.gpus = gpu_minors(&s.devices).into_iter().collect();
                j.ranks.insert(p.pid, r);
            }
            j.pids.insert(root);
            j.pids.insert(p.pid);
            j.gpus.extend(gpu_minors(&s.devices));
            j.devices.extend(s.devices.iter().cloned());
            // The job's root: the oldest process found (a Slurm batch script before its steps).
            let older = |a: u32, b: u32| {
                self.seen.get(&a).map(|s| s.proc.starttime)
                    < self.seen.get(&b).map(|s| s.proc.starttime)
            };
            if root != j.root && older(root, j.root) {
                j.root = root;
            }
        }
        for j in jobs.values_mut() {
            if let Some(s) = self.seen.get(&j.root) {
                j.command = s.proc.cmdline.clone();
                j.uid = s.proc.uid;
                if j.slurm.as_ref().is_some_and(|x| x.step_id.is_none()) {
                    j.slurm = self.slurm_of(&s.proc).cloned();
                }
            }
        }
        jobs.into_values().collect()
    }
}

#[cfg(test)]
#[path = "discover_tests.rs"]
mod tests;
