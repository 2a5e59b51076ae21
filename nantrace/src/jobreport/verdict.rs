//! The job report's verdict: which node (and GPU, or link) is the culprit, from every node's
//! summary, the peer comparison and what explains the job's own words. Read in this order:
//! the strongest machine finding of the kernel or NVML on a node; a node standing out from
//! its peers; the job's own words on one node (at most POSSIBLY); a hung collective read over
//! all ranks; else the nodes' own answers.
use super::hang::JobHang;
use super::{gpu_of, Node, NodeSummary, Outlier};
use crate::report::Finding;

pub(super) type Verdict = (
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
pub(super) struct Explained<'a> {
    pub has_nan: bool,
    pub first_failure: Option<&'a crate::report::Order>,
    pub steps: &'a [f64],
    /// What the ranks' watchdog lines say of a hung collective, over every node.
    pub hang: Option<&'a JobHang>,
}

/// The verdict over the nodes' summaries (see the module's order).
pub(super) fn verdict(
    nodes: &[NodeSummary],
    outliers: &[Outlier],
    missing: &[String],
    raw: &[Node],
    views: &[Vec<String>],
    explained: &Explained<'_>,
) -> Verdict {
    let j = Judge {
        nodes,
        outliers,
        missing,
        raw,
        views,
        ex: explained,
        link: outliers.iter().find(|o| o.measure == "tcp_lossy_links"),
        incomplete: if missing.is_empty() {
            String::new()
        } else {
            format!(
                " INCOMPLETE: no bundle from {} ({} of the job's nodes).",
                missing.join(", "),
                missing.len()
            )
        },
    };
    // The culprit: the node with the strongest machine finding from the kernel or NVML; the
    // job's own words only where no node has more (and then at most POSSIBLY).
    if let Some((i, f)) = j.ranked(false) {
        return j.machine(i, f);
    }
    if let Some(v) = j.standing_out() {
        return v;
    }
    if let Some((i, f)) = j.ranked(true) {
        let s = &nodes[i];
        return (
            format!("POSSIBLY THE MACHINE ({}), in the job's own words only: {}: {}; the kernel and NVML of every node show no fault{}.{}", f.family.label(), s.name, f.text, j.others(i), j.incomplete),
            format!("{}{}", f.family.label(), crate::report::rules::JOB_WORDS_SUFFIX),
            Some(s.name.clone()),
            None,
            None,
        );
    }
    j.no_culprit()
}

/// What the verdict reads, with the rules it applies to it.
struct Judge<'a> {
    nodes: &'a [NodeSummary],
    outliers: &'a [Outlier],
    missing: &'a [String],
    raw: &'a [Node],
    views: &'a [Vec<String>],
    ex: &'a Explained<'a>,
    /// The lossy link the peer comparison found, if any.
    link: Option<&'a Outlier>,
    /// " INCOMPLETE: ..." when a node's bundle is missing, else empty.
    incomplete: String,
}

