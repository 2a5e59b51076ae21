//! Which rank stopped: a hung collective read across the ranks' watchdog lines
//! (`joblog::watchdog`). Every rank of a hung job prints the same timeout; what differs is
//! where each one stood, and the rank that differs is where to look.
//!
//! Per process group, with `T` the collective the others wait in (the lowest one a rank
//! timed out in, else the highest any rank enqueued):
//! - a rank whose last enqueued is below `T` never reached it: it stopped on its CPU side
//!   first (its Python was elsewhere: data loading, a rank-only branch, a GIL deadlock,
//!   blocked I/O). torch 2.8 and later count a collective as enqueued once its NCCL call
//!   returns, so a rank blocked inside that call looks the same: a strong hint, not proof;
//! - all enqueued `T` but one rank's last completed lags the others': its GPU, NCCL or link
//!   side did not finish;
//! - every rank at -1: frozen before the first collective (rendezvous, process-group init);
//! - one collective with different operations or sizes across ranks: the job's code
//!   (collectives out of order, wrong sizes);
//! - torch's own desync report (`TORCH_NCCL_DESYNC_DEBUG`) is taken as it names ranks;
//! - otherwise no rank is named, and what is missing is said (ranks of the world with no line).
//!
//! These are the job's own words: a hang located here is never machine evidence by itself.
use std::collections::{BTreeMap, BTreeSet};

use crate::joblog::watchdog::{self, Progress};

/// At most this many (group, rank) pairs are followed (bounded on hostile output).
const RANKS_MAX: usize = 65_536;
/// At most this many process groups are followed.
const GROUPS_MAX: usize = 4_096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The named ranks never enqueued the collective the others wait in.
    CpuSide,
    /// The named ranks enqueued it but their last completed lags the others'.
    GpuSide,
    /// Every rank seen froze before its first collective.
    BeforeFirst,
    /// The ranks disagree on one collective's operation or size.
    Mismatch,
    /// torch's desync report named them lagging, without saying which way.
    Reported,
    /// The named ranks printed nothing while every rank seen timed out in one collective.
    Silent,
    /// The lines name no lagging rank.
    Unnamed,
}

#[derive(Clone, Debug)]
pub struct Hang {
    pub kind: Kind,
    /// The process group (torch's PG id; `0` is the default group).
    pub pg: String,
    /// The lagging ranks (empty: none named).
    pub ranks: Vec<u32>,
    /// The collective they did not join (or finish).
    pub collective: Option<i64>,
    pub op: Option<String>,
    /// Ranks seen in this group's lines, and the world's ranks not among them.
    pub seen: Vec<u32>,
    pub missing: Vec<u32>,
    /// What the lines say, in a clause (`last enqueued 41, the others 42`).
    pub detail: String,
    /// The lagging rank's own line (or the report's), and the node it came from.
    pub evidence: String,
    pub evidence_node: Option<String>,
    /// How far the lines go (a caveat said after the sentence).
    pub hint: String,
    /// The shortest collective timeout a line names.
    pub timeout_ms: Option<u64>,
}

#[derive(Default)]
struct RankState {
    enqueued: Option<i64>,
    completed: Option<i64>,
    waits_in: Option<i64>,
    /// (collective, operation, numel in) as the rank's timeout line says.
    work: Option<(i64, String, Option<u64>)>,
    /// It timed out in a collective its line does not number (gloo).
    timed_out: bool,
    line: String,
    node: Option<String>,
}

#[derive(Default)]
struct Group {
    ranks: BTreeMap<u32, RankState>,
    not_joined: Option<(Vec<u32>, i64, String, Option<String>)>,
    not_finished: Option<(Vec<u32>, i64, String, Option<String>)>,
    lagging: Option<(Vec<u32>, String, Option<String>)>,
    timeout_ms: Option<u64>,
}

/// A list of ranks as people write it: `1`, `0, 2`, `0-7`.
pub fn rank_list(r: &[u32]) -> String {
    let mut r = r.to_vec();
    r.sort_unstable();
    r.dedup();
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < r.len() {
        let mut j = i;
        while j + 1 < r.len() && r[j + 1] == r[j] + 1 {
            j += 1;
        }
        parts.push(if j >= i + 2 {
            format!("{}-{}", r[i], r[j])
        } else if j == i + 1 {
            format!("{}, {}", r[i], r[j])
        } else {
            r[i].to_string()
        });
        i = j + 1;
    }
    if parts.len() > 12 {
        let n = parts.len() - 12;
        parts.truncate(12);
        parts.push(format!("and {n} more runs"));
    }
    parts.join(", ")
}

