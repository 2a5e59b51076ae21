//! The agent's memory of its incidents across restarts: a small append-only index in the
//! spool (`<spool>/.history.jsonl`, 0600), one JSON line per incident with an FNV-1a checksum
//! of its entry, so a torn last line after a crash (or an edited one) is skipped and counted,
//! never believed. Bounded: past `MAX_ENTRIES` half is kept, the entries without GPU evidence
//! dropped first (rewritten whole, by
//! rename). Lost or missing, it is rebuilt from the bundles in the spool, each of which holds
//! its own entry (`history.json`, written beside report.md).
//!
//! What it answers: `nantrace ctl history [--gpu ID] [--since 30d]`, the "History" section
//! appended to each bundle's report.md (this GPU was implicated in N earlier incidents on this
//! node; a repeat offender: drain and send for service), and `nantrace_gpu_implicated_total`.
use std::io::{BufRead as _, Read as _, Write as _};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::safefs;

pub const FILE: &str = ".history.jsonl";
/// The entry each bundle keeps of itself (the rebuild's source).
pub const IN_BUNDLE: &str = "history.json";
pub const MAX_ENTRIES: usize = 4096;
const MAX_LINE: usize = 16 << 10;

/// Within this many days, this many incidents on one GPU make it a repeat offender.
pub const REPEAT_DAYS: i64 = 7;
pub const REPEAT_COUNT: usize = 3;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Gpu {
    pub pci: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
}

/// One fault behind an implicated GPU: what the kernel or NVML saw, when (wall ms).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Fault {
    pub pci: String,
    pub signal: String,
    pub time_ms: i64,
}

/// Two entries' faults within this of each other (same GPU, same signal) are one fault seen by
/// two bundles (the same Xid in three watched jobs' windows: one kernel timestamp, each
/// session's clock mapping within a millisecond or so of the others).
pub const FAULT_SAME_MS: i64 = 250;

fn same_fault(a: &Fault, b: &Fault) -> bool {
    a.pci.eq_ignore_ascii_case(&b.pci)
        && a.signal == b.signal
        && (a.time_ms - b.time_ms).abs() <= FAULT_SAME_MS
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Entry {
    pub time_s: i64,
    pub job: String,
    pub trigger: String,
    /// The verdict's head: "PROBABLY THE MACHINE (GPU)", "NOT THE MACHINE (software/configuration)".
    pub verdict: String,
    pub family: String,
    pub gpus: Vec<Gpu>,
    pub bundle: String,
    /// The faults behind `gpus` (an entry of an earlier agent has none: it counts as its own).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub faults: Vec<Fault>,
}

impl Entry {
    fn faults_on<'a>(&'a self, pci: &'a str) -> impl Iterator<Item = &'a Fault> + 'a {
        self.faults
            .iter()
            .filter(move |f| f.pci.eq_ignore_ascii_case(pci))
    }
}

/// For each of `entries` (oldest first), on GPU `pci`: `None` when it brought a fault not
/// seen in an earlier one (an incident of its own), else `Some(j)`, the entry whose fault it
/// holds again (the same Xid in another watched job's bundle, or in a later incident's
/// window). An entry without faults (an earlier agent's) is its own.
fn incident_of(entries: &[&Entry], pci: &str) -> Vec<Option<usize>> {
    let mut seen: Vec<(&Fault, usize)> = Vec::new();
    let mut out = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        let mut any = false;
        let mut new = false;
        let mut first_of: Option<usize> = None;
        for f in e.faults_on(pci) {
            any = true;
            match seen.iter().find(|(s, _)| same_fault(s, f)) {
                Some((_, j)) => first_of = Some(first_of.map_or(*j, |k: usize| k.min(*j))),
                None => {
                    seen.push((f, i));
                    new = true;
                }
            }
        }
        out.push(if new || !any { None } else { first_of });
    }
    out
}

/// How many incidents of `entries` (oldest first) brought a fault of GPU `pci` not seen in an
/// earlier one: one Xid in three watched jobs' bundles, or in every later incident's window,
/// counts once (redteam4 D-5).
pub fn distinct_incidents(entries: &[&Entry], pci: &str) -> usize {
    incident_of(entries, pci)
        .iter()
        .filter(|x| x.is_none())
        .count()
}

