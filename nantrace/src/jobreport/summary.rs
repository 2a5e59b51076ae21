//! A node's summary (`summary.json`), written with its bundle: the map step of the job
//! report. What the job report needs of a quiet node (one whose own analysis found nothing
//! and whose window holds no evidence of any kind) in kilobytes: its header, its events that
//! are not the collectors' samples, its GPUs' samples in buckets, its own verdict. A node with
//! anything to say is read from its timeline, as is a node the job's verdict names.
//!
//! A summary is its node's claim, like its timeline (written by the same agent into the same
//! directory): it is used only when it says it was made by this analysis version from a
//! timeline of the size that lies beside it.
use std::path::Path;

use serde_json::{json, Value};

use super::buckets::{Bucket, Buckets};
use super::{node_view, NodePart};
use crate::merge::Node;
use crate::report::Analysis;

/// The version of the analysis a summary's verdict comes from: bumped whenever the node
/// report or the peer measures change what they say of the same timeline, so that the job
/// report reads a summary of an older analysis from its timeline instead.
pub const ANALYSIS_VERSION: u32 = 1;

/// A summary larger than this is not read (a node's is tens of kilobytes).
const SUMMARY_MAX: u64 = 16 << 20;

/// Event sources that never make a node worth reading whole: the job's plain lines, its
/// processes starting and ending normally, the trigger, kernel lines nantrace does not
/// classify (a driver loading).
pub(super) fn quiet(e: &Value) -> bool {
    match e["source"].as_str().unwrap_or("") {
        "kmsg" => e["class"].is_null(),
        "log" => [
            "fault",
            "hang",
            "watchdog",
            "nonfinite",
            "overflow",
            "loss_scale",
        ]
        .iter()
        .all(|k| e[*k].is_null() || e[*k] == false),
        "fork" | "exec" | "trigger" => true,
        "exit" => e["exit_code"].as_i64() == Some(0) && e["signal"].is_null(),
        _ => false,
    }
}

/// A system or disk sample over what the node report's sample detectors act on (swap-in,
/// memory pressure: `report/detect/memory.rs`; a disk's await: `storage.rs`).
fn loud_sample(e: &Value) -> bool {
    let signal = crate::report::rules::signal;
    let over = |v: &Value, t: f64| v.as_f64().is_some_and(|x| x >= t);
    match e["source"].as_str() {
        Some("system") => {
            over(&e["swap_in_kb_s"], signal("swap_thrash").threshold)
                || over(
                    &e["psi_memory_some_avg10"],
                    signal("memory_pressure").threshold,
                )
        }
        Some("disk") => e["disks"].as_object().is_some_and(|m| {
            m.values()
                .any(|d| over(&d["r_await_ms"], 100.0) || over(&d["w_await_ms"], 100.0))
        }),
        _ => false,
    }
}

/// The summary of a node's bundle, from what its dump analysed: `t` its digest (the
/// timeline's head and the events the analysis read, on the node's clock), its snapshot and
/// its own analysis. `timeline` (its size and hash) is added by the bundle's writer.
pub fn of(t: &Value, snapshot: &Value, a: &Analysis) -> Value {
    let events: Vec<&Value> = t["events"]
        .as_array()
        .map_or(Vec::new(), |v| v.iter().collect());
    let gpus = Buckets::of_events(events.iter().copied());
    let mut pcis: Vec<&str> = events.iter().filter_map(|e| e["pci"].as_str()).collect();
    pcis.sort_unstable();
    pcis.dedup();
    let kept: Vec<&Value> = events
        .iter()
        .copied()
        .filter(|e| !super::load::is_sample(e))
        .collect();
    // A sample a detector would act on makes the node loud too: against the job's reference
    // (not its own) the detector could see it in its window.
    let loud_samples = events.iter().filter(|e| loud_sample(e)).count();
    let loud_events: Vec<&&Value> = kept.iter().filter(|e| !quiet(e)).collect();
    let loud = loud_events.len() + loud_samples;
    // A node whose only words are its ranks' hang lines (every node of a hung job): what the
    // job report reads of it (those lines, its stacks, its Flight Recorder and RAS views) is
    // all in the summary; its samples are quiet.
    let hang_only = !a.machine
        && loud_samples == 0
        && loud_events.iter().all(|e| hang_line(e))
        && a
            .suspects
            .iter()
            .all(|f| f.family == crate::report::rules::Family::Hang);
    let complete = t["accounting"]["digest"]["over_the_cap_not_analysed"]
        .as_u64()
        .is_none_or(|n| n == 0);
    json!({
        "schema": crate::bundle::SUMMARY_SCHEMA,
        "analysis": ANALYSIS_VERSION,
        "host": t["host"],
        "clock": t["clock"],
        "trigger": t["trigger"],
        "first_nan": t["first_nan"],
        "job": t["job"],
        "window": t["window"],
        "accounting": t["accounting"],
        "snapshot": super::load::thin_snapshot(snapshot),
        "own": {
            "verdict": a.verdict,
            "family": a.family,
            "machine": a.machine,
            "suspects": a.suspects.len(),
            "events_not_quiet": loud,
            "events_complete": complete,
            "hang_only": hang_only,
        },
        "pcis": pcis,
        "gpu_buckets": gpus.rows(),
        "events": kept,
    })
}

