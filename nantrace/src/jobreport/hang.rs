//! A hung collective across the job's nodes (`report::hang` over every node's lines), with
//! each named rank's node and state at its node's trigger, and the job report's verdict for it.
use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde_json::Value;

use super::hang_flight::{silent_in_the_dumps_collective, PgKey};

use super::{Node, NodeSummary, Verdict};
use crate::report::flight::RankDump;

/// A hung collective across the job's nodes (`report::hang`), with each rank's node.
pub(super) struct JobHang {
    pub(super) hang: crate::report::hang::Hang,
    /// rank -> node, from each bundle's ranks (its processes' RANK), else from the node whose
    /// bundle alone holds the rank's lines (every node may read a shared output file).
    node_of: BTreeMap<u32, String>,
    /// The first watchdog line, against the job's first NaN (or its first trigger).
    pub(super) first_rel_s: f64,
    /// The named ranks' state at their nodes' triggers, where the stacks have it.
    at: Vec<String>,
    /// Every node's ranks grouped by where their main threads stood (`rank_groups`).
    groups: Option<String>,
    /// NCCL RAS's view at a node's trigger (its view is the whole job's): the first node
    /// whose RAS answered with ranks not OK, else the first that answered.
    ras: Option<String>,
    /// Where each rank stood, as its watchdog lines say, by (process group, rank).
    rows: BTreeMap<(String, u32), RankRow>,
    /// Every network line of the job's output, on every node, is a socket timeout or reset
    /// (`socket_reset`): only then are they a named rank's consequences (an IB or NCCL network
    /// error never is; review finding).
    sockets_only: bool,
    /// The hang is the Flight Recorder's (the lines named no rank).
    from_flight: bool,
    /// Every rank the stacks or the Flight Recorder dumps hold, where it stood.
    stood: Vec<RankStood>,
}

/// The Flight Recorder dumps of every node compared, as a hang (`report::flight`), each
/// dump's rank placed on the node that read it where no bundle claims the rank.
fn flight(
    raw: &[Node],
    world: Option<u32>,
    node_of: &mut BTreeMap<u32, String>,
) -> (Option<crate::report::hang::Hang>, bool, Vec<RankDump>) {
    let (mut read, mut not) = (Vec::new(), Vec::new());
    for n in raw {
        let (r, x) = crate::report::flight::dumps(&n.snapshot["flight_recorder"], Some(&n.name));
        read.extend(r);
        not.extend(x);
    }
    for d in &read {
        if let Some(n) = &d.node {
            node_of.entry(d.rank).or_insert_with(|| n.clone());
        }
    }
    let Some(f) = crate::report::flight::judge(&read, &not, world) else {
        return (None, false, read);
    };
    let named = f.kind.is_some();
    (Some(f.hang(&|r| node_of.get(&r).cloned())), named, read)
}

/// Where one rank stood, as its watchdog lines say (the greatest of their counters): what the
/// job report's page lists for a hang. The line is the job's own words (cut short).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankRow {
    pub rank: u32,
    pub pg: String,
    pub node: Option<String>,
    /// The collective it timed out in, and its operation.
    pub waits_in: Option<i64>,
    pub op: Option<String>,
    pub enqueued: Option<i64>,
    pub completed: Option<i64>,
    /// One of the ranks the hang names.
    pub lagging: bool,
    pub line: String,
    /// When it printed its first watchdog line, against the job's reference.
    pub at_s: Option<f64>,
}

/// The hang as the job report's page draws it: what the lines say, each rank's row (the
/// named ranks first), and the stack groups and NCCL RAS clause the verdict carries.
#[derive(Clone, Debug, Default)]
pub struct HangView {
    /// What the lines say of the named ranks, in a few words.
    pub kind: &'static str,
    pub pg: String,
    pub collective: Option<i64>,
    pub op: Option<String>,
    /// The named ranks and their nodes.
    pub lagging: Vec<(u32, Option<String>)>,
    /// At most [`HangView::ROWS`] rows: the named ranks first, then by group and rank.
    pub ranks: Vec<RankRow>,
    /// Ranks with a watchdog line in all (rows beyond [`HangView::ROWS`] are counted only).
    pub ranks_seen: usize,
    /// Ranks of the world that printed no watchdog line (at most 1024 kept).
    pub missing: Vec<u32>,
    /// The hang's sentence as the verdict says it.
    pub sentence: String,
    /// The named ranks' state at their nodes' triggers.
    pub at: Vec<String>,
    pub groups: Option<String>,
    pub ras: Option<String>,
    /// The first watchdog line, against the job's reference.
    pub first_rel_s: f64,
    /// Every rank the nodes' stacks or Flight Recorder dumps hold (at most
    /// [`HangView::STOOD`]), by rank: where each stood besides its lines.
    pub stood: Vec<RankStood>,
}

