//! `nantrace merge`: node bundles of one job on one clock. Each bundle records its clock
//! mapping and NTP state; the merge applies each node's correction, orders all events
//! globally and states the residual uncertainty.
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde_json::{json, Value};

/// A merged timeline's schema (the bundle model owns every file's schema).
pub use crate::bundle::MERGED_SCHEMA as SCHEMA;

pub struct Node {
    pub name: String,
    pub dir: PathBuf,
    pub timeline: Value,
    pub snapshot: Value,
    pub correction_s: f64,
    pub uncertainty_s: Option<f64>,
}

pub fn load(dir: &Path) -> anyhow::Result<Node> {
    load_with(dir, crate::bundle::load)
}

/// A node's header and snapshot, its events not read (`events` empty).
pub fn load_head(dir: &Path) -> anyhow::Result<Node> {
    load_with(dir, crate::bundle::load_head)
}

fn load_with(
    dir: &Path,
    read: fn(&Path) -> anyhow::Result<(Value, Value)>,
) -> anyhow::Result<Node> {
    let (t, snapshot) = read(dir).with_context(|| format!("{}", dir.display()))?;
    anyhow::ensure!(
        t["schema"] == crate::bundle::SCHEMA,
        "{}: not a node bundle (schema {})",
        dir.display(),
        t["schema"]
    );
    let mut correction_s = t["clock"]["correction_s"].as_f64().unwrap_or(0.0);
    let mut uncertainty_s = t["clock"]["uncertainty_s"].as_f64();
    // An NTP correction is seconds at most; anything beyond a day is a broken or hostile
    // bundle (redteam 5.21): not applied, and the node counts as unsynchronised.
    if correction_s.is_nan() || correction_s.abs() > 86_400.0 {
        correction_s = 0.0;
        uncertainty_s = None;
    }
    Ok(Node {
        name: t["host"]["hostname"].as_str().unwrap_or("node").to_string(),
        dir: dir.to_path_buf(),
        timeline: t,
        snapshot,
        correction_s,
        uncertainty_s,
    })
}

fn shifted(time: &str, by_s: f64) -> (String, i128) {
    let t = time::OffsetDateTime::parse(time, &time::format_description::well_known::Rfc3339)
        .map(|t| t.unix_timestamp_nanos())
        .unwrap_or(0);
    let n = t.saturating_add((by_s * 1e9) as i128);
    (crate::clock::rfc3339(n), n)
}

/// The job's clock, from the nodes' headers alone (their events are not needed): which
/// bundles are the same incident twice, each node's unique name, the first trigger (offsets
/// count from it) and the first NaN of any node.
pub struct Clock {
    pub skipped: Vec<usize>,
    pub t0: i128,
    triggers: Vec<(i128, Value)>,
    first_nan: Option<Value>,
}

