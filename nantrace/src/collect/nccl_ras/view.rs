//! NCCL RAS's view of the job, typed: the job summary, and per communicator the ranks that are
//! not OK. Made from either output format (`text.rs`, and [`from_json`] here); serialized into
//! snapshot.json `nccl_ras.view` and read back by the report.
//!
//! Everything here is the job's own text (its NCCL process wrote it, and any process of the
//! job's network namespace can listen on the port): bounded, cleaned, never machine evidence.
//!
//! The JSON format (NCCL >= 2.28.7, `SET FORMAT json`) is read from `jsonWriteHeader`,
//! `jsonStartCommunicator`, `jsonWriteRankData`, `jsonWriteMissingRank` and `jsonWriteFooter`
//! in src/ras/client_support.cc of NVIDIA/nccl v2.30.7-1 (73cf1122, also the same in
//! v2.28.7-1 ae7aed19). It is a dump of the raw data ("the analysis and interpretation is
//! left to the consumer", docs/userguide/source/troubleshooting/ras.rst): the MISMATCH,
//! INCOMPLETE, DEAD and ERROR states are derived here the way `rasClientRunComms` derives
//! them for the text output.
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Communicators listed with their ranks, at most (the others are counted).
pub const COMMS_MAX: usize = 64;
/// Ranks listed per communicator, at most.
pub const RANKS_MAX: usize = 256;
/// Processes listed (DEAD, INCOMPLETE), at most.
pub const PROCESSES_MAX: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    Text,
    Json,
}

/// What is wrong with a rank or a process, in NCCL's words (its `errorStr` and the `DEAD`
/// section of client_support.cc).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Kind {
    /// RAS gave up on its process: unreachable over the RAS network for 60 s.
    Dead,
    /// No data from its process when RAS gathered (unresponsive, not yet dead).
    Incomplete,
    /// An initialization or asynchronous NCCL error on the rank.
    Error,
    /// It disagrees with the communicator's other ranks: its status, or how many operations
    /// of one kind it launched, or it does not count itself a member.
    Mismatch,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Dead => "DEAD",
            Kind::Incomplete => "INCOMPLETE",
            Kind::Error => "ERROR",
            Kind::Mismatch => "MISMATCH",
        }
    }
}

/// Why a rank is not OK.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "what", rename_all = "snake_case")]
pub enum Why {
    /// RAS has no data from the rank's process.
    NoAnswer,
    /// Its process answered but does not count itself a member (NCCL's `NOCOMM`, `UNKNOWN`
    /// before 2.26): it left the communicator, or has not joined it yet.
    NotMember,
    /// Its status (`INIT`, `RUNNING`, `FINALIZE`, `ABORT`) differs from `most` ranks'.
    Status {
        status: String,
        most: Option<String>,
    },
    /// It launched `launched` operations of kind `op` (`AllReduce`, ...; none named before
    /// NCCL 2.26) where `most` ranks launched another number.
    Ops {
        op: Option<String>,
        launched: u64,
        most: Option<u64>,
    },
    /// An NCCL error (`phase`: initialization or asynchronous).
    Error { phase: String, error: String },
}

/// One rank of a communicator that is not OK.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankIssue {
    pub rank: u32,
    pub kind: Kind,
    pub why: Why,
    /// Its node as RAS names it (an IP address).
    pub host: Option<String>,
    pub pid: Option<u32>,
    pub cuda_dev: Option<u32>,
    pub nvml_dev: Option<u32>,
}

/// A job process RAS names at the job level (its `INCOMPLETE` and `DEAD` sections).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessIssue {
    pub kind: Kind,
    pub pid: u32,
    pub host: String,
    /// Its GPUs as NCCL prints them (`5`, or `0,1 (NVML 2,3)`).
    pub gpus: String,
}

/// A communicator with ranks that are not OK.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Comm {
    /// The text format's `#<group>-<index>`.
    pub id: Option<String>,
    /// NCCL's communicator hash, 16 hex digits.
    pub hash: String,
    /// Ranks in the communicator.
    pub size: Option<u32>,
    /// NOCOMM, INIT, RUNNING, FINALIZE or ABORT (the highest any rank is in).
    pub status: Option<String>,
    /// INCOMPLETE, ERROR, MISMATCH.
    pub errors: Vec<String>,
    /// Ranks RAS has no data from.
    pub missing_ranks: Option<u32>,
    pub ranks: Vec<RankIssue>,
    /// Ranks beyond [`RANKS_MAX`], counted.
    pub ranks_not_listed: u32,
}

