//! A hung collective across the job's nodes (`report::hang` over every node's lines), with
//! each named rank's node and state at its node's trigger, and the job report's verdict for it.
use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::{Node, NodeSummary, Verdict};

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
        let hang = crate::report::hang::judge(lines, world, None)?;
        let mut node_of: BTreeMap<u32, String> = BTreeMap::new();
        for n in nodes {
            for r in dist(n)["ranks"].as_array().into_iter().flatten() {
                if let Some(r) = r["rank"].as_u64().and_then(|r| u32::try_from(r).ok()) {
                    node_of.entry(r).or_insert_with(|| n.name.clone());
                }
            }
        }
        // Ranks no bundle claims: the node whose bundle alone printed their lines.
        let mut printed: BTreeMap<u32, BTreeSet<&str>> = BTreeMap::new();
        let mut first_rel_s = f64::INFINITY;
        for e in events.iter().filter(|e| e["source"] == "log") {
            if let (Some(node), Some(line)) = (e["node"].as_str(), e["line"].as_str()) {
                let Some(p) = crate::joblog::watchdog::parse(line) else {
                    continue;
                };
                if let Some(t) = e["offset_s"].as_f64() {
                    first_rel_s = first_rel_s.min(t - nan_off);
                }
                if let Some(r) = p.rank {
                    if printed.len() < 65_536 || printed.contains_key(&r) {
                        printed.entry(r).or_default().insert(node);
                    }
                }
            }
        }
        for (r, at) in printed {
            if at.len() == 1 {
                node_of
                    .entry(r)
                    .or_insert_with(|| at.into_iter().next().unwrap_or_default().to_string());
            }
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
        let groups = crate::report::detect::rank_groups(
            raw.iter()
                .map(|n| (Some(n.name.as_str()), &n.snapshot["stacks"])),
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
        Some(JobHang {
            hang,
            node_of,
            first_rel_s,
            at,
            groups,
            ras,
        })
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
