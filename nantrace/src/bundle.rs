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
/// A timeline of several nodes on one clock (`nantrace merge`, the job report's node views).
pub const MERGED_SCHEMA: &str = "nantrace.merged/1";
/// gpucheck.json (`nantrace gpucheck`, added to a NaN bundle after the job).
pub const GPUCHECK_SCHEMA: &str = "nantrace.gpucheck/1";
/// A node's summary, `summary.json` (docs/bundle.md): what the job report reads of a quiet
/// node instead of its timeline.
pub const SUMMARY_SCHEMA: &str = "nantrace.summary/1";

/// The node a bundle is from (read where the world is read: `collect::host`).
pub use crate::collect::host::Host;

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
    /// The kernel wrote a core when the signal ended it (wait(2)'s WCOREDUMP for `run`; the
    /// exit event's `core_dumped` otherwise).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub exit_core_dumped: bool,
    /// The agent: which job this is (Slurm job/step/user, pod/namespace/container, or a
    /// process tree) and why it was watched.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity: Option<Value>,
}

/// What one incident holds: everything the bundle is made from, nothing filled in later.
pub struct Incident<'a> {
    pub host: &'a Host,
    pub clock: &'a ClockMap,
    pub triggers: &'a [Fired],
    pub job: &'a JobInfo,
    pub accounting: Value,
    /// Sorted by time (references into the recorder's lanes: no copy of the window).
    pub events: &'a [&'a Event],
    pub window_pre_s: f64,
    pub post_s: f64,
    /// The job's Flight Recorder dumps read at the dump, raw (`bundle::flight`).
    pub flight_copies: &'a [(String, Vec<u8>)],
}

pub struct Written<A> {
    pub dir: PathBuf,
    /// Non-empty files written in full; 0 means the bundle holds nothing (full disk).
    pub written: usize,
    pub failures: Vec<String>,
    /// What the layers above made of it (the report's analysis: its verdict is printed with
    /// the summary).
    pub analysis: A,
}

/// A file of a bundle: its name and its bytes.
pub type File = (&'static str, Vec<u8>);

/// What the layers above make of a bundle's digest (`export::derived`), as work to run in the
/// order the files are written; the model writes them, it neither analyses nor renders. The
/// answer (the analysis and report.md, report.txt) is made and written first: on a nearly
/// full disk, or when the dump is killed, it is what survives; then what is rendered from the
/// analysis (report.html). `beside` (trace.json) needs no analysis and runs on a thread of
/// its own from the start.
pub struct Derived<'a, A> {
    pub beside: Box<dyn FnOnce() -> Vec<File> + Send + 'a>,
    pub answer: Box<dyn FnOnce() -> (A, Vec<File>) + 'a>,
    pub views: Views<'a, A>,
    /// The node's summary (`summary.json`, [`SUMMARY_SCHEMA`]) from the analysis; the
    /// writer adds the size and hash of the timeline.json it wrote (`timeline`).
    pub summary: Box<dyn FnOnce(&A) -> Value + 'a>,
}

/// What is rendered from the analysis.
pub type Views<'a, A> = Box<dyn FnOnce(&A) -> Vec<File> + 'a>;

impl<A> Derived<'_, A> {
    /// The analysis and every file, the answer first (`nantrace report --write`).
    pub fn run(self) -> (A, Vec<File>) {
        let Derived {
            beside,
            answer,
            views,
            summary: _,
        } = self;
        std::thread::scope(|s| {
            let beside = s.spawn(beside);
            let (a, mut files) = answer();
            files.extend(views(&a));
            files.extend(beside.join().unwrap_or_default());
            (a, files)
        })
    }
}

/// Index of the first non-finite log line, if any.
pub fn first_nan<'a>(events: &[&'a Event]) -> Option<&'a Event> {
    events
        .iter()
        .copied()
        .find(|e| matches!(&e.detail, Detail::Log(l) if l.nonfinite))
}