/// RAS's view of the job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct View {
    pub format: Format,
    pub nccl_version: Option<String>,
    pub cuda_runtime_version: Option<i64>,
    pub cuda_driver_version: Option<i64>,
    /// The job summary (text format only).
    pub nodes: Option<u32>,
    pub processes: Option<u32>,
    pub gpus: Option<u32>,
    /// Communicators RAS knows, and ranks in them (the text's "Ranks in group" summed).
    pub communicators: Option<u32>,
    pub ranks: Option<u32>,
    /// Seconds RAS took to gather the communicators' data.
    pub collection_s: Option<f64>,
    /// Communication timeouts while gathering (some process did not answer in time).
    pub timeouts: Option<u32>,
    /// Job processes RAS has no data from, and those it considers dead.
    pub missing_processes: Option<u32>,
    pub dead_processes: Option<u32>,
    pub processes_listed: Vec<ProcessIssue>,
    /// Communicators with ranks not OK (at most [`COMMS_MAX`]).
    pub comms: Vec<Comm>,
    pub comms_not_listed: u32,
}

impl View {
    pub fn empty(format: Format) -> Self {
        View {
            format,
            nccl_version: None,
            cuda_runtime_version: None,
            cuda_driver_version: None,
            nodes: None,
            processes: None,
            gpus: None,
            communicators: None,
            ranks: None,
            collection_s: None,
            timeouts: None,
            missing_processes: None,
            dead_processes: None,
            processes_listed: Vec::new(),
            comms: Vec::new(),
            comms_not_listed: 0,
        }
    }

    /// Whether any rank or process is not OK.
    pub fn has_issues(&self) -> bool {
        !self.comms.is_empty()
            || self.comms_not_listed > 0
            || !self.processes_listed.is_empty()
            || self.missing_processes.unwrap_or(0) > 0
            || self.dead_processes.unwrap_or(0) > 0
    }

    /// Ranks of processes RAS considers dead are DEAD, not only INCOMPLETE.
    pub(super) fn mark_dead(&mut self) {
        let dead: Vec<(String, u32)> = self
            .processes_listed
            .iter()
            .filter(|p| p.kind == Kind::Dead)
            .map(|p| (p.host.clone(), p.pid))
            .collect();
        for r in self.comms.iter_mut().flat_map(|c| c.ranks.iter_mut()) {
            if r.kind == Kind::Incomplete
                && r.pid.is_some_and(|pid| {
                    dead.iter()
                        .any(|(h, p)| *p == pid && r.host.as_ref() == Some(h))
                })
            {
                r.kind = Kind::Dead;
            }
        }
    }

    pub(super) fn push_comm(&mut self, c: Comm) {
        if self.comms.len() < COMMS_MAX {
            self.comms.push(c);
        } else {
            self.comms_not_listed += 1;
        }
    }
}

impl Comm {
    pub(super) fn push(&mut self, r: RankIssue) {
        if self.ranks.len() < RANKS_MAX {
            self.ranks.push(r);
        } else {
            self.ranks_not_listed += 1;
        }
    }
}

/// A node as RAS names it (an IP address from `inet_ntop`, `unknown`, or empty): anything
/// else is the job's invention and is shown cleaned and cut.
pub fn host(s: &str) -> String {
    if s.len() <= 64
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || ".:%_-".contains(c))
    {
        s.to_string()
    } else {
        format!(
            "{}…",
            crate::term::clean(s).chars().take(32).collect::<String>()
        )
    }
}

/// A word of the job's text (a version, a status, an error name): cleaned, at most `max`.
pub fn word(s: &str, max: usize) -> String {
    crate::term::clean(s.trim()).chars().take(max).collect()
}