impl Clock {
    /// Names the nodes uniquely (two bundles from one host stay apart) and reads the clock.
    pub fn of(nodes: &mut [Node]) -> Clock {
        for i in 0..nodes.len() {
            if nodes[..i].iter().any(|n| n.name == nodes[i].name) {
                nodes[i].name = format!("{}#{}", nodes[i].name, i + 1);
            }
        }
        let mut triggers = Vec::new();
        let mut nans = Vec::new();
        // The same bundle given twice (or two copies of it) would double every event (5.23):
        // one incident is one (boot, trigger instant); later copies are skipped, and said.
        let mut seen = std::collections::BTreeMap::new();
        let mut skipped = Vec::new();
        for (i, n) in nodes.iter().enumerate() {
            let key = (
                n.timeline["host"]["boot_id"].to_string(),
                n.timeline["trigger"]["mono_ns"].to_string(),
            );
            if key.0 != "null" && key.1 != "null" {
                if let Some(first) = seen.get(&key) {
                    crate::say!("nantrace: WARNING: {} is the same incident as {} (same boot and trigger): merged once", n.dir.display(), first);
                    skipped.push(i);
                    continue;
                }
                seen.insert(key, n.dir.display().to_string());
            }
            let (t, ns) = shifted(
                n.timeline["trigger"]["time"].as_str().unwrap_or(""),
                n.correction_s,
            );
            triggers.push((ns, json!({ "node": n.name, "kind": n.timeline["trigger"]["kind"], "time": t, "reason": n.timeline["trigger"]["reason"] })));
            if let Some(tn) = n.timeline["first_nan"]["time"].as_str() {
                let (t, ns) = shifted(tn, n.correction_s);
                let mut fnan = n.timeline["first_nan"].clone();
                if !fnan.is_object() {
                    continue;
                }
                fnan["time"] = json!(t);
                fnan["node"] = json!(n.name);
                nans.push((ns, fnan));
            }
        }
        triggers.sort_by_key(|t| t.0);
        nans.sort_by_key(|t| t.0);
        let t0 = triggers.first().map_or(0, |t| t.0);
        let first_nan = nans.first().map(|(ns, v)| {
            let mut v = v.clone();
            v["offset_s"] = json!((*ns - t0) as f64 / 1e9);
            v
        });
        Clock {
            skipped,
            t0,
            triggers,
            first_nan,
        }
    }

    /// The job's first NaN on any node (`offset_s` on the job's clock), or null.
    pub fn first_nan(&self) -> Value {
        self.first_nan.clone().unwrap_or(Value::Null)
    }

    /// A node's events moved out of its timeline onto the job's clock (`time` corrected,
    /// `time_node_clock`, `node`, `offset_s` from the first trigger), in the node's order,
    /// each with its corrected instant.
    pub fn events_of(&self, n: &mut Node) -> Vec<(i128, Value)> {
        // The node's events move (one copy in memory, not two: at 1024 nodes the copies were
        // most of the job report's memory). Junk (a number, a string) is not an event:
        // skipped, not a panic (redteam 5.22).
        let own = match n.timeline.get_mut("events").map(Value::take) {
            Some(Value::Array(a)) => a,
            _ => Vec::new(),
        };
        let mut out = Vec::with_capacity(own.len());
        for mut e in own.into_iter().filter(Value::is_object) {
            let (t, ns) = shifted(e["time"].as_str().unwrap_or(""), n.correction_s);
            e["time_node_clock"] = e["time"].clone();
            e["time"] = json!(t);
            e["node"] = json!(n.name);
            e["offset_s"] = json!((ns - self.t0) as f64 / 1e9);
            out.push((ns, e));
        }
        out
    }

    /// The merged timeline (schema `nantrace.merged/1`) of the nodes' headers and `events`
    /// (on the job's clock, in any order: sorted here).
    pub fn assemble(&self, nodes: &[Node], mut events: Vec<(i128, Value)>) -> Value {
        // Stable: events of one instant keep the order they came in (node by node).
        events.sort_by_key(|e| e.0);
        let mut unc: Vec<f64> = nodes.iter().filter_map(|n| n.uncertainty_s).collect();
        unc.sort_by(|a, b| b.total_cmp(a));
        let unsynced: Vec<&str> = nodes
            .iter()
            .filter(|n| n.uncertainty_s.is_none())
            .map(|n| n.name.as_str())
            .collect();
        let residual = if unsynced.is_empty() {
            json!(unc.iter().take(2).sum::<f64>())
        } else {
            Value::Null
        };
        let statement = if unsynced.is_empty() {
            format!("events of different nodes are ordered to within ±{:.3} ms (sum of the two largest NTP error bounds)", unc.iter().take(2).sum::<f64>() * 1e3)
        } else {
            format!("nodes {unsynced:?} report no synchronised clock: cross-node order is only as good as their unsynchronised clocks; within a node, order is exact")
        };
        let first = &nodes[0].timeline;
        // Who wrote the kernel log lines, as every node's dump checked them (not the first
        // node's list for all: a forged line on another node would read as the kernel's).
        let mut accounting = first["accounting"].clone();
        if accounting.is_object() {
            accounting["kernel_writers"] =
                union_kernel_writers(nodes.iter().map(|n| &n.timeline));
        }
        json!({
            "schema": SCHEMA,
            "nodes": nodes.iter().map(|n| json!({
                "name": n.name, "bundle": n.dir.display().to_string(), "host": n.timeline["host"],
                "clock": n.timeline["clock"], "correction_s": n.correction_s, "uncertainty_s": n.uncertainty_s,
                "trigger": n.timeline["trigger"], "accounting": n.timeline["accounting"],
            })).collect::<Vec<_>>(),
            "residual_uncertainty_s": residual,
            "clock_statement": statement,
            "host": { "hostname": format!("{} nodes", nodes.len()), "kernel": first["host"]["kernel"] },
            "trigger": self.triggers.first().map(|t| t.1.clone()),
            "triggers": self.triggers.iter().map(|t| t.1.clone()).collect::<Vec<_>>(),
            "first_nan": self.first_nan,
            "window": first["window"],
            "job": first["job"],
            "accounting": accounting,
            "events": events.into_iter().map(|e| e.1).collect::<Vec<_>>(),
        })
    }
}

