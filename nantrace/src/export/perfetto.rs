//! trace.json in the Chrome Trace Event Format (opens in ui.perfetto.dev and chrome://tracing):
//! one process per evidence family (one per node after a merge), one track per source, GPU,
//! disk, peer and job process; counters for GPU/memory/I/O/loss; instants for Xid, AER, OOM,
//! exits, signals and the trigger; job processes as named B/E spans.
use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{json, Value};

mod tracks;
use tracks::Procs;

/// One Trace Event Format record (typed: building 100 k of them as `Value` maps cost twice as
/// much in the dump).
#[derive(Clone, Debug, Serialize)]
pub struct Ev {
    pub name: String,
    pub ph: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub s: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ts: Option<f64>,
    pub pid: u64,
    pub tid: u64,
    #[serde(skip_serializing_if = "Value::is_null")]
    pub args: Value,
}

/// trace.json.
#[derive(Debug, Serialize)]
pub struct Trace {
    #[serde(rename = "traceEvents")]
    pub trace_events: Vec<Ev>,
    #[serde(rename = "displayTimeUnit")]
    pub display_time_unit: &'static str,
    #[serde(rename = "otherData")]
    pub other_data: Value,
}

pub fn rank(ph: &str) -> u8 {
    match ph {
        "B" => 0,
        "E" => 2,
        _ => 1,
    }
}

fn family(source: &str) -> u64 {
    crate::source::Source::parse(source).map_or(8, |s| s.trace_family().0)
}

struct Builder {
    out: Vec<Ev>,
    threads: BTreeMap<(u64, u64), String>,
    node_base: u64,
}

impl Builder {
    fn pid(&self, fam: u64) -> u64 {
        self.node_base + fam
    }
    fn thread(&mut self, fam: u64, tid: u64, name: &str) -> (u64, u64) {
        let pid = self.pid(fam);
        self.threads
            .entry((pid, tid))
            .or_insert_with(|| name.to_string());
        (pid, tid)
    }
    #[expect(
        clippy::too_many_arguments,
        reason = "one call shape for every instant kind; a struct would only rename them"
    )]
    fn instant(
        &mut self,
        ts: f64,
        fam: u64,
        tid: u64,
        tname: &str,
        name: &str,
        args: Value,
        global: bool,
    ) {
        let pid = self.pid(fam);
        self.threads
            .entry((pid, tid))
            .or_insert_with(|| tname.to_string());
        self.out.push(Ev {
            name: name.to_string(),
            ph: "i",
            s: Some(if global { "g" } else { "t" }),
            ts: Some(ts),
            pid,
            tid,
            args,
        });
    }
    fn counter(&mut self, ts: f64, fam: u64, name: &str, values: Value) {
        let pid = self.pid(fam);
        self.out.push(Ev {
            name: name.to_string(),
            ph: "C",
            s: None,
            ts: Some(ts),
            pid,
            tid: 0,
            args: values,
        });
    }
}

fn hash(s: &str) -> u64 {
    s.bytes().fold(1469598103934665603u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(1099511628211)
    }) % 100_000
        + 1000
}

/// Build the trace events of one timeline; `node` (index, name) separates merged nodes.
pub fn events(timeline: &Value, node: Option<(u64, &str)>, base_wall_us: f64) -> Vec<Ev> {
    let mut b = Builder {
        out: Vec::new(),
        threads: BTreeMap::new(),
        node_base: node.map_or(0, |n| (n.0 + 1) * 100),
    };
    let empty = Vec::new();
    let evs = timeline["events"].as_array().unwrap_or(&empty);
    let clock = Clock::of(evs, node.is_none(), base_wall_us);
    let end_ts = evs.iter().map(|e| clock.ts(e)).fold(0.0, f64::max);
    let start_ts = evs
        .iter()
        .map(|e| clock.ts(e))
        .fold(f64::INFINITY, f64::min)
        .min(end_ts);
    let mut procs = Procs {
        open: BTreeMap::new(),
        lifetimes: Vec::new(),
        start_ts,
    };
    for e in evs {
        b.event(e, clock.ts(e), &mut procs);
    }
    b.lifetimes(procs, timeline["job"]["root_pid"].as_u64(), end_ts);
    let mut meta = b.metadata(node.map_or(String::new(), |n| format!("{}: ", n.1)));
    // Stable order: by time, B before instants before E at the same time (keeps spans matched).
    b.out.sort_by(|x, y| {
        x.ts.unwrap_or(0.0)
            .total_cmp(&y.ts.unwrap_or(0.0))
            .then(rank(x.ph).cmp(&rank(y.ph)))
    });
    meta.extend(b.out);
    meta
}

