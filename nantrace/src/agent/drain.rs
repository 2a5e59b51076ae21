//! Acting on a verdict through the scheduler (`drain` in agent.toml, off by default): when an
//! incident's verdict says this node or one of its GPUs needs a reset, a reboot or service,
//! the agent drains the node in Slurm with nantrace's reason (`drain = "slurm"`), or writes the
//! command into the report and the webhook for a person (`drain = "recommend"`).
//!
//! Only evidence a user cannot forge drains: PROBABLY THE MACHINE from the kernel's or NVML's
//! own records, checked before the drain (`trust::check_writer`: a kernel log line must be one the
//! kernel wrote, at a record's start, as `/dev/kmsg` says) (a fatal Xid, an uncorrected ECC error or remap failure, a fatal AER error, an
//! uncorrected machine check, a gpucheck mismatch), never POSSIBLY, UNDECIDED, NOT THE MACHINE
//! or the job's own words. A node already DRAIN or DOWN is left alone, one incident drains at
//! most once (a person's `scontrol update state=resume` stands), and at most
//! `drain_max_per_hour` drains happen per clock hour: across the cluster through slots in
//! `<job_dir>/.drains/` (the agents' own directory), else on this node (`<spool>/.drains/`).
//! What the cap holds back is said, with the command to run by hand.
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::safefs;
use crate::session::Dumped;

/// Signals whose evidence is the kernel's or NVML's and which mean the GPU or the node needs
/// a reset, a reboot or service before the next job.
const SERVICE_SIGNALS: &[&str] = &[
    "gpu_fallen_off_bus",
    "xid_critical",
    "ecc_uncorrected",
    "gpu_remap_failure",
    "gpu_remap_pending",
    "gpucheck_mismatch",
    "aer_fatal",
    "machine_check",
];

/// How long scontrol may take before it is killed (a slurmctld that does not answer).
const SCONTROL_TIMEOUT: Duration = Duration::from_secs(15);

/// Slots older than this are removed from the ledger (the record of which incidents drained).
const LEDGER_KEEP_HOURS: i64 = 24 * 30;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Recommend,
    Slurm,
}

/// Whether `name` can be a Slurm node name passed to scontrol: no spaces, quotes, `=` or
/// shell characters (it is an argument, never a shell word, but Slurm parses it too).
pub fn valid_node_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Text for Slurm's reason field: the characters of nantrace's own words and of kernel
/// evidence (PCI addresses, Xid names), nothing that Slurm or a shell would read otherwise.
fn reason_text(s: &str, max: usize) -> String {
    let mut out = String::new();
    for c in s.chars() {
        let c = if c.is_ascii_alphanumeric() || " .:_/()+-,#".contains(c) {
            c
        } else {
            ' '
        };
        if !(c == ' ' && out.ends_with(' ')) {
            out.push(c);
        }
        if out.len() >= max {
            break;
        }
    }
    out.trim().to_string()
}

/// The reason to drain for, or why not. `incident` names the bundle.
pub fn decide(d: &Dumped, incident: &str) -> Result<String, String> {
    let verdict = d.verdict.as_deref().unwrap_or("");
    let family = d.family.as_deref().unwrap_or("");
    if !verdict.starts_with("PROBABLY THE MACHINE") {
        let head = verdict.split(':').next().unwrap_or("no verdict");
        return Err(format!("the verdict is {head}, not PROBABLY THE MACHINE"));
    }
    let signal = d.top_signal.unwrap_or("");
    if family.ends_with(crate::report::rules::JOB_WORDS_SUFFIX)
        || crate::report::rules::is_job_words(signal)
    {
        return Err("the evidence is the job's own words".into());
    }
    if !SERVICE_SIGNALS.contains(&signal) {
        return Err(format!(
            "the top suspect ({signal}) does not need a reset, a reboot or service"
        ));
    }
    if signal == "xid_critical"
        && d.top_action.is_some_and(|a| {
            a == crate::classify::action_text("restart_app")
                || a == crate::classify::action_text("none")
        })
    {
        return Err("NVIDIA's catalog asks only to restart the application".into());
    }
    let evidence = d.top_suspect.as_deref().unwrap_or("");
    let evidence = evidence.split(", ").next().unwrap_or(evidence);
    Ok(reason_text(
        &format!(
            "nantrace: {family} {} {incident}",
            reason_text(evidence, 100)
        ),
        200,
    ))
}