/// Everything in timeline.json but the events.
pub fn timeline_head(inc: &Incident) -> Value {
    let first = &inc.triggers[0];
    let t0 = first.mono_ns;
    let off = |m: u64| (m as f64 - t0 as f64) / 1e9;
    let nan = first_nan(inc.events).map(|e| {
        let Detail::Log(l) = &e.detail else { unreachable!() };
        let what = crate::nanscan::describe(&l.text);
        json!({ "time": rfc3339(inc.clock.to_wall(e.mono_ns)), "offset_s": off(e.mono_ns), "line": l.text.as_ref(), "step": l.step, "what": what.as_ref().map(|w| w.0.as_str()), "is_nan": what.as_ref().map(|w| w.1) })
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
    })
}

/// One event as it appears in timeline.json.
fn event_json(inc: &Incident, e: &Event) -> Value {
    let t0 = inc.triggers[0].mono_ns;
    let mut j = e.to_json(inc.clock);
    j["offset_s"] = json!((e.mono_ns as f64 - t0 as f64) / 1e9);
    j
}

/// The whole timeline as one value (small incidents: tests, the benchmark's profile). The
/// bundle itself streams it (see [`write`]).
pub fn timeline(inc: &Incident) -> Value {
    let mut t = timeline_head(inc);
    t["events"] = Value::Array(inc.events.iter().map(|e| event_json(inc, e)).collect());
    t
}

/// timeline.json, streamed: the head pretty, then one event per line (compact, greppable,
/// and never the whole window as one JSON tree in memory).
fn write_timeline(w: &mut dyn std::io::Write, inc: &Incident, head: &Value) -> std::io::Result<()> {
    write_timeline_with(w, head, inc.events.len(), &mut |i, w| {
        serde_json::to_writer(w, &event_json(inc, inc.events[i])).map_err(std::io::Error::from)
    })
}

/// timeline.json in nantrace's layout: the head pretty-printed, then `"events"` with one event
/// per line (what [`load`] reads line by line). `head` has no `events`; `event(i, w)` writes
/// the i-th of `n`.
pub fn write_timeline_with(
    w: &mut dyn std::io::Write,
    head: &Value,
    n: usize,
    event: &mut dyn FnMut(usize, &mut dyn std::io::Write) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut h = serde_json::to_vec_pretty(head)?;
    if h.ends_with(b"{}") {
        h.truncate(h.len() - 1); // an empty head: "{"
    } else {
        h.truncate(h.len().saturating_sub(2)); // reopen the object: drop "\n}"
        h.push(b',');
    }
    w.write_all(&h)?;
    w.write_all(b"\n  \"events\": [\n")?;
    for i in 0..n {
        w.write_all(b"    ")?;
        event(i, &mut *w)?;
        w.write_all(if i + 1 < n { b",\n" } else { b"\n" })?;
    }
    w.write_all(b"  ]\n}\n")
}

fn write_app_log(w: &mut dyn std::io::Write, inc: &Incident) -> std::io::Result<()> {
    let first = first_nan(inc.events).map(|e| e as *const Event);
    for &e in inc.events {
        if let Detail::Log(l) = &e.detail {
            if Some(e as *const Event) == first {
                writeln!(
                    w,
                    ">>>>> nantrace: FIRST NON-FINITE VALUE on the next line ({}) <<<<<",
                    rfc3339(inc.clock.to_wall(e.mono_ns))
                )?;
            }
            let stream = match l.stream {
                1 => "stdout",
                2 => "stderr",
                3 => "stdout+stderr",
                _ => "file",
            };
            writeln!(
                w,
                "{} [{stream}] {}",
                rfc3339(inc.clock.to_wall(e.mono_ns)),
                l.text
            )?;
        }
    }
    Ok(())
}

fn write_kernel_log(w: &mut dyn std::io::Write, inc: &Incident) -> std::io::Result<()> {
    for e in inc.events {
        if let Detail::Kmsg(k) = &e.detail {
            for line in k.text.lines() {
                writeln!(w, "{} {}", rfc3339(inc.clock.to_wall(e.mono_ns)), line)?;
            }
        }
    }
    Ok(())
}