/// A trace's clock: within one node, mono_ns orders exactly and is cheap; merged timelines
/// (whose mono clocks differ per node) go through the corrected wall time.
struct Clock {
    use_mono: bool,
    mono0: u64,
    base_wall_us: f64,
}

impl Clock {
    fn of(evs: &[Value], one_node: bool, base_wall_us: f64) -> Self {
        let use_mono = one_node && evs.iter().all(|e| e["mono_ns"].is_u64());
        let mono0 = evs
            .iter()
            .filter_map(|e| e["mono_ns"].as_u64())
            .min()
            .unwrap_or(0);
        Clock {
            use_mono,
            mono0,
            base_wall_us,
        }
    }

    /// µs from the trace's start.
    fn ts(&self, e: &Value) -> f64 {
        if self.use_mono {
            (e["mono_ns"].as_u64().unwrap_or(self.mono0) - self.mono0) as f64 / 1000.0
        } else {
            wall_us(e) - self.base_wall_us
        }
    }
}

/// Wall time of an event in µs since the epoch (from its RFC 3339 `time`).
pub fn wall_us(e: &Value) -> f64 {
    e["time"]
        .as_str()
        .and_then(|t| {
            time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()
        })
        .map_or(0.0, |t| t.unix_timestamp_nanos() as f64 / 1000.0)
}

pub fn trace(timeline: &Value) -> Trace {
    let base = timeline["events"]
        .as_array()
        .and_then(|a| a.first())
        .map_or(0.0, wall_us);
    Trace {
        trace_events: events(timeline, None, base),
        display_time_unit: "ms",
        other_data: json!({ "generator": "nantrace", "schema": timeline["schema"], "time_zero_utc": crate::clock::rfc3339((base * 1000.0) as i128) }),
    }
}

/// Check a trace against the Trace Event Format rules nantrace relies on; returns the problems.
pub fn validate(trace: &Value) -> Vec<String> {
    let mut errs = Vec::new();
    let Some(evs) = trace["traceEvents"].as_array() else {
        return vec!["no traceEvents array".into()];
    };
    let mut last: BTreeMap<(u64, u64), f64> = BTreeMap::new();
    let mut stacks: BTreeMap<(u64, u64), Vec<String>> = BTreeMap::new();
    for (i, e) in evs.iter().enumerate() {
        let ph = e["ph"].as_str().unwrap_or("");
        if !["B", "E", "X", "i", "I", "C", "M"].contains(&ph) {
            errs.push(format!("event {i}: unknown phase {ph:?}"));
            continue;
        }
        if e["name"].as_str().is_none()
            || e["pid"].as_u64().is_none()
            || e["tid"].as_u64().is_none()
        {
            errs.push(format!("event {i}: missing name/pid/tid"));
        }
        if ph == "M" {
            continue;
        }
        let Some(ts) = e["ts"].as_f64() else {
            errs.push(format!("event {i}: missing ts"));
            continue;
        };
        if ts < 0.0 {
            errs.push(format!("event {i}: negative ts"));
        }
        let track = (
            e["pid"].as_u64().unwrap_or(0),
            e["tid"].as_u64().unwrap_or(0),
        );
        if let Some(p) = last.get(&track) {
            if ts < *p {
                errs.push(format!(
                    "event {i}: ts {ts} goes back on track {track:?} (last {p})"
                ));
            }
        }
        last.insert(track, ts);
        if ph == "i" && !["g", "p", "t"].contains(&e["s"].as_str().unwrap_or("t")) {
            errs.push(format!("event {i}: bad instant scope"));
        }
        if ph == "C" && !e["args"].is_object() {
            errs.push(format!("event {i}: counter without args"));
        }
        match ph {
            "B" => stacks
                .entry(track)
                .or_default()
                .push(e["name"].as_str().unwrap_or("").to_string()),
            "E" if stacks.entry(track).or_default().pop().is_none() => {
                errs.push(format!("event {i}: E without B on {track:?}"));
            }
            _ => {}
        }
    }
    for (t, s) in stacks {
        if !s.is_empty() {
            errs.push(format!("track {t:?}: {} B without E", s.len()));
        }
    }
    errs
}