/// The record of drains: one file per slot `<hour>-<k>` (k < the cap), made with O_EXCL so
/// that two agents racing for the last slot of an hour cannot both have it.
pub struct Ledger {
    dir: PathBuf,
    /// "the cluster" (the job directory) or "this node" (the spool).
    scope: &'static str,
}

impl Ledger {
    /// `<parent>/.drains/`, made (0700) when missing; it must be a directory of this uid that
    /// nobody else can write.
    pub fn open(parent: &Path, scope: &'static str) -> std::io::Result<Ledger> {
        use std::os::unix::fs::MetadataExt as _;
        let dir = parent.join(".drains");
        match safefs::Dir::open(parent)?.create_subdir(".drains") {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let m = std::fs::symlink_metadata(&dir)?;
        // SAFETY: no arguments, no failure mode.
        let me = unsafe { libc::geteuid() };
        if !m.file_type().is_dir() || m.uid() != me || m.mode() & 0o022 != 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!("{} is not this agent's alone", dir.display()),
            ));
        }
        Ok(Ledger { dir, scope })
    }

    fn slots(&self) -> Vec<(String, String)> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        rd.flatten()
            .take(10_000)
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let mut text = String::new();
                std::fs::File::open(e.path())
                    .ok()?
                    .take(4096)
                    .read_to_string(&mut text)
                    .ok()?;
                Some((name, text))
            })
            .collect()
    }

    /// Whether `incident` drained a node before.
    fn drained(&self, incident: &str) -> bool {
        self.slots()
            .iter()
            .any(|(_, t)| serde_json::from_str::<Value>(t).is_ok_and(|v| v["incident"] == incident))
    }

    /// A slot of `hour` for this drain, or None when the cap's are all taken.
    fn claim(&self, hour: i64, cap: u32, record: &Value) -> std::io::Result<Option<String>> {
        let dir = safefs::Dir::open(&self.dir)?;
        for k in 0..cap {
            let name = format!("{hour}-{k}");
            match dir.write_new(&name, record.to_string().as_bytes()) {
                Ok(()) => return Ok(Some(name)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    fn release(&self, slot: &str) {
        if let Ok(d) = safefs::Dir::open(&self.dir) {
            let _ = d.remove(slot);
        }
    }

    fn prune(&self, hour: i64) {
        let Ok(d) = safefs::Dir::open(&self.dir) else {
            return;
        };
        for (name, _) in self.slots() {
            // Only a slot's own name (`<hour>-<k>`, digits): nothing else here is ours to remove.
            let Some((h, k)) = name.split_once('-') else {
                continue;
            };
            if k.is_empty() || !k.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            if h.parse::<i64>().is_ok_and(|h| h < hour - LEDGER_KEEP_HOURS) {
                let _ = d.remove(&name);
            }
        }
    }
}

/// What was done about one incident: `action` is one of drained, recommended, held_by_cap,
/// already_drained, not_needed, failed (the `result` label of `nantrace_drains_total`).
#[derive(Debug, Clone)]
pub struct Outcome {
    pub action: &'static str,
    pub command: Option<String>,
    pub text: String,
}

impl Outcome {
    pub fn json(&self) -> Value {
        json!({ "action": self.action, "command": self.command, "text": self.text })
    }
}

pub struct Drainer {
    pub mode: Mode,
    pub node: String,
    pub cap: u32,
    pub ledger: Option<Ledger>,
    /// The scontrol to run ("scontrol" from PATH).
    pub scontrol: PathBuf,
    /// `trust_user_written_kmsg`.
    pub user_written_kmsg: bool,
}

/// Run scontrol with a deadline; (success, stdout + stderr).
fn scontrol(bin: &Path, args: &[&str]) -> (bool, String) {
    let child = Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return (false, format!("{}: {e}", bin.display())),
    };
    let t0 = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(st)) => {
                let mut out = String::new();
                if let Some(mut o) = child.stdout.take() {
                    let _ = o.by_ref().take(64 << 10).read_to_string(&mut out);
                }
                if let Some(mut e) = child.stderr.take() {
                    let _ = e.by_ref().take(64 << 10).read_to_string(&mut out);
                }
                return (st.success(), out.trim().to_string());
            }
            Ok(None) if t0.elapsed() < SCONTROL_TIMEOUT => {
                std::thread::sleep(Duration::from_millis(50))
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return (
                    false,
                    format!(
                        "scontrol did not answer within {} s",
                        SCONTROL_TIMEOUT.as_secs()
                    ),
                );
            }
        }
    }
}

