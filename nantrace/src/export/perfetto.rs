//! trace.json in the Chrome Trace Event Format (opens in ui.perfetto.dev and chrome://tracing):
//! one process per evidence family (one per node after a merge), one track per source, GPU,
//! disk, peer and job process; counters for GPU/memory/I/O/loss; instants for Xid, AER, OOM,
//! exits, signals and the trigger; job processes as named B/E spans.
use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{json, Value};

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
    // Within one node, mono_ns orders exactly and is cheap; merged timelines (whose mono
    // clocks differ per node) go through the corrected wall time.
    let use_mono = node.is_none() && evs.iter().all(|e| e["mono_ns"].is_u64());
    let mono0 = evs
        .iter()
        .filter_map(|e| e["mono_ns"].as_u64())
        .min()
        .unwrap_or(0);
    let ts_of = |e: &Value| -> f64 {
        if use_mono {
            (e["mono_ns"].as_u64().unwrap_or(mono0) - mono0) as f64 / 1000.0
        } else {
            wall_us(e) - base_wall_us
        }
    };
    let end_ts = evs.iter().map(ts_of).fold(0.0, f64::max);
    let start_ts = evs
        .iter()
        .map(ts_of)
        .fold(f64::INFINITY, f64::min)
        .min(end_ts);
    let mut open: BTreeMap<u64, (f64, String)> = BTreeMap::new();
    let root = timeline["job"]["root_pid"].as_u64();
    let mut lifetimes: Vec<(u64, f64, f64, String)> = Vec::new();
    for e in evs {
        let ts = ts_of(e);
        let src = e["source"].as_str().unwrap_or("?");
        let fam = family(src);
        let pid = e["pid"].as_u64().unwrap_or(0);
        let comm = e["comm"].as_str().unwrap_or("");
        match src {
            "log" => {
                if let Some(l) = e["loss"].as_f64() {
                    b.counter(ts, 5, "loss", json!({ "loss": l }));
                }
                if let Some(s) = e["loss_scale"].as_f64() {
                    b.counter(ts, 5, "loss scale", json!({ "loss_scale": s }));
                }
                if e["fault"].is_object() {
                    let f = &e["fault"];
                    let name = format!(
                        "{}: {}",
                        f["family"].as_str().unwrap_or("?"),
                        f["what"].as_str().unwrap_or("?")
                    );
                    b.instant(
                        ts,
                        5,
                        3,
                        "job errors",
                        &name,
                        json!({ "line": e["line"], "code": f["code"], "rank": f["rank"] }),
                        false,
                    );
                }
                if e["nonfinite"] == true {
                    b.instant(
                        ts,
                        5,
                        1,
                        "non-finite values",
                        "non-finite loss",
                        json!({ "line": e["line"] }),
                        false,
                    );
                } else if e["overflow"] == true {
                    b.instant(
                        ts,
                        5,
                        2,
                        "fp16 overflow",
                        "gradient overflow",
                        json!({ "line": e["line"] }),
                        false,
                    );
                }
            }
            "gpu" => {
                let g = e["gpu"].as_u64().unwrap_or(0);
                for (k, label) in [
                    ("temp_c", "temperature C"),
                    ("power_w", "power W"),
                    ("util_gpu_pct", "utilization %"),
                    ("sm_clock_mhz", "SM clock MHz"),
                ] {
                    if let Some(v) = e[k].as_f64() {
                        b.counter(ts, 2, &format!("GPU{g} {label}"), json!({ k: v }));
                    }
                }
            }
            "system" => {
                for (k, label) in [
                    ("mem_available_kb", "memory available KiB"),
                    ("swap_used_kb", "swap used KiB"),
                    ("cpu_busy_pct", "CPU busy %"),
                    ("iowait_pct", "iowait %"),
                    ("swap_in_kb_s", "swap-in KiB/s"),
                ] {
                    if let Some(v) = e[k].as_f64() {
                        b.counter(ts, 3, label, json!({ k: v }));
                    }
                }
            }
            "job_procs" => {
                if let Some(v) = e["job_rss_kb"].as_f64() {
                    b.counter(ts, 3, "job RSS KiB", json!({ "rss_kb": v }));
                }
            }
            "disk" => {
                if let Some(m) = e["disks"].as_object() {
                    for (d, v) in m {
                        b.counter(
                            ts,
                            7,
                            &format!("{d} await ms"),
                            json!({ "r_await_ms": v["r_await_ms"], "w_await_ms": v["w_await_ms"] }),
                        );
                    }
                }
            }
            "block" => {
                let dev = e["dev"].as_str().unwrap_or("?");
                b.counter(
                    ts,
                    7,
                    &format!("I/O latency ms {dev}"),
                    json!({ "latency_ms": e["latency_ms"] }),
                );
                if e["error"].as_i64().is_some_and(|x| x != 0) {
                    b.instant(
                        ts,
                        7,
                        hash(dev),
                        &format!("block {dev}"),
                        "I/O error",
                        json!({ "error": e["error"], "sector": e["sector"] }),
                        false,
                    );
                }
            }
            "net" => {
                if let Some(v) = e["tcp_retrans_per_s"].as_f64() {
                    b.counter(ts, 6, "TCP retransmits/s", json!({ "retrans_per_s": v }));
                }
            }
            "tcp_retransmit" => {
                let peer = format!("{}:{}", e["daddr"].as_str().unwrap_or("?"), e["dport"]);
                b.instant(
                    ts,
                    6,
                    hash(&peer),
                    &format!("peer {peer}"),
                    "retransmit",
                    json!({ "saddr": e["saddr"], "sport": e["sport"], "state": e["state"] }),
                    false,
                );
            }
            "fork" => {
                let child = e["child_pid"].as_u64().unwrap_or(0);
                open.insert(
                    child,
                    (ts, e["child_comm"].as_str().unwrap_or("").to_string()),
                );
                b.instant(
                    ts,
                    4,
                    pid,
                    &format!("{comm} {pid}"),
                    &format!("fork {child}"),
                    json!({ "child_comm": e["child_comm"] }),
                    false,
                );
            }
            "exit" => {
                let (start, name) = open.remove(&pid).unwrap_or((start_ts, comm.to_string()));
                lifetimes.push((pid, start, ts, name));
                let what = match (e["exit_code"].as_i64(), e["signal"].as_str()) {
                    (_, Some(s)) if e["core_dumped"] == true => format!("{s} (core dumped)"),
                    (_, Some(s)) => s.to_string(),
                    (Some(c), _) => format!("exit {c}"),
                    _ => "exit".into(),
                };
                b.instant(ts, 4, pid, &format!("{comm} {pid}"), &what, json!({ "exit_code": e["exit_code"], "signal": e["signal"], "core_dumped": e["core_dumped"] == true }), false);
            }
            "exec" | "signal" | "oom" => {
                let name = match src {
                    "signal" => format!(
                        "{} -> {}",
                        e["signal"].as_str().unwrap_or("?"),
                        e["target_pid"]
                    ),
                    "oom" => format!("OOM kill {}", e["victim_pid"]),
                    _ => format!("exec {}", e["filename"].as_str().unwrap_or("")),
                };
                let tid = if src == "exec" {
                    pid
                } else {
                    e["target_pid"]
                        .as_u64()
                        .or(e["victim_pid"].as_u64())
                        .unwrap_or(pid)
                };
                b.instant(
                    ts,
                    4,
                    tid,
                    &format!("process {tid}"),
                    &name,
                    e.clone(),
                    src == "oom",
                );
            }
            "kmsg" | "xid" | "aer" => {
                let name = match e["class"].as_str() {
                    Some("xid") => format!("Xid {}", e["xid"]),
                    Some(c) => c.to_string(),
                    None if src == "aer" => "AER".to_string(),
                    None => "kmsg".to_string(),
                };
                let global = matches!(e["severity"].as_str(), Some("critical"));
                b.instant(
                    ts,
                    1,
                    if src == "kmsg" { 1 } else { 2 },
                    if src == "kmsg" {
                        "kernel log"
                    } else {
                        "hardware errors"
                    },
                    &name,
                    json!({ "text": e["text"], "severity": e["severity"] }),
                    global,
                );
            }
            "gpu_change" | "nvml_xid" | "net_change" | "scheduler_change" => {
                let name = e["change"]
                    .as_str()
                    .map(String::from)
                    .unwrap_or_else(|| format!("NVML Xid {}", e["xid"]));
                b.instant(ts, fam, 1, src, &name, e.clone(), false);
            }
            "trigger" => b.instant(
                ts,
                8,
                1,
                "triggers",
                &format!("TRIGGER {}", e["kind"].as_str().unwrap_or("")),
                json!({ "reason": e["reason"] }),
                true,
            ),
            _ => {}
        }
    }
    // Job processes still running at the end of the window.
    for (pid, (start, name)) in open {
        lifetimes.push((pid, start, end_ts, name));
    }
    if let Some(r) = root {
        if !lifetimes.iter().any(|l| l.0 == r) {
            lifetimes.push((r, start_ts, end_ts, "job root".into()));
        }
    }
    for (pid, start, end, name) in lifetimes {
        let (p, t) = b.thread(4, pid, &format!("{name} {pid}"));
        b.out.push(Ev {
            name: format!("{name} {pid}"),
            ph: "B",
            s: None,
            ts: Some(start),
            pid: p,
            tid: t,
            args: Value::Null,
        });
        b.out.push(Ev {
            name: format!("{name} {pid}"),
            ph: "E",
            s: None,
            ts: Some(end.max(start)),
            pid: p,
            tid: t,
            args: Value::Null,
        });
    }
    let prefix = node.map_or(String::new(), |n| format!("{}: ", n.1));
    let mut meta = Vec::new();
    let families: std::collections::BTreeSet<(u64, &str)> = crate::source::Source::ALL
        .iter()
        .map(|s| s.trace_family())
        .collect();
    for (fam, name) in &families {
        meta.push(Ev {
            name: "process_name".into(),
            ph: "M",
            s: None,
            ts: None,
            pid: b.pid(*fam),
            tid: 0,
            args: json!({ "name": format!("{prefix}{name}") }),
        });
        meta.push(Ev {
            name: "process_sort_index".into(),
            ph: "M",
            s: None,
            ts: None,
            pid: b.pid(*fam),
            tid: 0,
            args: json!({ "sort_index": b.pid(*fam) }),
        });
    }
    for ((p, t), n) in &b.threads {
        meta.push(Ev {
            name: "thread_name".into(),
            ph: "M",
            s: None,
            ts: None,
            pid: *p,
            tid: *t,
            args: json!({ "name": n }),
        });
    }
    // Stable order: by time, B before instants before E at the same time (keeps spans matched).
    b.out.sort_by(|x, y| {
        x.ts.unwrap_or(0.0)
            .total_cmp(&y.ts.unwrap_or(0.0))
            .then(rank(x.ph).cmp(&rank(y.ph)))
    });
    meta.extend(b.out);
    meta
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
