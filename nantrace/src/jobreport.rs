//! The job report: one answer for a job that ran on many nodes, from its node bundles.
//!
//! A layer above the node report: the bundles are put on one clock (`crate::merge`), each
//! node's evidence is analysed by the node report (`crate::report::analyze`) against the
//! job's reference (its first NaN on any node, else the first trigger), the nodes are
//! compared with their peers (in a data-parallel job they do the same work), and the verdict
//! names the node, the GPU or the link, and what to do. A node the job ran on whose bundle
//! is not there is named as missing, and the verdict then says it is incomplete.
//!
//! Untrusted input: the bundles may come from a shared directory a user can write. Files are
//! read as plain files only (never through a link, never a FIFO), the walk is bounded, and
//! what a bundle claims about its job is shown as its claim.
use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::{json, Value};

use crate::merge::Node;
use crate::report::{Analysis, Finding};

/// Node bundles read at most (a job of 4096 nodes fits; a directory with more is refused).
pub const MAX_NODES: usize = 4096;

/// One node of the job.
#[derive(Clone, Debug, Serialize)]
pub struct NodeSummary {
    pub name: String,
    pub bundle: String,
    /// What the bundle says its job is (Slurm job id, rank, ...): its claim, as written.
    pub job: Value,
    pub verdict: String,
    pub family: String,
    pub machine: bool,
    /// The node's strongest machine-family finding (kernel or NVML evidence before the job's
    /// own words), against the job's reference.
    pub first_machine: Option<Finding>,
    /// Only the job's own output speaks of the machine on this node (no kernel or NVML side).
    pub machine_from_job_words_only: bool,
    /// Peer-comparison measures over the window.
    pub measures: BTreeMap<&'static str, f64>,
}

/// A node whose measure stands out from its peers'.
#[derive(Debug, Serialize)]
pub struct Outlier {
    pub node: String,
    pub measure: &'static str,
    pub family: &'static str,
    pub value: f64,
    pub peers_median: f64,
    pub peers: usize,
    pub text: String,
    /// For a lossy link's bad end: the nodes at the other end of its lossy links.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub other_ends: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct JobReport {
    pub verdict: String,
    pub family: String,
    /// The node the verdict names, its GPU (PCI address, UUID when the snapshot has it).
    pub node: Option<String>,
    pub gpu: Option<String>,
    pub action: Option<String>,
    pub reference: String,
    pub nodes: Vec<NodeSummary>,
    /// Nodes the job ran on (from the bundles' Slurm node list) without a bundle here.
    pub missing: Vec<String>,
    /// Job identities the bundles carry (more than one: bundles of different jobs).
    pub jobs: Vec<String>,
    pub outliers: Vec<Outlier>,
    pub clock_statement: String,
    /// The job's first failure on any node and rank, when its network and hang lines on the
    /// other nodes came after it (`report::order`): those are its consequences.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_failure: Option<crate::report::Order>,
    /// Nodes read from their summaries (quiet nodes, `jobreport::summary`), the others
    /// from their timelines.
    #[serde(skip)]
    pub from_summaries: usize,
    /// A hung collective the ranks' watchdog lines tell of (before the job's first NaN, when
    /// there is one), as job-report.html draws it.
    #[serde(skip)]
    pub hang: Option<HangView>,
}

/// The view of one node on the job's clock: its events, its own accounting, the job's
/// reference (first NaN of any node).
fn node_view(first_nan: &Value, n: &Node, events: Vec<Value>) -> Value {
    json!({
        "schema": crate::merge::SCHEMA,
        "host": n.timeline["host"],
        "job": n.timeline["job"],
        "window": n.timeline["window"],
        "accounting": n.timeline["accounting"],
        "trigger": n.timeline["trigger"],
        "first_nan": first_nan,
        "events": events,
    })
}

/// Signals that are the job's own words (its output), not the kernel's or NVML's.
/// Words anyone could write (the job's, or a kernel log line written from user space).
fn job_words(f: &Finding) -> bool {
    f.anyones_words()
}

fn job_identity(n: &Node) -> Value {
    let s = &n.snapshot["scheduler"]["slurm"];
    let id = &n.timeline["job"]["identity"];
    json!({
        "slurm_job_id": s["job_id"].as_str().or(id["slurm_job_id"].as_str()).or(id["job_id"].as_str()),
        "slurm_procid": s["procid"],
        "node_list": s["node_list"],
        "identity": id,
    })
}

