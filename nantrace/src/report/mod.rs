//! `nantrace report`: answers "was it the machine?" from a bundle's timeline and snapshot.
//! Ranked suspects come from the signal table in [`rules`]; when nothing fires, the report says
//! so plainly and lists what was checked.
pub(crate) mod detect;
pub mod flight;
pub mod gpucheck;
pub mod hang;
pub mod order;
pub use order::Order;
mod acc;
mod facts;
use acc::Acc;
mod implicated;
mod render;
pub mod rules;
mod verdict;
pub use implicated::{implicated_faults, implicated_gpus, implicated_witnesses, GpuWitness};

pub use render::{facts_lines, for_bundle, markdown, md, order_lines};

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::{json, Value};

use rules::Family;

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
    /// The kernel log lines behind it as nantrace recorded them (at most 8): what a drain
    /// checks against `/dev/kmsg`'s record of who wrote them (`agent::drain`).
    #[serde(skip)]
    pub kernel_lines: Vec<crate::klog::Line>,
    /// Also seen by a witness no user can write: NVML, a tracepoint's own fields (not
    /// printk text), nantrace's own check.
    #[serde(skip)]
    pub unforgeable: bool,
    /// Who wrote its kernel log lines, as the dump checked them in `/dev/kmsg`
    /// (`accounting.kernel_writers`): the first line found written from user space (said),
    /// and how many were the kernel's and how many were not checked or not found.
    #[serde(skip)]
    pub written_from_user_space: Option<String>,
    #[serde(skip)]
    pub lines_kernel: usize,
    #[serde(skip)]
    pub lines_unknown: usize,
    /// Set by the analysis: no line the kernel's, and one written from user space (or left
    /// unchecked by a dump that could not check them all): what the report says of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_the_kernels: Option<String>,
}

impl Finding {
    /// Machine evidence that can set the verdict (a consequence cannot).
    pub fn blames_machine(&self) -> bool {
        self.family.is_machine() && !self.consequence
    }

    /// Evidence that rests only on kernel log lines written from user space (`/dev/kmsg`
    /// said so at the dump): text any process of root's, or a relay such as journald's
    /// `ForwardToKMsg`, could write (redteam4 D-14, for the verdict as for a drain).
    pub fn user_written_only(&self) -> bool {
        self.not_the_kernels.is_some()
    }

