//! `nantrace report`: answers "was it the machine?" from a bundle's timeline and snapshot.
//! Ranked suspects come from the signal table in [`rules`]; when nothing fires, the report says
//! so plainly and lists what was checked.
pub(crate) mod detect;
pub mod gpucheck;
pub mod hang;
pub mod order;
pub use order::Order;
mod render;
pub mod rules;

pub use render::{facts_lines, for_bundle, markdown, md, order_lines};

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::{json, Value};

use rules::{Family, Signal};

use crate::source::Source;

/// One suspect: a signal that fired, with its evidence.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    pub signal: &'static str,
    pub family: Family,
    pub severity: u32,
    /// Seconds relative to the first NaN (or the trigger when there is none); negative = before.
    /// The time of its line closest to the reference (for the score).
    pub rel_s: f64,
    /// The time of its earliest line: what "after X" tests (a cause and its consequences).
    #[serde(skip)]
    pub first_rel_s: f64,
    pub text: String,
    pub touches_job: bool,
    pub count: usize,
    pub score: f64,
    /// What NVIDIA's catalog recommends for this Xid/SXid (in words), when it is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action: Option<&'static str>,
    /// The job's network or hang lines after its first failure of another kind (`order`):
    /// listed, never the verdict.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub consequence: bool,
}

impl Finding {
    /// Machine evidence that can set the verdict (a consequence cannot).
    pub fn blames_machine(&self) -> bool {
        self.family.is_machine() && !self.consequence
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Analysis {
    pub verdict: String,
    /// The family the verdict names (`GPU`, `network`, ..., `none`).
    pub family: String,
    pub machine: bool,
    pub reference: String,
    pub suspects: Vec<Finding>,
    pub checked: Vec<String>,
    pub facts: Value,
    /// The job's first failure and the consequences it explains (`order`), when there are.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub order: Option<Order>,
}

fn f(v: &Value) -> Option<f64> {
    v.as_f64()
}

fn when(rel: f64, reference: &str) -> String {
    let a = rel.abs();
    let t = if a < 1.0 {
        format!("{:.0} ms", a * 1000.0)
    } else if a < 120.0 {
        format!("{a:.1} s")
    } else {
        format!("{:.1} min", a / 60.0)
    };
    if rel <= 0.0 {
        format!("{t} before {reference}")
    } else {
        format!("{t} after {reference}")
    }
}

struct Ctx<'a> {
    by_src: std::collections::HashMap<&'a str, Vec<(f64, &'a Value)>>,
    job_pids: BTreeSet<u64>,
    job_gpus: BTreeSet<String>,
    /// "ip:port" of the job's TCP peers and local ends (snapshot.network.job_sockets).
    job_peers: BTreeSet<String>,
    /// Each GPU's memory (MiB) by PCI address, from NVML at the trigger.
    gpu_total_mib: BTreeMap<String, f64>,
    /// Whether NVML answered at the trigger.
    nvml: bool,
    root: Option<u64>,
    /// The job's threads at the trigger (snapshot.json `stacks`).
    stacks: &'a Value,
    /// The incident is a hang: the stall trigger, or a collective hang in the job's output
    /// (a thread's state at the trigger is read only then).
    hung: bool,
}

impl Ctx<'_> {
    /// Events of one source that can be causes: a cause precedes its effect, so only what
    /// happened before the reference (with 0.2 s of slack for the log line's own delivery
    /// through the job's pipe).
    fn src(&self, s: Source) -> impl Iterator<Item = &(f64, &Value)> + '_ {
        self.by_src
            .get(s.as_str())
            .into_iter()
            .flatten()
            .filter(|(r, _)| *r <= 0.2)
    }

    /// Every event of one source in the window, before and after the reference.
    fn all(&self, s: Source) -> impl Iterator<Item = &(f64, &Value)> + '_ {
        self.by_src.get(s.as_str()).into_iter().flatten()
    }
}

struct Acc {
    out: BTreeMap<String, Finding>,
}

impl Acc {
    fn add(
        &mut self,
        sig: &'static Signal,
        key: &str,
        rel: f64,
        touches: bool,
        text: impl FnOnce() -> String,
    ) {
        let k = format!("{}/{key}", sig.id);
        match self.out.get_mut(&k) {
            Some(x) => {
                x.count += 1;
                x.touches_job |= touches;
                if rel.abs() < x.rel_s.abs() {
                    x.rel_s = rel;
                }
                x.first_rel_s = x.first_rel_s.min(rel);
            }
            None => {
                self.out.insert(
                    k,
                    Finding {
                        signal: sig.id,
                        family: sig.family,
                        severity: sig.severity,
                        rel_s: rel,
                        first_rel_s: rel,
                        text: text(),
                        touches_job: touches,
                        count: 1,
                        score: 0.0,
                        action: None,
                        consequence: false,
                    },
                );
            }
        }
    }

    /// A finding's earliest line, where its detector merged lines before adding them.
    fn set_first(&mut self, sig: &'static Signal, key: &str, first: f64) {
        if let Some(f) = self.out.get_mut(&format!("{}/{key}", sig.id)) {
            f.first_rel_s = f.first_rel_s.min(first);
        }
    }

