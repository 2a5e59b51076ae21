//! The verdict: the one sentence a node report answers with, from its suspects, the order of
//! causes and what nantrace could see (a hang or a stall has its own reading).
use serde_json::Value;

use super::*;

/// The verdict and the family it names. Any machine-family suspect (GPU, PCIe, host memory,
/// host kernel/CPU, storage, network) makes it "PROBABLY" (a strong signal) or "POSSIBLY"
/// THE MACHINE: nantrace never says "not the machine" while the machine spoke. Without one,
/// the job's own software or GPU-memory-limit error is named, then an unexplained hang; only
/// with none of these, and with eyes (probes or NVML), "NOT THE MACHINE as far as nantrace can see".
/// The job stopped making progress (the stall trigger) and nothing on this node explains it:
/// never "the model side"; where each rank stood at the trigger, from the stacks.
pub(super) fn stall_verdict(timeline: &Value, snapshot: &Value) -> (String, String) {
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
    let at = match detect::node_rank_groups(stacks, &snapshot["flight_recorder"]) {
        Some(g) => g,
        None if at.is_empty() => "no job process was left to sample".to_string(),
        None => format!("at the trigger: {}", at.join("; ")),
    };
    let at = match detect::ras_clause(&snapshot["nccl_ras"]) {
        Some(r) => format!("{at}; {r}"),
        None => at,
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
pub(super) fn hang_verdict(top: &Finding, timeline: &Value, snapshot: &Value) -> (String, String) {
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
    // NCCL RAS's view, unless it is the finding the verdict already quotes.
    let ras = detect::ras_clause(&snapshot["nccl_ras"])
        .filter(|_| top.signal != "nccl_ras_ranks")
        .map_or(String::new(), |r| format!("; {r}"));
    let with_stacks = |h: &hang::Hang| {
        let at: Vec<String> = h
            .ranks
            .iter()
            .take(8)
            .filter_map(|r| detect::rank_state(stacks, *r).map(|s| format!("rank {r}, {s}")))
            .collect();
        let groups = detect::node_rank_groups(stacks, &snapshot["flight_recorder"])
            .map_or(String::new(), |g| format!("; {g}"))
            + &ras;
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
    // The watchdog lines first; where they name no rank (gloo's timeouts carry no counters),
    // the job's Flight Recorder dumps.
    let fr = detect::flight_of(&snapshot["flight_recorder"]).map(|f| f.hang(&|_| None));
    let judged = match (hang::judge(lines, world, local.as_ref()), fr) {
        (Some(h), _) if h.named_by_words() => Some(h),
        (_, Some(f)) if f.named() => Some(f),
        (Some(h), _) if h.named() => Some(h),
        (h, f) => h.or(f),
    };
    match judged {
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
                "UNDECIDED ({label}): {}{ras}. No GPU, network or host fault on this node in the window: the rank that stopped is elsewhere; merge the other nodes' bundles (nantrace merge)",
                top.text
            ),
            label,
        ),
    }
}

pub(super) fn verdict(
    suspects: &[Finding],
    timeline: &Value,
    snapshot: &Value,
    window_min: f64,
    ref_name: &str,
) -> (String, String) {
    software_explains_the_gpu(suspects)
        .or_else(|| machine(suspects, timeline, snapshot))
        .or_else(|| job_side(suspects))
        .or_else(|| {
            // The job's watchdog lines first; NCCL RAS's view alone only outside a stall (the
            // stall's verdict says where the ranks stood, and RAS's view with it).
            let hang = |ras: bool| {
                suspects.iter().find(|s| {
                    s.family == Family::Hang
                        && !s.consequence
                        && (s.signal == "nccl_ras_ranks") == ras
                })
            };
            hang(false)
                .or_else(|| hang(true).filter(|_| timeline["trigger"]["kind"] != "stall"))
                .map(|top| hang_verdict(top, timeline, snapshot))
        })
        .or_else(|| cannot_tell(timeline, snapshot))
        .or_else(|| {
            (timeline["trigger"]["kind"] == "stall").then(|| stall_verdict(timeline, snapshot))
        })
        .unwrap_or_else(|| not_the_machine(timeline, snapshot, window_min, ref_name))
}

/// The first suspect `pred` holds for (they are ranked).
fn first(suspects: &[Finding], pred: impl Fn(&Finding) -> bool) -> Option<&Finding> {
    suspects.iter().find(|s| pred(s))
}

fn label(f: &Finding) -> String {
    f.family.label().to_string()
}

/// A GPU fault of the kind the job's own code can cause (Xid 13/31/43, illegal address).
fn ambiguous_gpu(f: &Finding) -> bool {
    matches!(
        f.signal,
        "xid_app_possible" | "joblog_gpu_ambiguous" | "joblog_gpu_oom_not_limit"
    )
}

/// Such a GPU fault next to the job's own software error (a device-side assert): the error
/// explains it. Only a cause explains (a device-side assert, an invalid CUDA call): the abort
/// or the segfault that follows a GPU fault is its consequence, not its explanation.
fn software_explains_the_gpu(suspects: &[Finding]) -> Option<(String, String)> {
    let sw = first(suspects, |s| s.signal == "joblog_software_bug")?;
    let machine: Vec<&Finding> = suspects.iter().filter(|s| s.blames_machine()).collect();
    (!machine.is_empty()
        && machine.iter().all(|m| {
            ambiguous_gpu(m)
                && (m.rel_s - sw.rel_s).abs() <= rules::signal("joblog_software_bug").threshold
        }))
    .then(|| {
        (
            format!(
                "NOT THE MACHINE ({}): {}; the GPU fault next to it follows from it: {}",
                sw.family.label(),
                sw.text,
                machine[0].text
            ),
            label(sw),
        )
    })
}

/// The machine's evidence: PROBABLY on a strong signal, POSSIBLY on a weak or ambiguous one
/// or on the job's words alone.
fn machine(suspects: &[Finding], timeline: &Value, snapshot: &Value) -> Option<(String, String)> {
    // A kernel log line not the kernel's never speaks for the machine over evidence that is
    // (a forged Xid beside a real OOM kill of the user's own process: the OOM kill).
    let top = first(suspects, |s| s.blames_machine() && !s.user_written_only())
        .or_else(|| first(suspects, Finding::blames_machine))?;
    let job_sw = first(suspects, |s| {
        matches!(s.family, Family::Software | Family::GpuMemoryLimit)
    })
    .map_or(String::new(), |s| {
        format!(" (the job also reported: {})", s.text)
    });
    // The GPU faulted, but NVIDIA's catalog (or CUDA) says the job's own code can cause it.
    let ambiguous = ambiguous_gpu(top);
    // The job's words alone (any user can print a kernel's or a driver's line): at most
    // POSSIBLY, and the family says so. A thread's state the job can cause (its own FUSE
    // daemon holding it in D state) does not lift the job's words above them (review of
    // 12-02).
    if top.anyones_words()
        && suspects
            .iter()
            .filter(|s| s.blames_machine())
            .all(|s| s.anyones_words() || rules::user_controllable(s.signal))
    {
        return Some(job_words_only(top, ambiguous, &job_sw, timeline, snapshot));
    }
    let (head, qualifier) = if top.severity >= 60 {
        ("PROBABLY", "")
    } else if ambiguous {
        ("POSSIBLY", ", or the job's own code")
    } else {
        ("POSSIBLY", ", weak signals only")
    };
    Some((
        format!(
            "{head} THE MACHINE ({}{qualifier}): {}{job_sw}",
            top.family.label(),
            top.text
        ),
        label(top),
    ))
}

/// POSSIBLY on the job's words alone. Where the kernel log was watched and shows no such
/// fault, that is evidence against them, and the verdict says it.
fn job_words_only(
    top: &Finding,
    ambiguous: bool,
    job_sw: &str,
    timeline: &Value,
    snapshot: &Value,
) -> (String, String) {
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
    if top.user_written_only() {
        // A kernel log line, but not the kernel's: /dev/kmsg recorded its writer (the
        // finding's text says who).
        return (
            format!(
                "POSSIBLY THE MACHINE ({}{or_code}), on a kernel log line not the kernel's only: {}; no record the kernel, NVML or a tracepoint wrote shows it{job_sw}",
                top.family.label(),
                top.text
            ),
            format!("{}{}", top.family.label(), rules::JOB_WORDS_SUFFIX),
        );
    }
    (
        format!(
            "POSSIBLY THE MACHINE ({}{or_code}), in the job's own words only: {}{against}{job_sw}",
            top.family.label(),
            top.text
        ),
        format!("{}{}", top.family.label(), rules::JOB_WORDS_SUFFIX),
    )
}

/// The job's own software or configuration, or a resource limit it hit.
fn job_side(suspects: &[Finding]) -> Option<(String, String)> {
    let top = first(suspects, |s| {
        matches!(s.family, Family::Software | Family::GpuMemoryLimit)
    })?;
    let why = if top.family == Family::GpuMemoryLimit {
        "a resource limit, not a fault: reduce the batch or sequence length, or use more GPUs"
    } else {
        "a bug or a configuration problem in the job, not a machine fault"
    };
    Some((
        format!(
            "NOT THE MACHINE ({}): {}; {why}",
            top.family.label(),
            top.text
        ),
        label(top),
    ))
}

/// Neither probes nor NVML: nothing seen to answer with.
fn cannot_tell(timeline: &Value, snapshot: &Value) -> Option<(String, String)> {
    let acc = &timeline["accounting"];
    let probes = acc["probes_attached"]
        .as_array()
        .is_some_and(|a| !a.is_empty());
    let nvml = snapshot["gpu"]["available"].as_bool() == Some(true);
    (!probes && !nvml).then(|| {
        (
            format!(
                "CANNOT TELL: nantrace saw neither kernel events ({}) nor GPU health (NVML: {}); the job's output names no machine fault. Run as root with the probes to answer.",
                acc["probes_error"].as_str().unwrap_or("probes not loaded"),
                snapshot["gpu"]["reason"].as_str().unwrap_or("not available")
            ),
            "unknown".into(),
        )
    })
}

/// Nothing found in a window nantrace saw: the model side, and what a silent data
/// corruption check said or would say.
fn not_the_machine(
    timeline: &Value,
    snapshot: &Value,
    window_min: f64,
    ref_name: &str,
) -> (String, String) {
    let acc = &timeline["accounting"];
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
pub(super) fn sees_the_machine(timeline: &Value, snapshot: &Value) -> bool {
    let acc = &timeline["accounting"];
    let probes = acc["probes_attached"]
        .as_array()
        .is_some_and(|a| !a.is_empty());
    let nvml = snapshot["gpu"]["available"].as_bool() == Some(true);
    (probes || nvml) && incomplete_classes(acc).is_empty()
}

pub(super) fn incomplete_classes(acc: &Value) -> Vec<String> {
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