/// A communicator hash as 16 lowercase hex digits (text: `%016lx`, JSON: `0x%lx`).
pub fn hash(s: &str) -> String {
    let h = s.trim().trim_start_matches("0x");
    if !h.is_empty() && h.len() <= 16 && h.chars().all(|c| c.is_ascii_hexdigit()) {
        format!("{:0>16}", h.to_ascii_lowercase())
    } else {
        word(s, 32)
    }
}

/// `ncclResult_t` in words: client_support.cc's `ncclErrorToString`, with the code.
pub fn nccl_error(code: i64) -> String {
    let name = match code {
        1 => "Unhandled CUDA error",
        2 => "System error",
        3 => "Internal error",
        4 => "Invalid argument",
        5 => "Invalid usage",
        6 => "Remote process error",
        7 => "NCCL operation in progress",
        8 => "Timeout",
        _ => "Unexpected error",
    };
    format!("{name} ({code})")
}

fn num<T: TryFrom<u64>>(v: &Value) -> Option<T> {
    v.as_u64().and_then(|n| T::try_from(n).ok())
}

/// A rank's status the way `rasClientRunComms` ranks it: abort, then finalize or destroy,
/// then initialized (RUNNING), else INIT.
fn status_of(s: &Value) -> &'static str {
    if s["abort_flag"] == true {
        "ABORT"
    } else if s["finalize_called"] == true || s["destroy_flag"] == true {
        "FINALIZE"
    } else if s["init_state"].as_i64() == Some(0) {
        "RUNNING"
    } else {
        "INIT"
    }
}

/// The most frequent value (ties: the larger value, as `rasValCountsCompareRev` sorts).
fn most<T: Ord + Clone>(vals: impl Iterator<Item = T>) -> Option<T> {
    let mut counts: std::collections::BTreeMap<T, usize> = std::collections::BTreeMap::new();
    for v in vals {
        *counts.entry(v).or_default() += 1;
    }
    counts
        .into_iter()
        .max_by(|a, b| a.1.cmp(&b.1).then(a.0.cmp(&b.0)))
        .map(|x| x.0)
}

fn issue(r: &Value, kind: Kind, why: Why) -> RankIssue {
    RankIssue {
        rank: num(&r["rank"]).unwrap_or(u32::MAX),
        kind,
        why,
        host: r["host"].as_str().map(host),
        pid: r["pid"].as_i64().and_then(|p| u32::try_from(p).ok()),
        cuda_dev: num(&r["cuda_dev"]),
        nvml_dev: num(&r["nvml_dev"]),
    }
}

type Errors = std::collections::BTreeSet<&'static str>;

/// The missing ranks of a JSON communicator: DEAD, INCOMPLETE (unresponsive) or not members;
/// the processes of the first two, once each, into `procs`.
fn json_missing(
    missing: &[Value],
    comm: &mut Comm,
    errors: &mut Errors,
    procs: &mut Vec<ProcessIssue>,
) {
    for m in missing {
        let st = &m["status"];
        let (kind, why) = if st["considered_dead"] == true {
            (Kind::Dead, Why::NoAnswer)
        } else if st["unresponsive"] == true {
            (Kind::Incomplete, Why::NoAnswer)
        } else {
            (Kind::Mismatch, Why::NotMember)
        };
        errors.insert(if why == Why::NoAnswer {
            "INCOMPLETE"
        } else {
            "MISMATCH"
        });
        let r = issue(m, kind, why);
        if let (Some(pid), Some(h), false) = (r.pid, r.host.clone(), kind == Kind::Mismatch) {
            if procs.len() < PROCESSES_MAX && !procs.iter().any(|p| p.pid == pid && p.host == h) {
                let gpus = match (r.cuda_dev, r.nvml_dev) {
                    (Some(c), Some(n)) if c != n => format!("{c} (NVML {n})"),
                    (Some(c), _) => c.to_string(),
                    _ => "?".into(),
                };
                procs.push(ProcessIssue {
                    kind,
                    pid,
                    host: h,
                    gpus,
                });
            }
        }
        comm.push(r);
    }
}

