//! Detector for the job's own failure lines (see `crate::joblog`): one suspect per rule and
//! code, with the ranks that printed it, corroborated by the kernel side for GPU faults.
//!
//! Rules: the job's lines count at any time in the window (a CUDA error is reported at the
//! next synchronisation, often after the NaN it caused); a generic line (NCCL `unhandled
//! system error`, `remote process exited`, a communicator abort) gives way to a specific one
//! within the threshold or in the same traceback; an ambiguous GPU fault becomes hardware when
//! a hardware Xid (NVIDIA's catalog) is on the job's GPUs within 30 s, and stays ambiguous
//! (with the Xid named) when the Xid is one NVIDIA lists as possibly the application's.
use std::collections::BTreeSet;

use super::{Acc, Ctx};
use crate::joblog::JobFamily;
use crate::report::rules::signal;
use crate::source::Source;

struct Line<'a> {
    rel: f64,
    family: JobFamily,
    kind: &'a str,
    what: &'a str,
    code: Option<&'a str>,
    generic: bool,
    rank: Option<u64>,
    group: u64,
    text: &'a str,
}

/// A short, single-line excerpt of a line the job printed (the renderers escape it).
pub(crate) fn excerpt(s: &str) -> String {
    let s: String = s.chars().filter(|c| !c.is_control()).collect();
    let s = s.trim();
    if s.chars().count() > 160 {
        format!("{}…", s.chars().take(160).collect::<String>())
    } else {
        s.to_string()
    }
}

fn ranks(r: &BTreeSet<u64>) -> String {
    match r.len() {
        0 => String::new(),
        1 => format!(", rank {}", r.iter().next().unwrap_or(&0)),
        n if n <= 8 => format!(
            ", ranks {}",
            r.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
        ),
        n => format!(", {n} ranks"),
    }
}

/// A collective that timed out with no error in view: where to look, and what the watchdog's
/// own numbers say (a timeout the job set far below torch's 10 minutes is outlasted by one
/// rank's slow step). In nantrace's corpus of public incidents (tests/corpus/incidents), all 9
/// logs whose only failure lines were watchdog timeouts (2 of them only its C++ stack) were
/// the job's own doing (the two hangs the network caused, a firewall and an antivirus,
/// printed no error at all).
fn watchdog_timeout_ms(code: Option<&str>) -> Option<u64> {
    code.and_then(|c| c.split("timeout ").nth(1))
        .and_then(|t| t.split(' ').next())
        .and_then(|t| t.parse::<u64>().ok())
}

fn hang_note(timeout_ms: Option<u64>) -> String {
    let short = match timeout_ms {
        Some(t) if t < 300_000 => format!("; the job set its collective timeout to {:.0} s (torch's default is 600 s): one rank's slow step (a checkpoint, an evaluation, data preparation) outlasts it", t as f64 / 1000.0),
        _ => String::new(),
    };
    format!("{short}; no cause in view on this node: look at the other ranks (nantrace merge); with no error on any rank such a hang is most often the job's own (ranks doing different work: uneven data, rank-0-only code, a step longer than the timeout): py-spy dump the stuck ranks")
}

/// One suspect in the making: its signal, the time closest to the reference, the ranks, how
/// many lines, its text, and its earliest line's time.
type Slot = (
    &'static crate::report::rules::Signal,
    f64,
    BTreeSet<u64>,
    usize,
    String,
    f64,
);