impl Drainer {
    pub fn command(&self, reason: &str) -> String {
        format!(
            "scontrol update NodeName={} State=DRAIN Reason=\"{reason}\"",
            self.node
        )
    }

    /// The node's Slurm state (`IDLE`, `MIXED+DRAIN`, `DOWN*`, ...).
    fn state(&self) -> Result<String, String> {
        let (ok, out) = scontrol(&self.scontrol, &["show", "node", &self.node, "-o"]);
        if !ok {
            return Err(out);
        }
        out.split_whitespace()
            .find_map(|w| w.strip_prefix("State="))
            .map(str::to_string)
            .ok_or_else(|| format!("no State= in scontrol's answer: {out}"))
    }

    /// Act on one incident's decision (blocking: scontrol runs here).
    pub fn act(&self, ask: Result<String, String>, incident: &str, now_s: i64) -> Outcome {
        let reason = match ask {
            Ok(r) => r,
            Err(why) => {
                return Outcome {
                    action: "not_needed",
                    command: None,
                    text: format!("no drain: {why}"),
                }
            }
        };
        let command = self.command(&reason);
        if self.mode == Mode::Recommend {
            return Outcome {
                action: "recommended",
                text: format!(
                    "drain recommended (drain = \"recommend\"); to drain, run: {command}"
                ),
                command: Some(command),
            };
        }
        let Some(ledger) = &self.ledger else {
            return Outcome { action: "failed", text: format!("not drained: no ledger to cap drains with (see the agent's start); run by hand if right: {command}"), command: Some(command) };
        };
        let hour = now_s.div_euclid(3600);
        ledger.prune(hour);
        if ledger.drained(incident) {
            return Outcome { action: "already_drained", text: format!("not drained again: incident {incident} drained {} before (a person's resume stands)", self.node), command: Some(command) };
        }
        match self.state() {
            Ok(st) if ["DRAIN", "DOWN", "FAIL"].iter().any(|s| st.contains(s)) => {
                return Outcome { action: "already_drained", text: format!("not drained: {} is already {st} in Slurm", self.node), command: Some(command) };
            }
            Ok(_) => {}
            Err(e) => return Outcome { action: "failed", text: format!("not drained: the node's state in Slurm is unknown ({e}); run by hand if right: {command}"), command: Some(command) },
        }
        let record =
            json!({ "node": self.node, "incident": incident, "time_s": now_s, "reason": reason });
        let slot = match ledger.claim(hour, self.cap, &record) {
            Ok(Some(s)) => s,
            Ok(None) => {
                return Outcome {
                    action: "held_by_cap",
                    text: format!("drain held back: {} drain(s) this hour already on {} (drain_max_per_hour); run by hand if right: {command}", self.cap, ledger.scope),
                    command: Some(command),
                }
            }
            Err(e) => return Outcome { action: "failed", text: format!("not drained: the drain ledger {}: {e}; run by hand if right: {command}", ledger.dir.display()), command: Some(command) },
        };
        let arg_node = format!("NodeName={}", self.node);
        let arg_reason = format!("Reason={reason}");
        let (ok, out) = scontrol(
            &self.scontrol,
            &["update", &arg_node, "State=DRAIN", &arg_reason],
        );
        if ok {
            Outcome {
                action: "drained",
                text: format!("drained {} in Slurm: {command}", self.node),
                command: Some(command),
            }
        } else {
            ledger.release(&slot);
            Outcome {
                action: "failed",
                text: format!("drain failed: {out}; run by hand if right: {command}"),
                command: Some(command),
            }
        }
    }
}

/// The drain section appended to the bundle's report.md (its own file, in the spool, written
/// as the agent writes bundles: no link followed).
pub fn append_to_report(bundle: &Path, o: &Outcome) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(bundle.join("report.md"))?;
    writeln!(
        f,
        "\n## Drain\n\n{}: {}",
        o.action,
        crate::report::md(&o.text)
    )
}

#[cfg(test)]
mod tests;

