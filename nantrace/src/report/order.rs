//! Reading the incident, not the last line (issue 24): the job's failure lines in time order,
//! on every rank, and the first one that explains the rest.
//!
//! When one rank dies of its own error (a Python exception, a GPU out of memory, a full disk,
//! an uncorrectable ECC error), every other rank loses it: broken pipes, connection resets,
//! aborted communicators, watchdog timeouts. Those come last and are loudest, and on their
//! own they read as the network. The rule: the earliest failure line of a family that can be
//! a cause (software, GPU memory, storage, host memory, GPU), before every network or hang
//! line of the job and not one the job outlived, makes the job's network and hang lines
//! after it its consequences. They stay in the report, listed as consequences, and do not
//! set the verdict. Network or hang lines before it (the network failed first) cancel the
//! rule: then the network is as likely the cause and nothing is demoted. Kernel and NVML
//! evidence is never demoted by the job's words.
use serde::Serialize;

use super::{Ctx, OUTLIVED_STEPS};
use crate::joblog::JobFamily;
use crate::source::Source;

/// The longest a rank's peers wait before their consequence shows (NCCL's and torch's
/// collective timeouts are 10 to 30 minutes by default; some jobs raise them to an hour).
pub const CONSEQUENCE_WITHIN_S: f64 = 3600.0;

/// The incident's first cause among the job's lines, and the consequences it explains.
#[derive(Clone, Debug, Serialize)]
pub struct Order {
    /// Seconds relative to the reference (the first NaN, or the trigger).
    pub cause_rel_s: f64,
    pub cause_rank: Option<u64>,
    /// The node that printed it (a merged timeline's events name their node).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cause_node: Option<String>,
    /// The rule's words for the cause (`Python exception in the job's code`).
    pub cause_what: String,
    /// The cause line as the job printed it (cut short; the renderers escape it).
    pub cause_line: String,
    /// The job's first network or hang line after the cause.
    pub first_consequence_rel_s: f64,
    /// Consequence suspects (their texts), filled in by `analyze`.
    pub consequences: Vec<String>,
    /// What the times are relative to (`the first NaN`, `the trigger`), set by `analyze`.
    #[serde(skip)]
    pub reference: &'static str,
    /// The suspects' signals this first failure explains.
    #[serde(skip)]
    explains: &'static [&'static str],
}

/// A line that can be the incident's first cause: a fatal error of a family the network does
/// not cause. Network filesystems and object stores are storage in words but often the fabric
/// in fact (a Lustre eviction, an S3 read timeout, a stale NFS handle): never a cause here.
fn can_be_cause(f: JobFamily, fault: &serde_json::Value) -> bool {
    matches!(
        f,
        JobFamily::Software
            | JobFamily::GpuOom
            | JobFamily::Storage
            | JobFamily::HostMemory
            | JobFamily::GpuHw
            | JobFamily::GpuAmbiguous
    ) && fault["generic"] != true
        && fault["fatal"] != false
        && !matches!(
            fault["kind"].as_str(),
            Some("object_store_timeout" | "fs_disconnected" | "estale")
        )
}

/// The job's network lines that say the fabric failed (not a socket a peer closed).
fn fabric_failure(fault: &serde_json::Value) -> bool {
    fault["generic"] != true
        && matches!(
            fault["kind"].as_str(),
            Some("ib_completion" | "ibv_failure" | "nccl_net" | "ucx_error" | "rdma_transport")
        )
}

/// Training steps logged in (from + 5 s, to): a consequence after so many is not one.
fn ran_on(steps: &[f64], from: f64, to: f64) -> usize {
    steps
        .iter()
        .filter(|s| **s > from + 5.0 && **s < to)
        .count()
}

/// The job's first failure line that explains its later network and hang lines, if there is
/// one; `steps` are the times of the training steps the job logged (relative, sorted or not).
pub(super) fn first_cause(ctx: &Ctx<'_>, steps: &[f64]) -> Option<Order> {
    first_cause_in(ctx.all(Source::Log).map(|(r, e)| (*r, *e)), steps)
}