/// A line of the job's that says only that a collective hung (a watchdog or gloo timeout, a
/// rank's counters, an abort after it): nothing the node's samples are needed for.
fn hang_line(e: &Value) -> bool {
    let hang = crate::joblog::JobFamily::Hang.as_str();
    e["source"] == "log"
        && (e["fault"].is_null() || e["fault"]["family"] == hang)
        && ["nonfinite", "overflow", "loss_scale"]
            .iter()
            .all(|k| e[*k].is_null() || e[*k] == false)
}

/// A bundle's summary when the job report may use it instead of its timeline: a current one
/// ([`current`]) of a quiet node, or of a node whose only words are its ranks' hang lines
/// (a hung job's every node: 1024 of them read from their timelines took 38 s).
pub fn usable(dir: &Path) -> Option<Value> {
    let s = current(dir)?;
    let own = &s["own"];
    let read = own["machine"] == false
        && own["events_complete"] == true
        && s["events"].is_array()
        && ((own["suspects"] == 0 && own["events_not_quiet"] == 0) || own["hang_only"] == true);
    read.then_some(s)
}

/// A bundle's summary of this schema and analysis version, made from a timeline of the
/// size of the one beside it.
pub fn current(dir: &Path) -> Option<Value> {
    let f = crate::bundle::open_plain(&dir.join("summary.json")).ok()?;
    if f.metadata().ok()?.len() > SUMMARY_MAX {
        return None;
    }
    let s: Value = serde_json::from_reader(std::io::BufReader::new(f)).ok()?;
    let timeline = crate::bundle::open_plain(&dir.join("timeline.json")).ok()?;
    let bytes = timeline.metadata().ok()?.len();
    // A bundle that says it is incomplete, or has no snapshot.json, is read from its files:
    // its summary may carry a snapshot the files do not.
    let whole = !dir.join(crate::bundle::recover::NOTE).exists()
        && crate::bundle::open_plain(&dir.join("snapshot.json")).is_ok();
    let fits = whole
        && s["schema"] == crate::bundle::SUMMARY_SCHEMA
        && s["analysis"] == ANALYSIS_VERSION
        && s["timeline"]["bytes"].as_u64() == Some(bytes);
    fits.then_some(s)
}

/// The node of a summary: its header and events as a timeline (on its own clock), its
/// summary's snapshot.
pub fn node(dir: &Path, s: &Value) -> Node {
    let mut timeline = json!({ "schema": crate::bundle::SCHEMA });
    for k in [
        "host",
        "clock",
        "trigger",
        "first_nan",
        "job",
        "window",
        "accounting",
        "events",
    ] {
        timeline[k] = s[k].clone();
    }
    let mut correction_s = timeline["clock"]["correction_s"].as_f64().unwrap_or(0.0);
    let mut uncertainty_s = timeline["clock"]["uncertainty_s"].as_f64();
    // As `merge::load`: beyond a day is no correction, and the node counts as unsynchronised.
    if correction_s.is_nan() || correction_s.abs() > 86_400.0 {
        correction_s = 0.0;
        uncertainty_s = None;
    }
    Node {
        name: timeline["host"]["hostname"]
            .as_str()
            .unwrap_or("node")
            .to_string(),
        dir: dir.to_path_buf(),
        timeline,
        snapshot: s["snapshot"].clone(),
        correction_s,
        uncertainty_s,
    }
}

impl NodePart {
    /// A quiet node's part from its summary: its events (not its samples) analysed against
    /// the job's reference, its GPU measures from its buckets, its links; its events given
    /// back.
    pub(super) fn from_summary(
        s: &Value,
        n: &Node,
        events: Vec<Value>,
        (t0_ns, first_nan): (i128, &Value),
    ) -> (NodePart, Vec<Value>) {
        let mut view = node_view(first_nan, n, events);
        let rows: Vec<Bucket> =
            serde_json::from_value(s["gpu_buckets"].clone()).unwrap_or_default();
        let pcis = s["pcis"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p.as_str().map(String::from))
            .collect();
        let part = NodePart::from_view(n, &view, &Buckets::from_rows(rows), pcis, t0_ns);
        let events = match view["events"].take() {
            Value::Array(a) => a,
            _ => Vec::new(),
        };
        (part, events)
    }
}