    fn set_action(&mut self, sig: &'static Signal, key: &str, action: &str) {
        if let Some(f) = self.out.get_mut(&format!("{}/{key}", sig.id)) {
            f.action = Some(crate::classify::action_text(action));
        }
    }
}

fn job_gpus(snapshot: &Value, job_pids: &BTreeSet<u64>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let devs = snapshot["gpu"]["devices"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for d in &devs {
        if let Some(ps) = d["compute_processes"].as_array() {
            if ps
                .iter()
                .any(|p| p["pid"].as_u64().is_some_and(|x| job_pids.contains(&x)))
            {
                out.insert(d["pci"].as_str().unwrap_or("").to_string());
            }
        }
    }
    if let Some(cvd) = snapshot["software"]["env"]["CUDA_VISIBLE_DEVICES"].as_str() {
        for idx in cvd.split(',').filter_map(|s| s.trim().parse::<u64>().ok()) {
            if let Some(d) = devs.iter().find(|d| d["index"].as_u64() == Some(idx)) {
                out.insert(d["pci"].as_str().unwrap_or("").to_string());
            }
        }
    }
    out
}

fn p99(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(
        v[((v.len() as f64 * 0.99).ceil() as usize)
            .saturating_sub(1)
            .min(v.len() - 1)],
    )
}

/// The analysis of a bundle's files as bytes (timeline.json, and snapshot.json when there is
/// one): the pure part of `nantrace report`, also the fuzzing entry point. Bad input is an
/// error, never a panic.
pub fn from_bytes(
    timeline: &[u8],
    snapshot: Option<&[u8]>,
) -> anyhow::Result<(Analysis, Value, Value)> {
    use anyhow::Context as _;
    let t: Value = serde_json::from_slice(timeline).context("timeline.json is not valid JSON")?;
    anyhow::ensure!(
        t["schema"] == crate::bundle::SCHEMA || t["schema"] == crate::bundle::MERGED_SCHEMA,
        "unknown schema {}",
        t["schema"]
    );
    anyhow::ensure!(
        t["events"].is_array() || t["events"].is_null(),
        "timeline.json: `events` is not a list"
    );
    let snap: Value = snapshot
        .and_then(|b| serde_json::from_slice(b).ok())
        .unwrap_or_else(|| json!({ "gpu": { "reason": "no snapshot.json in the bundle" } }));
    Ok((analyze(&t, &snap), t, snap))
}

/// Evaluate every signal over the incident.
pub fn analyze(timeline: &Value, snapshot: &Value) -> Analysis {
    let nan_off = f(&timeline["first_nan"]["offset_s"]);
    let ref_off = nan_off.unwrap_or(0.0);
    let empty = Vec::new();
    let evs = timeline["events"].as_array().unwrap_or(&empty);
    let root = timeline["job"]["root_pid"].as_u64();
    // The job's processes: events they caused. A signal event's `job` flag is about its target
    // (the sender can be anyone), so it does not make its sender a job process.
    let mut job_pids: BTreeSet<u64> = evs
        .iter()
        .filter(|e| e["job"] == true && e["source"] != "signal")
        .filter_map(|e| e["pid"].as_u64())
        .collect();
    job_pids.extend(root);
    for e in evs
        .iter()
        .filter(|e| e["source"] == "fork" && e["job"] == true)
    {
        job_pids.extend(e["child_pid"].as_u64());
    }
    let events: Vec<(f64, &Value)> = evs
        .iter()
        .map(|e| (f(&e["offset_s"]).unwrap_or(0.0) - ref_off, e))
        .collect();
    let mut by_src: std::collections::HashMap<&str, Vec<(f64, &Value)>> =
        std::collections::HashMap::new();
    for (r, e) in &events {
        by_src
            .entry(e["source"].as_str().unwrap_or(""))
            .or_default()
            .push((*r, *e));
    }
    let ctx = Ctx {
        by_src,
        job_gpus: job_gpus(snapshot, &job_pids),
        gpu_total_mib: snapshot["gpu"]["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| {
                Some((
                    d["pci"].as_str()?.to_string(),
                    d["memory"]["total_bytes"].as_f64()? / 1_048_576.0,
                ))
            })
            .collect(),
        nvml: snapshot["gpu"]["available"] == true,
        job_peers: snapshot["network"]["job_sockets"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|s| [s["remote"].as_str(), s["local"].as_str()])
            .flatten()
            .map(String::from)
            .collect(),
        job_pids,
        root,
        stacks: &snapshot["stacks"],
        hung: timeline["trigger"]["kind"] == "stall"
            || timeline["events"].as_array().is_some_and(|ev| {
                ev.iter().any(|e| {
                    e["source"] == "log"
                        && e["fault"]["family"].as_str()
                            == Some(crate::joblog::JobFamily::Hang.as_str())
                })
            }),
    };
    let mut acc = Acc {
        out: BTreeMap::new(),
    };

    detect::all(&ctx, &mut acc);
    // Row remapping state at the trigger (NVML): a failed remap, or rows waiting for a reset.
    for d in snapshot["gpu"]["devices"].as_array().into_iter().flatten() {
        let (rr, pci) = (&d["remapped_rows"], d["pci"].as_str().unwrap_or("?"));
        let touches = ctx.job_gpus.contains(pci);
        if rr["failure_occurred"] == true {
            acc.add(
                rules::signal("gpu_remap_failure"),
                pci,
                0.0,
                touches,
                || {
                    format!(
                        "row remapping failed on {pci} (NVML: {} uncorrectable remapped rows)",
                        rr["uncorrectable"]
                    )
                },
            );
        } else if rr["pending"] == true {
            acc.add(rules::signal("gpu_remap_pending"), pci, 0.0, touches, || format!("rows of {pci} wait for a GPU reset to be remapped (NVML: {} uncorrectable, {} correctable remapped rows)", rr["uncorrectable"], rr["correctable"]));
        }
    }

    // What the first non-finite line holds: a NaN, or an Inf with a finite loss (the demo's
    // `loss 4.98e36 | grad_norm inf` is not a NaN); from the bundle, else read again.
    let first = &timeline["first_nan"];
    let what = first["what"]
        .as_str()
        .map(|w| (w.to_string(), first["is_nan"] != false))
        .or_else(|| first["line"].as_str().and_then(crate::nanscan::describe));
    let ref_name = match (nan_off, &what) {
        (None, _) => "the trigger",
        (Some(_), Some((_, false))) => "the first non-finite value",
        _ => "the first NaN",
    };
    // Training steps the job logged, by time against the reference: a warning the job ran on
    // long after (a transport it then did without) is context, not the cause.
    let steps: Vec<f64> = ctx
        .by_src
        .get("log")
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .filter(|(_, e)| !e["loss"].is_null() || !e["step"].is_null())
        .map(|(r, _)| *r)
        .collect();
    let mut suspects: Vec<Finding> = acc.out.into_values().collect();
    let mut context = Vec::new();
    suspects.retain(|s| {
        let ran_on = steps.iter().filter(|t| **t > s.rel_s + 5.0 && **t <= 0.2).count();
        let outlived = nan_off.is_some() && s.rel_s < -OUTLIVED_S && ran_on >= OUTLIVED_STEPS && matches!(s.signal, "joblog_network" | "joblog_network_generic" | "joblog_hang");
        if outlived {
            context.push(format!("context, not evidence: {} ({:.0} s before {ref_name}; the job ran on after it: {ran_on} training steps logged)", s.text, -s.rel_s));
        }
        !outlived
    });
    let mut order = order::first_cause(&ctx, &steps);
    if let Some(o) = order.as_mut() {
        o.reference = ref_name;
    }
    for s in &mut suspects {
        let closeness = 1.0 / (1.0 + s.rel_s.abs() / 60.0);
        s.score = f64::from(s.severity)
            * (0.5 + 0.5 * closeness)
            * if s.touches_job { 1.25 } else { 1.0 };
        if s.count > 1 && !s.text.ends_with(" since") {
            s.text.push_str(&format!(" (×{})", s.count));
        }
        let sep = if s.text.ends_with(" since") {
            " "
        } else {
            ", "
        };
        s.text = format!("{}{sep}{}", s.text, when(s.rel_s, ref_name));
        // The job's network and hang lines after its first failure of another kind, on any
        // rank, are what that failure did to the other ranks; an ambiguous GPU error after a
        // network failure is what the failed transfers did (`order`).
        if let Some(o) = order
            .as_mut()
            .filter(|o| o.explains(s.signal, s.first_rel_s, &steps))
        {
            s.score *= 0.2;
            s.consequence = true;
            // A hang explained by the failure before it no longer needs "where to look".
            for note in [
                "; no cause in view on this node",
                "; a network error is also in the window",
            ] {
                if let Some(i) = s.text.find(note) {
                    let end = s.text[i..].find(": \"").map_or(s.text.len(), |j| i + j);
                    s.text.replace_range(i..end, "");
                }
            }
            let rank = o
                .cause_rank
                .map_or(String::new(), |r| format!(" on rank {r}"));
            s.text.push_str(&format!(
                " (after the job's first failure, {}{rank}: a consequence, not its cause)",
                o.cause_what
            ));
            o.consequences.push(s.text.clone());
            continue;
        }
        // The job's broken connections and hangs after its NaN are what the NaN did (a rank
        // stopped, its peers lost it), not its cause: they never outrank what came before.
        // No slack here (a cause's 0.2 s of delivery slack is for lines that can be causes):
        // a peer's `connection lost` 189 ms after the NaN is after it (the VM cluster's n1).
        if nan_off.is_some()
            && s.first_rel_s > 0.0
            && matches!(
                s.signal,
                "joblog_network" | "joblog_network_generic" | "joblog_hang"
            )
        {
            s.score *= 0.2;
            s.text.push_str(" (after it: a consequence, not its cause)");
        }
    }
    // A silent-data-corruption check run after the incident (gpucheck.json in the bundle): a
    // GPU that disagrees with itself or its peers is the strongest GPU evidence there is.
    if snapshot["gpucheck"].is_object() && snapshot["gpucheck"]["error"].is_null() {
        let sig = rules::signal("gpucheck_mismatch");
        for f in gpucheck::findings(&snapshot["gpucheck"])
            .into_iter()
            .filter(|f| !f.contains("did not complete") && !f.contains(" not checked: "))
        {
            let score = f64::from(sig.severity) * 1.25;
            suspects.push(Finding { signal: sig.id, family: sig.family, severity: sig.severity, rel_s: 0.0, first_rel_s: 0.0, text: format!("nantrace gpucheck after the incident: {f}"), touches_job: true, count: 1, score, action: Some("take the GPU out of service and run the vendor's diagnostics (dcgmi diag -r 3)"), consequence: false });
        }
    }
    suspects.sort_by(|a, b| b.score.total_cmp(&a.score));

    // A bundle's window as it says, within what nantrace records (a week); anything else
    // (a user's bundle with 1e300, redteam3 D-14) is not printed as a number of minutes.
    let window_min = match &timeline["window"]["pre_s"] {
        Value::Null => 10.0,
        v => v
            .as_f64()
            .filter(|v| v.is_finite() && *v > 0.0 && *v <= WINDOW_MAX_S)
            .map_or(f64::NAN, |v| v / 60.0),
    };
    let (verdict, family) = verdict(&suspects, timeline, snapshot, window_min, ref_name);
    let machine: Vec<&Finding> = suspects.iter().filter(|s| s.blames_machine()).collect();
    let reference = match nan_off {
        Some(_) => format!(
            "{} at {} ({}): {}",
            match &what {
                Some((w, true)) => format!("first NaN ({w})"),
                Some((w, false)) => format!("first non-finite value ({w}; no NaN yet)"),
                None => "first NaN".into(),
            },
            first["time"].as_str().unwrap_or("?"),
            local_time(first["time"].as_str()),
            first["line"].as_str().unwrap_or("")
        ),
        None => format!(
            "no NaN in the log; times are relative to the trigger ({} at {})",
            timeline["trigger"]["kind"].as_str().unwrap_or("?"),
            timeline["trigger"]["time"].as_str().unwrap_or("?")
        ),
    };
    let mut checked = checked(timeline, snapshot);
    checked.extend(context);
    Analysis {
        verdict,
        family,
        machine: !machine.is_empty(),
        reference,
        suspects,
        checked,
        facts: facts(timeline, snapshot),
        order: order.filter(|o| !o.consequences.is_empty()),
    }
}