impl HangView {
    pub const ROWS: usize = 256;
    pub const STOOD: usize = 4096;
}

/// One rank as the stacks and the Flight Recorder dumps saw it: what the job report's page
/// draws on the rank's lane besides its lines.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankStood {
    pub rank: u32,
    pub node: Option<String>,
    /// Its main process, and its main thread at its node's trigger (`rank_state`'s clause
    /// after the pid: `main thread S in futex_wait_queue, from train.py:211 log_metrics`).
    pub pid: Option<u64>,
    pub stack: Option<String>,
    /// Its dump's last collective of the hang's group (number, operation, state), and the
    /// last one it completed.
    pub fr_last: Option<(i64, String, String)>,
    pub fr_completed: Option<i64>,
    /// When that last collective was created, on the job's clock, or why it is not drawn.
    pub fr_created: Option<super::FrCreated>,
}

/// Each rank the nodes' stacks (its main process) or Flight Recorder dumps (`dumps`, of
/// group `pg`) hold, each once (the first node's), at most [`HangView::STOOD`]; a dump's
/// time on the job's clock (`clock`: its first trigger, the reference's offset from it).
fn stood(
    raw: &[Node],
    node_of: &BTreeMap<u32, String>,
    (pg, clock): (&PgKey<'_>, (i128, f64)),
    dumps: &[RankDump],
) -> Vec<RankStood> {
    let mut out: BTreeMap<u32, RankStood> = BTreeMap::new();
    let mut created: BTreeMap<u32, Option<i64>> = BTreeMap::new();
    for n in raw {
        let st = &n.snapshot["stacks"];
        for p in st["processes"].as_array().into_iter().flatten() {
            let Some(r) = p["rank"].as_u64().and_then(|r| u32::try_from(r).ok()) else {
                continue;
            };
            if p["rank_main"] != true || out.contains_key(&r) || out.len() >= HangView::STOOD {
                continue;
            }
            let Some(s) = crate::report::detect::rank_state(st, r) else {
                continue;
            };
            let (pid, stack) = match s.split_once(": ") {
                Some((p, rest)) => (
                    p.strip_prefix("pid ").and_then(|p| p.parse().ok()),
                    rest.to_string(),
                ),
                None => (None, s),
            };
            out.insert(
                r,
                RankStood {
                    rank: r,
                    node: Some(n.name.clone()),
                    pid,
                    stack: Some(stack),
                    ..RankStood::default()
                },
            );
        }
    }
    for d in dumps {
        if out.len() >= HangView::STOOD && !out.contains_key(&d.rank) {
            continue;
        }
        let of_pg = || {
            d.dump
                .entries
                .iter()
                .filter(|e| pg.is(e) && e.is_p2p != Some(true))
                .filter_map(|e| Some((e.collective_seq_id?, e)))
        };
        let s = out.entry(d.rank).or_insert_with(|| RankStood {
            rank: d.rank,
            node: d.node.clone(),
            ..RankStood::default()
        });
        if let Some((n, e)) = of_pg().max_by_key(|x| x.0) {
            s.fr_last = Some((n, e.profiling_name.clone(), e.state.clone()));
            created.insert(d.rank, e.time_created_ns);
        }
        s.fr_completed = of_pg()
            .filter(|(_, e)| e.state == "completed")
            .map(|x| x.0)
            .max();
    }
    // The dump's clock is the node's the rank ran on (the first bundle of that name).
    let by_name: HashMap<&str, &Node> = raw.iter().rev().map(|n| (n.name.as_str(), n)).collect();
    for s in out.values_mut() {
        if let Some(n) = node_of.get(&s.rank) {
            s.node = Some(n.clone());
        }
        if let Some(ns) = created.get(&s.rank) {
            let node = s.node.as_deref().and_then(|n| by_name.get(n)).copied();
            s.fr_created = Some(super::flight_clock::created(*ns, node, clock));
        }
    }
    out.into_values().collect()
}

/// The ranks' watchdog lines over every node, read once.
struct Lines<'a> {
    /// The nodes whose bundles hold each rank's lines.
    printed: BTreeMap<u32, BTreeSet<&'a str>>,
    /// The first watchdog line, against the job's reference.
    first_rel_s: f64,
    rows: BTreeMap<(String, u32), RankRow>,
}

