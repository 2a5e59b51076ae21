//! The job report's peer comparison: in a data-parallel job the nodes do the same work, so a
//! node whose counts or GPU samples stand out from the median of the others is named.
use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::Outlier;

/// Measures to compare between nodes, from a node's events in the window: counts of kernel
/// events, and its GPUs' samples from their buckets (`start_rel`: a bucket's start relative
/// to the job's reference, [`super::buckets::start_rel`]).
pub(super) fn measures(
    view: &Value,
    gpus: &super::buckets::Buckets,
    start_rel: impl Fn(i64) -> f64,
) -> BTreeMap<&'static str, f64> {
    let mut m = BTreeMap::new();
    // Near the incident only: from PEER_BEFORE_S before the job's reference to PEER_AFTER_S
    // after it (what a node did ten minutes earlier is not this incident).
    let reference = view["first_nan"]["offset_s"].as_f64().unwrap_or(0.0);
    let near = |e: &&Value| {
        e["offset_s"]
            .as_f64()
            .is_none_or(|o| (-PEER_BEFORE_S..=PEER_AFTER_S).contains(&(o - reference)))
    };
    let evs: Vec<&Value> = view["events"]
        .as_array()
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .filter(near)
        .collect();
    let count = |src: &str| evs.iter().filter(|e| e["source"] == src).count() as f64;
    // Loopback is never the fabric (another user's local sockets are not the job's network).
    let lo = crate::report::detect::loopback;
    m.insert(
        "tcp_retransmits",
        evs.iter()
            .filter(|e| {
                e["source"] == "tcp_retransmit"
                    && !lo(e["daddr"].as_str())
                    && !lo(e["saddr"].as_str())
            })
            .count() as f64,
    );
    m.insert("block_errors_or_slow_io", count("block"));
    m.insert("pcie_aer", count("aer"));
    gpus.measures(start_rel, &mut m);
    m
}

/// The peers are compared over this many seconds before the job's reference ...
pub const PEER_BEFORE_S: f64 = 120.0;
/// ... and this many after it (a job that hangs after its NaN keeps retransmitting).
pub const PEER_AFTER_S: f64 = 30.0;

