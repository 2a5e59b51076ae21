//! The agent's configuration: a TOML file (every key optional; unknown keys are an error, so a
//! typo is not silently ignored), then command-line flags. Reloaded on SIGHUP.
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Where bundles are written (created 0700).
    pub spool_dir: PathBuf,
    /// The spool's size limit; the oldest bundles go first.
    pub spool_max_mb: u64,
    /// Bundles older than this are removed (0: kept until the size limit).
    pub spool_max_age_days: f64,
    /// The control socket (root only, 0600).
    pub socket: PathBuf,
    /// Prometheus `/metrics` address ("" = off). Loopback by default.
    pub metrics_addr: String,
    /// How often /proc is scanned for new jobs.
    pub scan_interval_ms: u64,
    /// Device paths whose open descriptor makes a process a training job (prefixes).
    pub gpu_devices: Vec<String>,
    /// Command lines (regular expressions) that make a process a training job, GPU or not.
    pub match_commands: Vec<String>,
    /// Slurm jobs to watch: "gpu" (those that use a GPU or match a pattern) or "all".
    pub slurm_jobs: String,
    /// Kubernetes container logs.
    pub pod_log_dir: PathBuf,
    /// The node's memory budget for recording (MiB): half for node-wide events, half shared by
    /// the jobs.
    pub mem_cap_mb: usize,
    pub window_s: f64,
    pub post_s: f64,
    /// The stall trigger (`nantrace run --hang-after`): no step or loss line for this long
    /// while the job runs; 0 = off.
    pub hang_after_s: f64,
    pub sample_s: f64,
    pub slow_io_ms: f64,
    /// Triggers that are off (`nan`, `exit`, `signal`, `oom`, `xid`, `job-error`, ...).
    pub no_trigger: Vec<String>,
    /// Extra NaN patterns (regular expressions).
    pub nan_patterns: Vec<String>,
    /// POST a JSON summary of each incident here (http:// only; "" = off).
    pub webhook_url: String,
    pub webhook_timeout_s: f64,
    pub webhook_retries: u32,
    /// After a NaN bundle without hardware evidence, check the job's GPUs for silent data
    /// corruption (`nantrace gpucheck`) once no watched job uses a GPU.
    pub gpucheck_after_nan: bool,
    /// At most this many jobs are watched at once (more are counted as not watched).
    pub max_jobs: usize,
    /// At most this many of them from one user (one user's hundred jobs do not hide another's).
    pub max_jobs_per_user: usize,
    /// The job directory on the cluster's shared filesystem ("" = off): an incident of a
    /// Slurm job on one node makes every node's agent dump it, under one incident id
    /// (`<job_dir>/<job>/<incident>/<host>/`; see `agent::jobdir`).
    pub job_dir: PathBuf,
    /// What a verdict that the node needs a reset, reboot or service does (`agent::drain`):
    /// "off", "recommend" (the scontrol command in the report and the webhook) or "slurm"
    /// (the agent drains this node through scontrol, with nantrace's reason).
    pub drain: String,
    /// At most this many drains per clock hour: across the cluster where `job_dir` is set
    /// (slots in `<job_dir>/.drains/`), else on this node. What the cap holds back is said.
    pub drain_max_per_hour: u32,
    /// Whether a kernel log line written into `/dev/kmsg` from user space (a facility other
    /// than the kernel's) may drain the node or count against a GPU in the incident history:
    /// false (the default) acts only on lines the kernel wrote itself and on NVML's and
    /// tracepoints' records; true is for test clusters that inject faults by writing
    /// `/dev/kmsg` as root, never where journald forwards users' text there.
    pub trust_user_written_kmsg: bool,
    /// This node's name in Slurm ("" = the short host name, as slurm.conf's NodeName usually is).
    pub slurm_node_name: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            spool_dir: PathBuf::from("/var/lib/nantrace/incidents"),
            spool_max_mb: 10_240,
            spool_max_age_days: 30.0,
            socket: PathBuf::from("/run/nantrace/agent.sock"),
            metrics_addr: "127.0.0.1:9464".into(),
            scan_interval_ms: 500,
            gpu_devices: vec!["/dev/nvidia".into()],
            match_commands: Vec::new(),
            slurm_jobs: "gpu".into(),
            pod_log_dir: PathBuf::from("/var/log/pods"),
            mem_cap_mb: 512,
            window_s: 600.0,
            post_s: 15.0,
            hang_after_s: 0.0,
            sample_s: 1.0,
            slow_io_ms: 50.0,
            no_trigger: Vec::new(),
            nan_patterns: Vec::new(),
            webhook_url: String::new(),
            webhook_timeout_s: 5.0,
            webhook_retries: 3,
            gpucheck_after_nan: true,
            max_jobs: 64,
            max_jobs_per_user: 16,
            job_dir: PathBuf::new(),
            drain: "off".into(),
            drain_max_per_hour: 1,
            trust_user_written_kmsg: false,
            slurm_node_name: String::new(),
        }
    }
}