impl<'a> Lines<'a> {
    /// At most this many (group, rank) rows and ranks are followed (hostile output).
    const MAX: usize = 65_536;

    fn read(events: &'a [Value], nan_off: f64) -> Lines<'a> {
        let parsed: Vec<(&str, Option<f64>, crate::joblog::watchdog::Progress)> = events
            .iter()
            .filter(|e| e["source"] == "log")
            .filter_map(|e| {
                let (node, line) = (e["node"].as_str()?, e["line"].as_str()?);
                let p = crate::joblog::watchdog::parse(line)?;
                Some((node, e["offset_s"].as_f64(), p))
            })
            .take(1 << 20)
            .collect();
        // As `report::hang` places them: a line without a PG tag is the default group's only
        // when no other group is in the lines.
        let other_groups = parsed
            .iter()
            .any(|(_, _, p)| p.pg.as_deref().is_some_and(|g| g != "0"));
        let mut out = Lines {
            printed: BTreeMap::new(),
            first_rel_s: f64::INFINITY,
            rows: BTreeMap::new(),
        };
        for (node, t, p) in parsed {
            if let Some(t) = t {
                out.first_rel_s = out.first_rel_s.min(t - nan_off);
            }
            let Some(r) = p.rank else { continue };
            if out.printed.len() < Self::MAX || out.printed.contains_key(&r) {
                out.printed.entry(r).or_default().insert(node);
            }
            let pg = match p.pg.clone() {
                Some(g) => g,
                None if other_groups => continue,
                None => "0".into(),
            };
            let key = (pg, r);
            if out.rows.len() >= Self::MAX && !out.rows.contains_key(&key) {
                continue;
            }
            let row = out.rows.entry(key.clone()).or_insert_with(|| RankRow {
                rank: r,
                pg: key.0,
                ..RankRow::default()
            });
            row.take(&p);
            if let Some(t) = t.map(|t| t - nan_off) {
                row.at_s = Some(row.at_s.map_or(t, |a| a.min(t)));
            }
        }
        out
    }
}

impl RankRow {
    /// One more of the rank's lines: the greatest counters, the line that has them.
    fn take(&mut self, p: &crate::joblog::watchdog::Progress) {
        let max = |a: Option<i64>, b: Option<i64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        self.enqueued = max(self.enqueued, p.enqueued);
        self.completed = max(self.completed, p.completed);
        self.waits_in = max(self.waits_in, p.waits_in);
        if self.op.is_none() {
            self.op.clone_from(&p.op);
        }
        if self.line.is_empty() || p.enqueued.is_some() {
            self.line = p.quote.chars().take(200).collect();
        }
    }
}

impl JobHang {
    pub(super) fn read(
        merged: &Value,
        nodes: &[NodeSummary],
        raw: &[Node],
        nan_off: f64,
    ) -> Option<JobHang> {
        let dist = |n: &NodeSummary| n.job["identity"]["distributed"].clone();
        let world = nodes
            .iter()
            .filter_map(|n| dist(n)["world_size"].as_u64())
            .max()
            .and_then(|w| u32::try_from(w).ok());
        let events = merged["events"].as_array()?;
        let lines = events
            .iter()
            .filter(|e| e["source"] == "log")
            .filter_map(|e| Some((e["node"].as_str(), e["line"].as_str()?)));
        let watchdog = crate::report::hang::judge(lines, world, None);
        let mut node_of: BTreeMap<u32, String> = BTreeMap::new();
        for n in nodes {
            for r in dist(n)["ranks"].as_array().into_iter().flatten() {
                if let Some(r) = r["rank"].as_u64().and_then(|r| u32::try_from(r).ok()) {
                    node_of.entry(r).or_insert_with(|| n.name.clone());
                }
            }
        }
        // Ranks whose main process a node's stacks took at its trigger ran there (`nantrace
        // run` and `attach` record no launcher identity; the stacks read each rank's RANK).
        for n in raw {
            for p in n.snapshot["stacks"]["processes"]
                .as_array()
                .into_iter()
                .flatten()
            {
                let rank = p["rank"].as_u64().and_then(|r| u32::try_from(r).ok());
                if let (Some(r), true) = (rank, p["rank_main"] == true) {
                    node_of.entry(r).or_insert_with(|| n.name.clone());
                }
            }
        }
        // Ranks no bundle claims: the node whose bundle alone printed their lines.
        let Lines {
            printed,
            first_rel_s,
            mut rows,
        } = Lines::read(events, nan_off);
        for (r, at) in printed {
            if at.len() == 1 {
                node_of
                    .entry(r)
                    .or_insert_with(|| at.into_iter().next().unwrap_or_default().to_string());
            }
        }
        // The ranks' Flight Recorder dumps over every node, where the lines name no rank.
        let (flight, named_by_flight, dumps) = flight(raw, world, &mut node_of);
        // Where the dumps that agree all stand: the collective a silence names no number for.
        let dumps_at = flight
            .as_ref()
            .filter(|f| !f.named())
            .and_then(|f| f.collective.map(|n| (n, f.op.clone(), f.pg.clone())));
        let (mut hang, from_flight) = match (watchdog, flight) {
            (Some(h), _) if h.named_by_words() => (h, false),
            (_, Some(f)) if f.named() || named_by_flight => (f, true),
            (Some(h), _) if h.named() => (h, false),
            (h, f) => match h {
                Some(h) => (h, false),
                None => (f?, true),
            },
        };
        silent_in_the_dumps_collective(&mut hang, from_flight, dumps_at, &dumps);
        for ((_, r), row) in &mut rows {
            row.node = node_of.get(r).cloned();
            row.lagging = hang.ranks.contains(r);
        }
        // Where each named rank stood at its node's trigger (snapshot.json `stacks`).
        let at = hang
            .ranks
            .iter()
            .take(8)
            .filter_map(|r| {
                let node = node_of.get(r)?;
                let n = raw.iter().find(|n| &n.name == node)?;
                crate::report::detect::rank_state(&n.snapshot["stacks"], *r)
                    .map(|s| format!("rank {r} on {node}, {s}"))
            })
            .collect();
        let (pg_of, from) = crate::report::detect::rank_pgs(rows.keys(), &dumps);
        let groups = crate::report::detect::rank_groups_by(
            raw.iter()
                .map(|n| (Some(n.name.as_str()), &n.snapshot["stacks"])),
            |r| pg_of.get(&r).cloned().flatten(),
            from,
        );
        let views: Vec<(&str, String)> = raw
            .iter()
            .filter_map(|n| {
                crate::report::detect::ras_clause(&n.snapshot["nccl_ras"])
                    .map(|c| (n.name.as_str(), c))
            })
            .collect();
        let ras = views
            .iter()
            .find(|(_, c)| !c.contains("every rank"))
            .or(views.first())
            .map(|(node, c)| format!("{c} (asked on {node})"));
        let network = crate::joblog::JobFamily::Network.as_str();
        let sockets_only = events
            .iter()
            .filter(|e| e["source"] == "log" && e["fault"]["family"].as_str() == Some(network))
            .all(|e| e["fault"]["kind"] == "socket_reset");
        let clock = (super::t0_of(merged), nan_off);
        let key = if from_flight {
            PgKey::Name(&hang.pg)
        } else {
            PgKey::Id(&hang.pg)
        };
        let stood = stood(raw, &node_of, (&key, clock), &dumps);
        Some(JobHang {
            stood,
            sockets_only,
            hang,
            node_of,
            first_rel_s,
            at,
            groups,
            ras,
            rows,
            from_flight,
        })
    }