pub(super) fn detect(ctx: &Ctx<'_>, acc: &mut Acc, window_end: f64) {
    let lines = fault_lines(ctx, window_end);
    if lines.is_empty() {
        return;
    }
    let generic_window = signal("joblog_network_generic").threshold;
    let near = Near {
        xids: hardware_xids(ctx),
        corroborate_window: signal("joblog_gpu_corroborated").threshold,
        has_network: lines
            .iter()
            .any(|l| l.family == JobFamily::Network && !l.generic)
            || ctx
                .all(Source::Kmsg)
                .any(|(_, e)| matches!(e["class"].as_str(), Some("link_down" | "nic_error"))),
        // The shortest collective timeout any watchdog line names.
        timeout_ms: lines
            .iter()
            .filter(|o| o.family == JobFamily::Hang)
            .filter_map(|o| watchdog_timeout_ms(o.code))
            .min(),
    };
    let killed_from_outside = killed_from_outside(ctx);
    let mut merged: std::collections::BTreeMap<String, Slot> = Default::default();
    for l in &lines {
        if killed_from_outside && l.family == JobFamily::HostMemory && l.code == Some("SIGKILL") {
            continue;
        }
        // A generic line gives way to a specific one near it or in the same traceback.
        if l.generic
            && lines.iter().any(|o| {
                !o.generic
                    && o.family != JobFamily::Hang
                    && ((l.group != 0 && o.group == l.group)
                        || (o.rel - l.rel).abs() <= generic_window)
            })
        {
            continue;
        }
        let code = l.code.map_or(String::new(), |c| format!(" ({c})"));
        let (sig, note) = signal_of(ctx, l, &near);
        let key = format!("{}/{}/{}", sig.id, l.kind, l.code.unwrap_or(""));
        let slot = merged.entry(key).or_insert_with(|| {
            (
                sig,
                l.rel,
                BTreeSet::new(),
                0,
                format!(
                    "job output: {}{code}{note}: \"{}\"",
                    // An out-of-memory that the numbers say was not a limit is not called one.
                    if sig.id == "joblog_gpu_oom_not_limit" {
                        "GPU memory allocation failed"
                    } else {
                        l.what
                    },
                    excerpt(l.text)
                ),
                l.rel,
            )
        });
        slot.5 = slot.5.min(l.rel);
        if l.rel.abs() < slot.1.abs() {
            slot.1 = l.rel;
        }
        slot.2.extend(l.rank);
        slot.3 += 1;
    }
    for (key, (sig, rel, rk, n, text, first)) in merged {
        let text = format!("{text}{}", ranks(&rk));
        let touches = true;
        for _ in 0..n {
            acc.add(sig, &key, rel, touches, || text.clone());
        }
        acc.set_first(sig, &key, first);
    }
}

/// The job's failure lines in the window.
fn fault_lines<'a>(ctx: &'a Ctx<'_>, window_end: f64) -> Vec<Line<'a>> {
    ctx.all(Source::Log)
        .filter(|(r, _)| *r <= window_end)
        .filter_map(|(r, e)| {
            let f = &e["fault"];
            let family = JobFamily::parse(f["family"].as_str()?)?;
            Some(Line {
                rel: *r,
                family,
                kind: f["kind"].as_str().unwrap_or("?"),
                what: f["what"].as_str().unwrap_or("?"),
                code: f["code"].as_str(),
                generic: f["generic"] == true,
                rank: f["rank"].as_u64(),
                group: f["group"].as_u64().unwrap_or(0),
                text: e["line"].as_str().unwrap_or(""),
            })
        })
        .collect()
}

/// Hardware Xids (kernel log or NVML) near a GPU fault decide whether it is the hardware:
/// (time, Xid, PCI, on a GPU of the job).
fn hardware_xids(ctx: &Ctx<'_>) -> Vec<(f64, u32, String, bool)> {
    [Source::Xid, Source::NvmlXid]
        .into_iter()
        .flat_map(|s| ctx.all(s))
        .filter_map(|(r, e)| {
            let x = u32::try_from(e["xid"].as_u64()?).ok()?;
            let pci = e["pci"].as_str().unwrap_or("?").to_string();
            let job = ctx.job_gpus.is_empty()
                || ctx.job_gpus.contains(&pci)
                || e["xid_pid"]
                    .as_u64()
                    .is_some_and(|p| ctx.job_pids.contains(&p));
            Some((*r, x, pci, job))
        })
        .collect()
}

/// A SIGKILL that someone outside the job sent (the kernel saw who): the job's `Killed` /
/// `exitcode: -9` lines are that kill, not the OOM killer.
fn killed_from_outside(ctx: &Ctx<'_>) -> bool {
    ctx.all(Source::Signal).any(|(_, e)| {
        e["signal"] == "SIGKILL"
            && e["target_pid"]
                .as_u64()
                .is_some_and(|t| ctx.job_pids.contains(&t))
            && !e["pid"].as_u64().is_some_and(|p| ctx.job_pids.contains(&p))
    })
}