impl Judge<'_> {
    /// The job's words after the job's reference (its first NaN) are its consequences (the
    /// other ranks' broken connections once rank 0 stopped), never the cause; the same for
    /// the job's first failure on any node (`report::order`): the other nodes' broken
    /// connections and hangs after it are what it did to them.
    fn after_cause(&self, f: &Finding) -> bool {
        let sockets = matches!(f.signal, "joblog_network" | "joblog_network_generic")
            && self.ex.hang.is_some_and(JobHang::explains_sockets);
        sockets
            || consequence_family(f)
                && ((self.ex.has_nan && f.first_rel_s > 0.0)
                    || self.ex.first_failure.is_some_and(|c| {
                        c.explains_network() && c.explains(f.signal, f.first_rel_s, self.ex.steps)
                    }))
    }

    /// A lossy link's other end retransmits too: its retransmits are the culprit's link, not
    /// a fault of its own (peers::bad_end).
    fn other_end(&self, i: usize, f: &Finding) -> bool {
        f.signal == "retransmit_storm"
            && self
                .link
                .is_some_and(|l| l.other_ends.contains(&self.nodes[i].name))
    }

    /// The node with the strongest machine finding, of the kernel and NVML (`words` false) or
    /// of the job's own words only (`words` true).
    fn ranked(&self, words: bool) -> Option<(usize, &Finding)> {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, s)| s.machine && s.machine_from_job_words_only == words)
            .filter_map(|(i, s)| s.first_machine.as_ref().map(|f| (i, f)))
            .filter(|(i, f)| !self.other_end(*i, f))
            .filter(|(_, f)| !words || !self.after_cause(f))
            // A node whose own report explains its GPU fault by the job's own bug is not a culprit.
            .filter(|(i, _)| !self.nodes[*i].verdict.starts_with("NOT THE MACHINE"))
            .max_by(|a, b| {
                a.1.score
                    .total_cmp(&b.1.score)
                    .then(b.1.rel_s.total_cmp(&a.1.rel_s))
            })
    }

    /// A node whose machine finding is only the job's words after the cause.
    fn consequence(&self, s: &NodeSummary) -> bool {
        s.machine_from_job_words_only
            && s.first_machine
                .as_ref()
                .is_some_and(|f| self.after_cause(f))
    }

    /// "; 2 other nodes clean (n1, n3); also machine evidence on ...": the nodes but `i`.
    fn others(&self, i: usize) -> String {
        let clean: Vec<&str> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(j, s)| *j != i && (!s.machine || self.consequence(s)))
            .map(|(_, s)| s.name.as_str())
            .collect();
        let machine: Vec<String> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(j, s)| *j != i && s.machine && !self.consequence(s))
            .map(|(j, s)| match s.first_machine.as_ref() {
                Some(f) if self.other_end(j, f) => {
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
    }

    /// The verdict on node `i`, whose machine finding `f` is the strongest.
    fn machine(&self, i: usize, f: &Finding) -> Verdict {
        let s = &self.nodes[i];
        let support: Vec<&str> = self
            .outliers
            .iter()
            .filter(|o| o.node == s.name)
            .map(|o| o.text.as_str())
            .collect();
        let support = if support.is_empty() {
            String::new()
        } else {
            format!(" Peers: {}.", support.join("; "))
        };
        let gpu = gpu_of(f, &self.views[i], &self.raw[i].snapshot);
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
        let hung = self
            .ex
            .hang
            .filter(|h| h.hang.named())
            .map_or(String::new(), |h| format!(" The hang: {}.", h.sentence()));
        (
            format!(
                "{strength} ({}): {}{what}: {}{}.{support}{hung} Action: {action}.{}",
                f.family.label(),
                s.name,
                f.text,
                self.others(i),
                self.incomplete
            ),
            f.family.label().to_string(),
            Some(s.name.clone()),
            gpu,
            Some(action),
        )
    }

    /// A node standing out from its peers without a fault of its own: the lossy link first,
    /// else the largest ratio to the peers' median.
    fn standing_out(&self) -> Option<Verdict> {
        let o = self.link.or_else(|| {
            self.outliers.iter().max_by(|a, b| {
                (a.value / a.peers_median.max(1.0)).total_cmp(&(b.value / b.peers_median.max(1.0)))
            })
        })?;
        Some((
            format!("POSSIBLY THE MACHINE ({}): {} stands out from its peers: {}. No fault on it by itself; check its {} before the next run.{}", o.family, o.node, o.text, o.family, self.incomplete),
            o.family.to_string(),
            Some(o.node.clone()),
            None,
            Some(format!("check {} ({})", o.node, o.family)),
        ))
    }

    /// No node is the culprit: a hang read over all ranks, else what the nodes' own reports
    /// say (the job's side, a hang without counters, a blind node, or nothing found), with
    /// the consequences after the cause listed.
    fn no_culprit(&self) -> Verdict {
        let (nodes, missing, incomplete) = (self.nodes, self.missing, &self.incomplete);
        let has_nan = self.ex.has_nan;
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
        if let Some(h) = self.ex.hang.filter(|h| h.hang.named() || sw.is_empty()) {
            return h.verdict(incomplete, blind);
        }
        let hung = !has_nan
            && nodes
                .iter()
                .any(|s| s.family == crate::report::rules::Family::Hang.label());
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
        } else if hung {
            format!("UNDECIDED ({}): the job's output reports a collective hang, and no rank's watchdog counters are in the bundles read (which rank stopped cannot be read from its lines); no node with a hardware, kernel, system or network fault in the window", crate::report::rules::Family::Hang.label())
        } else if !undecided.is_empty() {
            format!("CANNOT TELL for {}: no kernel events or GPU health there; the other {} node(s) show no machine fault", undecided.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", "), n - undecided.len())
        } else {
            format!("NOT THE MACHINE, as far as nantrace can see: {n} node{} alike, none with a hardware, kernel, system or network fault in the window, no node standing out from its peers. Look at the model side: learning rate, data, precision", if n == 1 { "" } else { "s" })
        };
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
        let base = self.with_consequences(base);
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

    /// `base`, then the nodes whose machine findings are consequences of the cause.
    fn with_consequences(&self, base: String) -> String {
        let after: Vec<String> = self
            .nodes
            .iter()
            .filter(|s| self.consequence(s))
            .filter_map(|s| {
                s.first_machine
                    .as_ref()
                    .map(|f| format!("{}: {}", s.name, f.text))
            })
            .collect();
        if after.is_empty() {
            return base;
        }
        format!(
            "{base}. After the {}, consequences, not the cause: {}",
            match self.ex.first_failure {
                Some(c) if c.explains_network() && (!self.ex.has_nan || c.cause_rel_s < 0.0) =>
                    format!(
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
    }
}