/// The longest window a bundle can say it kept (`run --window` allows a week).
pub const WINDOW_MAX_S: f64 = 7.0 * 86_400.0;

/// A job-output network or hang warning this long before the reference, with the job's
/// training going on after it ([`OUTLIVED_STEPS`] steps logged), is context: the job did
/// without what it warned about (NCCL's `NET/IB : No device found` at start-up, then hours of
/// training over sockets).
pub const OUTLIVED_S: f64 = 120.0;
pub const OUTLIVED_STEPS: usize = 20;

static PCI_IN_TEXT: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
    regex::Regex::new(r"(?i)\b([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])\b").unwrap()
});

/// A finding that implicates a GPU in the node's history: the GPU's own hardware, on the
/// kernel's or NVML's evidence (redteam4 D-6: an Xid NVIDIA lists as possibly the
/// application's, a power cap, a corrected ECC error are not a fault of it). Any GPU of the
/// node, the job's or not (the job's GPUs are unknown without NVML): the history counts each
/// fault once however many jobs' bundles hold it (`implicated_faults`, D-5).
fn implicates_a_gpu(f: &Finding) -> bool {
    f.family == Family::Gpu
        && !rules::is_job_words(f.signal)
        && !matches!(
            f.signal,
            "xid_app_possible" | "gpu_power_cap" | "ecc_corrected"
        )
}

