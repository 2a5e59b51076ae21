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
#[derive(Debug, Serialize)]
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
}

/// The view of one node on the job's clock: its events, its own accounting, the job's
/// reference (first NaN of any node).
fn node_view(merged: &Value, n: &Node, events: Vec<Value>) -> Value {
    json!({
        "schema": crate::merge::SCHEMA,
        "host": n.timeline["host"],
        "job": n.timeline["job"],
        "window": n.timeline["window"],
        "accounting": n.timeline["accounting"],
        "trigger": n.timeline["trigger"],
        "first_nan": merged["first_nan"],
        "events": events,
    })
}

/// Signals that are the job's own words (its output), not the kernel's or NVML's.
fn job_words(f: &Finding) -> bool {
    crate::report::rules::is_job_words(f.signal)
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
    let mut summaries = Vec::new();
    // Each node's events, in one pass over the merged timeline (a pass per node was the
    // job report's N² at 1024 nodes); each node's view lives only while it is analysed, and
    // only the PCI addresses its events name are kept (to name the culprit's GPU).
    let mut by_node: std::collections::HashMap<&str, Vec<&Value>> =
        std::collections::HashMap::new();
    for e in merged["events"].as_array().into_iter().flatten() {
        if let Some(n) = e["node"].as_str() {
            by_node.entry(n).or_default().push(e);
        }
    }
    let mut views = Vec::new();
    let mut link_views = Vec::new();
    for n in nodes {
        let events: Vec<Value> = by_node
            .remove(n.name.as_str())
            .unwrap_or_default()
            .into_iter()
            .cloned()
            .collect();
        let view = node_view(merged, n, events);
        let a: Analysis = crate::report::analyze(&view, &n.snapshot);
        let machine: Vec<&Finding> = a.suspects.iter().filter(|s| s.blames_machine()).collect();
        let first_machine = machine
            .iter()
            .find(|s| !job_words(s))
            .or(machine.first())
            .map(|f| (*f).clone());
        let words_only = !machine.is_empty() && machine.iter().all(|s| job_words(s));
        summaries.push(NodeSummary {
            name: n.name.clone(),
            bundle: n.dir.display().to_string(),
            job: job_identity(n),
            verdict: a.verdict.clone(),
            family: a.family.clone(),
            machine: a.machine,
            first_machine,
            machine_from_job_words_only: words_only,
            measures: measures(&view),
        });
        link_views.push((n.name.clone(), peers::links(&view, &n.snapshot)));
        let mut pcis: Vec<String> = view["events"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["pci"].as_str().map(String::from))
            .collect();
        pcis.sort();
        pcis.dedup();
        views.push(pcis);
    }
    // The nodes the job ran on, from what the bundles say; their host names as the bundles do.
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
    let missing: Vec<String> = expected
        .iter()
        .filter(|e| !present.contains(e.split('.').next().unwrap_or("")))
        .cloned()
        .collect();
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

    let reference = match merged["first_nan"]["node"].as_str() {
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
    };
    // The job's first failure on any node: every node's log lines on the merged clock.
    let nan_off = merged["first_nan"]["offset_s"].as_f64().unwrap_or(0.0);
    let logs = || {
        merged["events"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["source"] == "log")
            .filter_map(|e| Some((e["offset_s"].as_f64()? - nan_off, e)))
    };
    // Each step once (every rank may print it): the earliest time any node logged it.
    let mut by_step: BTreeMap<i64, f64> = BTreeMap::new();
    let mut unnumbered = Vec::new();
    for (t, e) in logs().filter(|(_, e)| !e["loss"].is_null() || !e["step"].is_null()) {
        match e["step"].as_i64() {
            Some(n) => {
                let v = by_step.entry(n).or_insert(t);
                *v = v.min(t);
            }
            None => unnumbered.push(t),
        }
    }
    let steps: Vec<f64> = by_step.into_values().chain(unnumbered).collect();
    let first_failure = crate::report::order::first_cause_in(logs(), &steps);
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
    }
}

type Verdict = (
    String,
    String,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// The job's words that are consequences when they come after the job's first NaN: the other
/// ranks' broken connections and hangs once a rank stopped. A GPU, memory or storage fault in
/// the job's words is never explained away by coming later.
fn consequence_family(f: &Finding) -> bool {
    matches!(
        f.family,
        crate::report::rules::Family::Network | crate::report::rules::Family::Hang
    )
}

/// What makes the job's words on a node consequences: the job's first NaN, its first failure
/// on any node (`report::order`), and the training steps logged (each once) on the merged clock.
struct Explained<'a> {
    has_nan: bool,
    first_failure: Option<&'a crate::report::Order>,
    steps: &'a [f64],
    /// What the ranks' watchdog lines say of a hung collective, over every node.
    hang: Option<&'a JobHang>,
}