impl Config {
    /// The file (when given; a missing default path is not an error) then checks.
    pub fn load(path: Option<&Path>) -> anyhow::Result<Self> {
        let c = match path {
            Some(p) if p.exists() => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading {}", p.display()))?;
                toml::from_str(&text).with_context(|| format!("{}", p.display()))?
            }
            Some(p) if p != Path::new(DEFAULT_PATH) => {
                anyhow::bail!("config file {} does not exist", p.display())
            }
            _ => Config::default(),
        };
        c.check()?;
        Ok(c)
    }

    pub fn check(&self) -> anyhow::Result<()> {
        self.check_patterns()?;
        self.check_gpu_devices()?;
        self.check_paths()?;
        for t in &self.no_trigger {
            anyhow::ensure!(
                crate::trigger::TriggerKind::parse(t).is_some(),
                "no_trigger: unknown trigger {t:?}"
            );
        }
        anyhow::ensure!(
            matches!(self.slurm_jobs.as_str(), "gpu" | "all"),
            "slurm_jobs must be \"gpu\" or \"all\", not {:?}",
            self.slurm_jobs
        );
        self.check_webhook()?;
        if !self.metrics_addr.is_empty() {
            self.metrics_addr
                .parse::<std::net::SocketAddr>()
                .with_context(|| format!("metrics_addr {:?}", self.metrics_addr))?;
        }
        self.check_numbers()?;
        anyhow::ensure!(
            matches!(self.drain.as_str(), "off" | "recommend" | "slurm"),
            "drain must be \"off\", \"recommend\" or \"slurm\", not {:?}",
            self.drain
        );
        anyhow::ensure!(
            (1..=1000).contains(&self.drain_max_per_hour),
            "drain_max_per_hour must be from 1 to 1000"
        );
        anyhow::ensure!(
            self.slurm_node_name.is_empty()
                || crate::agent::drain::valid_node_name(&self.slurm_node_name),
            "slurm_node_name {:?}: letters, digits, '-', '_' and '.' only",
            self.slurm_node_name
        );
        anyhow::ensure!(
            self.webhook_retries <= 10,
            "webhook_retries must be at most 10"
        );
        anyhow::ensure!(
            (1..=4096).contains(&self.max_jobs),
            "max_jobs must be from 1 to 4096"
        );
        anyhow::ensure!(
            (1..=4096).contains(&self.max_jobs_per_user),
            "max_jobs_per_user must be from 1 to 4096"
        );
        Ok(())
    }

    /// A pattern that matches an empty string matches every process or every line: pid 1 a
    /// job, every line a NaN (redteam3 D-9). `run --nan-pattern` refuses it too.
    fn check_patterns(&self) -> anyhow::Result<()> {
        for (key, list) in [
            ("match_commands", &self.match_commands),
            ("nan_patterns", &self.nan_patterns),
        ] {
            for p in list {
                let re = regex::Regex::new(p).with_context(|| format!("{key}: {p:?}"))?;
                // `.`, `.+`, `\S`: whatever matches these unrelated texts matches everything.
                anyhow::ensure!(!re.is_match("") && !["x", "/usr/sbin/sshd -D", "step 1 loss 0.5"].iter().all(|t| re.is_match(t)), "{key}: {p:?} matches an empty string or any text, so it matches everything: give a pattern that names something");
            }
        }
        Ok(())
    }

    /// A prefix of what every process holds (`/dev`, `/dev/n`, `/dev/pts`) makes every process
    /// a GPU job.
    fn check_gpu_devices(&self) -> anyhow::Result<()> {
        for d in &self.gpu_devices {
            let name = Path::new(d)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            // A prefix of what every process holds (`/dev`, `/dev/n`, `/dev/pts`) makes every process a GPU job.
            let common = [
                "/dev/null",
                "/dev/pts/0",
                "/dev/urandom",
                "/dev/zero",
                "/dev/tty",
                "/dev/shm/x",
            ]
            .iter()
            .any(|c| c.starts_with(d.as_str()));
            anyhow::ensure!(d.starts_with('/') && !d.ends_with('/') && !name.is_empty() && !d.contains("/../") && !common, "gpu_devices: {d:?} must be an absolute device path prefix that names devices (as /dev/nvidia), not a directory or a prefix of /dev/null: every process holds something under /dev");
        }
        Ok(())
    }

    /// The spool, socket, job and pod log directories: absolute, not a system directory.
    fn check_paths(&self) -> anyhow::Result<()> {
        check_dir("spool_dir", &self.spool_dir, true)?;
        check_dir("socket", &self.socket, true)?;
        check_dir("job_dir", &self.job_dir, false)?;
        check_dir("pod_log_dir", &self.pod_log_dir, false)?;
        anyhow::ensure!(
            !SYSTEM_DIRS.contains(&self.socket.parent().and_then(Path::to_str).unwrap_or("/"))
                || self.socket.parent() == Some(Path::new("/run")),
            "socket {}: put it in a directory of its own (as /run/nantrace/)",
            self.socket.display()
        );
        Ok(())
    }

    /// The webhook's URL goes into a request line: http only, no control characters, no
    /// credentials.
    fn check_webhook(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.webhook_url.is_empty() || self.webhook_url.starts_with("http://"), "webhook_url: only http:// is supported (put a local relay in front of an https endpoint)");
        // The URL goes into a request line: no space, CR, LF or other control character can
        // add a header or a second request (redteam3 D-9).
        anyhow::ensure!(!self.webhook_url.chars().any(|c| c.is_whitespace() || c.is_control()), "webhook_url {:?}: spaces and control characters (CR, LF) are not allowed in a URL; percent-encode them", self.webhook_url);
        anyhow::ensure!(
            self.webhook_url.is_empty()
                || self.webhook_url["http://".len()..]
                    .split(['/', '?', '#'])
                    .next()
                    .is_some_and(|h| !h.is_empty() && !h.contains('@')),
            "webhook_url {:?}: http://host[:port]/path expected (no user:password@)",
            self.webhook_url
        );
        Ok(())
    }

    /// Every number within what makes sense.
    fn check_numbers(&self) -> anyhow::Result<()> {
        let range = |name: &str, v: f64, lo: f64, hi: f64| -> anyhow::Result<()> {
            anyhow::ensure!(
                v.is_finite() && v >= lo && v <= hi,
                "{name} must be a number from {lo} to {hi}, not {v}"
            );
            Ok(())
        };
        range("window_s", self.window_s, 1.0, 86_400.0)?;
        range("post_s", self.post_s, 0.0, 3_600.0)?;
        range("hang_after_s", self.hang_after_s, 0.0, 86_400.0)?;
        anyhow::ensure!(
            self.hang_after_s == 0.0 || self.hang_after_s >= 1.0,
            "hang_after_s must be 0 (off) or at least 1 second, not {}",
            self.hang_after_s
        );
        range("sample_s", self.sample_s, 0.0, 3_600.0)?;
        range("slow_io_ms", self.slow_io_ms, 0.001, 600_000.0)?;
        range("spool_max_age_days", self.spool_max_age_days, 0.0, 36_500.0)?;
        range("webhook_timeout_s", self.webhook_timeout_s, 0.1, 600.0)?;
        anyhow::ensure!(
            (16..=1 << 20).contains(&self.mem_cap_mb),
            "mem_cap_mb must be from 16 to 1048576"
        );
        anyhow::ensure!(
            (1..=1 << 30).contains(&self.spool_max_mb),
            "spool_max_mb must be from 1 to 2^30"
        );
        anyhow::ensure!(
            (50..=60_000).contains(&self.scan_interval_ms),
            "scan_interval_ms must be from 50 to 60000"
        );
        Ok(())
    }

    pub fn session_opts(&self) -> crate::session::SessionOpts {
        crate::session::SessionOpts {
            out: self.spool_dir.clone(),
            window_s: self.window_s,
            mem_cap_mb: (self.mem_cap_mb / 2).max(8),
            post_s: self.post_s,
            no_trigger: self
                .no_trigger
                .iter()
                .filter_map(|t| crate::trigger::TriggerKind::parse(t))
                .collect(),
            trigger_file: None,
            nan_patterns: self.nan_patterns.clone(),
            grad_rule: crate::nanscan::GradRule::Auto,
            slow_io_ms: self.slow_io_ms,
            sample_s: self.sample_s,
            no_probes: false,
            injected: None,
            run_as: None,
            unbuffered: false,
            hang_after_s: self.hang_after_s,
            trust_user_written_kmsg: self.trust_user_written_kmsg,
        }
    }
}