    /// The hang was read from the ranks' Flight Recorder dumps and names the rank that never
    /// joined a collective (or a mismatch): the job's socket timeouts and resets on any node
    /// are what that did to its peers.
    pub(super) fn explains_sockets(&self) -> bool {
        use crate::report::hang::Kind;
        self.from_flight
            && self.sockets_only
            && matches!(self.hang.kind, Kind::CpuSide | Kind::Mismatch)
    }

    pub(super) fn sentence(&self) -> String {
        let mut s = self.hang.sentence(&|r| self.node_of.get(&r).cloned());
        if !self.at.is_empty() {
            s = format!("{s}; at the trigger: {}", self.at.join("; "));
        }
        if let Some(g) = &self.groups {
            s = format!("{s}; {g}");
        }
        if let Some(r) = &self.ras {
            s = format!("{s}; {r}");
        }
        s
    }

    /// What the job report's page draws of this hang.
    pub(super) fn view(&self) -> HangView {
        use crate::report::hang::Kind;
        let kind = match self.hang.kind {
            Kind::CpuSide => {
                "never enqueued the collective the others wait in: stopped first, on the CPU side"
            }
            Kind::GpuSide => "enqueued it but did not finish it: the GPU, NCCL or link side",
            Kind::BeforeFirst => "every rank seen froze before its first collective",
            Kind::Mismatch => "the ranks disagree on one collective's operation or size",
            Kind::Reported => "named lagging by torch's desync report",
            Kind::Silent => "printed nothing while the others waited",
            Kind::Unnamed => "the lines name no lagging rank",
        };
        let mut rows: Vec<&RankRow> = self.rows.values().collect();
        // The named ranks first, then by group (in number order) and rank.
        rows.sort_by_key(|r| {
            (
                !r.lagging,
                r.pg.parse::<u64>().unwrap_or(u64::MAX),
                r.pg.clone(),
                r.rank,
            )
        });
        HangView {
            kind,
            pg: self.hang.pg.clone(),
            collective: self.hang.collective,
            op: self.hang.op.clone(),
            lagging: self
                .hang
                .ranks
                .iter()
                .take(1024)
                .map(|r| (*r, self.node_of.get(r).cloned()))
                .collect(),
            ranks_seen: rows.len(),
            ranks: rows.into_iter().take(HangView::ROWS).cloned().collect(),
            missing: self.hang.missing.iter().take(1024).copied().collect(),
            sentence: self.sentence(),
            at: self.at.clone(),
            groups: self.groups.clone(),
            ras: self.ras.clone(),
            first_rel_s: self.first_rel_s,
            stood: self.stood.clone(),
        }
    }