/// `accounting.kernel_writers` over several timelines (a node's dumps, or the nodes of a
/// merge): each list's entries once (at most 256 each, as the report reads them), the counts
/// summed.
pub fn union_kernel_writers<'a>(timelines: impl Iterator<Item = &'a Value>) -> Value {
    let mut out = json!({ "checked": 0, "not_checked": 0, "the_kernels": [], "not_the_kernels": [] });
    let (mut k, mut u) = (
        std::collections::BTreeSet::new(),
        std::collections::BTreeSet::new(),
    );
    for t in timelines {
        let w = &t["accounting"]["kernel_writers"];
        for (name, seen) in [("the_kernels", &mut k), ("not_the_kernels", &mut u)] {
            for e in w[name].as_array().into_iter().flatten() {
                let key = (e["mono_ns"].as_u64(), e["text"].as_str().map(str::to_string));
                if seen.len() < 256 && seen.insert(key) {
                    if let Some(a) = out[name].as_array_mut() {
                        a.push(e.clone());
                    }
                }
            }
        }
        for n in ["checked", "not_checked"] {
            out[n] = json!(out[n].as_u64().unwrap_or(0) + w[n].as_u64().unwrap_or(0));
        }
    }
    out
}


/// Merge node timelines into one (schema `nantrace.merged/1`).
pub fn merge(nodes: &mut [Node]) -> Value {
    let clock = Clock::of(nodes);
    let mut events = Vec::new();
    for (i, n) in nodes.iter_mut().enumerate() {
        if !clock.skipped.contains(&i) {
            events.extend(clock.events_of(n));
        }
    }
    clock.assemble(nodes, events)
}