pub fn app_log(inc: &Incident) -> String {
    let mut v = Vec::new();
    let _ = write_app_log(&mut v, inc);
    String::from_utf8_lossy(&v).into_owned()
}

pub fn kernel_log(inc: &Incident) -> String {
    let mut v = Vec::new();
    let _ = write_kernel_log(&mut v, inc);
    String::from_utf8_lossy(&v).into_owned()
}

/// The most events the analysis (report, trace, HTML) holds as JSON values at once (~1.5 KiB
/// each), so the dump stays within the recorder's cap plus ~64 MiB whatever the flood.
pub const DIGEST_MAX: usize = 20_000;
/// Of those, at most this many loss-curve lines and this many routine kernel events (forks,
/// block requests, retransmits), the latest ones.
const DIGEST_CURVE: usize = 5_000;
const DIGEST_ROUTINE: usize = 10_000;

/// Does the analysis need this event? 0 = always (flagged lines, classified kernel lines,
/// samples...), 2 = loss-curve lines, 3 = routine kernel events, 9 = never (plain log lines:
/// they are in app.log and timeline.json, not in the reasoning).
fn digest_rank(e: &Event) -> u8 {
    match &e.detail {
        Detail::Log(l)
            if l.nonfinite || l.overflow || l.fault.is_some() || l.loss_scale.is_some() =>
        {
            0
        }
        Detail::Log(l) if l.loss.is_some() => 2,
        Detail::Log(_) => 9,
        Detail::Fork { .. } | Detail::Exec { .. } | Detail::Block { .. } | Detail::Tcp(_) => 3,
        Detail::Exit { code, signal, .. } if *code == 0 && *signal == 0 => 3,
        Detail::Kmsg(k) if k.class().is_none() => 3,
        _ => 0,
    }
}

/// The timeline the analysis reads: every event that matters for a suspect (up to
/// [`DIGEST_MAX`], the closest to the trigger first), the latest [`DIGEST_CURVE`] loss-curve
/// lines and the latest [`DIGEST_ROUTINE`] routine kernel events. One pass, bounded memory.
/// What it left out is counted in `accounting.digest` (the report says so).
pub fn digest(inc: &Incident, head: &Value) -> Value {
    let t0 = inc.triggers[0].mono_ns;
    let mut key: Vec<(u64, usize)> = Vec::new();
    let mut curve = std::collections::VecDeque::with_capacity(DIGEST_CURVE);
    let mut routine = std::collections::VecDeque::with_capacity(DIGEST_ROUTINE);
    let (mut plain, mut candidates) = (0usize, 0usize);
    for (i, e) in inc.events.iter().enumerate() {
        let ring = match digest_rank(e) {
            9 => {
                plain += 1;
                continue;
            }
            0 => None,
            2 => Some((&mut curve, DIGEST_CURVE)),
            _ => Some((&mut routine, DIGEST_ROUTINE)),
        };
        candidates += 1;
        match ring {
            None => key.push((e.mono_ns.abs_diff(t0), i)),
            Some((r, cap)) => {
                if r.len() == cap {
                    r.pop_front();
                }
                r.push_back(i);
            }
        }
    }
    if key.len() > DIGEST_MAX {
        key.select_nth_unstable(DIGEST_MAX);
        key.truncate(DIGEST_MAX);
    }
    let room = DIGEST_MAX.saturating_sub(key.len());
    let mut keep: Vec<usize> = key
        .into_iter()
        .map(|k| k.1)
        .chain(
            curve
                .into_iter()
                .rev()
                .chain(routine.into_iter().rev())
                .take(room),
        )
        .collect();
    keep.sort_unstable();
    let mut t = head.clone();
    t["events"] = Value::Array(
        keep.iter()
            .map(|&i| event_json(inc, inc.events[i]))
            .collect(),
    );
    t["accounting"]["digest"] = json!({ "events": inc.events.len(), "analysed": keep.len(), "plain_log_lines_not_analysed": plain, "over_the_cap_not_analysed": candidates - keep.len() });
    t
}

