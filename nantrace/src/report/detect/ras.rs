//! NCCL RAS's view at the trigger (snapshot.json `nccl_ras`, `collect::nccl_ras`): the ranks
//! NCCL itself finds DEAD, INCOMPLETE, in ERROR or MISMATCHed, with their process, node and
//! GPU. The job's own view (its NCCL wrote it): it says where a hang is, never that the machine
//! is at fault; a dead process is its job's or its node's, which that node's bundle tells. Read
//! only in a hang: a running job's ranks differ in their operation counts all the time.
use serde_json::Value;

use super::{Acc, Ctx};
use crate::collect::nccl_ras::{Comm, Kind, ProcessIssue, RankIssue, View, Why};
use crate::report::rules::signal;

/// Ranks named per finding, at most.
const NAMED: usize = 8;

/// The view in the section, when RAS answered and its answer was read.
pub(crate) fn view(section: &Value) -> Option<View> {
    serde_json::from_value(section.get("view")?.clone()).ok()
}

/// Where it runs: `process 4125 on 10.0.0.2, GPU 1 (NVML 3)`.
fn place(pid: Option<u32>, host: Option<&str>, gpu: Option<String>) -> String {
    let mut p = Vec::new();
    if let Some(pid) = pid {
        p.push(format!("process {pid}"));
    }
    if let Some(h) = host.filter(|h| !h.is_empty()) {
        p.push(format!("on {h}"));
    }
    let mut s = p.join(" ");
    if let Some(g) = gpu {
        s = if s.is_empty() {
            format!("GPU {g}")
        } else {
            format!("{s}, GPU {g}")
        };
    }
    s
}

fn gpu(r: &RankIssue) -> Option<String> {
    r.cuda_dev.map(|c| match r.nvml_dev {
        Some(n) if n != c => format!("{c} (NVML {n})"),
        _ => c.to_string(),
    })
}

/// One rank in words: `rank 7 MISMATCH: launched 6649 AllReduce operations where most launched
/// 6650, behind (process 483079 on 172.16.64.210, GPU 7)`.
pub(crate) fn rank_words(r: &RankIssue) -> String {
    let what = match &r.why {
        Why::NoAnswer if r.kind == Kind::Dead => "unreachable over RAS for 60 s".to_string(),
        Why::NoAnswer => "no answer from its process".to_string(),
        Why::NotMember => {
            "its process answers but is not a member (left or not joined yet)".to_string()
        }
        Why::Status { status, most } => match most {
            Some(m) => format!("status {status} where most are {m}"),
            None => format!("status {status}"),
        },
        Why::Ops { op, launched, most } => {
            let op = op.as_deref().map_or(String::new(), |o| format!(" {o}"));
            match most {
                Some(m) if m > launched => {
                    format!("launched {launched}{op} operations where most launched {m}: behind")
                }
                Some(m) => {
                    format!("launched {launched}{op} operations where most launched {m}: ahead")
                }
                None => format!("launched {launched}{op} operations"),
            }
        }
        Why::Error { phase, error } => format!("{phase} error {error}"),
    };
    let at = place(r.pid, r.host.as_deref(), gpu(r));
    let at = if at.is_empty() {
        String::new()
    } else {
        format!(" ({at})")
    };
    format!("rank {} {}: {what}{at}", r.rank, r.kind.as_str())
}

fn process_words(p: &ProcessIssue) -> String {
    let what = if p.kind == Kind::Dead {
        "considered dead (unreachable over RAS)"
    } else {
        "no answer"
    };
    format!(
        "{}: {what}",
        place(Some(p.pid), Some(&p.host), Some(p.gpus.clone()))
    )
}

/// The ranks in words, the worst first, at most [`NAMED`] and how many more.
fn ranks_words(c: &Comm) -> String {
    let mut r: Vec<&RankIssue> = c.ranks.iter().collect();
    r.sort_by_key(|x| (x.kind, x.rank));
    let more = r.len().saturating_sub(NAMED) + c.ranks_not_listed as usize;
    let mut s: Vec<String> = r.iter().take(NAMED).map(|x| rank_words(x)).collect();
    if more > 0 {
        s.push(format!("and {more} more"));
    }
    s.join("; ")
}

/// Job processes no communicator's rank already names.
fn lone_processes(v: &View) -> Vec<&ProcessIssue> {
    v.processes_listed
        .iter()
        .filter(|p| {
            !v.comms
                .iter()
                .flat_map(|c| &c.ranks)
                .any(|r| r.pid == Some(p.pid) && r.host.as_deref() == Some(p.host.as_str()))
        })
        .collect()
}