pub const DEFAULT_PATH: &str = "/etc/nantrace/agent.toml";

/// Directories of the system that the spool (whose old bundles the agent removes) or the
/// socket's directory must never be.
const SYSTEM_DIRS: &[&str] = &[
    "/",
    "/etc",
    "/usr",
    "/usr/local",
    "/usr/lib",
    "/bin",
    "/sbin",
    "/lib",
    "/lib64",
    "/boot",
    "/dev",
    "/proc",
    "/sys",
    "/run",
    "/var",
    "/var/lib",
    "/var/log",
    "/var/tmp",
    "/var/spool",
    "/home",
    "/root",
    "/tmp",
    "/opt",
    "/srv",
    "/mnt",
    "/media",
];

/// A directory setting: absolute, no `.` or `..` on the way, never a system directory itself
/// nor under /proc, /sys or /dev (redteam3 D-9: `spool_dir = "/"` was only a warning).
fn check_dir(key: &str, p: &Path, required: bool) -> anyhow::Result<()> {
    use std::path::Component;
    if p.as_os_str().is_empty() {
        anyhow::ensure!(!required, "{key} must be set");
        return Ok(());
    }
    anyhow::ensure!(
        p.is_absolute(),
        "{key} {}: give an absolute path (the agent's working directory is not a place for it)",
        p.display()
    );
    anyhow::ensure!(
        p.components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_))),
        "{key} {}: no '.' or '..' in the path",
        p.display()
    );
    let s = p.to_str().unwrap_or("").trim_end_matches('/');
    let s = if s.is_empty() { "/" } else { s };
    anyhow::ensure!(
        key == "socket" || key == "pod_log_dir" || !SYSTEM_DIRS.contains(&s),
        "{key} {}: a system directory; give one of nantrace's own (as /var/lib/nantrace/incidents)",
        p.display()
    );
    anyhow::ensure!(
        !["/proc", "/sys", "/dev"].iter().any(|d| p.starts_with(d)),
        "{key} {}: not under /proc, /sys or /dev",
        p.display()
    );
    Ok(())
}