/// Write the bundle under `out`, one way: the typed events stream into timeline.json,
/// app.log and kernel.log; `derive` (the analysis and the renderers, from the layers above)
/// reads a bounded digest of them and gives report.md, report.txt, trace.json and
/// report.html; the snapshot goes as is. Each file that fails is reported and the others
/// still written.
///
/// The directory is created by us (0700) under a random temporary name, filled with O_EXCL
/// files relative to its descriptor, then claimed under its final name with
/// `renameat2(RENAME_NOREPLACE)`: a name taken by anything (another instance's bundle, a
/// dangling symlink) moves on to the next suffix instead of failing (redteam 4.7, 4.13, 6.13).
pub fn write<A>(
    out: &Path,
    inc: &Incident,
    snapshot: &Value,
    derive: impl for<'d> FnOnce(&'d Value, &'d Value) -> Derived<'d, A>,
) -> std::io::Result<Written<A>> {
    fs::create_dir_all(out)?;
    let outd = safefs::Dir::open(out)?;
    let stamp = compact_utc(inc.clock.to_wall(inc.triggers[0].mono_ns));
    let host = safefs::sanitize(&inc.host.hostname, "host");
    let base = format!("nantrace-{host}-{stamp}");
    let (tmp, tmp_name) =
        outd.create_temp_subdir(&format!(".{base}.tmp-{}-", std::process::id()))?;
    // Held until the bundle is claimed: a writer that dies lets go of it, and the next start
    // keeps its directory as incomplete (bundle::recover).
    let _ = tmp.lock(true);
    let mut failures = Vec::new();
    let mut written = 0;
    let mut put =
        |name: &str, fill: &mut dyn FnMut(&mut dyn std::io::Write) -> std::io::Result<()>| match tmp
            .write_with(name, |w| fill(w))
        {
            Err(e) => failures.push(format!("{name}: {e}")),
            Ok(n) if n > 0 => written += 1,
            Ok(_) => {}
        };
    // Smallest and most telling first: on a nearly full disk the job's log and the answer
    // survive (redteam 1.21).
    put("app.log", &mut |w| write_app_log(w, inc));
    put("kernel.log", &mut |w| write_kernel_log(w, inc));
    let mut head = timeline_head(inc);
    let d = digest(inc, &head);
    // timeline.json says what the analysis read of it.
    head["accounting"]["digest"] = d["accounting"]["digest"].clone();
    // timeline.json (every event, the longest file) on a thread of its own; what the layers
    // above derive from the digest on this one (they take a thread of their own for the
    // trace): the dump of a 100 k-event window takes the longest of these, not their sum.
    let hash = std::sync::Mutex::new(None);
    let (analysis, timeline, trace_panicked, summary) = std::thread::scope(|s| {
        let timeline = s.spawn(|| {
            tmp.write_with("timeline.json", |w| {
                let mut w = Fnv::new(w);
                write_timeline(&mut w, inc, &head)?;
                *hash
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(w.hash);
                Ok(())
            })
        });
        let Derived {
            beside,
            answer,
            views,
            summary,
        } = derive(&d, snapshot);
        let beside = s.spawn(beside);
        let (analysis, answer) = answer();
        for (name, data) in &answer {
            put(name, &mut |w| w.write_all(data));
        }
        drop(answer);
        let (snap, fr) = flight::split(snapshot);
        put("snapshot.json", &mut |w| {
            serde_json::to_writer_pretty(&mut *w, &*snap).map_err(std::io::Error::from)
        });
        for (name, data) in flight::files(&tmp, fr, inc.flight_copies) {
            put(&name, &mut |w| w.write_all(&data));
        }
        for (name, data) in &views(&analysis) {
            put(name, &mut |w| w.write_all(data));
        }
        // A renderer that panicked leaves its file out, said as a failure below.
        let beside = beside.join();
        for (name, data) in beside.as_deref().unwrap_or_default() {
            put(name, &mut |w| w.write_all(data));
        }
        let summary = summary(&analysis);
        (analysis, timeline.join(), beside.is_err(), summary)
    });
    if trace_panicked {
        failures.push("trace.json: the renderer panicked".into());
    }
    match timeline {
        Ok(Ok(n)) if n > 0 => {
            written += 1;
            // A bundle whose snapshot.json failed gets no summary (the summary would carry a
            // snapshot its files do not have).
            let summary = if failures.iter().any(|f| f.starts_with("snapshot.json")) {
                Value::Null
            } else {
                summary
            };
            // The summary of this timeline, named by its size and hash; none for a bundle
            // whose timeline failed (the job report then has nothing to check it against).
            let mut summary = summary;
            let h = hash.lock().ok().and_then(|h| *h);
            if summary.is_object() {
                summary["timeline"] =
                    json!({ "bytes": n, "fnv1a64": h.map(|h| format!("{h:016x}")) });
                let _ = tmp.write_with("summary.json", |w| {
                    serde_json::to_writer(w, &summary).map_err(std::io::Error::from)
                });
            }
        }
        Ok(Ok(_)) => {}
        Ok(Err(e)) => failures.push(format!("timeline.json: {e}")),
        Err(_) => failures.push("timeline.json: the writer thread panicked".into()),
    }
    drop(d);
    let base = final_base(out, (&tmp, &tmp_name), base, written, &failures)?;
    let name = recover::claim(&outd, &tmp_name, &base).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("{e}; the files are in {}", out.join(&tmp_name).display()),
        )
    })?;
    Ok(Written {
        dir: out.join(&name),
        written,
        failures,
        analysis,
    })
}