fn verdict(
    nodes: &[NodeSummary],
    outliers: &[Outlier],
    missing: &[String],
    raw: &[Node],
    views: &[Vec<String>],
    explained: &Explained<'_>,
) -> Verdict {
    let Explained {
        has_nan,
        first_failure,
        steps,
        hang,
    } = *explained;
    let incomplete = if missing.is_empty() {
        String::new()
    } else {
        format!(
            " INCOMPLETE: no bundle from {} ({} of the job's nodes).",
            missing.join(", "),
            missing.len()
        )
    };
    // The culprit: the node with the strongest machine finding from the kernel or NVML; the
    // job's own words only where no node has more (and then at most POSSIBLY).
    // The job's words after the job's reference (its first NaN) are its consequences (the
    // other ranks' broken connections once rank 0 stopped), never the cause.
    // A lossy link's other end retransmits too: its retransmits are the culprit's link, not
    // a fault of its own (peers::bad_end).
    // The same for the job's first failure on any node (`report::order`): the other nodes'
    // broken connections and hangs after it are what it did to them.
    let after_cause = |f: &Finding| {
        consequence_family(f)
            && ((has_nan && f.first_rel_s > 0.0)
                || first_failure.is_some_and(|c| {
                    c.explains_network() && c.explains(f.signal, f.first_rel_s, steps)
                }))
    };
    let link = outliers.iter().find(|o| o.measure == "tcp_lossy_links");
    let other_end = |i: usize, f: &Finding| {
        f.signal == "retransmit_storm"
            && link.is_some_and(|l| l.other_ends.contains(&nodes[i].name))
    };
    let ranked = |words: bool| {
        nodes
            .iter()
            .enumerate()
            .filter(|(_, s)| s.machine && s.machine_from_job_words_only == words)
            .filter_map(|(i, s)| s.first_machine.as_ref().map(|f| (i, f)))
            .filter(|(i, f)| !other_end(*i, f))
            .filter(|(_, f)| !words || !after_cause(f))
            // A node whose own report explains its GPU fault by the job's own bug is not a culprit.
            .filter(|(i, _)| !nodes[*i].verdict.starts_with("NOT THE MACHINE"))
            .max_by(|a, b| {
                a.1.score
                    .total_cmp(&b.1.score)
                    .then(b.1.rel_s.total_cmp(&a.1.rel_s))
            })
    };
    let consequence = |s: &NodeSummary| {
        s.machine_from_job_words_only && s.first_machine.as_ref().is_some_and(after_cause)
    };
    let others = |i: usize| {
        let clean: Vec<&str> = nodes
            .iter()
            .enumerate()
            .filter(|(j, s)| *j != i && (!s.machine || consequence(s)))
            .map(|(_, s)| s.name.as_str())
            .collect();
        let machine: Vec<String> = nodes
            .iter()
            .enumerate()
            .filter(|(j, s)| *j != i && s.machine && !consequence(s))
            .map(|(j, s)| match s.first_machine.as_ref() {
                Some(f) if other_end(j, f) => {
                    format!("{} (the other end of the lossy link: {})", s.name, f.text)
                }
                f => format!("{} ({})", s.name, f.map_or("", |f| f.text.as_str())),
            })
            .collect();
        let mut t = String::new();
        if !clean.is_empty() {
            t.push_str(&format!(
                "; {} other node{} clean ({})",
                clean.len(),
                if clean.len() == 1 { "" } else { "s" },
                clean.join(", ")
            ));
        }
        if !machine.is_empty() {
            t.push_str(&format!(
                "; also machine evidence on {}",
                machine.join(", ")
            ));
        }
        t
    };
    if let Some((i, f)) = ranked(false) {
        let s = &nodes[i];
        let support: Vec<&str> = outliers
            .iter()
            .filter(|o| o.node == s.name)
            .map(|o| o.text.as_str())
            .collect();
        let support = if support.is_empty() {
            String::new()
        } else {
            format!(" Peers: {}.", support.join("; "))
        };
        let gpu = gpu_of(f, &views[i], &raw[i].snapshot);
        let what = gpu.as_ref().map_or(String::new(), |g| format!(", {g}"));
        let strength = if f.severity >= 60 {
            "PROBABLY THE MACHINE"
        } else {
            "POSSIBLY THE MACHINE"
        };
        let act = f.action.map(|a| a.to_string());
        // A drain only for PROBABLY (redteam4: "Action: drain" on a POSSIBLY verdict).
        let action = if f.severity >= 60 {
            format!(
                "drain {}{}",
                s.name,
                act.as_ref()
                    .map_or(String::new(), |a| format!(", then: {a}"))
            )
        } else {
            format!(
                "check {} before its next job (evidence too weak to drain it)",
                s.name
            )
        };
        let hung = hang
            .filter(|h| h.hang.named())
            .map_or(String::new(), |h| format!(" The hang: {}.", h.sentence()));
        return (
            format!(
                "{strength} ({}): {}{what}: {}{}.{support}{hung} Action: {action}.{incomplete}",
                f.family.label(),
                s.name,
                f.text,
                others(i)
            ),
            f.family.label().to_string(),
            Some(s.name.clone()),
            gpu,
            Some(action),
        );
    }
    if let Some(o) = outliers
        .iter()
        .find(|o| o.measure == "tcp_lossy_links")
        .or_else(|| {
            outliers.iter().max_by(|a, b| {
                (a.value / a.peers_median.max(1.0)).total_cmp(&(b.value / b.peers_median.max(1.0)))
            })
        })
    {
        return (
            format!("POSSIBLY THE MACHINE ({}): {} stands out from its peers: {}. No fault on it by itself; check its {} before the next run.{incomplete}", o.family, o.node, o.text, o.family),
            o.family.to_string(),
            Some(o.node.clone()),
            None,
            Some(format!("check {} ({})", o.node, o.family)),
        );
    }
    if let Some((i, f)) = ranked(true) {
        let s = &nodes[i];
        return (
            format!("POSSIBLY THE MACHINE ({}), in the job's own words only: {}: {}; the kernel and NVML of every node show no fault{}.{incomplete}", f.family.label(), s.name, f.text, others(i)),
            format!("{}{}", f.family.label(), crate::report::rules::JOB_WORDS_SUFFIX),
            Some(s.name.clone()),
            None,
            None,
        );
    }
    let undecided: Vec<&NodeSummary> = nodes
        .iter()
        .filter(|s| s.verdict.starts_with("CANNOT TELL"))
        .collect();
    let blind = !missing.is_empty() || !undecided.is_empty();
    let sw: Vec<&NodeSummary> = nodes
        .iter()
        .filter(|s| s.verdict.starts_with("NOT THE MACHINE ("))
        .collect();
    let n = nodes.len();
    // A hang the job-wide lines read: the whole job's view before one node's.
    if let Some(h) = hang.filter(|h| h.hang.named() || sw.is_empty()) {
        return h.verdict(&incomplete, blind);
    }
    let base = if let Some(s) = sw.first() {
        format!(
            "NOT THE MACHINE ({}): {}: {}",
            s.family,
            s.name,
            s.verdict
                .trim_start_matches("NOT THE MACHINE ")
                .split_once("): ")
                .map_or(s.verdict.as_str(), |x| x.1)
        )
    } else if !has_nan
        && nodes
            .iter()
            .any(|s| s.family == crate::report::rules::Family::Hang.label())
    {
        format!("UNDECIDED ({}): the job's output reports a collective hang, and no rank's watchdog counters are in the bundles read (which rank stopped cannot be read from its lines); no node with a hardware, kernel, system or network fault in the window", crate::report::rules::Family::Hang.label())
    } else if !undecided.is_empty() {
        format!("CANNOT TELL for {}: no kernel events or GPU health there; the other {} node(s) show no machine fault", undecided.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", "), n - undecided.len())
    } else {
        format!("NOT THE MACHINE, as far as nantrace can see: {n} node{} alike, none with a hardware, kernel, system or network fault in the window, no node standing out from its peers. Look at the model side: learning rate, data, precision", if n == 1 { "" } else { "s" })
    };
    let hung = !has_nan
        && nodes
            .iter()
            .any(|s| s.family == crate::report::rules::Family::Hang.label());
    let family = sw
        .first()
        .map_or(
            if hung {
                crate::report::rules::Family::Hang.label()
            } else if undecided.is_empty() {
                "none"
            } else {
                "unknown"
            },
            |s| s.family.as_str(),
        )
        .to_string();
    let after: Vec<String> = nodes
        .iter()
        .filter(|s| consequence(s))
        .filter_map(|s| {
            s.first_machine
                .as_ref()
                .map(|f| format!("{}: {}", s.name, f.text))
        })
        .collect();
    let base = if after.is_empty() {
        base
    } else {
        format!(
            "{base}. After the {}, consequences, not the cause: {}",
            match first_failure {
                Some(c) if c.explains_network() && (!has_nan || c.cause_rel_s < 0.0) => format!(
                    "job's first failure ({}{}: {})",
                    c.cause_node.as_deref().unwrap_or("?"),
                    c.cause_rank
                        .map_or(String::new(), |r| format!(", rank {r}")),
                    c.cause_what
                ),
                _ => "first NaN".to_string(),
            },
            after.join("; ")
        )
    };
    if missing.is_empty() {
        (format!("{base}."), family, None, None, None)
    } else {
        (
            format!(
                "{base}, on the {n} nodes seen.{incomplete} The missing node{} may hold the cause.",
                if missing.len() == 1 { "" } else { "s" }
            ),
            family,
            None,
            None,
            None,
        )
    }
}

mod hang;
mod load;
mod render;
pub use load::{find_bundles, from_dir, is_job_dir};
pub use render::markdown;
#[cfg(test)]
use render::ranks_text;
mod hostlist;
mod peers;
use hang::JobHang;
pub use hostlist::expand_hostlist;
use peers::measures;
pub use peers::{outliers, PEER_AFTER_S, PEER_BEFORE_S};

#[cfg(test)]
mod hang_tests;
#[cfg(test)]
mod order_tests;
#[cfg(test)]
mod tests;