/// The ranks whose status is not most ranks', and those with an NCCL error.
fn json_status(ranks: &[Value], missing: bool, comm: &mut Comm, errors: &mut Errors) {
    let statuses: Vec<&str> = ranks.iter().map(|r| status_of(&r["status"])).collect();
    let top = most(statuses.iter().copied());
    comm.status = ["ABORT", "FINALIZE", "RUNNING", "INIT"]
        .into_iter()
        .find(|s| statuses.contains(s))
        .or(missing.then_some("NOCOMM"))
        .map(String::from);
    for (r, s) in ranks.iter().zip(&statuses) {
        if Some(*s) != top {
            errors.insert("MISMATCH");
            let why = Why::Status {
                status: (*s).to_string(),
                most: top.map(String::from),
            };
            comm.push(issue(r, Kind::Mismatch, why));
        }
        for (phase, key) in [
            ("initialization", "init_state"),
            ("asynchronous", "async_error"),
        ] {
            let code = r["status"][key].as_i64().unwrap_or(0);
            if code != 0 && code != 7 {
                errors.insert("ERROR");
                let why = Why::Error {
                    phase: phase.into(),
                    error: nccl_error(code),
                };
                comm.push(issue(r, Kind::Error, why));
            }
        }
    }
}

/// Operation counts, per kind of operation: the ranks outside the most frequent count.
fn json_ops(ranks: &[Value], comm: &mut Comm, errors: &mut Errors) {
    let ops: Vec<&String> = ranks
        .iter()
        .filter_map(|r| r["collective_counts"].as_object())
        .flat_map(|m| m.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .take(32)
        .collect();
    for op in ops {
        let count = |r: &Value| r["collective_counts"][op.as_str()].as_u64();
        let Some(top) = most(ranks.iter().filter_map(count)) else {
            continue;
        };
        for r in ranks {
            if let Some(n) = count(r).filter(|n| *n != top) {
                errors.insert("MISMATCH");
                let why = Why::Ops {
                    op: Some(word(op, 32)),
                    launched: n,
                    most: Some(top),
                };
                comm.push(issue(r, Kind::Mismatch, why));
            }
        }
    }
}

/// One communicator of the JSON output: its ranks that are not OK.
fn json_comm(c: &Value, procs: &mut Vec<ProcessIssue>) -> Comm {
    let ranks = c["ranks"].as_array().map_or(&[][..], Vec::as_slice);
    let missing = c["missing_ranks"].as_array().map_or(&[][..], Vec::as_slice);
    let mut comm = Comm {
        hash: hash(c["hash"].as_str().unwrap_or("?")),
        size: num(&c["size"]),
        missing_ranks: num(&c["missing_ranks_count"]),
        ..Comm::default()
    };
    let mut errors = Errors::new();
    json_missing(missing, &mut comm, &mut errors, procs);
    json_status(ranks, !missing.is_empty(), &mut comm, &mut errors);
    json_ops(ranks, &mut comm, &mut errors);
    comm.errors = errors.into_iter().map(String::from).collect();
    comm
}

/// The JSON output (`SET FORMAT json`), or why it is not one.
pub fn from_json(s: &str) -> Result<View, String> {
    let v: Value = serde_json::from_str(s).map_err(|e| format!("not valid JSON: {e}"))?;
    if !v.is_object() {
        return Err("not a JSON object".into());
    }
    let mut view = View::empty(Format::Json);
    view.nccl_version = v["nccl_version"].as_str().map(|s| word(s, 64));
    view.cuda_runtime_version = v["cuda_runtime_version"].as_i64();
    view.cuda_driver_version = v["cuda_driver_version"].as_i64();
    view.communicators = num(&v["communicators_count"]);
    view.collection_s = v["ras"]["collection_time_sec"].as_f64();
    view.timeouts = num(&v["ras"]["timeouts_count"]);
    let comms = v["communicators"].as_array().map_or(&[][..], Vec::as_slice);
    let mut ranks = 0u32;
    let mut procs = Vec::new();
    for c in comms {
        ranks = ranks.saturating_add(num(&c["size"]).unwrap_or(0));
        let comm = json_comm(c, &mut procs);
        if !comm.errors.is_empty() {
            view.push_comm(comm);
        }
    }
    view.ranks = Some(ranks);
    let count = |k: Kind| u32::try_from(procs.iter().filter(|p| p.kind == k).count()).ok();
    view.dead_processes = count(Kind::Dead);
    view.missing_processes = count(Kind::Incomplete);
    view.processes_listed = procs;
    Ok(view)
}