fn ranks_word(r: &[u32]) -> String {
    format!(
        "{} {}",
        if r.len() == 1 { "rank" } else { "ranks" },
        rank_list(r)
    )
}

/// The hang the lines tell of, if any watchdog line is among them: `(node, line)` pairs (the
/// node whose bundle holds the line, when there are several), the job's world size when known
/// (to name the ranks that printed nothing), and the ranks whose lines these are when known
/// (one node's ranks: a rank of another node printing nothing here says nothing).
pub fn judge<'a>(
    lines: impl IntoIterator<Item = (Option<&'a str>, &'a str)>,
    world: Option<u32>,
    local: Option<&BTreeSet<u32>>,
) -> Option<Hang> {
    let mut groups: BTreeMap<String, Group> = BTreeMap::new();
    let mut followed = 0usize;
    let parsed: Vec<(Option<&str>, &str, Progress)> = lines
        .into_iter()
        .filter_map(|(node, line)| watchdog::parse(line).map(|p| (node, line, p)))
        .take(1 << 20)
        .collect();
    // A line without a PG tag (the `WorkNCCL(...)` timeout line has only `[Rank N]`) is the
    // default group's only when no other group is in the lines: else it cannot be placed.
    let other_groups = parsed
        .iter()
        .any(|(_, _, p)| p.pg.as_deref().is_some_and(|g| g != "0"));
    for (node, line, p) in &parsed {
        let (node, line) = (*node, *line);
        let pg = match &p.pg {
            Some(g) => g.clone(),
            None if other_groups
                && p.lagging.is_empty()
                && p.not_joined.is_none()
                && p.not_finished.is_none() =>
            {
                continue
            }
            None => "0".into(),
        };
        if !groups.contains_key(&pg) && groups.len() >= GROUPS_MAX {
            continue;
        }
        let g = groups.entry(pg).or_default();
        take(g, p, node, line, &mut followed);
    }
    let world: Option<BTreeSet<u32>> = world.filter(|w| *w <= 1 << 20).map(|w| (0..w).collect());
    let mut unnamed = None;
    // The default group first, then by number (not "10" before "2").
    let mut order: Vec<(&String, &Group)> = groups.iter().collect();
    order.sort_by_key(|(pg, _)| (pg.parse::<u64>().unwrap_or(u64::MAX), (*pg).clone()));
    for (pg, g) in order {
        let h = judge_group(pg, g, world.as_ref(), local);
        if h.kind != Kind::Unnamed {
            return Some(h);
        }
        unnamed.get_or_insert(h);
    }
    unnamed
}

fn take(g: &mut Group, p: &Progress, node: Option<&str>, line: &str, followed: &mut usize) {
    let ex = || {
        if p.quote.is_empty() {
            crate::report::detect::excerpt(line)
        } else {
            p.quote.clone()
        }
    };
    let node_s = || node.map(String::from);
    if let Some(t) = p.timeout_ms {
        g.timeout_ms = Some(g.timeout_ms.map_or(t, |m| m.min(t)));
    }
    if let Some((r, n)) = &p.not_joined {
        g.not_joined.get_or_insert((r.clone(), *n, ex(), node_s()));
    }
    if let Some((r, n)) = &p.not_finished {
        g.not_finished
            .get_or_insert((r.clone(), *n, ex(), node_s()));
    }
    if !p.lagging.is_empty() {
        g.lagging.get_or_insert((p.lagging.clone(), ex(), node_s()));
    }
    let Some(rank) = p.rank else {
        return;
    };
    if !g.ranks.contains_key(&rank) {
        if *followed >= RANKS_MAX {
            return;
        }
        *followed += 1;
    }
    let s = g.ranks.entry(rank).or_default();
    let max = |a: Option<i64>, b: Option<i64>| match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    s.enqueued = max(s.enqueued, p.enqueued);
    s.completed = max(s.completed, p.completed);
    s.waits_in = max(s.waits_in, p.waits_in);
    s.timed_out |= p.timed_out;
    if let (Some(n), Some(op)) = (p.waits_in, &p.op) {
        s.work.get_or_insert((n, op.clone(), p.numel.map(|x| x.0)));
    }
    // The line that says the most about where it stood: one with its counters.
    if s.line.is_empty() || p.enqueued.is_some() {
        s.line = ex();
        s.node = node_s();
    }
}