/// The GPU named in a finding's text, with its UUID from the node's snapshot when known.
fn gpu_of(f: &Finding, event_pcis: &[String], snapshot: &Value) -> Option<String> {
    let text = f.text.to_ascii_lowercase();
    let from_events = event_pcis
        .iter()
        .map(String::as_str)
        .find(|p| text.contains(&p.to_ascii_lowercase()));
    let devs = snapshot["gpu"]["devices"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    let from_snapshot = devs.iter().filter_map(|d| d["pci"].as_str()).find(|p| {
        text.contains(&p.to_ascii_lowercase())
            || text.contains(
                &p.to_ascii_lowercase()
                    .trim_start_matches("0000:")
                    .to_string(),
            )
    });
    let pci = from_events.or(from_snapshot)?.to_string();
    let uuid = devs
        .iter()
        .find(|d| {
            d["pci"]
                .as_str()
                .is_some_and(|p| p.eq_ignore_ascii_case(&pci))
        })
        .and_then(|d| d["uuid"].as_str());
    Some(match uuid {
        Some(u) => format!("GPU {pci} ({u})"),
        None => format!("GPU {pci}"),
    })
}

/// The job's answer from its merged timeline and its nodes.
pub fn build(merged: &Value, nodes: &[Node]) -> JobReport {
    let mut by_node: std::collections::HashMap<&str, Vec<&Value>> =
        std::collections::HashMap::new();
    for e in merged["events"].as_array().into_iter().flatten() {
        if let Some(n) = e["node"].as_str() {
            by_node.entry(n).or_default().push(e);
        }
    }
    // Each node's events come from one pass over the merged timeline (a pass per node was
    // the job report's N² at 1024 nodes), and each node's view lives only while it is
    // analysed.
    let parts = nodes
        .iter()
        .map(|n| {
            let events: Vec<Value> = by_node
                .remove(n.name.as_str())
                .unwrap_or_default()
                .into_iter()
                .cloned()
                .collect();
            NodePart::of(n, events, (t0_of(merged), &merged["first_nan"])).0
        })
        .collect();
    build_from(merged, nodes, parts)
}

/// The job's first trigger (what its offsets count from), from a merged timeline.
fn t0_of(merged: &Value) -> i128 {
    merged["trigger"]["time"]
        .as_str()
        .and_then(crate::clock::parse_rfc3339_ns)
        .unwrap_or(0)
}

/// One node's part of the job report, taken while its events are at hand: its summary (its
/// own analysis on the job's clock, its peer measures), its links and the PCI addresses its
/// events name (to name the culprit's GPU).
#[derive(Clone)]
pub struct NodePart {
    summary: NodeSummary,
    pcis: Vec<String>,
    links: peers::Links,
}

impl NodePart {
    /// `events`: the node's events on the job's clock (given back, not copied); `t0_ns`: the
    /// job's first trigger; `first_nan`: the job's reference.
    pub fn of(
        n: &Node,
        events: Vec<Value>,
        (t0_ns, first_nan): (i128, &Value),
    ) -> (NodePart, Vec<Value>) {
        let mut view = node_view(first_nan, n, events);
        let gpus = buckets::Buckets::of_events(view["events"].as_array().into_iter().flatten());
        let mut pcis: Vec<String> = view["events"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["pci"].as_str().map(String::from))
            .collect();
        pcis.sort();
        pcis.dedup();
        let part = NodePart::from_view(n, &view, &gpus, pcis, t0_ns);
        let events = match view["events"].take() {
            Value::Array(a) => a,
            _ => Vec::new(),
        };
        (part, events)
    }

    /// The node's own analysis of `view` (its events on the job's clock, against the job's
    /// reference), its peer measures (its GPUs from `gpus`), its links.
    fn from_view(
        n: &Node,
        view: &Value,
        gpus: &buckets::Buckets,
        pcis: Vec<String>,
        t0_ns: i128,
    ) -> NodePart {
        let reference = view["first_nan"]["offset_s"].as_f64().unwrap_or(0.0);
        let a: Analysis = crate::report::analyze(view, &n.snapshot);
        let machine: Vec<&Finding> = a.suspects.iter().filter(|s| s.blames_machine()).collect();
        let first_machine = machine
            .iter()
            .find(|s| !job_words(s))
            .or(machine.first())
            .map(|f| (*f).clone());
        let words_only = !machine.is_empty() && machine.iter().all(|s| job_words(s));
        let summary = NodeSummary {
            name: n.name.clone(),
            bundle: n.dir.display().to_string(),
            job: job_identity(n),
            verdict: a.verdict.clone(),
            family: a.family.clone(),
            machine: a.machine,
            first_machine,
            machine_from_job_words_only: words_only,
            measures: measures(view, gpus, |b| {
                buckets::start_rel(b, n.correction_s, t0_ns, reference)
            }),
        };
        NodePart {
            summary,
            pcis,
            links: peers::links(view, &n.snapshot),
        }
    }
}

/// The job's answer from its merged timeline, its nodes and each node's part (in the
/// nodes' order).
pub fn build_from(merged: &Value, nodes: &[Node], parts: Vec<NodePart>) -> JobReport {
    let mut summaries = Vec::with_capacity(parts.len());
    let mut views = Vec::with_capacity(parts.len());
    let mut link_views = Vec::with_capacity(parts.len());
    for p in parts {
        link_views.push((p.summary.name.clone(), p.links));
        summaries.push(p.summary);
        views.push(p.pcis);
    }
    let missing = missing_nodes(&summaries, nodes);
    let jobs: Vec<String> = summaries
        .iter()
        .filter_map(|s| s.job["slurm_job_id"].as_str().map(String::from))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut outl = outliers(
        &summaries
            .iter()
            .map(|s| (s.name.clone(), s.measures.clone()))
            .collect::<Vec<_>>(),
    );
    // Lossy links: their bad end, from the job's own sockets, over the busier end's count.
    if let Some(l) = peers::bad_end(&link_views) {
        outl.retain(|o| o.measure != "tcp_retransmits");
        outl.insert(0, l);
    }
    drop(link_views);

    let reference = reference_text(merged);
    let nan_off = merged["first_nan"]["offset_s"].as_f64().unwrap_or(0.0);
    let steps = job_steps(merged, nan_off);
    let first_failure = crate::report::order::first_cause_in(logs(merged, nan_off), &steps);
    let hang = JobHang::read(merged, &summaries, nodes, nan_off)
        // A hang that only began after the job's first NaN is what the NaN did (rank 0
        // stopped and the others waited): the NaN is the answer.
        .filter(|h| !merged["first_nan"].is_object() || h.first_rel_s <= 0.0);
    let (verdict, family, node, gpu, action) = verdict(
        &summaries,
        &outl,
        &missing,
        nodes,
        &views,
        &Explained {
            has_nan: merged["first_nan"].is_object(),
            first_failure: first_failure.as_ref(),
            steps: &steps,
            hang: hang.as_ref(),
        },
    );
    JobReport {
        verdict,
        family,
        node,
        gpu,
        action,
        reference,
        nodes: summaries,
        missing,
        jobs,
        outliers: outl,
        clock_statement: merged["clock_statement"].as_str().unwrap_or("").to_string(),
        first_failure,
        from_summaries: 0,
        hang: hang.as_ref().map(JobHang::view),
    }
}

/// The nodes the job ran on, from what the bundles say, that sent no bundle (their host
/// names as the bundles write them).
fn missing_nodes(summaries: &[NodeSummary], nodes: &[Node]) -> Vec<String> {
    let expected: BTreeSet<String> = summaries
        .iter()
        .filter_map(|s| s.job["node_list"].as_str())
        .flat_map(expand_hostlist)
        .collect();
    let present: BTreeSet<String> = nodes
        .iter()
        .map(|n| {
            n.timeline["host"]["hostname"]
                .as_str()
                .unwrap_or("")
                .split('.')
                .next()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    expected
        .iter()
        .filter(|e| !present.contains(e.split('.').next().unwrap_or("")))
        .cloned()
        .collect()
}

/// What the job's times count from, in words.
fn reference_text(merged: &Value) -> String {
    match merged["first_nan"]["node"].as_str() {
        Some(node) => format!(
            "the job's first NaN, on {node} at {}: {}",
            merged["first_nan"]["time"].as_str().unwrap_or("?"),
            merged["first_nan"]["line"].as_str().unwrap_or("")
        ),
        None => format!(
            "no NaN on any node; times are relative to the first trigger ({} on {})",
            merged["trigger"]["kind"].as_str().unwrap_or("?"),
            merged["trigger"]["node"].as_str().unwrap_or("?")
        ),
    }
}

/// Every node's log lines on the merged clock, against the job's first NaN.
fn logs(merged: &Value, nan_off: f64) -> impl Iterator<Item = (f64, &Value)> {
    merged["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["source"] == "log")
        .filter_map(move |e| Some((e["offset_s"].as_f64()? - nan_off, e)))
}

/// The job's training steps, each once (every rank may print it): the earliest time any node
/// logged it; lines with a loss and no step number each count.
fn job_steps(merged: &Value, nan_off: f64) -> Vec<f64> {
    let mut by_step: BTreeMap<i64, f64> = BTreeMap::new();
    let mut unnumbered = Vec::new();
    for (t, e) in
        logs(merged, nan_off).filter(|(_, e)| !e["loss"].is_null() || !e["step"].is_null())
    {
        match e["step"].as_i64() {
            Some(n) => {
                let v = by_step.entry(n).or_insert(t);
                *v = v.min(t);
            }
            None => unnumbered.push(t),
        }
    }
    by_step.into_values().chain(unnumbered).collect()
}

mod buckets;
mod flight_clock;
mod hang_flight;
pub use flight_clock::FrCreated;
mod hang;
mod load;
pub mod summary;
mod verdict;
use verdict::{verdict, Explained, Verdict};
mod render;
pub use load::{find_bundles, from_dir, from_dir_past, is_job_dir, FULL_LANES_NODES};
pub use render::markdown;
#[cfg(test)]
use render::ranks_text;
mod hostlist;
mod peers;
use hang::JobHang;
pub use hang::{HangView, RankRow};
pub use hostlist::expand_hostlist;
use peers::measures;
pub use peers::{outliers, MEASURES, PEER_AFTER_S, PEER_BEFORE_S};

#[cfg(test)]
pub(crate) mod flight_tests;
#[cfg(test)]
mod hang_tests;
#[cfg(test)]
mod order_tests;
#[cfg(test)]
mod scale_tests;
#[cfg(test)]
mod tests;