/// As `first_cause`, over the job's log events as (seconds relative to the reference, event):
/// one node's, or every node's of a multi-node job on the merged clock (`jobreport`).
pub fn first_cause_in<'a>(
    log: impl Iterator<Item = (f64, &'a serde_json::Value)>,
    steps: &[f64],
) -> Option<Order> {
    let mut lines: Vec<(f64, &serde_json::Value)> =
        log.filter(|(_, e)| e["fault"].is_object()).collect();
    lines.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut cause: Option<(f64, &serde_json::Value)> = None;
    // A fabric failure first (an IB completion error): a GPU error of the kind software or
    // hardware can cause that follows it on the same rank (NCCL's `Cuda failure 'an illegal
    // memory access'` once its transfers failed, nccl-tests#24) is its consequence.
    let mut network_first: Option<(f64, &serde_json::Value)> = None;
    for (r, e) in lines {
        let f = &e["fault"];
        let Some(family) = f["family"].as_str().and_then(JobFamily::parse) else {
            continue;
        };
        // The job ran on after the "cause" (it was not fatal), or the consequence comes too
        // long after it to be the peers' timeout.
        let explains =
            |t: f64| ran_on(steps, t, r) < OUTLIVED_STEPS && r - t <= CONSEQUENCE_WITHIN_S;
        if let Some((t, c)) = network_first {
            let same_rank = c["fault"]["rank"] == f["rank"];
            if family == JobFamily::GpuAmbiguous && same_rank && explains(t) {
                return Some(order(t, c, r, NETWORK_EXPLAINS));
            }
            continue;
        }
        if matches!(family, JobFamily::Network | JobFamily::Hang) {
            let Some((t, c)) = cause else {
                if fabric_failure(f) {
                    network_first = Some((r, e));
                    continue;
                }
                return None;
            };
            return explains(t).then(|| order(t, c, r, CAUSE_EXPLAINS));
        }
        if cause.is_none() && can_be_cause(family, f) {
            cause = Some((r, e));
        }
    }
    None
}

/// What a first failure of a cause family makes consequences: the job's network and hang lines.
const CAUSE_EXPLAINS: &[&str] = &["joblog_network", "joblog_network_generic", "joblog_hang"];
/// What a network failure first makes consequences: the job's ambiguous GPU errors.
const NETWORK_EXPLAINS: &[&str] = &["joblog_gpu_ambiguous"];

fn order(
    t: f64,
    c: &serde_json::Value,
    first_consequence: f64,
    explains: &'static [&'static str],
) -> Order {
    let cf = &c["fault"];
    Order {
        cause_rel_s: t,
        cause_rank: cf["rank"].as_u64(),
        cause_node: c["node"].as_str().map(String::from),
        cause_what: cf["what"].as_str().unwrap_or("?").to_string(),
        cause_line: super::detect::excerpt(c["line"].as_str().unwrap_or("")),
        first_consequence_rel_s: first_consequence,
        consequences: Vec::new(),
        reference: "the trigger",
        explains,
    }
}

impl Order {
    /// Whether this first failure explains a suspect: one of the signals it explains, whose
    /// earliest line came after it, within `CONSEQUENCE_WITHIN_S` and before the job had run
    /// on for `OUTLIVED_STEPS` steps (a network failure an hour of training later is its own).
    pub fn explains(&self, signal: &str, first_rel_s: f64, steps: &[f64]) -> bool {
        self.explains.contains(&signal)
            && first_rel_s > self.cause_rel_s
            && first_rel_s - self.cause_rel_s <= CONSEQUENCE_WITHIN_S
            && ran_on(steps, self.cause_rel_s, first_rel_s) < OUTLIVED_STEPS
    }

    /// Whether the first failure is of a cause family, explaining the network and hang lines
    /// after it (the job report then spares the nodes those lines are on).
    pub fn explains_network(&self) -> bool {
        self.explains == CAUSE_EXPLAINS
    }
}