/// How each measure is judged against the peers: (measure, family, higher is worse, the
/// smallest value that can stand out when the peers' median is 0).
pub const MEASURES: &[(&str, &str, bool, f64)] = &[
    ("tcp_retransmits", "network", true, 10.0),
    ("block_errors_or_slow_io", "storage", true, 5.0),
    ("pcie_aer", "PCIe", true, 3.0),
    ("gpu_ecc_corrected_increase", "GPU", true, 10.0),
    ("gpu_pcie_replay_increase", "PCIe", true, 10.0),
    ("gpu_power_w_mean", "GPU", false, 0.0),
    ("gpu_sm_clock_mhz_mean", "GPU", false, 0.0),
    ("gpu_temp_c_mean", "GPU", true, 0.0),
];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Nodes whose measure stands out from the median of the other nodes: for counts, at least
/// 5x the peers' median and at least the measure's floor over it; for the GPU's power and
/// clocks, below half the peers' median; for its temperature, 15 °C over it. Needs two peers
/// at least (with one there is no telling which of the two is the odd one).
pub fn outliers(nodes: &[(String, BTreeMap<&'static str, f64>)]) -> Vec<Outlier> {
    let mut out = Vec::new();
    if nodes.len() < 3 {
        return out;
    }
    for &(measure, family, higher_worse, floor) in MEASURES {
        for (i, (name, m)) in nodes.iter().enumerate() {
            let Some(&v) = m.get(measure) else { continue };
            let peers: Vec<f64> = nodes
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .filter_map(|(_, (_, p))| p.get(measure).copied())
                .collect();
            if peers.len() < 2 {
                continue;
            }
            let med = median(peers.clone());
            let stands_out = match (measure, higher_worse) {
                ("gpu_temp_c_mean", _) => v >= med + 15.0,
                (_, true) => v >= floor.max(1.0) && v >= 5.0 * med && v - med >= floor,
                (_, false) => med > 0.0 && v < 0.5 * med,
            };
            if !stands_out {
                continue;
            }
            let label = measure.replace('_', " ");
            let text = if med > 0.0 {
                format!(
                    "{name}: {label} {v:.0}, {:.1}x the median of {} peers ({med:.0})",
                    v / med,
                    peers.len()
                )
            } else {
                format!(
                    "{name}: {label} {v:.0}, the median of {} peers is 0",
                    peers.len()
                )
            };
            out.push(Outlier {
                node: name.clone(),
                measure,
                family,
                value: v,
                peers_median: med,
                peers: peers.len(),
                text,
                other_ends: Vec::new(),
            });
        }
    }
    out
}

/// A node's TCP links in the window: its own addresses on the job's network (the local ends of
/// the job's connections), the peers the job talks to, and the retransmits to each peer.
#[derive(Debug, Default, Clone)]
pub(super) struct Links {
    own: BTreeSet<String>,
    peers: BTreeSet<String>,
    /// The job's connections as (local, remote) `ip:port`: a retransmit counts only on them.
    sockets: BTreeSet<(String, String)>,
    /// Retransmits per (source, destination) `ip:port`, non-loopback.
    retransmits: BTreeMap<(String, String), usize>,
}

/// The address of an `ip:port` or `[ip]:port` endpoint.
fn ip(endpoint: &str) -> String {
    let e = endpoint.trim();
    match e.strip_prefix('[') {
        Some(r) => r.split(']').next().unwrap_or("").to_string(),
        None => e.rsplit_once(':').map_or(e, |(h, _)| h).to_string(),
    }
}

pub(super) fn links(view: &Value, snapshot: &Value) -> Links {
    let lo = |s: &str| crate::report::detect::loopback(Some(s));
    let mut l = Links::default();
    for s in snapshot["network"]["job_sockets"]
        .as_array()
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .take(4096)
    {
        let (local, remote) = (
            ip(s["local"].as_str().unwrap_or("")),
            ip(s["remote"].as_str().unwrap_or("")),
        );
        if local.is_empty()
            || remote.is_empty()
            || lo(&local)
            || lo(&remote)
            || remote == "0.0.0.0"
            || remote == "::"
        {
            continue;
        }
        l.own.insert(local);
        l.peers.insert(remote);
        l.sockets.insert((
            s["local"].as_str().unwrap_or("").to_string(),
            s["remote"].as_str().unwrap_or("").to_string(),
        ));
    }
    let reference = view["first_nan"]["offset_s"].as_f64().unwrap_or(0.0);
    for e in view["events"].as_array().map_or(&[][..], Vec::as_slice) {
        if e["source"] != "tcp_retransmit"
            || !e["offset_s"]
                .as_f64()
                .is_none_or(|o| (-PEER_BEFORE_S..=PEER_AFTER_S).contains(&(o - reference)))
        {
            continue;
        }
        let (Some(d), Some(sa)) = (e["daddr"].as_str(), e["saddr"].as_str()) else {
            continue;
        };
        if lo(d) || lo(sa) || l.retransmits.len() >= 4096 {
            continue;
        }
        let endpoint = |a: &str, p: &Value| {
            if a.contains(':') {
                format!("[{a}]:{p}")
            } else {
                format!("{a}:{p}")
            }
        };
        *l.retransmits
            .entry((endpoint(sa, &e["sport"]), endpoint(d, &e["dport"])))
            .or_default() += 1;
    }
    l
}

/// Two nodes of a link, in name order.
type Pair<'a> = (&'a str, &'a str);

/// Retransmits on a link (either end) from which it counts as lossy.
const LINK_LOSSY: usize = 5;

/// The bad end of the job's lossy links (the VM cluster's packet-loss case: both
/// ends of a lossy link retransmit, and counting per node named the busier end, rank 0).
/// A link is a pair of the job's nodes, known from each node's own addresses; the culprit is
/// the node at the end of every lossy link, and where one lossy link leaves two such nodes,
/// the one with no clean link while the other end has one (a NIC or cable fault shows on all
/// of its node's links; rank 0's link to a third node stayed clean). None when it cannot tell.
pub(super) fn bad_end(nodes: &[(String, Links)]) -> Option<Outlier> {
    let (pairs, used) = link_counts(nodes);
    // Clean: a link of the job with no retransmit at all (one with a few is neither).
    let any_retx: BTreeSet<(String, String)> = pairs.keys().map(|(a, b)| pair_key(a, b)).collect();
    let lossy: Vec<(Pair, (usize, usize))> = pairs
        .into_iter()
        .filter(|(_, (a, b))| a + b >= LINK_LOSSY)
        .collect();
    if lossy.is_empty() {
        return None;
    }
    let culprit = culprit(&lossy, &used, &any_retx)?;
    Some(describe(culprit, &lossy, &used, &any_retx, nodes.len()))
}

/// An unordered pair of nodes, owned.
fn pair_key(a: &str, b: &str) -> (String, String) {
    if a < b {
        (a.into(), b.into())
    } else {
        (b.into(), a.into())
    }
}

/// Per unordered pair of nodes: retransmits from each end, counted only on the job's own
/// connections; and the pairs the job uses.
#[expect(clippy::type_complexity, reason = "counts per pair, named in the doc")]
fn link_counts(
    nodes: &[(String, Links)],
) -> (
    BTreeMap<(&str, &str), (usize, usize)>,
    BTreeSet<(String, String)>,
) {
    let owner: BTreeMap<&str, &str> = nodes
        .iter()
        .flat_map(|(n, l)| l.own.iter().map(move |a| (a.as_str(), n.as_str())))
        .collect();
    let mut pairs: BTreeMap<(&str, &str), (usize, usize)> = BTreeMap::new();
    let mut used: BTreeSet<(String, String)> = BTreeSet::new();
    // The job's connections as either end listed them at its dump: a retransmit counts only
    // on one of them (not another program's between the same nodes, as slurmd's, nor an
    // earlier job's), and a rank that had already exited (rank 0 after its NaN) still has
    // its connections in its peers' lists.
    let conns: BTreeSet<(&str, &str)> = nodes
        .iter()
        .flat_map(|(_, l)| {
            l.sockets
                .iter()
                .flat_map(|(a, b)| [(a.as_str(), b.as_str()), (b.as_str(), a.as_str())])
        })
        .collect();
    for (n, l) in nodes {
        for p in &l.peers {
            if let Some(&m) = owner.get(p.as_str()).filter(|m| **m != n.as_str()) {
                used.insert(pair_key(n, m));
            }
        }
        for ((src, dst), c) in &l.retransmits {
            if !conns.contains(&(src.as_str(), dst.as_str())) {
                continue;
            }
            if let Some(&m) = owner.get(ip(dst).as_str()).filter(|m| **m != n.as_str()) {
                let k = if n.as_str() < m {
                    (n.as_str(), m)
                } else {
                    (m, n.as_str())
                };
                let e = pairs.entry(k).or_default();
                if n.as_str() == k.0 {
                    e.0 += c;
                } else {
                    e.1 += c;
                }
            }
        }
    }
    (pairs, used)
}

/// The node at the end of every lossy link; of a single lossy link, the end that has no clean
/// link while the other end has one; else none.
fn culprit<'a>(
    lossy: &[(Pair<'a>, (usize, usize))],
    used: &BTreeSet<(String, String)>,
    any_retx: &BTreeSet<(String, String)>,
) -> Option<&'a str> {
    let mut candidates: BTreeSet<&str> = [lossy[0].0 .0, lossy[0].0 .1].into_iter().collect();
    for ((a, b), _) in &lossy[1..] {
        candidates.retain(|c| c == a || c == b);
    }
    let clean = |n: &str| {
        used.iter()
            .filter(|(a, b)| (a == n || b == n) && !any_retx.contains(&(a.clone(), b.clone())))
            .count()
    };
    match candidates.len() {
        1 => candidates.iter().next().copied(),
        2 => {
            let v: Vec<&str> = candidates.iter().copied().collect();
            match (clean(v[0]), clean(v[1])) {
                (0, c) if c > 0 => Some(v[0]),
                (c, 0) if c > 0 => Some(v[1]),
                _ => None,
            }
        }
        _ => None,
    }
}

/// The culprit as an outlier, in words: every lossy link, the other nodes' clean ones.
fn describe(
    culprit: &str,
    lossy: &[(Pair<'_>, (usize, usize))],
    used: &BTreeSet<(String, String)>,
    any_retx: &BTreeSet<(String, String)>,
    n_nodes: usize,
) -> Outlier {
    let total: usize = lossy.iter().map(|(_, (a, b))| a + b).sum();
    let desc: Vec<String> = lossy
        .iter()
        .map(|((a, b), (x, y))| format!("{a}–{b}: {a} {x}, {b} {y} retransmits"))
        .collect();
    let clean_others: Vec<String> = used
        .iter()
        .filter(|k| !any_retx.contains(*k) && k.0 != culprit && k.1 != culprit)
        .map(|(a, b)| format!("{a}–{b}"))
        .collect();
    let other_ends: Vec<String> = lossy
        .iter()
        .map(|((a, b), _)| {
            if *a == culprit {
                (*b).to_string()
            } else {
                (*a).to_string()
            }
        })
        .collect();
    let text = format!(
        "{culprit}: every lossy link of the job ends at {culprit} ({}){}",
        desc.join("; "),
        if clean_others.is_empty() {
            String::new()
        } else {
            format!(
                ", while the other nodes' links stayed clean ({})",
                clean_others.join(", ")
            )
        }
    );
    Outlier {
        node: culprit.to_string(),
        measure: "tcp_lossy_links",
        family: "network",
        value: total as f64,
        peers_median: 0.0,
        peers: n_nodes.saturating_sub(1),
        text,
        other_ends,
    }
}