/// What a hang called the job's side cannot rule out without the rank's stacks.
pub const JOBS_SIDE_CAVEAT: &str = "a rank blocked in D state on a filesystem, or inside a NCCL call, looks the same in these lines: its stacks tell";

impl Hang {
    /// Whether the lines name the rank (or ranks) where to look.
    pub fn named(&self) -> bool {
        self.kind != Kind::Unnamed
    }

    /// Whether the lines name the rank by what it said (its counters, torch's report, a
    /// mismatch), not by its silence: a Flight Recorder dump that names a rank says more
    /// than a silence does.
    pub fn named_by_words(&self) -> bool {
        self.named() && self.kind != Kind::Silent
    }

    /// Whether the lines put the hang on the job's side: a rank that stopped before the
    /// collective (its CPU side), with no machine fault in view.
    pub fn jobs_side(&self) -> bool {
        matches!(self.kind, Kind::CpuSide | Kind::Silent)
    }

    /// One sentence: which ranks, on which node (`node_of`: the node a rank ran on, when
    /// known), which collective, the evidence line, and which side it points at.
    pub fn sentence(&self, node_of: &dyn Fn(u32) -> Option<String>) -> String {
        let on = |r: &[u32]| -> String {
            let nodes: BTreeSet<String> = r.iter().filter_map(|r| node_of(*r)).collect();
            if nodes.is_empty() {
                String::new()
            } else {
                format!(" on {}", nodes.into_iter().collect::<Vec<_>>().join(", "))
            }
        };
        let coll = match (&self.collective, &self.op) {
            (Some(n), Some(op)) => format!("collective {n} ({op}, PG {})", self.pg),
            (Some(n), None) => format!("collective {n} (PG {})", self.pg),
            _ => format!("a collective of PG {}", self.pg),
        };
        let ev = if self.evidence.is_empty() {
            String::new()
        } else {
            format!(": \"{}\"", self.evidence)
        };
        let who = format!("{}{}", ranks_word(&self.ranks), on(&self.ranks));
        let (it, was) = if self.ranks.len() == 1 {
            ("it", "was")
        } else {
            ("they", "were")
        };
        let its = if self.ranks.len() == 1 {
            "its"
        } else {
            "their"
        };
        let s = match self.kind {
            Kind::CpuSide => format!("{who} stopped first: {it} never enqueued {coll} ({}{ev}): on {its} CPU side, {its} Python elsewhere (data loading, a rank-only branch, a GIL deadlock, blocked I/O){}", self.detail, self.hint),
            Kind::GpuSide => format!("{who} did not finish {coll} ({}{ev}): its GPU, NCCL or link side", self.detail),
            Kind::BeforeFirst => format!("every rank seen froze before its first collective ({}{ev}): rendezvous or process-group init, not a collective", self.detail),
            Kind::Mismatch => format!("the ranks disagree on {coll}: {}{ev}: collectives out of order or of different sizes across ranks, the job's code", self.detail),
            Kind::Reported => format!("{who}: {}{ev}", self.detail),
            Kind::Silent => format!("{who} printed nothing while the others waited in {coll} ({}{ev}): {it} {was} not in it, so {it} stopped first on {its} CPU side, {its} Python elsewhere (data loading, a rank-only branch, a step longer than the timeout), unless {its} lines are not in what was read", self.detail),
            Kind::Unnamed => {
                let missing = if self.missing.is_empty() {
                    String::new()
                } else {
                    format!("; {} of the world printed no watchdog line in the bundles read: the one that stopped is likely among them (its node's bundle, or its lines, are missing)", ranks_word(&self.missing))
                };
                format!("the lines name no lagging rank: {}{ev}{missing}", if self.detail.is_empty() { "no rank's counters".to_string() } else { self.detail.clone() })
            }
        };
        let short = match self.timeout_ms {
            Some(t) if t < 300_000 => format!("; the job set its collective timeout to {:.0} s (torch's default is 600 s): one rank's slow step (a checkpoint, an evaluation) outlasts it", t as f64 / 1000.0),
            _ => String::new(),
        };
        format!("{s}{short}")
    }
}

pub(crate) mod rules;
use rules::judge_group;

#[cfg(test)]
mod tests;
