//! The incident bundle: `nantrace-<host>-<UTC time>/` with timeline.json, app.log, kernel.log
//! (and the evidence files of later stages). Written under a temporary name, then renamed;
//! files are 0600, the directory 0700: it holds other people's command lines and logs.
use std::fs;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{json, Value};

use crate::clock::{compact_utc, rfc3339, ClockMap};
use crate::event::{Detail, Event};
use crate::safefs;
use crate::trigger::Fired;

pub const SCHEMA: &str = "nantrace.timeline/1";

#[derive(Clone, Debug, Serialize)]
pub struct Host {
    pub hostname: String,
    pub kernel: String,
    pub boot_id: String,
}

impl Host {
    pub fn read() -> Self {
        let r = |p: &str| fs::read_to_string(p).unwrap_or_default().trim().to_string();
        Host { hostname: r("/proc/sys/kernel/hostname"), kernel: r("/proc/sys/kernel/osrelease"), boot_id: r("/proc/sys/kernel/random/boot_id") }
    }
}

/// NTP state from adjtimex(2): how far this node's clock may be from true time.
pub fn ntp_state() -> Value {
    // SAFETY: zeroed timex with modes = 0 only reads the kernel's state.
    let mut tx: libc::timex = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a timex.
    let state = unsafe { libc::adjtimex(&mut tx) };
    if state < 0 {
        return json!({ "error": std::io::Error::last_os_error().to_string() });
    }
    let synced = state != libc::TIME_ERROR && (tx.status & libc::STA_UNSYNC) == 0;
    json!({
        "synchronized": synced,
        "offset_us": if tx.status & libc::STA_NANO != 0 { tx.offset / 1000 } else { tx.offset },
        "maxerror_us": tx.maxerror,
        "esterror_us": tx.esterror,
        "source": "adjtimex",
    })
}

#[derive(Clone, Debug, Serialize, Default)]
pub struct JobInfo {
    pub root_pid: Option<u32>,
    pub command: Vec<String>,
    pub exit_code: Option<i32>,
    pub exit_signal: Option<i32>,
}

pub struct Incident<'a> {
    pub host: &'a Host,
    pub clock: &'a ClockMap,
    pub triggers: &'a [Fired],
    pub job: &'a JobInfo,
    pub accounting: Value,
    pub events: &'a [Event],
    pub window_pre_s: f64,
    pub post_s: f64,
    /// Extra files (name, contents) from later stages: snapshot.json, trace.json, reports.
    pub extra: Vec<(String, Vec<u8>)>,
    /// timeline.json, when a later stage already built it.
    pub timeline: Option<Value>,
    /// The report's first line, once the report was made.
    pub verdict: Option<String>,
}

pub struct Written {
    pub dir: PathBuf,
    /// Non-empty files written in full; 0 means the bundle holds nothing (full disk).
    pub written: usize,
    pub failures: Vec<String>,
}

/// Index of the first non-finite log line, if any.
pub fn first_nan(events: &[Event]) -> Option<&Event> {
    events.iter().find(|e| matches!(&e.detail, Detail::Log(l) if l.nonfinite))
}

pub fn timeline(inc: &Incident) -> Value {
    let first = &inc.triggers[0];
    let t0 = first.mono_ns;
    let off = |m: u64| (m as f64 - t0 as f64) / 1e9;
    let events: Vec<Value> = inc
        .events
        .iter()
        .map(|e| {
            let mut j = e.to_json(inc.clock);
            j["offset_s"] = json!(off(e.mono_ns));
            j
        })
        .collect();
    let nan = first_nan(inc.events).map(|e| {
        let Detail::Log(l) = &e.detail else { unreachable!() };
        json!({ "time": rfc3339(inc.clock.to_wall(e.mono_ns)), "offset_s": off(e.mono_ns), "line": l.text.as_ref(), "step": l.step })
    });
    let ntp = ntp_state();
    let start = inc.events.first().map_or(t0, |e| e.mono_ns.min(t0));
    let end = inc.events.last().map_or(t0, |e| e.mono_ns.max(t0));
    json!({
        "schema": SCHEMA,
        "nantrace_version": env!("CARGO_PKG_VERSION"),
        "host": inc.host,
        "trigger": {
            "kind": first.kind,
            "time": rfc3339(inc.clock.to_wall(first.mono_ns)),
            "mono_ns": first.mono_ns,
            "reason": first.reason,
        },
        "triggers": inc.triggers.iter().map(|f| json!({
            "kind": f.kind, "time": rfc3339(inc.clock.to_wall(f.mono_ns)), "offset_s": off(f.mono_ns), "reason": f.reason,
        })).collect::<Vec<_>>(),
        "first_nan": nan,
        "window": {
            "start": rfc3339(inc.clock.to_wall(start)),
            "end": rfc3339(inc.clock.to_wall(end)),
            "pre_s": inc.window_pre_s,
            "post_s": inc.post_s,
        },
        "clock": {
            "mapping": "wall = CLOCK_MONOTONIC + offset_ns (CLOCK_REALTIME - CLOCK_MONOTONIC, sampled every 10 s)",
            "offset_ns": inc.clock.offset_ns.to_string(),
            "sample_error_ns": inc.clock.error_ns,
            "ntp": ntp,
            // Seconds to add to this node's times to get reference time, and the bound on the
            // remaining error (adjtimex maxerror), used by `nantrace merge`. Unsynchronised: null.
            "correction_s": if ntp["synchronized"] == true { ntp["offset_us"].as_f64().unwrap_or(0.0) / 1e6 } else { 0.0 },
            "uncertainty_s": if ntp["synchronized"] == true { json!(ntp["maxerror_us"].as_f64().unwrap_or(0.0) / 1e6) } else { Value::Null },
        },
        "job": inc.job,
        "accounting": inc.accounting,
        "events": events,
    })
}