/// The faults behind `implicated_gpus`, each once: (PCI, signal, the wall time of its first
/// line in ms), with `reference_wall_ns` the time the analysis counts from (the first NaN, or
/// the trigger). The same Xid in three watched jobs' bundles, or in every later incident's
/// window, is one fault (redteam4 D-5).
pub fn implicated_faults(
    a: &Analysis,
    reference_wall_ns: i128,
) -> Vec<(String, &'static str, i64)> {
    let mut out: Vec<(String, &'static str, i64)> = Vec::new();
    let base_ms = (reference_wall_ns / 1_000_000) as i64;
    for f in a.suspects.iter().filter(|f| implicates_a_gpu(f)) {
        // A finding folds every line of its kind: its earliest and the one nearest the
        // reference (a new Xid that triggered this dump, after one an earlier bundle had).
        let mut times = vec![base_ms + (f.first_rel_s * 1000.0).round() as i64];
        let near = base_ms + (f.rel_s * 1000.0).round() as i64;
        if (near - times[0]).abs() > 250 {
            times.push(near);
        }
        for c in PCI_IN_TEXT.captures_iter(&f.text) {
            let pci = c[1].to_ascii_lowercase();
            for t in &times {
                if out.len() < 64
                    && !out
                        .iter()
                        .any(|(p, s, x)| *p == pci && *s == f.signal && x == t)
                {
                    out.push((pci.clone(), f.signal, *t));
                }
            }
        }
    }
    out
}

/// The GPUs an analysis implicates on the kernel's or NVML's evidence (never the job's words):
/// (PCI address, UUID from NVML when known), at most 16, for the agent's incident history.
pub fn implicated_gpus(a: &Analysis, snapshot: &Value) -> Vec<(String, Option<String>)> {
    let devs = snapshot["gpu"]["devices"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    let mut out: Vec<(String, Option<String>)> = Vec::new();
    for f in a.suspects.iter().filter(|f| implicates_a_gpu(f)) {
        for c in PCI_IN_TEXT.captures_iter(&f.text) {
            let pci = c[1].to_ascii_lowercase();
            if out.len() < 16 && !out.iter().any(|(p, _)| *p == pci) {
                let uuid = devs
                    .iter()
                    .find(|d| {
                        d["pci"]
                            .as_str()
                            .is_some_and(|p| p.eq_ignore_ascii_case(&pci))
                    })
                    .and_then(|d| d["uuid"].as_str())
                    .map(String::from);
                out.push((pci, uuid));
            }
        }
    }
    out
}

/// The verdict and the family it names. Any machine-family suspect (GPU, PCIe, host memory,
/// host kernel/CPU, storage, network) makes it "PROBABLY" (a strong signal) or "POSSIBLY"
/// THE MACHINE: nantrace never says "not the machine" while the machine spoke. Without one,
/// the job's own software or GPU-memory-limit error is named, then an unexplained hang; only
/// with none of these, and with eyes (probes or NVML), "NOT THE MACHINE as far as nantrace can see".
/// The job stopped making progress (the stall trigger) and nothing on this node explains it:
/// never "the model side"; where each rank stood at the trigger, from the stacks.
fn stall_verdict(timeline: &Value, snapshot: &Value) -> (String, String) {
    let stacks = &snapshot["stacks"];
    let mut ranks: Vec<u32> = stacks["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["rank_main"] == true)
        .filter_map(|p| p["rank"].as_u64().and_then(|r| u32::try_from(r).ok()))
        .collect();
    ranks.sort_unstable();
    let mut at: Vec<String> = ranks
        .iter()
        .take(8)
        .filter_map(|r| detect::rank_state(stacks, *r).map(|s| format!("rank {r}, {s}")))
        .collect();
    if at.is_empty() {
        // No ranks: the job's first process.
        if let Some(p) = stacks["processes"].as_array().and_then(|a| a.first()) {
            let t = &p["threads"][0];
            at.push(format!(
                "pid {}: main thread {}{}",
                p["pid"],
                t["state"][1]
                    .as_str()
                    .or(t["state"][0].as_str())
                    .unwrap_or("?"),
                t["wchan"][1]
                    .as_str()
                    .filter(|w| !w.is_empty() && *w != "0")
                    .map_or(String::new(), |w| format!(" in {w}"))
            ));
        }
    }
    let at = match detect::rank_groups([(None, stacks)]) {
        Some(g) => g,
        None if at.is_empty() => "no job process was left to sample".to_string(),
        None => format!("at the trigger: {}", at.join("; ")),
    };
    (
        format!(
            "UNDECIDED ({}): the job stopped making progress ({}), with no GPU, network, storage or host fault on this node in the window; {at}. A rank blocked elsewhere (another node) or the job's own code (a rank-only branch, data loading, a deadlock): merge the other nodes' bundles",
            rules::Family::Hang.label(),
            crate::term::clean(timeline["trigger"]["reason"].as_str().unwrap_or("stall"))
        ),
        rules::Family::Hang.label().to_string(),
    )
}

/// A collective hang with no machine fault in view: the ranks' watchdog lines say which rank
/// stopped, where they can (`hang`); else the rank that stopped is on another node.
fn hang_verdict(top: &Finding, timeline: &Value, snapshot: &Value) -> (String, String) {
    let dist = &timeline["job"]["identity"]["distributed"];
    let world = dist["world_size"]
        .as_u64()
        .and_then(|w| u32::try_from(w).ok());
    // This node's ranks, when its bundle says them: another node's ranks print nothing here.
    let local: Option<BTreeSet<u32>> = dist["ranks"].as_array().map(|a| {
        a.iter()
            .filter_map(|r| r["rank"].as_u64().and_then(|r| u32::try_from(r).ok()))
            .collect()
    });
    let lines = timeline["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["source"] == "log")
        .filter_map(|e| e["line"].as_str())
        .map(|l| (None, l));
    let label = top.family.label().to_string();
    let stacks = &snapshot["stacks"];
    let with_stacks = |h: &hang::Hang| {
        let at: Vec<String> = h
            .ranks
            .iter()
            .take(8)
            .filter_map(|r| detect::rank_state(stacks, *r).map(|s| format!("rank {r}, {s}")))
            .collect();
        let groups =
            detect::rank_groups([(None, stacks)]).map_or(String::new(), |g| format!("; {g}"));
        if at.is_empty() {
            format!("{}{groups}", h.sentence(&|_| None))
        } else {
            format!(
                "{}; at the trigger: {}{groups}",
                h.sentence(&|_| None),
                at.join("; ")
            )
        }
    };
    match hang::judge(lines, world, local.as_ref()) {
        Some(h) if h.kind == hang::Kind::Mismatch => (
            format!(
                "NOT THE MACHINE ({}): {}; no GPU, network or host fault on this node in the window",
                Family::Software.label(),
                with_stacks(&h)
            ),
            Family::Software.label().to_string(),
        ),
        // The job's side only with eyes on the machine: probes or NVML, and no machine
        // evidence evicted (a GPU off the bus also stops NVML and the stuck rank's output).
        Some(h) if h.jobs_side() && sees_the_machine(timeline, snapshot) => (
            format!(
                "NOT THE MACHINE ({}), most likely: {}; no GPU, network, storage or host fault on this node in the window: the job's side ({}). Take that rank's stacks while it hangs (py-spy dump --pid)",
                Family::Software.label(),
                with_stacks(&h),
                hang::JOBS_SIDE_CAVEAT
            ),
            Family::Software.label().to_string(),
        ),
        Some(h) if h.named() => (
            format!(
                "UNDECIDED ({label}): {}. No GPU, network or host fault on this node in the window: look at that rank (its stacks while it hangs: py-spy dump --pid)",
                with_stacks(&h)
            ),
            label,
        ),
        Some(h) => (
            format!(
                "UNDECIDED ({label}): {}; {}. No GPU, network or host fault on this node in the window: the rank that stopped is elsewhere; merge the other nodes' bundles (nantrace report on the job's incident)",
                top.text,
                with_stacks(&h)
            ),
            label,
        ),
        None => (
            format!(
                "UNDECIDED ({label}): {}. No GPU, network or host fault on this node in the window: the rank that stopped is elsewhere; merge the other nodes' bundles (nantrace merge)",
                top.text
            ),
            label,
        ),
    }
}

fn verdict(
    suspects: &[Finding],
    timeline: &Value,
    snapshot: &Value,
    window_min: f64,
    ref_name: &str,
) -> (String, String) {
    let first = |pred: &dyn Fn(&Finding) -> bool| suspects.iter().find(|s| pred(s));
    let label = |f: &Finding| f.family.label().to_string();
    // A GPU fault of the kind the job's own code can cause (Xid 13/31/43, illegal address),
    // next to the job's own software error (a device-side assert): the error explains it.
    let ambiguous_gpu = |f: &Finding| {
        matches!(
            f.signal,
            "xid_app_possible" | "joblog_gpu_ambiguous" | "joblog_gpu_oom_not_limit"
        )
    };
    // Only a cause explains (a device-side assert, an invalid CUDA call): the abort or the
    // segfault that follows a GPU fault is its consequence, not its explanation.
    if let Some(sw) = first(&|s| s.signal == "joblog_software_bug") {
        let machine: Vec<&Finding> = suspects.iter().filter(|s| s.blames_machine()).collect();
        if !machine.is_empty()
            && machine.iter().all(|m| {
                ambiguous_gpu(m)
                    && (m.rel_s - sw.rel_s).abs() <= rules::signal("joblog_software_bug").threshold
            })
        {
            return (
                format!(
                    "NOT THE MACHINE ({}): {}; the GPU fault next to it follows from it: {}",
                    sw.family.label(),
                    sw.text,
                    machine[0].text
                ),
                label(sw),
            );
        }
    }
    if let Some(top) = first(&|s| s.blames_machine()) {
        let job_sw = first(&|s| matches!(s.family, Family::Software | Family::GpuMemoryLimit))
            .map_or(String::new(), |s| {
                format!(" (the job also reported: {})", s.text)
            });
        // The GPU faulted, but NVIDIA's catalog (or CUDA) says the job's own code can cause it.
        let ambiguous = matches!(
            top.signal,
            "xid_app_possible" | "joblog_gpu_ambiguous" | "joblog_gpu_oom_not_limit"
        );
        // The job's words alone (any user can print a kernel's or a driver's line): at most
        // POSSIBLY, and the family says so. Where the kernel log was watched and shows no such
        // fault, that is evidence against them, and the verdict says it.
        // A thread's state the job can cause (its own FUSE daemon holding it in D state)
        // does not lift the job's words above them (review of 12-02).
        if rules::is_job_words(top.signal)
            && suspects
                .iter()
                .filter(|s| s.blames_machine())
                .all(|s| rules::is_job_words(s.signal) || rules::user_controllable(s.signal))
        {
            let watched = timeline["accounting"]["probes_attached"]
                .as_array()
                .is_some_and(|a| {
                    a.iter().any(|p| {
                        p.as_str().is_some_and(|p| {
                            p.starts_with("printk:") || p == "kmsg" || p.ends_with("/dev/kmsg")
                        })
                    })
                });
            let nvml = snapshot["gpu"]["available"].as_bool() == Some(true);
            let against = match (watched, nvml) {
                (true, true) => "; the kernel log, watched, and NVML show no such fault",
                (true, false) => "; the kernel log, watched, shows no such fault",
                (false, true) => "; NVML shows no such fault, and the kernel log was not watched",
                (false, false) => "; neither the kernel log nor NVML was watched to confirm it",
            };
            let or_code = if ambiguous {
                ", or the job's own code"
            } else {
                ""
            };
            return (format!("POSSIBLY THE MACHINE ({}{or_code}), in the job's own words only: {}{against}{job_sw}", top.family.label(), top.text), format!("{}{}", top.family.label(), rules::JOB_WORDS_SUFFIX));
        }
        return if top.severity >= 60 {
            (
                format!(
                    "PROBABLY THE MACHINE ({}): {}{job_sw}",
                    top.family.label(),
                    top.text
                ),
                label(top),
            )
        } else if ambiguous {
            (
                format!(
                    "POSSIBLY THE MACHINE ({}, or the job's own code): {}{job_sw}",
                    top.family.label(),
                    top.text
                ),
                label(top),
            )
        } else {
            (
                format!(
                    "POSSIBLY THE MACHINE ({}, weak signals only): {}{job_sw}",
                    top.family.label(),
                    top.text
                ),
                label(top),
            )
        };
    }
    if let Some(top) = first(&|s| matches!(s.family, Family::Software | Family::GpuMemoryLimit)) {
        let why = if top.family == Family::GpuMemoryLimit {
            "a resource limit, not a fault: reduce the batch or sequence length, or use more GPUs"
        } else {
            "a bug or a configuration problem in the job, not a machine fault"
        };
        return (
            format!(
                "NOT THE MACHINE ({}): {}; {why}",
                top.family.label(),
                top.text
            ),
            label(top),
        );
    }
    if let Some(top) = first(&|s| s.family == Family::Hang && !s.consequence) {
        return hang_verdict(top, timeline, snapshot);
    }
    let acc = &timeline["accounting"];
    let probes = acc["probes_attached"]
        .as_array()
        .is_some_and(|a| !a.is_empty());
    let nvml = snapshot["gpu"]["available"].as_bool() == Some(true);
    if !probes && !nvml {
        return (
            format!(
                "CANNOT TELL: nantrace saw neither kernel events ({}) nor GPU health (NVML: {}); the job's output names no machine fault. Run as root with the probes to answer.",
                acc["probes_error"].as_str().unwrap_or("probes not loaded"),
                snapshot["gpu"]["reason"].as_str().unwrap_or("not available")
            ),
            "unknown".into(),
        );
    }
    if timeline["trigger"]["kind"] == "stall" {
        return stall_verdict(timeline, snapshot);
    }
    let incomplete = incomplete_classes(acc);
    let window = if incomplete.is_empty() {
        if window_min.is_finite() {
            format!("in the {window_min:.0} minutes before {ref_name}")
        } else {
            format!("in the window before {ref_name} (its length in the bundle is not a valid one)")
        }
    } else {
        format!(
            "in what the window kept before {ref_name} (INCOMPLETE: {} evicted for memory)",
            incomplete.join(", ")
        )
    };
    let g = &snapshot["gpucheck"];
    let advice = "(Silent data corruption, ~1 faulty device in 1000, logs nothing: run `nantrace gpucheck --bundle BUNDLE` once the GPUs are free.)";
    let found = if g.is_object() {
        gpucheck::findings(g)
    } else {
        Vec::new()
    };
    let (skipped, other): (Vec<&String>, Vec<&String>) =
        found.iter().partition(|f| f.contains(" not checked: "));
    let checked = g["gpus"]
        .as_array()
        .map_or(0, |a| a.iter().filter(|x| x["skipped"].is_null()).count());
    let sdc = if g.is_object() && g["error"].is_null() && other.is_empty() {
        let clean = format!("nantrace gpucheck after the incident: {checked} GPU(s) computed bit-identical FP32/FP16/BF16 results run to run and to their peers, no memory errors");
        match (skipped.is_empty(), checked) {
            (true, _) => format!("{clean}."),
            (false, 0) => format!(
                "nantrace gpucheck after the incident tested no GPU: {}. {advice}",
                skipped
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
            (false, _) => format!(
                "{clean}; {}. {advice}",
                skipped
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        }
    } else {
        advice.to_string()
    };
    (
        format!("NOT THE MACHINE, as far as nantrace can see: no hardware, kernel, system or job-output fault {window}. Look at the model side: learning rate, data, precision. {sdc}"),
        "none".into(),
    )
}

/// Sources of machine evidence that lost events to the memory cap (the window is incomplete).
/// Whether nantrace could see the machine in this window: kernel probes or NVML, and no
/// machine evidence evicted for memory.
fn sees_the_machine(timeline: &Value, snapshot: &Value) -> bool {
    let acc = &timeline["accounting"];
    let probes = acc["probes_attached"]
        .as_array()
        .is_some_and(|a| !a.is_empty());
    let nvml = snapshot["gpu"]["available"].as_bool() == Some(true);
    (probes || nvml) && incomplete_classes(acc).is_empty()
}

fn incomplete_classes(acc: &Value) -> Vec<String> {
    let ev = &acc["recorder"]["evicted_by_memory_per_source"];
    ev.as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, v)| k.as_str() != "log" && v.as_u64().unwrap_or(0) > 0)
                .map(|(k, v)| format!("{k} ×{v}"))
                .collect()
        })
        .unwrap_or_default()
}

fn local_time(utc: Option<&str>) -> String {
    let Some(t) = utc.and_then(|s| {
        time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()
    }) else {
        return "local time unknown".into();
    };
    // SAFETY: localtime_r with valid pointers; only reads the TZ database.
    let off = unsafe {
        let secs = t.unix_timestamp() as libc::time_t;
        let mut tm: libc::tm = std::mem::zeroed();
        libc::localtime_r(&secs, &mut tm);
        tm.tm_gmtoff
    };
    let lt = t
        .to_offset(time::UtcOffset::from_whole_seconds(off as i32).unwrap_or(time::UtcOffset::UTC));
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02} local, UTC{:+}",
        lt.year(),
        u8::from(lt.month()),
        lt.day(),
        lt.hour(),
        lt.minute(),
        lt.second(),
        off as f64 / 3600.0
    )
}