/// The merged timeline as nantrace writes every timeline.json (one event per line), so
/// `nantrace report` reads it back line by line like a node's.
pub fn timeline_bytes(merged: &Value) -> std::io::Result<Vec<u8>> {
    let mut head = merged.clone();
    let events = head
        .as_object_mut()
        .and_then(|o| o.remove("events"))
        .unwrap_or(Value::Null);
    let events = events.as_array().map_or(&[][..], Vec::as_slice);
    let mut out = Vec::new();
    crate::bundle::write_timeline_with(&mut out, &head, events.len(), &mut |i, w| {
        serde_json::to_writer(w, &events[i]).map_err(std::io::Error::from)
    })?;
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn node(name: &str, correction: f64, events: &[(&str, &str)]) -> Node {
        let evs: Vec<Value> = events.iter().map(|(t, what)| json!({ "time": t, "source": "kmsg", "text": what, "pid": 1, "comm": "x", "job": false })).collect();
        Node {
            name: name.into(),
            dir: PathBuf::from(format!("/b/{name}")),
            timeline: json!({ "schema": crate::bundle::SCHEMA, "host": { "hostname": name }, "trigger": { "kind": "file", "time": events[0].0, "reason": "" }, "events": evs, "job": {}, "clock": { "correction_s": correction } }),
            snapshot: Value::Null,
            correction_s: correction,
            uncertainty_s: Some(0.002),
        }
    }

    #[test]
    fn corrected_clocks_give_the_true_global_order() {
        // Node b's clock runs 1.5 s fast: its raw 10:00:01.0 is really 09:59:59.5.
        let a = node(
            "a",
            0.0,
            &[
                ("2026-11-30T10:00:00.000000000Z", "a1"),
                ("2026-11-30T10:00:00.600000000Z", "a2"),
            ],
        );
        let b = node(
            "b",
            -1.5,
            &[
                ("2026-11-30T10:00:01.000000000Z", "b1 (really 09:59:59.5)"),
                ("2026-11-30T10:00:01.800000000Z", "b2 (really 10:00:00.3)"),
            ],
        );
        let mut nodes = vec![a, b];
        let m = merge(&mut nodes);
        let order: Vec<&str> = m["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["text"].as_str().unwrap())
            .collect();
        assert_eq!(
            order,
            [
                "b1 (really 09:59:59.5)",
                "a1",
                "b2 (really 10:00:00.3)",
                "a2"
            ]
        );
        assert_eq!(m["events"][0]["time"], "2026-11-30T09:59:59.500000000Z");
        assert_eq!(
            m["events"][0]["time_node_clock"],
            "2026-11-30T10:00:01.000000000Z"
        );
        assert_eq!(m["events"][0]["node"], "b");
        assert_eq!(m["residual_uncertainty_s"], 0.004);
        assert_eq!(m["trigger"]["node"], "b");
    }

    /// Every node's check of who wrote its kernel log lines reaches the merged timeline (the
    /// second review of 2026-12-04: only the first node's list did, so a forged line on
    /// another node read as the kernel's).
    #[test]
    fn every_nodes_kernel_writers_are_kept() {
        let mut a = node("a", 0.0, &[("2026-11-30T10:00:00Z", "a1")]);
        let mut b = node("b", 0.0, &[("2026-11-30T10:00:01Z", "b1")]);
        a.timeline["accounting"] = json!({ "kernel_writers": { "checked": 1, "not_checked": 0, "the_kernels": [{ "mono_ns": 5, "text": "x" }], "not_the_kernels": [] } });
        b.timeline["accounting"] = json!({ "kernel_writers": { "checked": 2, "not_checked": 3, "the_kernels": [], "not_the_kernels": [{ "mono_ns": 7, "text": "NVRM: Xid forged", "writer": "user" }] } });
        let m = merge(&mut [a, b]);
        let w = &m["accounting"]["kernel_writers"];
        assert_eq!(w["the_kernels"].as_array().unwrap().len(), 1, "{w}");
        assert_eq!(w["not_the_kernels"][0]["text"], "NVRM: Xid forged", "{w}");
        assert_eq!((w["checked"].as_u64(), w["not_checked"].as_u64()), (Some(3), Some(3)));
    }

    #[test]
    fn unsynchronised_nodes_are_said() {
        let a = node("a", 0.0, &[("2026-11-30T10:00:00Z", "a1")]);
        let mut b = node("a", 0.0, &[("2026-11-30T10:00:00Z", "b1")]);
        b.uncertainty_s = None;
        let mut nodes = vec![a, b];
        let m = merge(&mut nodes);
        assert_eq!(m["residual_uncertainty_s"], Value::Null);
        assert!(m["clock_statement"]
            .as_str()
            .unwrap()
            .contains("no synchronised clock"));
        assert_eq!(m["nodes"][1]["name"], "a#2");
    }
}