/// Down to `keep` entries (oldest first in `entries`): the oldest that implicate no GPU go
/// first, then, only if GPU entries alone are more than `keep`, the oldest of those. A flood
/// of incidents without GPU evidence (one user's jobs exiting 1 every second) cannot push a
/// GPU's record out (redteam4 D-10).
fn evict(entries: &mut Vec<Entry>, keep: usize) {
    let mut excess = entries.len().saturating_sub(keep);
    if excess == 0 {
        return;
    }
    let mut drop = vec![false; entries.len()];
    for (i, e) in entries.iter().enumerate() {
        if excess == 0 {
            break;
        }
        if e.gpus.is_empty() {
            drop[i] = true;
            excess -= 1;
        }
    }
    for d in &mut drop {
        if excess == 0 {
            break;
        }
        if !*d {
            *d = true;
            excess -= 1;
        }
    }
    let mut it = drop.into_iter();
    entries.retain(|_| !it.next().unwrap_or(false));
}

fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &c| {
        (h ^ u64::from(c)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn line_of(e: &Entry) -> String {
    let body = serde_json::to_string(e).unwrap_or_default();
    format!(
        "{{\"fnv\":\"{:016x}\",\"e\":{body}}}",
        fnv1a(body.as_bytes())
    )
}

/// An entry from one line, when its checksum holds (over the entry as `line_of` writes it:
/// the struct's field order, so a value edited or torn anywhere fails it).
fn parse_line(l: &str) -> Option<Entry> {
    let v: Value = serde_json::from_str(l).ok()?;
    let e: Entry = serde_json::from_value(v["e"].clone()).ok()?;
    let body = serde_json::to_string(&e).ok()?;
    (v["fnv"].as_str()? == format!("{:016x}", fnv1a(body.as_bytes()))).then_some(e)
}

/// The head of a verdict (up to its first ':'), at most 120 characters.
pub fn verdict_head(v: &str) -> String {
    v.split(':').next().unwrap_or(v).chars().take(120).collect()
}

pub struct History {
    dir: PathBuf,
    pub entries: Vec<Entry>,
    /// Lines whose checksum or shape did not hold (a torn write, an edit): skipped.
    pub bad_lines: usize,
    pub rebuilt: bool,
}

impl History {
    /// Read `<spool>/.history.jsonl`; when it is missing, rebuild it from the spool's bundles.
    pub fn open(spool: &Path) -> History {
        let mut h = History {
            dir: spool.to_path_buf(),
            entries: Vec::new(),
            bad_lines: 0,
            rebuilt: false,
        };
        match crate::bundle::open_plain(&spool.join(FILE)) {
            Ok(f) => {
                for l in std::io::BufReader::new(f.take(64 << 20))
                    .split(b'\n')
                    .map_while(Result::ok)
                {
                    if l.is_empty() {
                        continue;
                    }
                    match std::str::from_utf8(&l)
                        .ok()
                        .filter(|l| l.len() <= MAX_LINE)
                        .and_then(parse_line)
                    {
                        Some(e) => h.entries.push(e),
                        None => h.bad_lines += 1,
                    }
                }
                if h.entries.len() > MAX_ENTRIES {
                    evict(&mut h.entries, MAX_ENTRIES);
                }
            }
            Err(_) => {
                h.rebuild();
            }
        }
        h
    }

    /// From each bundle's own `history.json`, oldest first, and written out whole.
    fn rebuild(&mut self) {
        let mut found: Vec<Entry> = Vec::new();
        for (dir, _, _) in super::spool::bundles(&self.dir) {
            let Ok(f) = crate::bundle::open_plain(&dir.join(IN_BUNDLE)) else {
                continue;
            };
            let mut text = String::new();
            if f.take(MAX_LINE as u64).read_to_string(&mut text).is_ok() {
                if let Ok(e) = serde_json::from_str::<Entry>(&text) {
                    found.push(e);
                }
            }
        }
        found.sort_by_key(|e| e.time_s);
        evict(&mut found, MAX_ENTRIES);
        self.entries = found;
        self.rebuilt = true;
        let _ = self.rewrite();
    }

    fn rewrite(&self) -> std::io::Result<()> {
        let text: String = self.entries.iter().map(|e| line_of(e) + "\n").collect();
        safefs::Dir::open(&self.dir)?.replace(FILE, text.as_bytes())
    }

    /// Add an incident: appended (O_APPEND, no link followed, synced), and the bundle's own
    /// copy written beside its report.
    pub fn add(&mut self, e: Entry) -> std::io::Result<()> {
        if let Ok(d) = safefs::Dir::open(Path::new(&e.bundle)) {
            let _ = d.write_new(
                IN_BUNDLE,
                serde_json::to_string(&e).unwrap_or_default().as_bytes(),
            );
        }
        let line = line_of(&e) + "\n";
        self.entries.push(e);
        if self.entries.len() > MAX_ENTRIES {
            evict(&mut self.entries, MAX_ENTRIES / 2);
            return self.rewrite();
        }
        use std::os::unix::fs::OpenOptionsExt as _;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(self.dir.join(FILE))?;
        f.write_all(line.as_bytes())?;
        f.sync_data()
    }

    /// Entries since `since_s` that implicate `gpu` (a PCI address or a UUID, any case) when
    /// one is given, oldest first.
    pub fn query(&self, gpu: Option<&str>, since_s: i64) -> Vec<&Entry> {
        let want = gpu.map(str::to_ascii_lowercase);
        self.entries
            .iter()
            .filter(|e| e.time_s >= since_s)
            .filter(|e| {
                want.as_ref().is_none_or(|w| {
                    e.gpus.iter().any(|g| {
                        g.pci.eq_ignore_ascii_case(w)
                            || g.uuid.as_ref().is_some_and(|u| u.eq_ignore_ascii_case(w))
                    })
                })
            })
            .collect()
    }

    /// Incidents per GPU (PCI address), all the index holds: `nantrace_gpu_implicated_total`.
    pub fn per_gpu(&self) -> std::collections::BTreeMap<String, usize> {
        let pcis: std::collections::BTreeSet<String> = self
            .entries
            .iter()
            .flat_map(|e| e.gpus.iter().map(|g| g.pci.clone()))
            .collect();
        pcis.into_iter()
            .map(|p| {
                let n = distinct_incidents(&self.query(Some(&p), i64::MIN), &p);
                (p, n)
            })
            .collect()
    }

    /// The report's History section for an incident just added (`now` is its entry): for each
    /// GPU it implicates, its earlier incidents in the last 30 days, and the repeat-offender
    /// action when it reached `REPEAT_COUNT` within `REPEAT_DAYS`.
    pub fn section(&self, now: &Entry) -> Option<String> {
        if now.gpus.is_empty() {
            return None;
        }
        let mut s = String::new();
        for g in &now.gpus {
            // The GPU's entries up to this one, oldest first; the incident this one is (its
            // own, or the earlier one whose fault it holds again), and the others.
            let mut all: Vec<&Entry> = self
                .query(Some(&g.pci), now.time_s - 30 * 86_400)
                .into_iter()
                .filter(|e| e.bundle != now.bundle && e.time_s <= now.time_s)
                .collect();
            all.push(now);
            let of = incident_of(&all, &g.pci);
            let me = all.len() - 1;
            let mine = of[me].unwrap_or(me);
            let earlier: Vec<&Entry> = (0..me)
                .filter(|i| of[*i].is_none() && *i != mine)
                .map(|i| all[i])
                .collect();
            let earlier_n = earlier.len();
            let name = match &g.uuid {
                Some(u) => format!("GPU {} ({u})", g.pci),
                None => format!("GPU {}", g.pci),
            };
            if earlier.is_empty() {
                s.push_str(&format!(
                    "- {name}: no earlier incident on this node in the index (since {}).\n",
                    self.entries.first().map_or_else(
                        || "now".to_string(),
                        |e| crate::clock::rfc3339(i128::from(e.time_s) * 1_000_000_000)
                    )
                ));
                continue;
            }
            let list: Vec<String> = earlier
                .iter()
                .rev()
                .take(5)
                .map(|e| {
                    format!(
                        "{} ({})",
                        crate::clock::rfc3339(i128::from(e.time_s) * 1_000_000_000),
                        e.verdict
                    )
                })
                .collect();
            s.push_str(&format!(
                "- {name} was implicated in {earlier_n} earlier incident{} on this node in 30 days (distinct faults): {}{}.\n",
                if earlier_n == 1 { "" } else { "s" },
                list.join(", "),
                if earlier.len() > 5 { ", ..." } else { "" }
            ));
            let week = 1 + earlier
                .iter()
                .filter(|e| e.time_s >= now.time_s - REPEAT_DAYS * 86_400)
                .count();
            if week >= REPEAT_COUNT {
                s.push_str(&format!("  **Repeat offender: implicated {week} times in {REPEAT_DAYS} days: drain the node and send {name} for service** (dcgmi diag -r 3, then the vendor).\n"));
            }
        }
        Some(s)
    }

    /// `ctl history`: the entries as JSON, newest last, at most 1000.
    pub fn answer(&self, gpu: Option<&str>, since_s: i64) -> Value {
        let q = self.query(gpu, since_s);
        let skip = q.len().saturating_sub(1000);
        json!({ "incidents": q.into_iter().skip(skip).collect::<Vec<_>>(), "index_entries": self.entries.len(), "bad_lines": self.bad_lines })
    }
}

/// "30d", "12h", "90m", "3600s" or a number of seconds, into seconds.
pub fn parse_since(s: &str) -> Option<i64> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()? {
        'd' => (&s[..s.len() - 1], 86_400),
        'h' => (&s[..s.len() - 1], 3_600),
        'm' => (&s[..s.len() - 1], 60),
        's' => (&s[..s.len() - 1], 1),
        _ => (s, 1),
    };
    num.parse::<i64>()
        .ok()
        .filter(|n| (0..=36_500 * 86_400).contains(n))
        .map(|n| n * mul)
        .filter(|v| *v <= 36_500 * 86_400)
}

#[cfg(test)]
mod tests;

/// `nantrace_gpu_incidents_7d{gpu}`: incidents per GPU in the last `REPEAT_DAYS` days, from the
/// index (0 for a GPU whose incidents aged out): what the repeat-offender alert reads, right
/// across restarts.
pub fn set_gauges(h: &History, metrics: &super::Metrics) {
    let since = (crate::clock::realtime_ns() / 1_000_000_000) as i64 - REPEAT_DAYS * 86_400;
    // Labelled by the node's own devices (an address not on it: `not_on_node`, summed).
    let mut per: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    for gpu in h.per_gpu().keys() {
        *per.entry(super::metrics::gpu_label(gpu)).or_default() +=
            distinct_incidents(&h.query(Some(gpu), since), gpu);
    }
    for (label, n) in per {
        metrics.set("nantrace_gpu_incidents_7d", &[("gpu", &label)], n as f64);
    }
}

/// The index at the agent's start, said, with `nantrace_gpu_implicated_total` set from it
/// (one series per GPU of the node; it survives restarts as the index does).
pub fn start(
    spool: &Path,
    metrics: &std::sync::Arc<super::Metrics>,
) -> std::sync::Arc<std::sync::Mutex<History>> {
    let h = History::open(spool);
    crate::say!(
        "nantrace: incident history: {} incident(s) in {}{}{}",
        h.entries.len(),
        spool.join(FILE).display(),
        if h.rebuilt {
            " (rebuilt from the spool's bundles)"
        } else {
            ""
        },
        if h.bad_lines > 0 {
            format!("; {} damaged line(s) skipped", h.bad_lines)
        } else {
            String::new()
        }
    );
    let mut per: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    for (gpu, n) in h.per_gpu() {
        *per.entry(super::metrics::gpu_label(&gpu)).or_default() += n;
    }
    for (label, n) in per {
        metrics.set(
            "nantrace_gpu_implicated_total",
            &[("gpu", &label)],
            n as f64,
        );
    }
    if let Some(last) = h.entries.last() {
        metrics.set(
            "nantrace_last_incident_timestamp_seconds",
            &[],
            last.time_s as f64,
        );
    }
    set_gauges(&h, metrics);
    std::sync::Arc::new(std::sync::Mutex::new(h))
}

/// After a bundle: its entry in the index and in the bundle, the History section appended to
/// its report.md, the metrics; the section (or null) for the incident's record. A GPU whose
/// faults only a user could have written (`doubtful_gpus`) is not counted, and the section
/// says so.
pub fn record(
    h: &std::sync::Mutex<History>,
    metrics: &super::Metrics,
    d: &crate::session::Dumped,
    job: &str,
    bundle: &Path,
    trust_user_written: bool,
) -> Value {
    let doubtful = if d.gpus.is_empty() {
        Vec::new()
    } else {
        super::trust::doubtful_gpus(d, trust_user_written, crate::klog::who_wrote)
    };
    let counted = |pci: &str| !doubtful.iter().any(|(p, _)| p == pci);
    let now_s = (crate::clock::realtime_ns() / 1_000_000_000) as i64;
    let e = Entry {
        time_s: now_s,
        job: job.chars().take(200).collect(),
        trigger: d.trigger.clone(),
        verdict: verdict_head(d.verdict.as_deref().unwrap_or("")),
        family: d.family.clone().unwrap_or_else(|| "none".into()),
        gpus: d
            .gpus
            .iter()
            .filter(|(pci, _)| counted(pci))
            .map(|(pci, uuid)| Gpu {
                pci: pci.clone(),
                uuid: uuid.clone(),
            })
            .collect(),
        bundle: bundle.display().to_string(),
        faults: d
            .faults
            .iter()
            .filter(|(pci, _, _)| counted(pci))
            .map(|(pci, signal, t)| Fault {
                pci: pci.clone(),
                signal: (*signal).to_string(),
                time_ms: *t,
            })
            .collect(),
    };
    let mut h = super::lock(h);
    // The counter counts a GPU's new faults, not bundles.
    let new_on: Vec<String> = e
        .gpus
        .iter()
        .filter(|g| {
            let mut f = e.faults_on(&g.pci).peekable();
            f.peek().is_none()
                || f.any(|f| {
                    !h.entries
                        .iter()
                        .any(|o| o.faults_on(&g.pci).any(|x| same_fault(x, f)))
                })
        })
        .map(|g| g.pci.clone())
        .collect();
    if let Err(err) = h.add(e.clone()) {
        crate::say!(
            "nantrace: incident history: {} not added to {}: {err}",
            bundle.display(),
            h.dir.join(FILE).display()
        );
    }
    let mut section = h.section(&e);
    if !doubtful.is_empty() {
        let mut s = section.take().map(|s| s + "\n\n").unwrap_or_default();
        for (pci, why) in &doubtful {
            s.push_str(&format!(
                "GPU {pci} is not counted in this node's history: {}.\n",
                crate::report::md(why)
            ));
        }
        section = Some(s.trim_end().to_string());
    }
    set_gauges(&h, metrics);
    drop(h);
    for pci in &new_on {
        metrics.inc(
            "nantrace_gpu_implicated_total",
            &[("gpu", &super::metrics::gpu_label(pci))],
        );
    }
    metrics.set(
        "nantrace_last_incident_timestamp_seconds",
        &[],
        now_s as f64,
    );
    let Some(section) = section else {
        return Value::Null;
    };
    use std::os::unix::fs::OpenOptionsExt as _;
    let appended = std::fs::OpenOptions::new()
        .append(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(bundle.join("report.md"))
        .and_then(|mut f| writeln!(f, "\n## History of this node's GPUs\n\n{section}"));
    if let Err(err) = appended {
        crate::say!(
            "nantrace: incident history: not added to {}/report.md: {err}",
            bundle.display()
        );
    }
    Value::String(section)
}