    /// Words anyone could write: the job's own (a driver's line printed by the job), or a
    /// kernel log line written from user space. At most POSSIBLY, never a drain.
    pub fn anyones_words(&self) -> bool {
        rules::is_job_words(self.signal) || self.user_written_only()
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
    /// NCCL RAS's view at the trigger (snapshot.json `nccl_ras`).
    ras: &'a Value,
    /// The job's Flight Recorder dumps read at the dump (snapshot `flight_recorder`).
    flight: &'a Value,
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
    let ctx = Ctx::of(timeline, snapshot, nan_off.unwrap_or(0.0));
    let writers = &timeline["accounting"]["kernel_writers"];
    let mut acc = Acc {
        out: BTreeMap::new(),
        user_written: acc::listed(&writers["not_the_kernels"], true),
        kernels: acc::listed(&writers["the_kernels"], false),
    };
    // Lines the dump left unchecked (more than it reads): a finding with one of them and none
    // the kernel's is unverified. An unreadable /dev/kmsg (`error`) leaves findings as before:
    // the drain and the history still fail closed on it.
    let truncated = writers["not_checked"].as_u64().is_some_and(|n| n > 0);
    detect::all(&ctx, &mut acc);
    remap_state(&ctx, snapshot, &mut acc);
    let first = &timeline["first_nan"];
    let (what, ref_name) = first_value(first, nan_off);
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
    for f in suspects.iter_mut() {
        f.not_the_kernels = acc::not_the_kernels(f, truncated);
        if let Some(w) = &f.not_the_kernels {
            f.text = format!("{} (its kernel log line was {w})", f.text);
        }
    }
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
    score(
        &mut suspects,
        order.as_mut(),
        &steps,
        nan_off.is_some(),
        ref_name,
    );
    detect::flight_explains(&ctx, &mut suspects);
    gpucheck_suspects(snapshot, &mut suspects);
    suspects.sort_by(|a, b| b.score.total_cmp(&a.score));
    let (verdict, family) = verdict::verdict(
        &suspects,
        timeline,
        snapshot,
        window_minutes(timeline),
        ref_name,
    );
    let machine = suspects.iter().any(Finding::blames_machine);
    let reference = reference_text(timeline, nan_off, what.as_ref());
    let mut checked = facts::checked(timeline, snapshot);
    checked.extend(context);
    Analysis {
        verdict,
        family,
        machine,
        reference,
        suspects,
        checked,
        facts: facts::facts(timeline, snapshot),
        order: order.filter(|o| !o.consequences.is_empty()),
    }
}

impl<'a> Ctx<'a> {
    /// What the detectors read: every event by source with its time against the reference,
    /// the job's processes, GPUs and peers, whether NVML answered, whether the job hung.
    fn of(timeline: &'a Value, snapshot: &'a Value, ref_off: f64) -> Self {
        let evs = timeline["events"].as_array().map_or(&[][..], Vec::as_slice);
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
        Ctx {
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
            ras: &snapshot["nccl_ras"],
            flight: &snapshot["flight_recorder"],
            hung: timeline["trigger"]["kind"] == "stall"
                || timeline["events"].as_array().is_some_and(|ev| {
                    ev.iter().any(|e| {
                        e["source"] == "log"
                            && e["fault"]["family"].as_str()
                                == Some(crate::joblog::JobFamily::Hang.as_str())
                    })
                }),
        }
    }
}

/// Row remapping state at the trigger (NVML): a failed remap, or rows waiting for a reset.
fn remap_state(ctx: &Ctx<'_>, snapshot: &Value, acc: &mut Acc) {
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
}

/// What the first non-finite line holds: a NaN, or an Inf with a finite loss (the demo's
/// `loss 4.98e36 | grad_norm inf` is not a NaN); from the bundle, else read again. And the
/// reference's name.
fn first_value(first: &Value, nan_off: Option<f64>) -> (Option<(String, bool)>, &'static str) {
    let what = first["what"]
        .as_str()
        .map(|w| (w.to_string(), first["is_nan"] != false))
        .or_else(|| first["line"].as_str().and_then(crate::nanscan::describe));
    let ref_name = match (nan_off, &what) {
        (None, _) => "the trigger",
        (Some(_), Some((_, false))) => "the first non-finite value",
        _ => "the first NaN",
    };
    (what, ref_name)
}

/// Each suspect's score (severity, closeness to the reference, the job's own), its count and
/// time in its text; the job's network and hang lines after its first failure of another kind
/// (`order`) or after its NaN marked as consequences.
fn score(
    suspects: &mut [Finding],
    mut order: Option<&mut order::Order>,
    steps: &[f64],
    after_a_nan: bool,
    ref_name: &str,
) {
    for s in suspects.iter_mut() {
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
            .as_deref_mut()
            .filter(|o| o.explains(s.signal, s.first_rel_s, steps))
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
        if after_a_nan
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
}

/// A silent-data-corruption check run after the incident (gpucheck.json in the bundle): a
/// GPU that disagrees with itself or its peers is the strongest GPU evidence there is.
fn gpucheck_suspects(snapshot: &Value, suspects: &mut Vec<Finding>) {
    if snapshot["gpucheck"].is_object() && snapshot["gpucheck"]["error"].is_null() {
        let sig = rules::signal("gpucheck_mismatch");
        for f in gpucheck::findings(&snapshot["gpucheck"])
            .into_iter()
            .filter(|f| !f.contains("did not complete") && !f.contains(" not checked: "))
        {
            let score = f64::from(sig.severity) * 1.25;
            suspects.push(Finding { signal: sig.id, family: sig.family, severity: sig.severity, rel_s: 0.0, first_rel_s: 0.0, text: format!("nantrace gpucheck after the incident: {f}"), touches_job: true, count: 1, score, action: Some("take the GPU out of service and run the vendor's diagnostics (dcgmi diag -r 3)"), consequence: false, kernel_lines: Vec::new(), unforgeable: true, written_from_user_space: None, lines_kernel: 0, lines_unknown: 0, not_the_kernels: None });
        }
    }
}

/// A bundle's window as it says, within what nantrace records (a week); anything else (a
/// user's bundle with 1e300, redteam3 D-14) is not printed as a number of minutes.
fn window_minutes(timeline: &Value) -> f64 {
    match &timeline["window"]["pre_s"] {
        Value::Null => 10.0,
        v => v
            .as_f64()
            .filter(|v| v.is_finite() && *v > 0.0 && *v <= WINDOW_MAX_S)
            .map_or(f64::NAN, |v| v / 60.0),
    }
}

/// The reference the times count from, in words.
fn reference_text(timeline: &Value, nan_off: Option<f64>, what: Option<&(String, bool)>) -> String {
    let first = &timeline["first_nan"];
    match nan_off {
        Some(_) => format!(
            "{} at {} ({}): {}",
            match what {
                Some((w, true)) => format!("first NaN ({w})"),
                Some((w, false)) => format!("first non-finite value ({w}; no NaN yet)"),
                None => "first NaN".into(),
            },
            first["time"].as_str().unwrap_or("?"),
            facts::local_time(first["time"].as_str()),
            first["line"].as_str().unwrap_or("")
        ),
        None => format!(
            "no NaN in the log; times are relative to the trigger ({} at {})",
            timeline["trigger"]["kind"].as_str().unwrap_or("?"),
            timeline["trigger"]["time"].as_str().unwrap_or("?")
        ),
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

#[cfg(test)]
mod order_tests;
#[cfg(test)]
mod ras_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod trust_tests;