/// The drainer the configuration asks for (None with `drain = "off"`). The ledger is the
/// cluster's in the job directory when the agent uses one, else this node's in the spool; a
/// ledger that cannot be opened is said, and every drain then fails with that message
/// (nothing drains without a cap).
pub fn start(
    cfg: &super::Config,
    host: &str,
    job_dir_in_use: bool,
) -> Option<std::sync::Arc<Drainer>> {
    let mode = match cfg.drain.as_str() {
        "recommend" => Mode::Recommend,
        "slurm" => Mode::Slurm,
        _ => return None,
    };
    let node = if cfg.slurm_node_name.is_empty() {
        host.split('.').next().unwrap_or(host).to_string()
    } else {
        cfg.slurm_node_name.clone()
    };
    if !valid_node_name(&node) {
        crate::say!("nantrace: drain: the host name {node:?} is not a Slurm node name; set slurm_node_name: drains are off");
        return None;
    }
    let ledger = match mode {
        Mode::Recommend => None,
        Mode::Slurm => {
            let (parent, scope) = if job_dir_in_use {
                (cfg.job_dir.as_path(), "the cluster")
            } else {
                (cfg.spool_dir.as_path(), "this node")
            };
            match Ledger::open(parent, scope) {
                Ok(l) => Some(l),
                Err(e) => {
                    crate::say!("nantrace: drain: WARNING: the drain ledger under {}: {e}: no drain will run (each is said)", parent.display());
                    None
                }
            }
        }
    };
    crate::say!(
        "nantrace: drain = {:?} for Slurm node {node}, at most {} per hour on {}",
        cfg.drain,
        cfg.drain_max_per_hour,
        ledger.as_ref().map_or("-", |l| l.scope)
    );
    Some(std::sync::Arc::new(Drainer {
        mode,
        node,
        cap: cfg.drain_max_per_hour,
        ledger,
        scontrol: PathBuf::from("scontrol"),
        user_written_kmsg: cfg.trust_user_written_kmsg,
    }))
}

/// After a bundle: decide, act on a thread of its own (scontrol may be slow), say it, count
/// it, append it to the bundle's report.md, and hand the incident's record, with its `drain`,
/// to `publish` (the agent's incident list and webhook).
pub fn after_dump(
    drainer: &std::sync::Arc<Drainer>,
    d: &Dumped,
    metrics: std::sync::Arc<super::Metrics>,
    label: String,
    mut rec: Value,
    publish: Box<dyn FnOnce(Value) + Send>,
) {
    let Some(dir) = d.dir.clone() else {
        publish(rec);
        return;
    };
    let incident = dir
        .file_name()
        .map_or_else(|| "?".to_string(), |n| n.to_string_lossy().into_owned());
    let ask = decide(d, &incident);
    let dr = drainer.clone();
    let (lines, unforgeable) = (d.top_kernel_lines.clone(), d.top_unforgeable);
    let spawned = std::thread::Builder::new()
        .name("nantrace-drain".into())
        .spawn(move || {
            // Read /dev/kmsg here, off the agent's loop, and only for a drain it would do.
            // A verdict that would drain on a record nobody can vouch for is said as such
            // (`unverified`, on stderr too), with the command for a person who knows better.
            let checked = ask.as_ref().ok().map(|_| {
                super::trust::check_writer(
                    &lines,
                    unforgeable,
                    dr.user_written_kmsg,
                    crate::klog::who_wrote,
                )
            });
            let now_s = (crate::clock::realtime_ns() / 1_000_000_000) as i64;
            let o = match (ask, checked) {
                (Ok(reason), Some(Err(why))) => {
                    let command = dr.command(&reason);
                    Outcome {
                        action: "unverified",
                        text: format!(
                            "no drain: {why}; if the fault is real, run by hand: {command}"
                        ),
                        command: Some(command),
                    }
                }
                (ask, _) => dr.act(ask, &incident, now_s),
            };
            metrics.inc("nantrace_drains_total", &[("result", o.action)]);
            if o.action != "not_needed" {
                crate::say!("nantrace: {label}{}", crate::term::clean(&o.text));
            }
            if let Err(e) = append_to_report(&dir, &o) {
                crate::say!(
                    "nantrace: {label}the drain's outcome not added to {}/report.md: {e}",
                    dir.display()
                );
            }
            rec["drain"] = o.json();
            publish(rec);
        });
    if let Err(e) = spawned {
        crate::say!("nantrace: drain: no thread for it ({e}): not drained");
    }
}