/// A writer that hashes what goes through it (FNV-1a, 64 bits): the timeline's identity in
/// its summary, taken while it is written.
struct Fnv<W> {
    inner: W,
    hash: u64,
}

impl<W: std::io::Write> Fnv<W> {
    fn new(inner: W) -> Self {
        Fnv {
            inner,
            hash: 0xcbf2_9ce4_8422_2325,
        }
    }
}

impl<W: std::io::Write> std::io::Write for Fnv<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        for &b in &buf[..n] {
            self.hash = (self.hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The identity of a bundle's timeline.json as its summary names it: its size and FNV-1a
/// hash (read through, never through a link).
pub fn timeline_identity(dir: &Path) -> anyhow::Result<Value> {
    let mut f = open_plain(&dir.join("timeline.json"))?;
    let mut h = Fnv::new(std::io::sink());
    let n = std::io::copy(&mut f, &mut h)?;
    Ok(json!({ "bytes": n, "fnv1a64": format!("{:016x}", h.hash) }))
}

/// The name a bundle is claimed under: its own, or with the incomplete suffix and a note
/// when some files could not be written; an error (and no directory left) when none could.
fn final_base(
    out: &Path,
    (tmp, tmp_name): (&safefs::Dir, &str),
    base: String,
    written: usize,
    failures: &[String],
) -> std::io::Result<String> {
    if written == 0 {
        // Nothing of it could be written (a full disk): no empty directory is left to pass
        // for a bundle (redteam3 D-12); the caller says so and counts the failure.
        let _ = std::fs::remove_dir_all(out.join(tmp_name));
        let kind = if failures.iter().any(|f| f.contains("No space left")) {
            std::io::ErrorKind::StorageFull
        } else {
            std::io::ErrorKind::Other
        };
        return Err(std::io::Error::new(
            kind,
            format!(
                "no file of the bundle could be written: {}",
                failures.join("; ")
            ),
        ));
    }
    if failures.is_empty() {
        return Ok(base);
    }
    // Some files missing: kept, under a name and with a note that say so.
    let _ = tmp.write_new(
        recover::NOTE,
        format!(
            "This bundle is incomplete: these files could not be written:\n{}\n",
            failures
                .iter()
                .map(|f| format!("- {f}"))
                .collect::<Vec<_>>()
                .join("\n")
        )
        .as_bytes(),
    );
    Ok(format!("{base}{}", recover::SUFFIX))
}

pub mod flight;
mod load;
pub mod recover;
pub use load::{load, load_head, open_plain, WHOLE_TIMELINE_MAX};