/// Command-line settings over the config file.
#[derive(Clone, Debug, Default)]
pub struct Args {
    pub config: Option<PathBuf>,
    pub spool_dir: Option<PathBuf>,
    pub socket: Option<PathBuf>,
    pub metrics_addr: Option<String>,
    pub match_commands: Vec<String>,
    pub gpu_devices: Vec<String>,
    pub slurm_jobs: Option<String>,
    pub post_s: Option<f64>,
    pub no_probes: bool,
    /// A `/proc`-shaped directory to discover jobs in (tests).
    pub proc_root: Option<PathBuf>,
    /// A `/sys/bus/pci/devices`-shaped directory: the node's PCI devices (tests).
    pub pci_devices: Option<PathBuf>,
}

impl Args {
    pub(super) fn config(&self) -> anyhow::Result<Config> {
        let mut c = Config::load(Some(
            self.config.as_deref().unwrap_or(Path::new(DEFAULT_PATH)),
        ))?;
        if let Some(v) = &self.spool_dir {
            c.spool_dir.clone_from(v);
        }
        if let Some(v) = &self.socket {
            c.socket.clone_from(v);
        }
        if let Some(v) = &self.metrics_addr {
            c.metrics_addr.clone_from(v);
        }
        if !self.match_commands.is_empty() {
            c.match_commands.clone_from(&self.match_commands);
        }
        if !self.gpu_devices.is_empty() {
            c.gpu_devices.clone_from(&self.gpu_devices);
        }
        if let Some(v) = &self.slurm_jobs {
            c.slurm_jobs.clone_from(v);
        }
        if let Some(v) = self.post_s {
            c.post_s = v;
        }
        c.check()?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::Config;

    #[test]
    fn every_key_is_optional_and_typos_are_errors() {
        let c: Config = toml::from_str("").unwrap();
        assert_eq!(c.metrics_addr, "127.0.0.1:9464");
        let c: Config =
            toml::from_str("spool_max_mb = 100\nmatch_commands = ['python .*train']\n").unwrap();
        assert_eq!(c.spool_max_mb, 100);
        c.check().unwrap();
        assert!(toml::from_str::<Config>("spool_max_bytes = 1").is_err());
        let bad: Config = toml::from_str("match_commands = ['(']").unwrap();
        assert!(bad.check().is_err());
        let bad: Config = toml::from_str("webhook_url = 'https://x'").unwrap();
        assert!(bad.check().unwrap_err().to_string().contains("http://"));
        let bad: Config = toml::from_str("no_trigger = ['nam']").unwrap();
        assert!(bad.check().is_err());
        // Numbers in range and finite (review 14).
        // Redteam3 D-9: what matches everything, system directories, relative paths, URLs
        // that would add a header.
        for bad in [
            "match_commands = ['']",
            "match_commands = ['.*']",
            "match_commands = ['.']",
            "nan_patterns = ['.+']",
            "gpu_devices = ['/dev']",
            "gpu_devices = ['/dev/n']",
            "gpu_devices = ['/dev/pts']",
            "nan_patterns = ['']",
            "nan_patterns = ['x?']",
            "gpu_devices = ['']",
            "gpu_devices = ['/dev/']",
            "gpu_devices = ['nvidia']",
            "spool_dir = '/'",
            "spool_dir = '/etc'",
            "spool_dir = '/var/lib/'",
            "spool_dir = 'spool'",
            "spool_dir = '/var/lib/nantrace/../../..'",
            "spool_dir = '/proc/self'",
            "socket = 'agent.sock'",
            "socket = '/tmp/agent.sock'",
            "job_dir = 'shared'",
            "webhook_url = \"http://h/x\\r\\nX-Evil: 1\"",
            "webhook_url = 'http://h/a b'",
            "webhook_url = 'http:///x'",
            "webhook_url = 'http://u:p@h/x'",
        ] {
            let c: Config = toml::from_str(bad).unwrap();
            assert!(c.check().is_err(), "{bad} accepted");
        }
        for good in [
            "spool_dir = '/var/lib/nantrace/incidents'",
            "gpu_devices = ['/dev/nvidia', '/tmp/x/nvidia']",
            "webhook_url = 'http://127.0.0.1:9000/hook?a=1'",
            "socket = '/run/agent.sock'",
            "nan_patterns = ['loss=nan']",
        ] {
            let c: Config = toml::from_str(good).unwrap();
            c.check().unwrap_or_else(|e| panic!("{good}: {e:#}"));
        }
        for bad in [
            "webhook_timeout_s = -1.0",
            "sample_s = nan",
            "window_s = nan",
            "post_s = -5.0",
            "spool_max_age_days = nan",
            "mem_cap_mb = 17592186044416",
            "max_jobs = 0",
        ] {
            let c: Config = toml::from_str(bad).unwrap();
            assert!(c.check().is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn the_shipped_config_parses() {
        let text = include_str!("../../../dist/agent.toml");
        let c: Config = toml::from_str(text).unwrap();
        c.check().unwrap();
    }
}

#[cfg(test)]
mod docs {
    #[test]
    fn every_key_is_in_docs_and_in_the_shipped_file() {
        let doc = include_str!("../../../docs/agent.md");
        let shipped = include_str!("../../../dist/agent.toml");
        let v = serde_json::to_value(super::Config::default()).unwrap();
        for k in v.as_object().unwrap().keys() {
            assert!(
                doc.contains(&format!("| `{k}` |")),
                "{k} is not in docs/agent.md's table"
            );
            assert!(
                shipped.lines().any(|l| l.starts_with(&format!("{k} ="))),
                "{k} is not in dist/agent.toml"
            );
        }
    }
}