/// trace.json of a merged timeline (`nantrace merge`, the job report): one group of processes
/// per node.
pub fn merged(merged: &Value, nodes: &[crate::merge::Node]) -> Trace {
    let base = merged["events"]
        .as_array()
        .and_then(|a| a.iter().map(wall_us).reduce(f64::min))
        .unwrap_or(0.0);
    let mut all = Vec::new();
    // Each node's events in one pass over the merged timeline, not a pass per node.
    let mut by_node: std::collections::HashMap<&str, Vec<Value>> = std::collections::HashMap::new();
    for e in merged["events"].as_array().into_iter().flatten() {
        if let Some(n) = e["node"].as_str() {
            by_node.entry(n).or_default().push(e.clone());
        }
    }
    for (i, n) in nodes.iter().enumerate() {
        let node_events = by_node.remove(n.name.as_str()).unwrap_or_default();
        let t = json!({ "events": node_events, "job": n.timeline["job"], "schema": crate::bundle::MERGED_SCHEMA });
        all.extend(events(&t, Some((i as u64, &n.name)), base));
    }
    // Per-track order is what the format needs; metadata first.
    all.sort_by(|a, b| {
        (a.ph != "M")
            .cmp(&(b.ph != "M"))
            .then(a.ts.unwrap_or(0.0).total_cmp(&b.ts.unwrap_or(0.0)))
            .then(rank(a.ph).cmp(&rank(b.ph)))
    });
    Trace {
        trace_events: all,
        display_time_unit: "ms",
        other_data: json!({ "generator": "nantrace merge", "clock": merged["clock_statement"] }),
    }
}

#[cfg(test)]
mod tests {
    use crate::merge::tests::node;

    #[test]
    fn a_merged_trace_is_valid_with_a_lane_group_per_node() {
        let mut nodes = vec![
            node("a", 0.0, &[("2026-11-30T10:00:00.000000000Z", "a1")]),
            node("b", -1.5, &[("2026-11-30T10:00:01.000000000Z", "b1")]),
        ];
        let m = crate::merge::merge(&mut nodes);
        let t = serde_json::to_value(super::merged(&m, &nodes)).unwrap();
        assert!(super::validate(&t).is_empty(), "{:?}", super::validate(&t));
        let names: Vec<&str> = t["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"] == "process_name")
            .filter_map(|e| e["args"]["name"].as_str())
            .collect();
        for node in ["a", "b"] {
            assert!(
                names.contains(&format!("{node}: kernel log").as_str()),
                "{names:?}"
            );
        }
        let a1 = t["traceEvents"].as_array().unwrap().iter().find(|e| {
            e["args"]["text"] == "a1" || e["name"].as_str().is_some_and(|n| n.contains("a1"))
        });
        assert!(a1.is_some(), "node a's event is in the trace: {t}");
    }
}