pub fn app_log(inc: &Incident) -> String {
    let mut out = String::new();
    let first = first_nan(inc.events).map(|e| e as *const Event);
    for e in inc.events {
        if let Detail::Log(l) = &e.detail {
            if Some(e as *const Event) == first {
                out.push_str(&format!(">>>>> nantrace: FIRST NON-FINITE VALUE on the next line ({}) <<<<<\n", rfc3339(inc.clock.to_wall(e.mono_ns))));
            }
            let stream = match l.stream { 1 => "stdout", 2 => "stderr", _ => "file" };
            out.push_str(&format!("{} [{stream}] {}\n", rfc3339(inc.clock.to_wall(e.mono_ns)), l.text));
        }
    }
    out
}

pub fn kernel_log(inc: &Incident) -> String {
    let mut out = String::new();
    for e in inc.events {
        if let Detail::Kmsg(k) = &e.detail {
            for line in k.text.lines() {
                out.push_str(&format!("{} {}\n", rfc3339(inc.clock.to_wall(e.mono_ns)), line));
            }
        }
    }
    out
}

/// timeline.json: one event per line (compact, greppable, fast to write for 100 k events).
pub fn timeline_bytes(full: &Value) -> Vec<u8> {
    // Everything but the events, pretty; then the events, one per line (no deep clone).
    let head: serde_json::Map<String, Value> = full.as_object().map(|m| m.iter().filter(|(k, _)| *k != "events").map(|(k, v)| (k.clone(), v.clone())).collect()).unwrap_or_default();
    let events = &full["events"];
    let mut out = serde_json::to_vec_pretty(&head).unwrap_or_default();
    out.truncate(out.len().saturating_sub(2)); // reopen the object: drop "\n}"
    out.extend_from_slice(b",\n  \"events\": [\n");
    if let Value::Array(a) = events {
        for (i, e) in a.iter().enumerate() {
            out.extend_from_slice(b"    ");
            out.extend_from_slice(&serde_json::to_vec(e).unwrap_or_default());
            out.extend_from_slice(if i + 1 < a.len() { b",\n" } else { b"\n" });
        }
    }
    out.extend_from_slice(b"  ]\n}\n");
    out
}

/// Write the bundle under `out`. Each file that fails is reported and the others still written.
/// The directory is created by us (0700) under a random temporary name, filled with O_EXCL
/// files relative to its descriptor, then claimed under its final name with
/// `renameat2(RENAME_NOREPLACE)`: a name taken by anything (another instance's bundle, a
/// dangling symlink) moves on to the next suffix instead of failing (redteam 4.7, 4.13, 6.13).
pub fn write(out: &Path, inc: &Incident) -> std::io::Result<Written> {
    fs::create_dir_all(out)?;
    let outd = safefs::Dir::open(out)?;
    let stamp = compact_utc(inc.clock.to_wall(inc.triggers[0].mono_ns));
    let host = safefs::sanitize(&inc.host.hostname, "host");
    let base = format!("nantrace-{host}-{stamp}");
    let (tmp, tmp_name) = outd.create_temp_subdir(&format!(".{base}.tmp-{}-", std::process::id()))?;
    let mut failures = Vec::new();
    let mut written = 0;
    let mut files: Vec<(String, Vec<u8>)> = vec![
        ("app.log".into(), app_log(inc).into_bytes()),
        ("kernel.log".into(), kernel_log(inc).into_bytes()),
    ];
    if !inc.extra.iter().any(|(n, _)| n == "timeline.json") {
        let t = inc.timeline.clone().unwrap_or_else(|| timeline(inc));
        files.push(("timeline.json".into(), timeline_bytes(&t)));
    }
    files.extend(inc.extra.iter().cloned());
    for (f, data) in &files {
        match tmp.write_new(f, data) {
            Err(e) => failures.push(format!("{f}: {e}")),
            Ok(()) if !data.is_empty() => written += 1,
            Ok(()) => {}
        }
    }
    let mut name = base.clone();
    let mut n = 2;
    loop {
        match outd.rename_noreplace(&tmp_name, &name) {
            Ok(()) => break,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 10_000 => {
                name = format!("{base}-{n}");
                n += 1;
            }
            Err(e) => return Err(std::io::Error::new(e.kind(), format!("{e}; the files are in {}", out.join(&tmp_name).display()))),
        }
    }
    Ok(Written { dir: out.join(&name), written, failures })
}