/// What the rest of the window says about a line: Xids near it, a network error, the
/// watchdog's timeout.
struct Near {
    xids: Vec<(f64, u32, String, bool)>,
    corroborate_window: f64,
    has_network: bool,
    timeout_ms: Option<u64>,
}

/// A failure line's signal, and what the window adds to its text.
fn signal_of(
    ctx: &Ctx<'_>,
    l: &Line<'_>,
    near: &Near,
) -> (&'static crate::report::rules::Signal, String) {
    match l.family {
        JobFamily::GpuHw => gpu_hw(l, near),
        JobFamily::GpuAmbiguous => gpu_ambiguous(l, near),
        JobFamily::Network if l.generic => (signal("joblog_network_generic"), String::new()),
        JobFamily::Network => (signal("joblog_network"), String::new()),
        JobFamily::Hang => (
            signal("joblog_hang"),
            if near.has_network {
                "; a network error is also in the window: that points at the network".into()
            } else {
                hang_note(near.timeout_ms)
            },
        ),
        JobFamily::HostMemory => (signal("joblog_host_memory"), String::new()),
        JobFamily::GpuOom => {
            let j = super::gpumem::judge(ctx, l.rel, l.text, ctx.nvml);
            (
                signal(if j.limit {
                    "joblog_gpu_oom"
                } else {
                    "joblog_gpu_oom_not_limit"
                }),
                j.note,
            )
        }
        JobFamily::Storage => (signal("joblog_storage"), String::new()),
        JobFamily::Software
            if matches!(
                l.kind,
                "device_side_assert"
                    | "cuda_misuse"
                    | "shape_or_device_mismatch"
                    | "invalid_device"
                    | "no_kernel_image"
                    | "cuda_code_config"
                    | "pytorch_internal_assert"
            ) =>
        {
            (signal("joblog_software_bug"), String::new())
        }
        JobFamily::Software => (signal("joblog_software"), String::new()),
    }
}

/// A hardware GPU error in the job's words: the kernel's Xid near it, or the job's word alone.
fn gpu_hw(l: &Line<'_>, near: &Near) -> (&'static crate::report::rules::Signal, String) {
    let xids = &near.xids;
    let corroborate_window = near.corroborate_window;
    let x = xids
        .iter()
        .filter(|x| x.3 && (x.0 - l.rel).abs() <= corroborate_window)
        .min_by(|a, b| (a.0 - l.rel).abs().total_cmp(&(b.0 - l.rel).abs()));
    (
        signal("joblog_gpu_hw"),
        x.map_or_else(
            || "; no Xid from the kernel or NVML near it: the job's own words".to_string(),
            |x| format!("; the kernel saw Xid {} on {}", x.1, x.2),
        ),
    )
}

/// A GPU error the job's own code can cause: hardware when a hardware Xid is near it.
fn gpu_ambiguous(l: &Line<'_>, near: &Near) -> (&'static crate::report::rules::Signal, String) {
    let xids = &near.xids;
    let corroborate_window = near.corroborate_window;
    let near: Vec<&(f64, u32, String, bool)> = xids
        .iter()
        .filter(|x| x.3 && (x.0 - l.rel).abs() <= corroborate_window)
        .collect();
    if let Some(hw) = near
        .iter()
        .find(|x| !crate::classify::xid_maybe_application(x.1))
    {
        let (name, _) = crate::classify::xid_info(hw.1);
        (
            signal("joblog_gpu_corroborated"),
            format!(
                "; with Xid {} ({name}) on {} {:.1} s {}: hardware",
                hw.1,
                hw.2,
                (hw.0 - l.rel).abs(),
                if hw.0 <= l.rel { "before" } else { "after" }
            ),
        )
    } else if let Some(app) = near.first() {
        (signal("joblog_gpu_ambiguous"), format!("; Xid {} on {} confirms a GPU fault, which NVIDIA lists as possibly the application's: hardware or software", app.1, app.2))
    } else {
        (
            signal("joblog_gpu_ambiguous"),
            "; no hardware Xid near it: hardware or software".to_string(),
        )
    }
}
