//! What the report states beside its verdict: the facts of the incident (when, where, which
//! job) and what nantrace checked and could not.
use serde_json::Value;

use super::*;

pub(super) fn local_time(utc: Option<&str>) -> String {
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

pub(super) fn checked(timeline: &Value, snapshot: &Value) -> Vec<String> {
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
    out.extend(ras_checked(&snapshot["nccl_ras"]));
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

/// What NCCL RAS said at the trigger, or why it said nothing (a bundle from before it was
/// asked says nothing here).
fn ras_checked(ras: &Value) -> Option<String> {
    let s = |k: &str| {
        ras[k]
            .as_str()
            .map(|x| x.chars().take(300).collect::<String>())
    };
    if let Some(why) = s("not_queried") {
        return Some(format!("NCCL RAS: not asked: {why}"));
    }
    if let Some(why) = s("not_reachable") {
        return Some(format!("NCCL RAS at the trigger: not reachable: {why}"));
    }
    if let Some(why) = s("error") {
        return Some(format!("NCCL RAS at the trigger: no answer: {why}"));
    }
    let head = format!(
        "NCCL RAS at the trigger ({} format, {} bytes{}{})",
        s("format")?,
        ras["output_bytes"],
        s("output_incomplete").map_or(String::new(), |w| format!(", incomplete: {w}")),
        s("output_cut").map_or(String::new(), |w| format!(", {w}"))
    );
    let Some(v) = detect::ras_view(ras) else {
        return Some(format!(
            "{head}: not read: {}",
            s("view_error").unwrap_or_default()
        ));
    };
    let ranks: usize = v
        .comms
        .iter()
        .map(|c| c.ranks.len() + c.ranks_not_listed as usize)
        .sum();
    Some(format!(
        "{head}: NCCL {}, {} communicator(s), {} rank(s); {}",
        v.nccl_version.as_deref().unwrap_or("version not said"),
        v.communicators.map_or("?".into(), |n| n.to_string()),
        v.ranks.map_or("?".into(), |n| n.to_string()),
        if v.has_issues() {
            format!(
                "{ranks} rank issue(s), {} process(es) without an answer, {} dead",
                v.missing_processes.unwrap_or(0),
                v.dead_processes.unwrap_or(0)
            )
        } else {
            "every rank OK".to_string()
        }
    ))
}

pub(super) fn facts(timeline: &Value, snapshot: &Value) -> Value {
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