fn checked(timeline: &Value, snapshot: &Value) -> Vec<String> {
    let acc = &timeline["accounting"];
    let mut out = Vec::new();
    // A bundle whose writer died or whose disk was full (bundle::recover): said first.
    for k in ["incomplete", "truncated"] {
        if let Some(t) = acc[k].as_str() {
            out.push(format!("INCOMPLETE BUNDLE: {t}"));
        }
    }
    let probes: Vec<String> = acc["probes_attached"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    if probes.is_empty() {
        out.push(format!(
            "kernel probes: NOT loaded ({})",
            acc["probes_error"].as_str().unwrap_or("unknown reason")
        ));
    } else {
        out.push(format!("kernel events through eBPF: {}", probes.join(", ")));
    }
    if let Some(m) = acc["probes_not_attached"].as_object() {
        for (k, v) in m {
            out.push(format!("not attached: {k} ({})", v.as_str().unwrap_or("")));
        }
    }
    match snapshot["gpu"]["available"].as_bool() {
        Some(true) => out.push(format!(
            "GPU health through NVML: {} GPU(s)",
            snapshot["gpu"]["device_count"]
        )),
        _ => out.push(format!(
            "GPU health: {}",
            snapshot["gpu"]["reason"].as_str().unwrap_or("no snapshot")
        )),
    }
    let n = |s: &str| acc["events"][s].as_u64().unwrap_or(0);
    out.push(format!("system samples: {} (memory, swap, CPU, PSI), disk samples: {}, network samples: {}, GPU samples: {}", n("system"), n("disk"), n("net"), n("gpu")));
    out.push(format!("log lines read: {}", n("log")));
    if let Some(b) = acc["log_bytes_not_scanned"].as_u64().filter(|b| *b > 0) {
        out.push(format!("job output: {b} bytes passed through to the terminal without the full scan (the scanner was behind a flood): only their lines holding a NaN or failure word (nan, inf, error, killed, CUDA, NCCL, ...) were read; the other lines are missing from the evidence"));
    }
    let d = &acc["digest"];
    if d["over_the_cap_not_analysed"].as_u64().unwrap_or(0) > 0 {
        out.push(format!(
            "analysis digest: {} of {} events analysed ({} plain log lines are in app.log only, {} more events over the digest cap are in timeline.json only)",
            d["analysed"], d["events"], d["plain_log_lines_not_analysed"], d["over_the_cap_not_analysed"]
        ));
    }
    let drops: u64 = acc["kernel_drops"]
        .as_object()
        .map_or(0, |m| m.values().filter_map(Value::as_u64).sum());
    let ev = &acc["recorder"];
    out.push(format!(
        "losses: {drops} kernel events dropped, {} evicted by time, {} by memory",
        ev["evicted_by_time"], ev["evicted_by_memory"]
    ));
    out
}

fn facts(timeline: &Value, snapshot: &Value) -> Value {
    let sw = &snapshot["software"];
    let precision: BTreeMap<String, Value> = sw["env"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| {
                    [
                        "AMP",
                        "FP16",
                        "BF16",
                        "FP8",
                        "TF32",
                        "PRECISION",
                        "MIXED",
                        "CUBLAS",
                        "CUDNN",
                        "DTYPE",
                        "HALF",
                        "ALLOW_TF32",
                    ]
                    .iter()
                    .any(|w| k.to_ascii_uppercase().contains(w))
                })
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default();
    let losses: Vec<Value> = timeline["events"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|e| e["source"] == "log" && !e["loss"].is_null())
                .map(|e| json!({ "step": e["step"], "loss": e["loss"], "offset_s": e["offset_s"] }))
                .collect()
        })
        .unwrap_or_default();
    let last: Vec<Value> = losses[losses.len().saturating_sub(12)..].to_vec();
    json!({
        "host": timeline["host"],
        "job": timeline["job"],
        "kernel": sw["kernel"],
        "nvidia_driver": sw["nvidia_driver"],
        "cuda_driver": sw["cuda_driver_version"],
        "nvcc": sw["nvcc"],
        "libraries": sw["libraries_loaded_by_job"],
        "frameworks": sw["frameworks"],
        "precision_env": precision,
        "env": sw["env"],
        "last_losses": last,
        "scheduler": snapshot["scheduler"],
        "injected": timeline["accounting"]["injected"],
    })
}

#[cfg(test)]
mod order_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod trust_tests;