/// RAS's view in one clause for a verdict: the largest communicator's ranks not OK (ranks
/// are a communicator's own numbers), the job's processes no rank names, or that all is well.
pub(crate) fn clause(section: &Value) -> Option<String> {
    let v = view(section)?;
    let comms = v.communicators.map_or(String::new(), |n| {
        format!(" of {n} communicator{}", if n == 1 { "" } else { "s" })
    });
    if !v.has_issues() {
        return Some(format!(
            "NCCL RAS at the trigger: every rank{comms} OK (no rank missing, dead, in error or behind in NCCL's own view)"
        ));
    }
    let mut with: Vec<&Comm> = v.comms.iter().filter(|c| !c.ranks.is_empty()).collect();
    with.sort_by_key(|c| std::cmp::Reverse(c.size.unwrap_or(0)));
    let mut said = Vec::new();
    if let Some(c) = with.first() {
        let mut r: Vec<&RankIssue> = c.ranks.iter().collect();
        r.sort_by_key(|x| (x.kind, x.rank));
        said.extend(r.iter().take(4).map(|r| rank_words(r)));
        let more = r.len().saturating_sub(4) + c.ranks_not_listed as usize;
        if more > 0 {
            said.push(format!("and {more} more"));
        }
        if with.len() > 1 {
            said.push(format!(
                "(communicator {}; {} more with ranks not OK)",
                c.hash,
                with.len() - 1
            ));
        }
    }
    said.extend(
        lone_processes(&v)
            .iter()
            .take(2)
            .map(|p| format!("job {}", process_words(p))),
    );
    if said.is_empty() {
        said.push(format!(
            "{} job processes without an answer, {} dead (not listed)",
            v.missing_processes.unwrap_or(0),
            v.dead_processes.unwrap_or(0)
        ));
    }
    let mut dead_on: Vec<&str> = v
        .comms
        .iter()
        .flat_map(|c| &c.ranks)
        .filter(|r| r.kind == Kind::Dead)
        .filter_map(|r| r.host.as_deref())
        .chain(
            v.processes_listed
                .iter()
                .filter(|p| p.kind == Kind::Dead)
                .map(|p| p.host.as_str()),
        )
        .filter(|h| !h.is_empty())
        .collect();
    dead_on.sort_unstable();
    dead_on.dedup();
    let dead = if dead_on.is_empty() {
        String::new()
    } else {
        format!(
            " (a dead process is its job's or its node's: read the bundle of {})",
            dead_on
                .iter()
                .take(4)
                .copied()
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    Some(format!(
        "NCCL RAS at the trigger (the job's own view): {}{dead}",
        said.join("; ")
    ))
}

pub(super) fn detect(ctx: &Ctx<'_>, acc: &mut Acc) {
    if !ctx.hung {
        return;
    }
    let Some(v) = view(ctx.ras) else { return };
    let via = ctx.ras["pid"]
        .as_u64()
        .map_or(String::new(), |p| format!(", asked through pid {p}"));
    let sig = signal("nccl_ras_ranks");
    let tail = "where the job's own NCCL sees the hang, not machine evidence (a dead process is its job's or its node's: read that node's bundle)";
    for c in &v.comms {
        if c.ranks.is_empty() && c.ranks_not_listed == 0 {
            continue;
        }
        let size = c.size.map_or(String::new(), |n| format!("{n} ranks"));
        let status = c.status.clone().unwrap_or_default();
        let about = [size, status]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join(", ");
        let about = if about.is_empty() {
            String::new()
        } else {
            format!(" ({about})")
        };
        acc.add(sig, &c.hash, 0.0, true, || {
            format!(
                "NCCL RAS at the trigger (the job's own view{via}): communicator {}{about} {}: {}: {tail}",
                c.hash,
                c.errors.join(","),
                ranks_words(c)
            )
        });
    }
    let lone = lone_processes(&v);
    if lone.is_empty() && v.comms.is_empty() && v.has_issues() {
        acc.add(sig, "processes", 0.0, true, || {
            format!(
                "NCCL RAS at the trigger (the job's own view{via}): {} job processes without an answer, {} considered dead (none listed): {tail}",
                v.missing_processes.unwrap_or(0),
                v.dead_processes.unwrap_or(0)
            )
        });
    }
    if !lone.is_empty() {
        let mut s: Vec<String> = lone.iter().take(NAMED).map(|p| process_words(p)).collect();
        if lone.len() > NAMED {
            s.push(format!("and {} more", lone.len() - NAMED));
        }
        acc.add(sig, "processes", 0.0, true, || {
            format!(
                "NCCL RAS at the trigger (the job's own view{via}): job {}: {tail}",
                s.join("; ")
            )
        });
    }
}