    /// The one node the named ranks ran on.
    fn node(&self) -> Option<String> {
        let nodes: BTreeSet<&String> = self
            .hang
            .ranks
            .iter()
            .filter_map(|r| self.node_of.get(r))
            .collect();
        (nodes.len() == 1)
            .then(|| nodes.into_iter().next().cloned())
            .flatten()
    }

    /// The verdict for a hang no machine fault explains: never "look at the model side".
    /// `blind`: a node of the job is missing or could not see its machine (a node that died
    /// sends no bundle and its ranks print nothing): the job's side cannot be said then.
    pub(super) fn verdict(&self, incomplete: &str, blind: bool) -> Verdict {
        use crate::report::hang::Kind;
        let label = crate::report::rules::Family::Hang.label();
        let node = self.node();
        let s = self.sentence();
        let at = node
            .as_deref()
            .map_or_else(|| "the named ranks".to_string(), |n| format!("{n}'s"));
        match self.hang.kind {
            Kind::Mismatch => (
                format!("NOT THE MACHINE ({}): {s}; no node with a hardware, kernel, system or network fault in the window.{incomplete}", crate::report::rules::Family::Software.label()),
                crate::report::rules::Family::Software.label().into(),
                None,
                None,
                None,
            ),
            Kind::GpuSide => {
                let action = format!("check {at} GPU and links (rank {}) before its next job; nothing to drain on the job's words alone", crate::report::hang::rank_list(&self.hang.ranks));
                (
                    format!("POSSIBLY THE MACHINE ({label}), in the job's own words only: {s}; no hardware, kernel, system or network fault on any node in the window. Action: {action}.{incomplete}"),
                    format!("{label}{}", crate::report::rules::JOB_WORDS_SUFFIX),
                    node,
                    None,
                    Some(action),
                )
            }
            Kind::CpuSide | Kind::Silent if !blind && node.is_some() => {
                let action = format!("look at what rank {} on {} was doing (its stacks while it hangs: py-spy dump --pid)", crate::report::hang::rank_list(&self.hang.ranks), node.as_deref().unwrap_or("its node"));
                let sw = crate::report::rules::Family::Software.label();
                (
                    format!("NOT THE MACHINE ({sw}), most likely: {s}; no hardware, kernel, system, storage or network fault on any node in the window: the job's side ({}). Action: {action}.{incomplete}", crate::report::hang::JOBS_SIDE_CAVEAT),
                    sw.into(),
                    node,
                    None,
                    Some(action),
                )
            }
            Kind::CpuSide | Kind::Silent | Kind::Reported | Kind::BeforeFirst => {
                let action = match self.hang.kind {
                    Kind::BeforeFirst => "look at the job's rendezvous and process-group init (MASTER_ADDR, ports, every rank started)".to_string(),
                    _ => format!("look at what rank {} on {} was doing (its stacks while it hangs: py-spy dump --pid)", crate::report::hang::rank_list(&self.hang.ranks), node.as_deref().unwrap_or("its node")),
                };
                (
                    format!("UNDECIDED ({label}): {s}; no hardware, kernel, system or network fault on any node in the window. Action: {action}.{incomplete}"),
                    label.into(),
                    node,
                    None,
                    Some(action),
                )
            }
            Kind::Unnamed => (
                format!("UNDECIDED ({label}): {s}; no hardware, kernel, system or network fault on any node in the window.{incomplete}"),
                label.into(),
                None,
                None,
                None,
            ),
        }
    }
}
